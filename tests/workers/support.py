"""Driving ``pdproxy serve --workers N`` from tests: the supervisor as a real process, and keep-alive connections
pinned to a known worker (every request on one connection reaches the worker that accepted it; ``GET /debug/load``
says which one that is)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support import wait_until


@contextlib.contextmanager
def serve_workers(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``pdproxy serve ARGS`` in its own session, output to ``log``; SIGTERM on exit, SIGKILL if it lingers."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pdproxy", "serve", *args], stdout=out, stderr=out,
                                start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


class Conn:
    """One HTTP/1.1 keep-alive connection to 127.0.0.1:``port`` (blocking; JSON bodies)."""

    def __init__(self, port: int, timeout_s: float = 30.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self._buf = b""

    def send(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> None:
        """Send one request (its response is read by :meth:`response`)."""
        payload = b"" if body is None else json.dumps(body).encode()
        head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(payload)}"]
        if body is not None:
            head.append("Content-Type: application/json")
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + payload)

    def _read_until(self, marker: bytes) -> bytes:
        while marker not in self._buf:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("connection closed by the proxy")
            self._buf += data
        out, self._buf = self._buf.split(marker, 1)
        return out

    def _read_exactly(self, n: int) -> bytes:
        while len(self._buf) < n:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("connection closed by the proxy")
            self._buf += data
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def response(self) -> tuple[int, Any]:
        """``(status, JSON body)`` of the next response (Content-Length or chunked)."""
        head = self._read_until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(head[0].split(" ", 2)[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        if fields.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int(self._read_until(b"\r\n"), 16)
                chunk = self._read_exactly(size + 2)[:-2]
                if size == 0:
                    break
                parts.append(chunk)
            data = b"".join(parts)
        else:
            data = self._read_exactly(int(fields.get("content-length", "0")))
        return status, json.loads(data) if data else None

    def request(self, method: str, path: str, body: Any = None,
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """Send one request and read its response."""
        self.send(method, path, body, headers)
        return self.response()

    def worker(self) -> int:
        """The worker row serving this connection (from ``GET /debug/load``)."""
        status, body = self.request("GET", "/debug/load")
        assert status == 200, body
        return int(body["worker"])

    def close(self) -> None:
        """Drop the connection (the proxy sees the client leave)."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def conns_on(port: int, wanted: dict[int, int], attempts: int = 400) -> dict[int, list[Conn]]:
    """Open connections until worker ``row`` serves ``wanted[row]`` of them, for every row (the kernel hands each
    new connection to either worker).  Raises ``AssertionError`` after ``attempts`` connections."""
    got: dict[int, list[Conn]] = {row: [] for row in wanted}
    for _ in range(attempts):
        if all(len(got[r]) >= n for r, n in wanted.items()):
            return got
        conn = Conn(port)
        row = conn.worker()
        if row in got and len(got[row]) < wanted[row]:
            got[row].append(conn)
        else:
            conn.close()
    for conns in got.values():
        for conn in conns:
            conn.close()
    raise AssertionError(f"could not get {wanted} connections per worker in {attempts} tries")


def wait_ready(port: int, rows: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until every worker serves (``/debug/load`` reports every row ready)."""
    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"pdproxy exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            conn = Conn(port, timeout_s=5)
        except OSError:
            return False
        try:
            status, body = conn.request("GET", "/debug/load")
        except (OSError, ValueError):
            return False
        finally:
            conn.close()
        return status == 200 and len(body.get("workers", [])) == rows and all(w["ready"] for w in body["workers"])

    wait_until(ready, 30, 0.1, f"{rows} workers ready")


def debug_load(port: int) -> dict[str, Any]:
    """``GET /debug/load`` on a fresh connection (either worker: both report the shared totals)."""
    conn = Conn(port, timeout_s=10)
    try:
        status, body = conn.request("GET", "/debug/load")
    finally:
        conn.close()
    assert status == 200, body
    return dict(body)


def endpoint_row(load: dict[str, Any], url: str) -> dict[str, Any]:
    """The ``/debug/load`` row of the endpoint at ``url``."""
    for row in load["endpoints"]:
        if row["name"].rstrip("/") == url.rstrip("/"):
            return dict(row)
    raise KeyError(url)


def board_idle(port: int) -> bool:
    """True when the shared view holds nothing: no lease, no prefill reservation, no waiter in any worker."""
    load = debug_load(port)
    return (all(e["requests"] == 0 and e["tokens"] == 0 and not e.get("prefill_inflight_tokens")
                and not e.get("kv_held_tokens") for e in load["endpoints"])
            and all(w["waiting"] == 0 and w["requests"] == 0 for w in load["workers"]))
