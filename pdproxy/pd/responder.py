"""The client side of one response: :class:`Responder`, which tracks whether the status line went out so an error
is sent the only way still possible; the :class:`ClientConnection` it writes to; and ``SSE_HEADERS``, the headers
of every SSE response the proxy starts.

Headers are lists of ``(name, value)`` byte pairs, names lower-case.  Before the status line an error becomes an
HTTP status with a JSON envelope; after it, an SSE error event then ``data: [DONE]`` (on Responses and Messages
their own error event, :mod:`pdproxy.apis.streams`).  The relay of a decoder's stream (:mod:`pdproxy.pd.relay`)
starts the response through its Responder, then its splice writes straight to the Responder's connection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from pdproxy.apis import streams as api_streams
from pdproxy.apis.request import Api
from pdproxy.errors import ProxyError, UpstreamHTTPError, sse_error_event
from pdproxy.http import sse
from pdproxy.timeline import RequestContext

SSE_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no"))


class ClientConnection(Protocol):
    """Where one response goes (:class:`pdproxy.http.server.Exchange`; a test may supply its own).

    ``start`` writes the status line and headers (lower-case byte names; without ``content-length`` the body is
    chunked), ``write`` a body piece, ``finish`` the last piece; all three write at once and never block.
    ``body_writer()``: a callable writing one body piece (framed) straight to the transport, for the splice.
    ``paused``: the client's transport is above its high-water mark; ``drain()`` waits until it is not.
    ``flow``: set by the relay to an object with ``client_paused()`` / ``client_resumed()``, called when
    ``paused`` changes, and ``client_gone()`` when the connection is lost.  ``abort()`` drops the connection
    (RST).  ``unsent()``: the bytes written to the client and not taken yet (0 once gone); ``send_timeout_s``:
    how long the client may take none of them before it is cut (``client_send_timeout_s``)."""

    flow: Any

    @property
    def paused(self) -> bool: ...

    @property
    def send_timeout_s(self) -> float: ...

    def unsent(self) -> int: ...

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    def write(self, data: bytes) -> None: ...

    def finish(self, data: bytes = b"") -> None: ...

    def body_writer(self) -> Callable[[bytes], None]: ...

    async def drain(self) -> None: ...

    def abort(self) -> None: ...


class Responder:
    """The client side of one request: tracks whether the status line went out, so errors are sent right.

    Before ``start()``: an error becomes an HTTP status with a JSON envelope (the Anthropic one on ``/v1/messages``,
    :func:`pdproxy.apis.streams.error_json`).  After: an SSE error event followed by ``data: [DONE]`` (if not already
    sent) — on Responses and Messages their own error event, which ends those streams (``api_stream``, set by the
    relay when the stream starts).  ``headers``: the proxy's own response headers (``x-request-id``), added to every
    status line; ``api``: the route the request came in on.
    """

    __slots__ = ("api", "api_stream", "conn", "ctx", "done_sent", "ended", "headers", "started")

    def __init__(self, conn: ClientConnection, ctx: RequestContext, headers: list[tuple[bytes, bytes]],
                 api: Api = Api.CHAT) -> None:
        self.conn = conn
        self.ctx = ctx
        self.headers = headers
        self.api = api
        self.api_stream: api_streams.ApiStream | None = None
        self.started = False
        self.ended = False
        self.done_sent = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the status line and ``headers`` (plus the proxy's own); records ``status`` on the request
        context."""
        self.start_nowait(status, headers)

    def start_nowait(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """:meth:`start` without awaiting (it never blocks)."""
        self.started = True
        self.ctx.status = status
        self.conn.start(status, headers + self.headers)

    async def write(self, data: bytes) -> None:
        """Send ``data`` (bytes) as a body chunk, then wait while the client's transport is above its
        high-water mark."""
        self.conn.write(data)
        if self.conn.paused:
            await self.conn.drain()

    def end_nowait(self, data: bytes = b"") -> None:
        """Send the last body chunk ``data`` (bytes, may be empty); no-op if the body already ended."""
        if not self.ended:
            self.ended = True
            self.conn.finish(data)

    async def end(self, data: bytes = b"") -> None:
        """:meth:`end_nowait` (kept awaitable for callers that stream)."""
        self.end_nowait(data)

    async def json(self, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """A complete JSON response: ``status``, ``body`` (JSON bytes, with Content-Length) and ``extra`` headers."""
        self.start_nowait(status, [(b"content-type", b"application/json"),
                                   (b"content-length", str(len(body)).encode())] + (extra or []))
        self.end_nowait(body)

    async def error(self, err: ProxyError) -> None:
        """Send ``err`` the only way still possible (see class docstring)."""
        self.error_nowait(err)

    def error_nowait(self, err: ProxyError) -> None:
        """:meth:`error` without awaiting."""
        self.ctx.error = err.message
        if not self.started:
            extra = [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
            ctype = err.content_type if isinstance(err, UpstreamHTTPError) else "application/json"
            body = api_streams.error_json(self.api, err)
            self.start_nowait(err.status_code, [(b"content-type", ctype.encode()),
                                                (b"content-length", str(len(body)).encode())] + extra)
            self.end_nowait(body)
            return
        if self.ended:
            return
        fmt = self.api_stream or api_streams.stream_for(self.api, self.ctx, None)
        if fmt is not None:                     # Responses / Messages: their error event ends the stream
            self.done_sent = True
            self.end_nowait(fmt.error_event(err))
            return
        tail = sse_error_event(err)
        if not self.done_sent:
            tail += sse.DONE_EVENT
            self.done_sent = True
        self.end_nowait(tail)
