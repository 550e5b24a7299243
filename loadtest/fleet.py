"""Child processes of the benchmark: fake engines, the proxy under test, the load generator — pinned to CPUs.

On a 2-core machine the generator, the engines and the proxy compete for CPU.  The bench pins the proxy under
test to the last CPU and everything else to the others (``os.sched_setaffinity`` in the child before exec), so
the proxy's CPU per event is not inflated by run-queue contention with the load it is measured under.  With a
single CPU nothing is pinned.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest.ports import free_port

ROOT = Path(__file__).resolve().parent.parent


def cpu_split() -> tuple[list[int] | None, list[int] | None]:
    """``(proxy_cpus, load_cpus)``: the last usable CPU for the proxy, the rest for engines and generator."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    return cpus[-1:], cpus[:-1]


def _preexec(cpus: Sequence[int] | None) -> Callable[[], None]:
    def run() -> None:
        os.setsid()
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        if cpus:
            os.sched_setaffinity(0, cpus)
    return run


class Child:
    """One child process in its own session (so the whole group can be signalled), optionally pinned.

    ``health_url``: polled until it answers 200 (``start`` raises ``RuntimeError`` if the process exits or
    ``timeout_s`` seconds pass).
    """

    def __init__(self, name: str, argv: Sequence[str], *, cpus: Sequence[int] | None, health_url: str | None,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.cpus = list(cpus) if cpus else None
        self.health_url = health_url
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = f"/tmp/pdproxy-bench-{name}-{os.getpid()}.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 30.0) -> Child:
        """Spawn the process (output to ``log_path``) and wait for ``health_url``."""
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_preexec(self.cpus), env=self.env, cwd=ROOT)
        if self.health_url is None:
            return self
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                if httpx.get(self.health_url, timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{self.name} not healthy within {timeout_s} s: {self.log_tail()}")

    def log_tail(self, n: int = 1500) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 10 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> Child:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def fake_engine(name: str, cpus: Sequence[int] | None) -> Child:
    """A ``loadtest.fake_engine`` process on a free port (``.url`` attribute set)."""
    port = free_port()
    child = Child(name, [sys.executable, "-m", "loadtest.fake_engine", "--port", str(port)], cpus=cpus,
                  health_url=f"http://127.0.0.1:{port}/health")
    child.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return child


def configure_engine(url: str, **timing: float) -> None:
    """Set a fake engine's timing (``itl_s``, ``ttft_s``, ``prefill_s``, ``burst``)."""
    httpx.post(url + "/bench/config", json=timing, timeout=5.0).raise_for_status()


def engine_stats(url: str) -> dict[str, Any]:
    """A fake engine's counters (``GET /bench/stats``)."""
    return dict(httpx.get(url + "/bench/stats", timeout=5.0).json())


def proxy_child(name: str, template: str, prefill: str, decode: str, cpus: Sequence[int] | None,
                health_path: str = "/health") -> Child:
    """A proxy started from a command template with ``{prefill}``, ``{decode}``, ``{port}``, ``{python}`` and
    ``{port2}`` (a second free port, e.g. for a metrics listener)."""
    port = free_port()
    argv = [a.format(prefill=prefill, decode=decode, port=port, python=sys.executable, port2=free_port())
            for a in shlex.split(template)]
    child = Child(name, argv, cpus=cpus, health_url=f"http://127.0.0.1:{port}{health_path}")
    child.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return child


def run_loadgen(spec: dict[str, Any], cpus: Sequence[int] | None, timeout_s: float) -> dict[str, Any]:
    """Run ``python -m loadtest.loadgen`` as its own (pinned) process and return its JSON result."""
    if cpus:
        spec = {**spec, "cpus": list(cpus)}
    proc = subprocess.run([sys.executable, "-m", "loadtest.loadgen", orjson.dumps(spec).decode()],
                          capture_output=True, timeout=timeout_s, preexec_fn=_preexec(None), cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"loadgen failed ({proc.returncode}): {proc.stderr.decode()[-2000:]}")
    return dict(orjson.loads(proc.stdout.splitlines()[-1]))
