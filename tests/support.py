"""Test support: real processes and real sockets on 127.0.0.1.

- :class:`SimProcess`: a ``pdproxy sim`` child process (its own process group), with its control API;
- :class:`ProxyThread`: the proxy app served by uvicorn in a background thread with its own event loop, so tests
  can drive it with real clients (``openai``, ``httpx``) and inspect its pool counters;
- :func:`wait_until`: poll a condition with a deadline (tests never sleep to pass).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import uvicorn

from loadtest.ports import free_port as free_port  # a port for a process that binds it later
from pdproxy.app.application import PDProxyApp, create_app
from pdproxy.http.server import uvicorn_config
from pdproxy.http.tls import apply_to_uvicorn
from pdproxy.settings import load_settings


def wait_until(cond: Callable[[], Any], timeout_s: float = 10.0, interval_s: float = 0.02, what: str = "") -> Any:
    """Poll ``cond`` until it returns a truthy value; raise ``AssertionError`` after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what or cond}: last={last!r}")


@contextlib.contextmanager
def sampling(read: Callable[[], Any], interval_s: float = 0.002) -> Iterator[list[Any]]:
    """Collect ``read()`` every ``interval_s`` seconds in a background thread while the block runs (and once
    after it): for asserting a bound held throughout, e.g. in-flight tokens never above a KV pool."""
    values: list[Any] = []
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            values.append(read())
            stop.wait(interval_s)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield values
    finally:
        stop.set()
        thread.join(timeout=30)
        values.append(read())


class SimProcess:
    """A simulated vLLM engine process: ``pdproxy sim --role ROLE --port PORT ARGS...``."""

    def __init__(self, role: str, *args: str, port: int | None = None) -> None:
        self.role = role
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "pdproxy", "sim", "--role", role, "--port", str(self.port), *args]
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=self.url, timeout=10.0)

    def start(self, timeout_s: float = 20.0) -> SimProcess:
        self.proc = subprocess.Popen(self.args, start_new_session=True, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)

        def healthy() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"sim exited ({self.proc.returncode}): {err[-2000:]}")
            try:
                return self.client.get("/health").status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, timeout_s, 0.05, f"sim {self.role} on {self.port}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.client.close()

    # --- control API (pdproxy/sim: /sim/*)
    def received(self) -> list[dict[str, Any]]:
        return list(self.client.get("/sim/received").json()["requests"])

    def completions_received(self) -> list[dict[str, Any]]:
        return [r for r in self.received() if r["path"].endswith("/completions")]

    def reset(self) -> None:
        self.client.post("/sim/reset").raise_for_status()

    def state(self) -> dict[str, Any]:
        return dict(self.client.get("/sim/state").json())

    def faults(self, *specs: dict[str, Any]) -> None:
        self.client.post("/sim/faults", json=list(specs)).raise_for_status()


@contextlib.contextmanager
def running(*sims: SimProcess) -> Iterator[tuple[SimProcess, ...]]:
    """Start ``sims`` concurrently (each waits for its own ``/health``), yield them, stop them all on exit."""
    try:
        with ThreadPoolExecutor(len(sims)) as pool:
            for future in [pool.submit(s.start) for s in sims]:
                future.result()
        yield sims
    finally:
        for s in sims:
            s.stop()


class ProxyThread:
    """pdproxy served by uvicorn on 127.0.0.1 in a background thread (own event loop)."""

    def __init__(self, *, ssl_context: ssl.SSLContext | None = None, **settings: Any) -> None:
        settings.setdefault("health_interval_s", 0.2)
        settings.setdefault("host", "127.0.0.1")
        self.settings = load_settings(**settings)
        self.app: PDProxyApp = create_app(self.settings)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])
        self.url = f"{'https' if ssl_context else 'http'}://127.0.0.1:{self.port}"
        config = uvicorn_config(self.app, loop="asyncio")
        apply_to_uvicorn(config, ssl_context)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))

    def start(self, timeout_s: float = 15.0) -> ProxyThread:
        self.thread.start()
        wait_until(lambda: self.server.started, timeout_s, 0.02, "proxy started")
        wait_until(lambda: httpx.get(self.url + "/health", verify=False).status_code == 200, timeout_s, 0.05,
                   "proxy healthy")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()

    @property
    def state(self) -> Any:
        return self.app.state

    def load(self) -> dict[str, tuple[int, int]]:
        st = self.app.state
        return st.pool.totals() if st is not None else {}

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Assert every per-endpoint load counter returns to zero (and no request is in flight)."""
        wait_until(lambda: self.app.state is not None and self.app.state.pool.idle()
                   and self.app.state.in_flight == 0, timeout_s, 0.02, f"proxy idle, load={self.load()}")
