"""``pdproxy serve`` as a real child process (its own process group), its stderr captured to a file.

Used where the command line itself is under test: TLS flags, ``--workers``, what ``serve`` logs, Envoy in front.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.support import free_port, wait_until


class ServeProcess:
    """``python -m pdproxy serve --host 127.0.0.1 --port PORT ARGS...``; ``log`` collects its stdout + stderr."""

    def __init__(self, log: Path, *args: str, port: int | None = None, scheme: str = "http",
                 env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log = log
        self.args = [sys.executable, "-m", "pdproxy", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                     "--health-interval-s", "0.2", *args]
        self.env = env
        """The process's environment (None: this one's)."""
        self.proc: subprocess.Popen[bytes] | None = None
        self._out: Any = None

    def start(self, *, verify: Any = True, timeout_s: float = 30.0) -> ServeProcess:
        """Start it and wait until ``GET /health`` answers 200 (over TLS: ``verify`` is an ``ssl.SSLContext``)."""
        self._out = open(self.log, "wb")  # noqa: SIM115 - closed by stop(); the process writes to it
        self.proc = subprocess.Popen(self.args, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=self.env)

        def healthy() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"pdproxy serve exited ({self.proc.returncode}): {self.text()[-3000:]}")
            try:
                return httpx.get(self.url + "/health", verify=verify, timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout_s, 0.1, f"pdproxy serve on {self.url}")
        return self

    def text(self) -> str:
        """Everything it wrote so far."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def json_lines(self) -> list[dict[str, Any]]:
        """Its log lines that are JSON objects (``--log-format json``), in order."""
        out = []
        for line in self.text().splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):
                obj = orjson.loads(line)
                if isinstance(obj, dict):
                    out.append(obj)
        return out

    def events(self, name: str, **match: Any) -> list[dict[str, Any]]:
        """JSON log records with ``event == name`` whose fields match ``match``."""
        return [r for r in self.json_lines() if r.get("event") == name
                and all(r.get(k) == v for k, v in match.items())]

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (drain) and wait for the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the server as an operator does — SIGTERM, so a ``--workers`` supervisor removes its run directory
        in ``/dev/shm`` (SIGKILL left one behind per test) — then, after ``timeout_s`` seconds, kill whatever is
        left of the process group; close the log."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
            if self.proc.poll() is None:           # not reaped yet: its process group is still its own
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._out is not None:
            self._out.close()
            self._out = None

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def worker_pids(supervisor: int) -> set[int]:
    """Worker processes of the supervisor (its spawned children, not multiprocessing's resource tracker)."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError):
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == supervisor and b"spawn_main" in (d / "cmdline").read_bytes():
                out.add(int(d.name))
    return out
