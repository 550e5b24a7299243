"""``pdproxy demo`` as a user runs it: it serves, it refuses busy ports clearly, and it never leaves engines behind."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from loadtest.ports import RESERVED, ephemeral_low
from tests.support import wait_until

pytestmark = pytest.mark.timeout(60)


def _free(port: int) -> bool:
    """Nothing listens on ``port`` (connections refused); TIME_WAIT leftovers do not count."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _ports() -> tuple[int, int]:
    """A proxy port and an engine base port B with B, B+100 and B+101 free, all below the kernel's ephemeral range
    (loadtest/ports.py: the demo binds them later)."""
    rng = random.Random()
    top = ephemeral_low() - 102
    while True:
        proxy, base = rng.randrange(20000, 25000), rng.randrange(25000, top)
        if all(_free(p) and p not in RESERVED for p in (proxy, base, base + 100, base + 101)):
            return proxy, base


def _demo(proxy: int, base: int, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pdproxy", "demo", "--port", str(proxy),
                             "--engine-base-port", str(base)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=None if env is None else {**os.environ, **env})


def _up(proxy: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{proxy}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL])
def test_demo_serves_and_its_engines_die_with_it(how: signal.Signals, tmp_path: Path) -> None:
    """Also: the demo's own request log holds this run's requests (an earlier run's lines were kept, ~100 KB of
    other runs' on a shared machine)."""
    log = tmp_path / f"pdproxy-demo-requests-{os.getuid()}.jsonl"
    log.write_text('{"an earlier run": 1}\n')
    proxy, base = _ports()
    demo = _demo(proxy, base, env={"TMPDIR": str(tmp_path)})
    try:
        wait_until(lambda: _up(proxy), 30, 0.1, "demo proxy healthy")
        r = httpx.post(f"http://127.0.0.1:{proxy}/v1/chat/completions", timeout=10,
                       json={"model": "sim-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert r.headers["x-pdproxy-prefiller"] == f"http://127.0.0.1:{base}"
        os.kill(demo.pid, how)
        demo.wait(timeout=30)
        if how is signal.SIGTERM:
            assert demo.returncode == 0
            (line,) = log.read_text().splitlines()
            assert '"status":200' in line.replace(" ", ""), line
        # however the demo ended, its engines are gone and their ports free
        wait_until(lambda: all(_free(p) for p in (proxy, base, base + 100, base + 101)), 15, 0.1, "ports freed")
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()


@pytest.mark.parametrize("env", [{}, {"PDPROXY_WORKERS": "2"}], ids=["plain", "workers-in-env"])
def test_the_demo_says_it_is_up_only_once_the_proxy_listens(env: dict[str, str]) -> None:
    """The "demo is up" banner and its commands to paste come after the proxy's port accepts connections: a user
    (or a script waiting for the line) who runs them at once is not refused.  The demo is one process whatever the
    environment says (``PDPROXY_WORKERS`` once made it serve without ever printing the banner)."""
    proxy, base = _ports()
    demo = _demo(proxy, base, env)
    try:
        assert demo.stdout is not None
        before = []
        for line in demo.stdout:
            if "pdproxy demo is up" in line:
                break
            before.append(line)
        else:
            raise AssertionError(f"no banner; stderr: {demo.stderr.read() if demo.stderr else ''}")
        with socket.create_connection(("127.0.0.1", proxy), timeout=5):
            pass                                    # listening already: not refused
        assert f"http://127.0.0.1:{proxy}" in line
        assert not any("sim_ready" in x for x in before), before   # the engines' line for scripts: not the user's
    finally:
        demo.send_signal(signal.SIGINT)
        try:
            demo.communicate(timeout=30)
        finally:
            if demo.poll() is None:
                demo.kill()
                demo.wait()
    wait_until(lambda: all(_free(p) for p in (proxy, base, base + 100, base + 101)), 15, 0.1, "ports freed")


def test_banner_names_the_request_logs_place() -> None:
    from pdproxy.tools.demo import request_log_hint
    assert "tail -f /tmp/r.jsonl" in request_log_hint("/tmp/r.jsonl")
    # --request-log-path - : the lines come to the terminal; no "tail -f -" to copy
    assert "terminal" in request_log_hint("-") and "tail" not in request_log_hint("-")


def test_busy_engine_port_is_refused_with_a_clear_message() -> None:
    proxy, base = _ports()
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", base + 100))
        squatter.listen()
        demo = _demo(proxy, base)
        out, err = demo.communicate(timeout=30)
    assert demo.returncode == 1
    assert f"port {base + 100} is already in use" in err and "--engine-base-port" in err
    assert "Traceback" not in err and "demo is up" not in out
    assert all(_free(p) for p in (proxy, base, base + 101))  # nothing was left running


def test_an_unusable_default_request_log_names_itself_and_the_flag(tmp_path: Path) -> None:
    """The demo's own request-log file (one per user in the temporary directory: another user's on a shared /tmp
    cannot clash) that cannot be opened stops the demo before any engine starts, in one line that says which file
    and which flag chooses another — not as if the user had given ``--request-log-path`` (old words)."""
    (tmp_path / f"pdproxy-demo-requests-{os.getuid()}.jsonl").mkdir()     # in its place: a directory
    proxy, base = _ports()
    demo = _demo(proxy, base, env={"TMPDIR": str(tmp_path)})
    out, err = demo.communicate(timeout=30)
    assert demo.returncode == 1 and "Traceback" not in err and out == "", err
    assert err.startswith(f"pdproxy demo: the request log {tmp_path}/pdproxy-demo-requests-{os.getuid()}.jsonl: "
                          "cannot open it for appending") and "give --request-log-path FILE" in err, err
    assert all(_free(p) for p in (proxy, base, base + 100, base + 101))


def test_the_demo_empties_only_its_own_regular_log(tmp_path: Path) -> None:
    """Never through a symbolic link (a shared /tmp: someone else's file in its place)."""
    from pdproxy.tools.demo import empty_own_log

    own, target, link = tmp_path / "own.jsonl", tmp_path / "target", tmp_path / "link.jsonl"
    own.write_text("old\n")
    target.write_text("keep\n")
    link.symlink_to(target)
    empty_own_log(str(own))
    empty_own_log(str(link))
    empty_own_log(str(tmp_path / "missing.jsonl"))
    assert own.read_text() == "" and target.read_text() == "keep\n" and not (tmp_path / "missing.jsonl").exists()
