"""A lean HTTP/1.1 client for the data plane: an asyncio protocol with httptools, keep-alive pooled per engine.

Why not aiohttp's ``ClientSession`` here: profiled under 1-token PD requests it was ~34 % of the proxy's CPU (two
legs per request: request building, tracing signals, cookie filtering, payload registry, stream reader), and
its ``StreamReader`` sits between every decoder read and the relay (loadtest/RESULTS.md).  This client does what
the two legs need and nothing else: one POST per connection at a time, ``Content-Length`` request bodies,
chunked, sized or close-delimited responses (httptools decodes the first two; the third ends at the engine's FIN),
and a body buffer the relay drains with ``readany()``, reading paused above 256 KB buffered.

The response object mimics the slice of ``aiohttp.ClientResponse`` the relay uses (``status``, ``headers``,
``content_type``, ``content.readany()/read()/at_eof()``, ``read()``, ``release()``, ``close()``) and raises
aiohttp's exception types (``ServerDisconnectedError``, ``ClientPayloadError``, ``ServerTimeoutError`` — a
``TimeoutError`` too), so callers catching ``aiohttp.ClientError`` keep working.  Connection failures raise
:class:`ConnectError` (the engine never saw the request).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import httptools

_PAUSE_BYTES = 256 * 1024


class ConnectError(Exception):
    """The TCP connection could not be opened (refused, unreachable, connect timeout)."""


class H1Response:
    """One response: status and headers once :meth:`H1Connection.request` returns, then the body by reads.

    ``headers`` keys are lower-case (``get`` is case-insensitive).  ``idle_timeout_s``: a read that waits longer
    for data raises ``aiohttp.ServerTimeoutError`` (a ``TimeoutError``); so does any read still waiting at
    ``deadline_at`` (``loop.time()`` seconds).  :meth:`set_idle_timeout` changes the idle timeout on the live
    response (the decode leg waits for its first event with the first-byte timeout, then for each next one with
    the inter-event timeout).  A broken connection fails reads with ``aiohttp.ClientPayloadError`` once the
    bytes that did arrive are read.
    """

    __slots__ = ("_buf", "_conn", "_eof", "_exc", "_size", "_timer", "_wait_since", "_waiter", "deadline_at",
                 "headers", "idle_timeout_s", "keep_alive", "status")

    def __init__(self, conn: H1Connection, idle_timeout_s: float | None, deadline_at: float | None = None) -> None:
        self._conn = conn
        self.idle_timeout_s = idle_timeout_s
        self.deadline_at = deadline_at
        self.status = 0
        self.headers = _Headers()
        self.keep_alive = True
        self._buf: list[bytes] = []
        self._size = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._wait_since = 0.0

    # --- aiohttp.ClientResponse look-alike ------------------------------------------------------------------
    @property
    def content(self) -> H1Response:
        """``self`` (aiohttp ``resp.content`` look-alike: the response is its own body reader)."""
        return self

    @property
    def content_type(self) -> str:
        """Media type of ``Content-Type`` without parameters (default ``application/octet-stream``)."""
        return self.headers.get("content-type", "application/octet-stream").split(";", 1)[0].strip()

    def at_eof(self) -> bool:
        """True once the whole body has arrived and been read."""
        return self._eof and not self._buf

    async def readany(self) -> bytes:
        """Everything buffered (waiting for at least one byte); ``b""`` at the end of the body."""
        if not self._buf:
            if self._eof:
                return b""
            await self._wait()
            if not self._buf:
                return b""
        return self._take()

    async def read(self, n: int = -1) -> bytes:
        """The rest of the body, or its next ``n`` bytes when ``n`` ≥ 0 (fewer at the end of the body); bytes
        beyond ``n`` stay buffered for the next read."""
        parts: list[bytes] = []
        size = 0
        while n < 0 or size < n:
            chunk = await self.readany()
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        data = b"".join(parts)
        if 0 <= n < size:
            rest = data[n:]
            self._buf.insert(0, rest)
            self._size += len(rest)
            data = data[:n]
        return data

    def set_idle_timeout(self, seconds: float | None) -> None:
        """Make reads time out after ``seconds`` without data from now on (None: no idle timeout).  A read
        waiting right now is re-timed from when it started waiting."""
        self.idle_timeout_s = seconds
        self._stop_timer()
        w = self._waiter
        if w is not None and not w.done() and (seconds is not None or self.deadline_at is not None):
            self._timer = asyncio.get_running_loop().call_at(self._due(), self._check_idle)

    def release(self) -> None:
        """Done with the response: the connection goes back to the pool if the whole message arrived (read or
        not) on a keep-alive connection, and is closed otherwise."""
        self._stop_timer()
        self._conn.done(self, reusable=self._eof and self.keep_alive)

    def close(self) -> None:
        """Drop the connection (the engine sees a disconnect and aborts the request, reference §1.5); reads of
        an unfinished body then raise ``aiohttp.ClientConnectionError``."""
        self._stop_timer()
        self._conn.done(self, reusable=False)
        if not self._eof and self._exc is None:
            self.fail(aiohttp.ClientConnectionError("response closed"))

    # --- fed by the protocol -------------------------------------------------------------------------------
    def _take(self) -> bytes:
        buf = self._buf
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        self._buf = []
        if self._size > _PAUSE_BYTES:
            self._conn.resume()
        self._size = 0
        return data

    async def _wait(self) -> None:
        """Wait for data.  The idle timer is armed lazily and re-armed only when it fires early, so a paced
        stream pays one clock read per wait instead of creating and cancelling a timer per event."""
        if self._exc is not None:
            raise self._exc
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        if self.idle_timeout_s is not None or self.deadline_at is not None:
            self._wait_since = loop.time()
            if self._timer is None:
                self._timer = loop.call_at(self._due(), self._check_idle)
        try:
            await waiter
        finally:
            self._waiter = None

    def _due(self) -> float:
        idle, deadline = self.idle_timeout_s, self.deadline_at
        due = self._wait_since + idle if idle is not None else float("inf")
        return min(due, deadline) if deadline is not None else due

    def _check_idle(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # not waiting now: the next wait re-arms the timer
        loop = asyncio.get_running_loop()
        due = self._due()
        if due > loop.time():
            self._timer = loop.call_at(due, self._check_idle)
        elif self.deadline_at is not None and due >= self.deadline_at:
            waiter.set_exception(aiohttp.ServerTimeoutError("response not complete by its deadline"))
        else:
            waiter.set_exception(aiohttp.ServerTimeoutError(f"no data for {self.idle_timeout_s} s"))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def feed(self, data: bytes) -> None:
        """Body bytes from the parser; reading is paused above 256 KB buffered."""
        self._buf.append(data)
        self._size += len(data)
        if self._size > _PAUSE_BYTES:
            self._conn.pause()
        self._wake()

    def feed_eof(self) -> None:
        """The message is complete."""
        self._eof = True
        self._stop_timer()
        self._wake()

    def fail(self, exc: BaseException) -> None:
        """The connection broke mid-body: pending and later reads raise ``exc``."""
        if self._eof:
            return
        self._exc = exc
        self._stop_timer()
        w = self._waiter
        if w is not None and not w.done():
            w.set_exception(exc)


def _ends_at_eof(resp: H1Response) -> bool:
    """Whether ``resp`` (headers in) has a body delimited by the connection's end: neither sized nor chunked."""
    return bool(resp.status) and "content-length" not in resp.headers and "transfer-encoding" not in resp.headers


class _Headers(dict[str, str]):
    """Lower-case header names; ``get`` accepts any case."""

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        """Header value for ``key`` in any case, or ``default``."""
        return super().get(key.lower(), default)


class H1Connection(asyncio.Protocol):
    """One keep-alive connection to an engine; one request at a time."""

    def __init__(self, pool: H1Pool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: H1Response | None = None
        self.headers_in: asyncio.Future[None] | None = None
        self.closed = False
        self.complete = False
        self.got_bytes = False
        self.requests = 0
        self.idle_since = 0.0
        self.paused = False

    # --- protocol callbacks ----------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        r = self.resp
        if r is not None and not self.complete and exc is None and _ends_at_eof(r):
            self.on_message_complete()  # a close-delimited body (RFC 9112 §6.3 rule 8) ends at the FIN
            return
        err = aiohttp.ServerDisconnectedError(f"engine closed the connection{f': {exc!r}' if exc else ''}")
        if self.headers_in is not None and not self.headers_in.done():
            self.headers_in.set_exception(err)
        if r is not None and not self.complete:
            r.fail(aiohttp.ClientPayloadError(f"response body incomplete: {err}"))

    def data_received(self, data: bytes) -> None:
        if self.resp is None:
            self.abort()  # unsolicited bytes on an idle connection (e.g. a 408 before a close): never reuse it
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._broken("unexpected protocol upgrade")
        except httptools.HttpParserError as exc:
            if self.complete:
                self.abort()  # bytes after the complete response (see on_message_begin): the response stands
            else:
                self._broken(f"malformed HTTP response: {exc}")

    def on_message_begin(self) -> None:
        if self.complete:
            raise ValueError("unsolicited bytes after the response")  # stops the parser before they touch it

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.resp is not None:
            self.resp.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        r = self.resp
        if r is not None:
            r.status = self.parser.get_status_code()
            r.keep_alive = self.parser.should_keep_alive()
        if self.headers_in is not None and not self.headers_in.done():
            self.headers_in.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp.feed(body)

    def on_message_complete(self) -> None:
        self.complete = True
        if self.resp is not None:
            self.resp.feed_eof()

    def _broken(self, why: str) -> None:
        err = aiohttp.ClientPayloadError(why)
        if self.headers_in is not None and not self.headers_in.done():
            self.headers_in.set_exception(err)
        if self.resp is not None:
            self.resp.fail(err)
        self.abort()

    # --- used by the pool and the response ---------------------------------------------------------------------
    async def request(self, head: bytes, body: bytes, idle_timeout_s: float | None, *,
                      headers_by: float | None = None, deadline_at: float | None = None) -> H1Response:
        """Send one request; return once the response headers are in.  Raises ``aiohttp.ClientError``, or
        ``TimeoutError`` when the headers are not in by ``headers_by`` (``loop.time()`` seconds; the connection
        is then closed).  ``idle_timeout_s`` / ``deadline_at``: see :class:`H1Response`."""
        assert self.transport is not None
        self.complete = False
        self.got_bytes = False
        if self.closed:  # nothing was sent: a caller may retry on another connection
            raise aiohttp.ServerDisconnectedError("engine closed the connection")
        loop = asyncio.get_running_loop()
        self.requests += 1
        self.parser = httptools.HttpResponseParser(self)
        self.resp = resp = H1Response(self, idle_timeout_s, deadline_at)
        self.headers_in = waiter = loop.create_future()
        timer = loop.call_at(headers_by, self._headers_late, waiter) if headers_by is not None else None
        if body:
            self.transport.writelines((head, body))
        else:
            self.transport.write(head)
        try:
            await waiter
        except BaseException:
            self.abort()
            raise
        finally:
            self.headers_in = None
            if timer is not None:
                timer.cancel()
        return resp  # not self.resp: a body that broke in the same read as the headers already dropped it

    @staticmethod
    def _headers_late(waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError("no response headers in time"))

    def pause(self) -> None:
        """Stop reading from the socket (back-pressure while the body buffer is full); no-op if closed or paused."""
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Resume reading from the socket after :meth:`pause`; no-op if closed or not paused."""
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def done(self, resp: H1Response, reusable: bool) -> None:
        """The caller is finished with ``resp`` (a no-op if the connection has moved on to another request)."""
        if self.resp is not resp:
            return
        self.resp = None
        if reusable and self.complete and not self.closed:
            self.resume()
            self.pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        """Close the connection at once (RST if data is pending); it is never reused."""
        self.closed = True
        self.resp = None
        if self.transport is not None:
            self.transport.abort()


class H1Pool:
    """Idle keep-alive connections per ``(host, port)``; connections idle longer than ``keepalive_s`` seconds
    are dropped (vLLM's uvicorn closes idle ones after 5 s)."""

    def __init__(self, *, connect_timeout_s: float, keepalive_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.idle: dict[tuple[str, int], list[H1Connection]] = {}

    async def connect(self, key: tuple[str, int], *, tls: bool = False, timeout_s: float | None = None
                      ) -> H1Connection:
        """A new connection (TLS with the default context when ``tls``) within ``timeout_s`` seconds (default
        and upper bound: ``connect_timeout_s``).  Raises :class:`ConnectError`."""
        loop = asyncio.get_running_loop()
        limit = self.connect_timeout_s if timeout_s is None else max(0.0, min(timeout_s, self.connect_timeout_s))
        try:
            async with asyncio.timeout(limit):
                _, conn = await loop.create_connection(lambda: H1Connection(self, key), key[0], key[1],
                                                       ssl=True if tls else None)
        except TimeoutError:
            raise ConnectError(f"connect to {key[0]}:{key[1]} timed out after {limit:.1f} s") from None
        except OSError as exc:
            raise ConnectError(f"connect to {key[0]}:{key[1]} failed: {exc}") from None
        return conn

    def take(self, key: tuple[str, int]) -> H1Connection | None:
        """A pooled idle connection, or None."""
        idle = self.idle.get(key)
        if not idle:
            return None
        limit = time.monotonic() - self.keepalive_s
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since >= limit:
                return conn
            conn.abort()
        return None

    def put(self, conn: H1Connection) -> None:
        """Return an idle keep-alive connection to the pool (stamped now; dropped after ``keepalive_s`` seconds)."""
        conn.idle_since = time.monotonic()
        self.idle.setdefault(conn.key, []).append(conn)

    def close(self) -> None:
        """Close every idle connection (in-use ones close when their response is released)."""
        for conns in self.idle.values():
            for conn in conns:
                conn.abort()
        self.idle.clear()
