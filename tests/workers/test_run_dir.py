"""A ``--workers`` supervisor's run directory (``/dev/shm/pdproxy-*``: the load board, wake-up FIFOs, prometheus
files) outlives a supervisor killed without its cleanup (SIGKILL, the OOM killer); the next supervisor removes
it, and only it: a directory whose supervisor lives (its ``owner.lock`` held) or that is not a run directory is
left alone (pdproxy/app/supervisor.py ``run_directory``)."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdproxy.app.supervisor import OWNER_LOCK, remove_orphaned_run_dirs
from tests.support import free_port, wait_until
from tests.workers.support import serve_workers

pytestmark = pytest.mark.timeout(90)


def _holder(lock: Path) -> subprocess.Popen[bytes]:
    """A process holding an exclusive flock on ``lock`` until killed (a live supervisor's)."""
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(lock)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
    return proc


def test_only_run_directories_whose_supervisor_died_are_removed(tmp_path: Path) -> None:
    live, dead, foreign = (tmp_path / f"pdproxy-{n}" for n in ("live", "dead", "nolock"))
    for d in (live, dead, foreign):
        d.mkdir()
        (d / "load.board").write_bytes(b"x")
    (live / OWNER_LOCK).touch()
    (dead / OWNER_LOCK).touch()
    (tmp_path / "pdproxy-file").write_bytes(b"not a directory")
    holder = _holder(live / OWNER_LOCK)
    try:
        assert remove_orphaned_run_dirs(tmp_path) == [dead]
        assert live.is_dir() and foreign.is_dir() and not dead.exists() and (tmp_path / "pdproxy-file").exists()
    finally:
        holder.kill()
        holder.wait()
    assert remove_orphaned_run_dirs(tmp_path) == [live]        # the kernel dropped the dead holder's lock
    assert foreign.is_dir() and not live.exists()


def _run_dir(log: Path) -> Path | None:
    found = re.search(r"pdproxy: run directory (\S+) \(load board", log.read_text(errors="replace"))
    return Path(found[1]) if found else None


def test_a_killed_supervisors_run_directory_is_removed_by_the_next_one(tmp_path: Path) -> None:
    args = ["--workers", "2", "--host", "127.0.0.1", "--prefill", f"http://127.0.0.1:{free_port()}",
            "--decode", f"http://127.0.0.1:{free_port()}", "--log-level", "info", "--shutdown-grace-s", "1"]
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    with serve_workers([*args, "--port", str(free_port())], first_log) as first:
        first_dir = wait_until(lambda: _run_dir(first_log), 30, 0.05, "the first supervisor's run directory")
        with open(first_dir / OWNER_LOCK, "rb") as f, pytest.raises(BlockingIOError):     # held while it lives
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.killpg(first.pid, signal.SIGKILL)                                # no cleanup can run
        first.wait()
    assert first_dir.is_dir()
    with serve_workers([*args, "--port", str(free_port())], second_log):
        second_dir = wait_until(lambda: _run_dir(second_log), 30, 0.05, "the second supervisor's run directory")
        assert not first_dir.exists() and second_dir.is_dir() and second_dir != first_dir
        # (others may go too: any supervisor SIGKILLed earlier by this user, e.g. by another test's clean-up)
        removed = re.search(r"removed \d+ run director(?:y|ies) left by supervisors that died: (.*)$",
                            second_log.read_text(), re.M)
        assert removed is not None and str(first_dir) in removed[1].split(", ")
    assert not second_dir.exists()                                          # SIGTERM: its own cleanup
