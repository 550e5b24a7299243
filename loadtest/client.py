"""A cheap HTTP/1.1 client for the load generator: asyncio protocol + httptools, keep-alive pool, SSE timing.

Why not httpx/aiohttp/openai: the load generator shares a 2-core machine with the engines and the proxy, so it
must cost a few µs per event; what it measures is when bytes arrive, per request:

- ``first_at``: arrival of the first complete SSE event (TTFT = ``first_at − start_at``);
- gaps: one entry per event after the first (seconds since the previous event; events that arrive in the
  same read get 0 — the client cannot tell them apart, neither can a real client);
- ``end_at``: the end of the HTTP message (after ``data: [DONE]``); E2E = ``end_at − start_at``;
- ``events``: complete ``data:`` events before ``[DONE]``; ``done``: whether ``[DONE]`` arrived.

A pool made with ``read_pause_s`` stops reading each stream for that long after its first event (a slow
reader), optionally with a small ``rcvbuf`` (``SO_RCVBUF``, bytes).  Non-streaming answers are kept whole in
``body``.  Events, gaps and TTFTs are also counted live into the pool's
``sink`` (any object with ``events``, ``gaps`` and ``ttfts``), so a window sees the events of streams that
outlive it.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httptools

now = time.perf_counter


@dataclass(slots=True)
class Response:
    """What one request saw (times are ``time.perf_counter()`` seconds)."""

    start_at: float
    status: int = 0
    first_at: float | None = None
    last_event_at: float | None = None
    end_at: float | None = None
    events: int = 0
    done: bool = False
    error: str | None = None
    body: bytes = b""


class Conn(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, pool: Pool, addr: tuple[str, int]) -> None:
        self.pool = pool
        self.addr = addr
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.waiter: asyncio.Future[Response] | None = None
        self.sse = False
        self.tail = b""
        self.chunks: list[bytes] = []
        self.closed = False
        self.keep_alive = True
        self.used = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.discard(self)
        self._finish(f"connection lost: {exc!r}" if exc else "connection closed by peer")

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(f"bad HTTP: {exc}")
            self.close()

    def send(self, request: bytes, resp: Response) -> asyncio.Future[Response]:
        self.resp = resp
        self.sse = False
        self.tail = b""
        self.chunks = []
        self.waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(request)
        return self.waiter

    def on_headers_complete(self) -> None:
        if self.resp is not None:
            self.resp.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type" and value.startswith(b"text/event-stream"):
            self.sse = True

    def on_body(self, body: bytes) -> None:
        r = self.resp
        if r is None:
            return
        if not self.sse:
            self.chunks.append(body)
            return
        data = self.tail + body if self.tail else body
        k = data.count(b"\n\n")
        if k == 0:
            self.tail = data
            return
        cut = data.rfind(b"\n\n") + 2
        self.tail = data[cut:]
        t = now()
        if b"data: [DONE]" in data:
            r.done = True
            k -= 1
        if k <= 0:
            return
        sink = self.pool.sink
        sink.events += k
        if r.first_at is None:
            r.first_at = t
            sink.ttfts.append(t - r.start_at)
            if self.pool.read_pause_s > 0 and self.transport is not None:  # a slow reader: stop reading a while
                self.transport.pause_reading()
                asyncio.get_running_loop().call_later(self.pool.read_pause_s, self._resume)
            k -= 1
            r.events += 1
            r.last_event_at = t
        if k > 0:
            assert r.last_event_at is not None
            sink.gaps.append(t - r.last_event_at)
            if k > 1:
                sink.gaps.extend([0.0] * (k - 1))
            r.events += k
            r.last_event_at = t

    def _resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def on_message_complete(self) -> None:
        r = self.resp
        if r is not None:
            r.end_at = now()
            if not self.sse:
                r.body = b"".join(self.chunks)
        waiter, self.resp, self.waiter = self.waiter, None, None
        if waiter is not None and not waiter.done():
            waiter.set_result(r)  # type: ignore[arg-type]
        if self.keep_alive and not self.closed:
            self.pool.release(self)
        else:
            self.close()

    def _finish(self, error: str) -> None:
        waiter, r = self.waiter, self.resp
        self.resp, self.waiter = None, None
        if r is not None:
            r.error = error
            r.end_at = now()
        if waiter is not None and not waiter.done():
            waiter.set_result(r)  # type: ignore[arg-type]

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Idle keep-alive connections per ``(host, port)``."""

    def __init__(self, sink: Any, *, read_pause_s: float = 0.0, rcvbuf: int = 0) -> None:
        self.sink = sink
        self.read_pause_s = read_pause_s
        self.rcvbuf = rcvbuf
        self.idle: dict[tuple[str, int], list[Conn]] = {}
        self.busy: set[Conn] = set()

    async def request(self, url: str, path: str, body: bytes, headers: bytes = b"", start_at: float | None = None
                      ) -> Response:
        """POST ``body`` (JSON) to ``url + path``; never raises for HTTP/transport errors (see ``error``).
        ``start_at``: when the user-visible request began (TTFT is measured from it; default: now)."""
        parts = urlsplit(url)
        addr = (parts.hostname or "127.0.0.1", parts.port or 80)
        req = (b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
               % (path.encode(), addr[0].encode(), addr[1], len(body), headers)) + body
        for attempt in range(2):
            resp = Response(start_at=start_at or now())
            try:
                conn = await self._acquire(addr)
            except OSError as exc:
                resp.error = f"connect: {exc!r}"
                resp.end_at = now()
                return resp
            reused = attempt == 0 and conn.used
            conn.used = True
            try:
                out = await conn.send(req, resp)
            except asyncio.CancelledError:
                conn.close()
                raise
            if out.error and reused and out.status == 0:
                continue  # the server closed an idle keep-alive connection as we reused it
            return out
        return resp

    async def _acquire(self, addr: tuple[str, int]) -> Conn:
        idle = self.idle.get(addr)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                self.busy.add(conn)
                return conn
        loop = asyncio.get_running_loop()
        if self.rcvbuf:  # a small receive buffer: a paused reader pushes back on the proxy sooner
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
            sock.setblocking(False)
            await loop.sock_connect(sock, addr)
            _, conn = await loop.create_connection(lambda: Conn(self, addr), sock=sock)
        else:
            _, conn = await loop.create_connection(lambda: Conn(self, addr), addr[0], addr[1])
        self.busy.add(conn)
        return conn

    def release(self, conn: Conn) -> None:
        self.busy.discard(conn)
        self.idle.setdefault(conn.addr, []).append(conn)

    def discard(self, conn: Conn) -> None:
        self.busy.discard(conn)
        idle = self.idle.get(conn.addr)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        """Close every connection (in-flight requests end with ``error``)."""
        for conn in list(self.busy) + [c for cs in self.idle.values() for c in cs]:
            conn.close()
        self.idle.clear()
        self.busy.clear()
