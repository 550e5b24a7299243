"""A lean HTTP/1.1 client for the data plane: an asyncio protocol with httptools, keep-alive pooled per engine.

Why not aiohttp's ``ClientSession`` (or httpx) here: profiled under 1-token PD requests aiohttp's client was ~34 %
of the proxy's CPU (two legs per request: request building, tracing signals, cookie filtering, payload registry,
stream reader), and any stream reader sits between every decoder read and the relay (loadtest/RESULTS.md).  This
client does what the two legs need and nothing else: one POST per connection at a time, ``Content-Length``
request bodies written with flow control, chunked, sized or close-delimited responses (httptools decodes the
first two; the third ends at the engine's FIN), interim ``1xx`` answers skipped (RFC 9110 §15.2), repeated
header fields kept (joined with ``", "``, RFC 9110 §5.3), response heads bounded (:data:`MAX_HEAD_BYTES`), and
two ways to take the body:

- **reads**: ``readany()`` / ``read()`` drain a body buffer (reading paused above 256 KB buffered), with an idle
  timeout and an absolute deadline as connection timers (the prefill leg, a JSON decode answer, the decoder's
  first event);
- **splice**: :meth:`H1Response.splice` hands the body straight to a :class:`BodySink` from the protocol's
  ``data_received``, with no future or coroutine switch (the relay's streaming phase, :mod:`pdproxy.pd.relay`): the
  body segments of one socket read — one per HTTP chunk, i.e. one per SSE event from vLLM — are joined and given
  as one piece at the end of that read, so a decoder that is ahead of the proxy costs one sink call (and one
  client write) per read, not per event; the sink pauses and resumes reading for back-pressure.

Errors are this module's own small tree, mapped to :class:`pdproxy.errors.ProxyError` in one place
(``pdproxy/http/upstream.py``)::

    TransportError
    ├── ConnectError     the connection could not be opened (refused, unreachable, connect timeout):
    │                    the engine never saw the request
    ├── PoolTimeout      no connection to that engine came free within the pool's wait (also a TimeoutError);
    │                    nothing was sent
    ├── Disconnected     the engine closed or reset the connection before the response was complete
    ├── ProtocolError    the answer is not valid HTTP/1.1 (malformed, an upgrade, a head over MAX_HEAD_BYTES)
    └── ReadTimeout      no data within the idle timeout, or the deadline passed (also a TimeoutError)

``TimeoutError`` (not a :class:`TransportError`) is raised by :meth:`H1Connection.request` when the response
head is not in by ``headers_by``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from contextlib import suppress
from types import TracebackType
from typing import Any, Protocol

import httptools

_PAUSE_BYTES = 256 * 1024
MAX_HEAD_BYTES = 64 * 1024
"""Upper bound of one response's status line + header fields (bytes); a larger head is a :class:`ProtocolError`
(vLLM's answers have ~200 bytes of headers)."""


class TransportError(Exception):
    """A failure of the HTTP/1.1 exchange with an engine (see the module docstring for the tree).  ``public``: a
    sentence of pdproxy's own about it that a client may read (no address, no other exception's text), added to
    the failure kind's fixed sentence (:func:`pdproxy.http.errors.transport_error`); None: that sentence alone."""

    public: str | None = None


class ConnectError(TransportError):
    """The TCP connection could not be opened (refused, unreachable, connect timeout)."""


class PoolTimeout(TransportError, TimeoutError):
    """Every connection to the engine allowed by ``max_per_endpoint`` stayed busy for the pool's whole wait."""


class Disconnected(TransportError):
    """The engine closed or reset the connection before the response was complete."""


class ProtocolError(TransportError):
    """The engine's bytes are not an acceptable HTTP/1.1 response."""


class ReadTimeout(TransportError, TimeoutError):
    """No body data within the idle timeout, or the response not complete by its deadline."""


class BodySink(Protocol):
    """Receives a spliced response body (:meth:`H1Response.splice`), called from the connection's protocol
    callbacks: ``data`` once per body segment (bytes, never empty), then exactly one of ``eof`` (the message is
    complete) or ``fail`` (a :class:`TransportError`; bytes that did arrive were all given to ``data``).  One
    ``data`` call holds every body segment of one socket read, in order (:meth:`H1Connection.data_received`); a
    ``data`` that raises fails the response (``fail`` with a :class:`ProtocolError`, the connection closed)."""

    def data(self, chunk: bytes) -> None: ...

    def eof(self) -> None: ...

    def fail(self, exc: TransportError) -> None: ...


class H1Response:
    """One response: status and headers once :meth:`H1Connection.request` returns, then the body by reads or by
    :meth:`splice`.

    ``headers`` keys are lower-case (``get`` is case-insensitive; a repeated field's values are joined with
    ``", "``).  ``idle_timeout_s``: a read that waits longer for data raises :class:`ReadTimeout`; so does any read
    still waiting at ``deadline_at`` (``loop.time()`` seconds).  :meth:`set_idle_timeout` changes the idle timeout
    on the live response.  A broken connection fails reads with :class:`Disconnected` (or
    :class:`ProtocolError`) once the bytes that did arrive are read.  ``with resp:`` calls :meth:`release` when
    the block is left, however it is left.
    """

    __slots__ = ("_buf", "_conn", "_eof", "_exc", "_size", "_timer", "_wait_since", "_waiter", "deadline_at",
                 "headers", "idle_timeout_s", "keep_alive", "sink", "status")

    def __init__(self, conn: H1Connection, idle_timeout_s: float | None, deadline_at: float | None = None) -> None:
        self._conn = conn
        self.idle_timeout_s = idle_timeout_s
        self.deadline_at = deadline_at
        self.status = 0
        self.headers = _Headers()
        self.keep_alive = True
        self.sink: BodySink | None = None
        self._buf: list[bytes] = []
        self._size = 0
        self._eof = False
        self._exc: TransportError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._wait_since = 0.0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the response's connection runs on."""
        return self._conn.loop

    @property
    def content(self) -> H1Response:
        """``self`` (the response is its own body reader: ``resp.content.readany()``)."""
        return self

    @property
    def content_type(self) -> str:
        """Media type of ``Content-Type`` without parameters (default ``application/octet-stream``)."""
        return str(self.headers.get("content-type", "application/octet-stream")).split(";", 1)[0].strip()

    def at_eof(self) -> bool:
        """True once the whole body has arrived and been read (or handed to a sink)."""
        return self._eof and not self._buf

    async def readany(self) -> bytes:
        """Everything buffered (waiting for at least one byte); ``b""`` at the end of the body.  Raises
        :class:`TransportError`."""
        if not self._buf:
            if self._eof:
                return b""
            await self._wait()
            if not self._buf:
                return b""
        return self._take()

    async def read(self, n: int = -1) -> bytes:
        """The rest of the body, or its next ``n`` bytes when ``n`` ≥ 0 (fewer at the end of the body); bytes
        beyond ``n`` stay buffered for the next read.  Raises :class:`TransportError`."""
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
            self._timer = self._conn.loop.call_at(self._due(), self._check_idle)

    def splice(self, sink: BodySink) -> None:
        """From now on hand the body to ``sink`` as it arrives (see :class:`BodySink`), starting with what is
        already buffered; reads are no longer allowed.  The read timers stop: the sink keeps its own."""
        self._stop_timer()
        self.sink = sink
        if self._buf:
            data = self._take()
            sink.data(data)
        if self._exc is not None:
            sink.fail(self._exc)
        elif self._eof:
            sink.eof()
        elif self.sink is sink:
            self._conn.splice_to(sink.data)

    def pause_reading(self) -> None:
        """Stop reading the engine's socket (back-pressure from the client side); no-op when closed."""
        self._conn.pause()

    def resume_reading(self) -> None:
        """Undo :meth:`pause_reading`."""
        self._conn.resume()

    def release(self) -> None:
        """Done with the response: the connection goes back to the pool if the whole message arrived (read or
        not) on a keep-alive connection, and is closed otherwise."""
        self._stop_timer()
        self._conn.done(self, reusable=self._eof and self.keep_alive)

    def __enter__(self) -> H1Response:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()

    def close(self) -> None:
        """Drop the connection (the engine sees a disconnect and aborts the request, docs/pd-protocol.md §6);
        reads of an unfinished body then raise :class:`Disconnected`; a sink is not told."""
        self._stop_timer()
        self.sink = None
        self._conn.done(self, reusable=False)
        if not self._eof and self._exc is None:
            self._exc = Disconnected("response closed")
            self._wake_with(self._exc)

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
        loop = self._conn.loop
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
        loop = self._conn.loop
        due = self._due()
        if due > loop.time():
            self._timer = loop.call_at(due, self._check_idle)
        elif self.deadline_at is not None and due >= self.deadline_at:
            waiter.set_exception(ReadTimeout("response not complete by its deadline"))
        else:
            waiter.set_exception(ReadTimeout(f"no data for {self.idle_timeout_s} s"))

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wake_with(self, exc: TransportError | None) -> None:
        w = self._waiter
        if w is not None and not w.done():
            if exc is None:
                w.set_result(None)
            else:
                w.set_exception(exc)

    def feed(self, data: bytes) -> None:
        """Body bytes from the parser (reads mode); reading is paused above 256 KB buffered."""
        self._buf.append(data)
        self._size += len(data)
        if self._size > _PAUSE_BYTES:
            self._conn.pause()
        self._wake_with(None)

    def feed_eof(self) -> None:
        """The message is complete."""
        self._eof = True
        self._stop_timer()
        sink = self.sink
        if sink is not None:
            sink.eof()
        else:
            self._wake_with(None)

    def fail(self, exc: TransportError) -> None:
        """The connection broke mid-body: pending and later reads raise ``exc`` (a sink gets ``fail``)."""
        if self._eof or self._exc is not None:
            return
        self._exc = exc
        self._stop_timer()
        sink = self.sink
        if sink is not None:
            sink.fail(exc)
        else:
            self._wake_with(exc)


class _Gone:
    """The parser of a closed connection: any bytes are an error (none can arrive)."""

    def feed_data(self, data: bytes) -> None:
        raise httptools.HttpParserError("connection closed")


_GONE: Any = _Gone()


def _ends_at_eof(resp: H1Response) -> bool:
    """Whether ``resp`` (headers in) has a body delimited by the connection's end: neither sized nor chunked."""
    return bool(resp.status) and "content-length" not in resp.headers and "transfer-encoding" not in resp.headers


class _Headers(dict[str, str]):
    """Lower-case header names; ``get`` accepts any case; a repeated field's values are joined with ``", "``."""

    def get(self, key: str, default: Any = None) -> Any:
        """Header value for ``key`` in any case, or ``default``."""
        return super().get(key.lower(), default)

    def add(self, name: str, value: str) -> None:
        """Record one header field line (``name`` lower-case)."""
        old = dict.get(self, name)
        self[name] = value if old is None else f"{old}, {value}"


class _Callbacks:
    """What the connection's parser calls (httptools looks the callbacks up once, when the parser is made): the
    connection's own methods, except ``on_body``, which is the connection's ``held.append`` itself — a chunked
    body's segments (one per SSE event from vLLM) cost the parser no Python frame; :meth:`H1Connection.data_received`
    gives them to the sink as one piece per read."""

    __slots__ = ("on_body", "on_header", "on_headers_complete", "on_message_begin", "on_message_complete",
                 "on_status")

    def __init__(self, conn: H1Connection) -> None:
        self.on_body = conn.held.append
        self.on_header = conn.on_header
        self.on_headers_complete = conn.on_headers_complete
        self.on_message_begin = conn.on_message_begin
        self.on_message_complete = conn.on_message_complete
        self.on_status = conn.on_status


class H1Connection(asyncio.Protocol):
    """One keep-alive connection to an engine; one request at a time."""

    def __init__(self, pool: H1Pool, key: tuple[str, int]) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.held: list[bytes] = []  # the body segments of the current read (see data_received)
        self.callbacks: _Callbacks | None = _Callbacks(self)
        self.parser = httptools.HttpResponseParser(self.callbacks)
        self.resp: H1Response | None = None
        self.sink_data: Callable[[bytes], None] | None = None   # the current read's body goes there (None: dropped)
        self.headers_in: asyncio.Future[None] | None = None
        self.closed = False
        self.counted = True  # holds one of the pool's per-endpoint places until closed
        self.in_idle = False
        self.complete = False
        self.interim = False
        self.got_bytes = False
        self.head_bytes = 0
        self.requests = 0
        self.idle_since = 0.0
        self.paused = False
        self.write_paused: asyncio.Future[None] | None = None

    # --- protocol callbacks ----------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        w = self.write_paused
        if w is not None and not w.done():
            w.set_result(None)
        r = self.resp
        if r is not None and not self.complete and exc is None and _ends_at_eof(r):
            self.on_message_complete()  # a close-delimited body (RFC 9112 §6.3 rule 8) ends at the FIN
            self._unlink()
            return
        err = Disconnected(f"engine closed the connection{f': {exc!r}' if exc else ''}")
        if self.headers_in is not None and not self.headers_in.done():
            self.headers_in.set_exception(err)
        if r is not None and not self.complete:
            r.fail(Disconnected(f"response body incomplete: {err}"))
        self._unlink()

    def _unlink(self) -> None:
        """Drop the parser and its callbacks (they hold bound methods of this protocol: a reference cycle) once the
        connection is gone, so the connection is freed by reference counting."""
        self.parser = _GONE
        self.callbacks = None

    def pause_writing(self) -> None:
        if self.write_paused is None or self.write_paused.done():
            self.write_paused = self.loop.create_future()

    def resume_writing(self) -> None:
        w = self.write_paused
        if w is not None and not w.done():
            w.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self.resp is None:
            self.abort()  # unsolicited bytes on an idle connection (e.g. a 408 before a close): never reuse it
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
            held = self.held
            if held:  # the body segments of this read: one piece to the sink (inline: once per read)
                data = held[0] if len(held) == 1 else b"".join(held)
                held.clear()
                sink = self.sink_data
                if sink is not None:
                    sink(data)
        except httptools.HttpParserUpgrade:
            self._broken("unexpected protocol upgrade")
        except httptools.HttpParserError as exc:
            if self.complete:
                self.abort()  # bytes after the complete response (see on_message_begin): the response stands
            else:
                cause = exc.__context__
                if isinstance(cause, ProtocolError):
                    self._broken(str(cause), cause.public)
                else:
                    self._broken(f"malformed HTTP response: {exc}")
        except ProtocolError as exc:  # the sink refused this read's piece (called here, not from a parser callback)
            self._broken(str(exc), exc.public)
        except Exception as exc:  # the sink failed on this read's piece
            self._broken(f"malformed HTTP response: {exc!r}")

    def on_message_begin(self) -> None:
        if self.complete:
            raise ValueError("unsolicited bytes after the response")  # stops the parser before they touch it

    def on_status(self, status: bytes) -> None:
        self.head_bytes += len(status)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > MAX_HEAD_BYTES:
            raise ProtocolError(f"response head larger than {MAX_HEAD_BYTES} bytes")
        if self.resp is not None:
            self.resp.headers.add(name.decode("latin-1").lower(), value.decode("latin-1"))

    def on_headers_complete(self) -> None:
        r = self.resp
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            self.interim = True
            self.head_bytes = 0
            if r is not None:
                r.headers.clear()
            return
        if r is not None:
            r.status = status
            r.keep_alive = self.parser.should_keep_alive()
        if self.headers_in is not None and not self.headers_in.done():
            self.headers_in.set_result(None)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        if self.held:
            self._flush()
        self.complete = True
        if self.resp is not None:
            self.resp.feed_eof()

    def splice_to(self, data: Callable[[bytes], None]) -> None:
        """Hand the response's later body to ``data`` (a :class:`BodySink`'s ``data``) instead of the response's
        read buffer: one piece per read, as :meth:`data_received` gives every body."""
        self.sink_data = data

    def _flush(self) -> None:
        """Give the held segments of this read to the sink as one piece (dropped when there is none)."""
        held = self.held
        data = held[0] if len(held) == 1 else b"".join(held)
        held.clear()
        sink = self.sink_data
        if sink is not None:  # None once the response is done with (done())
            sink(data)

    def _broken(self, why: str, public: str | None = None) -> None:
        if self.held:
            with suppress(Exception):  # a sink failing on the bytes before the break is told the break below
                self._flush()
        err = ProtocolError(why)
        err.public = public
        if self.headers_in is not None and not self.headers_in.done():
            self.headers_in.set_exception(err)
        if self.resp is not None:
            self.resp.fail(err)
        self.abort()

    # --- used by the pool and the response ---------------------------------------------------------------------
    async def request(self, head: bytes, body: bytes, idle_timeout_s: float | None, *,
                      headers_by: float | None = None, deadline_at: float | None = None) -> H1Response:
        """Send one request; return once the response headers are in.  Raises :class:`TransportError`, or
        ``TimeoutError`` when the headers are not in by ``headers_by`` (``loop.time()`` seconds; the connection
        is then closed).  ``idle_timeout_s`` / ``deadline_at``: see :class:`H1Response`.  A large ``body`` is
        written under the transport's flow control (the head's timer keeps running meanwhile)."""
        assert self.transport is not None
        self.complete = False
        self.interim = False
        self.got_bytes = False
        self.head_bytes = 0
        if self.closed:  # nothing was sent: a caller may retry on another connection
            raise Disconnected("engine closed the connection")
        loop = self.loop
        self.requests += 1
        assert self.callbacks is not None   # not closed (above): not unlinked
        self.parser = httptools.HttpResponseParser(self.callbacks)
        self.resp = resp = H1Response(self, idle_timeout_s, deadline_at)
        self.sink_data = resp.feed
        self.headers_in = waiter = loop.create_future()
        timer = loop.call_at(headers_by, self._headers_late, waiter) if headers_by is not None else None
        try:
            if body:
                self.transport.writelines((head, body))
            else:
                self.transport.write(head)
            w = self.write_paused
            if w is not None and not w.done():  # the body is still in our buffer: wait for the socket to take it
                await asyncio.wait((w, waiter), return_when=asyncio.FIRST_COMPLETED)
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
        """Stop reading from the socket (back-pressure); no-op if closed or paused."""
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
        self.sink_data = None
        self.held.clear()
        if reusable and self.complete and not self.closed:
            self.resume()
            self.pool.put(self)
        else:
            self.abort()

    def abort(self) -> None:
        """Close the connection at once (RST if data is pending); it is never reused."""
        self.closed = True
        self.resp = None
        self.pool.forget(self)
        if self.transport is not None:
            self.transport.abort()


def address(key: tuple[str, int]) -> str:
    """``host:port`` of a pool key, an IPv6 host bracketed (``[fd00::5]:8100``): the form
    :func:`pdproxy.errors.public_message` removes whole from a message a client reads (unbracketed, ``fd00::`` of
    ``fd00::5:8100`` was left in it)."""
    return f"[{key[0]}]:{key[1]}" if ":" in key[0] else f"{key[0]}:{key[1]}"


class H1Pool:
    """Keep-alive connections per ``(host, port)``: at most ``max_per_endpoint`` open at once (idle or busy; a
    caller past that waits up to ``wait_s`` seconds for one to come free, then gets :class:`PoolTimeout`);
    connections idle longer than ``keepalive_s`` seconds are dropped (vLLM's uvicorn closes idle ones after 5 s).
    Create it inside the running event loop it will serve."""

    def __init__(self, *, connect_timeout_s: float, keepalive_s: float, max_per_endpoint: int = 0,
                 wait_s: float = 10.0) -> None:
        self.loop = asyncio.get_running_loop()  # once: every asyncio.get_running_loop() costs a getpid() syscall
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self.max_per_endpoint = max_per_endpoint
        self.wait_s = wait_s
        self.idle: dict[tuple[str, int], list[H1Connection]] = {}
        self.open: dict[tuple[str, int], int] = {}
        self._waiters: dict[tuple[str, int], deque[asyncio.Future[None]]] = {}

    async def acquire(self, key: tuple[str, int], *, tls: bool = False, deadline: float | None = None,
                      fresh: bool = False) -> tuple[H1Connection, bool]:
        """A connection for one request and whether it was reused from the pool (never when ``fresh``).  Waits
        for a free place while the endpoint is at ``max_per_endpoint``, at most ``wait_s`` seconds and not past
        ``deadline`` (``loop.time()`` seconds).  Raises :class:`ConnectError`, :class:`PoolTimeout`, or
        ``TimeoutError`` when ``deadline`` passed."""
        loop = self.loop
        give_up = loop.time() + self.wait_s
        while True:
            if not fresh:
                conn = self.take(key)
                if conn is not None:
                    return conn, True
            cap = self.max_per_endpoint
            if not cap or self.open.get(key, 0) < cap:
                break
            if fresh and self.idle.get(key):  # make room: an idle connection is worth less than this request
                victim = self.idle[key].pop(0)
                victim.in_idle = False
                victim.abort()
                continue
            left = min(give_up, deadline if deadline is not None else give_up) - loop.time()
            if left <= 0:
                if deadline is not None and deadline < give_up:
                    raise TimeoutError("no time left to connect")
                raise PoolTimeout(f"all {cap} connections to {address(key)} stayed busy for {self.wait_s:.1f} s")
            waiter = loop.create_future()
            self._waiters.setdefault(key, deque()).append(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                pass
            finally:
                if not waiter.done():
                    waiter.cancel()
        left_s = None if deadline is None else deadline - loop.time()
        if left_s is not None and left_s <= 0:
            raise TimeoutError("no time left to connect")
        return await self.connect(key, tls=tls, timeout_s=left_s), False

    async def connect(self, key: tuple[str, int], *, tls: bool = False, timeout_s: float | None = None
                      ) -> H1Connection:
        """A new connection (TLS with the default context when ``tls``) within ``timeout_s`` seconds (default
        and upper bound: ``connect_timeout_s``).  Raises :class:`ConnectError`."""
        loop = self.loop
        limit = self.connect_timeout_s if timeout_s is None else max(0.0, min(timeout_s, self.connect_timeout_s))
        self.open[key] = self.open.get(key, 0) + 1
        try:
            async with asyncio.timeout(limit):
                _, conn = await loop.create_connection(lambda: H1Connection(self, key), key[0], key[1],
                                                       ssl=True if tls else None)
        except BaseException as exc:
            self._release_place(key)
            where = address(key)
            if isinstance(exc, TimeoutError):
                raise ConnectError(f"connect ({where}) timed out after {limit:.1f} s") from None
            if isinstance(exc, OSError):
                raise ConnectError(f"connect ({where}) failed: {exc}") from None
            raise
        return conn

    def take(self, key: tuple[str, int]) -> H1Connection | None:
        """A pooled idle connection, or None."""
        idle = self.idle.get(key)
        if not idle:
            return None
        limit = time.monotonic() - self.keepalive_s
        while idle:
            conn = idle.pop()
            conn.in_idle = False
            if not conn.closed and conn.idle_since >= limit:
                return conn
            conn.abort()
        return None

    def put(self, conn: H1Connection) -> None:
        """Return an idle keep-alive connection to the pool (stamped now; dropped after ``keepalive_s`` seconds)."""
        conn.idle_since = time.monotonic()
        conn.in_idle = True
        self.idle.setdefault(conn.key, []).append(conn)
        self._wake(conn.key)

    def forget(self, conn: H1Connection) -> None:
        """``conn`` closed: its place is free (idempotent)."""
        if conn.counted:
            conn.counted = False
            if conn.in_idle:
                conn.in_idle = False
                self.idle[conn.key].remove(conn)
            self._release_place(conn.key)

    def _release_place(self, key: tuple[str, int]) -> None:
        n = self.open.get(key, 0) - 1
        if n > 0:
            self.open[key] = n
        else:
            self.open.pop(key, None)
        self._wake(key)

    def _wake(self, key: tuple[str, int]) -> None:
        waiters = self._waiters.get(key)
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    def close(self) -> None:
        """Close every idle connection (in-use ones close when their response is released)."""
        for conns in list(self.idle.values()):
            for conn in list(conns):
                conn.abort()
        self.idle.clear()
