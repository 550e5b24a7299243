"""pdproxy's own HTTP/1.x server protocol (uvloop + httptools): the completion routes natively, the rest via ASGI.

Why not uvicorn's protocol for everything: a relayed event through ASGI costs an ``http.response.body`` dict, an
``await send()`` and a coroutine switch in the relay; the relay's splice (:mod:`pdproxy.pd.relay`) instead writes
each decoder segment to the client's transport from the decoder connection's ``data_received``.  That needs the
client's transport and its write flow control, which this protocol owns (figures: README "Performance").

What a connection does (RFC 9112):

- **versions**: HTTP/1.1 (keep-alive unless ``Connection: close``) and HTTP/1.0 (keep-alive only with
  ``Connection: keep-alive``, then answered with it).  Responses say ``HTTP/1.1``; a response without a length
  is chunked for 1.1 and delimited by closing the connection for 1.0 (§6.3, §7.1);
- **pipelining** (§9.3.2): requests are parsed as they arrive and answered strictly in order, one at a time;
  while one is queued, reading pauses;
- **keep-alive**: an idle connection is closed after ``timeout_keep_alive_s`` (default 75 s: longer than the
  clients' own pools keep idle connections — httpx 5 s, aiohttp 15 s — so the client always drops first and never
  sends a request on a connection the proxy is closing);
- **limits**: a request line + header fields over ``max_request_head_bytes`` get 431 (a URL over 8 KiB: 414);
  a completion body over ``max_body_bytes`` gets 413 (at once when ``Content-Length`` says so); a malformed
  request gets 400; each of these closes the connection;
- ``Expect: 100-continue``: ``100 Continue`` is sent when the request's turn comes (never for a body that is
  refused by its ``Content-Length``);
- **shutdown**: uvicorn's ``Server`` runs the protocol (``uvicorn.Config(http=protocol_factory(app))``): it owns
  the sockets (TLS included, via the ``ssl`` context the listening socket is created with), signals and the
  lifespan, and calls :meth:`ServerProtocol.shutdown` on every connection.

Routes: the generation routes (``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/messages``: :attr:`ServedApp.completion_routes`) are read whole and given to
``PDProxyApp.handle_completion(api, exchange)`` with an :class:`Exchange` (which implements
:class:`pdproxy.pd.responder.ClientConnection`); any other request runs the ASGI app (``PDProxyApp.__call__``: FastAPI's
control plane) through :class:`_AsgiCycle`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http
import logging
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import httptools
import orjson

from pdproxy.errors import error_body

if TYPE_CHECKING:
    from pdproxy.settings import Settings

log = logging.getLogger("pdproxy.server")



class ServedApp(Protocol):
    """What :class:`ServerProtocol` serves (``pdproxy.app.application.PDProxyApp``): its ``settings`` (limits and
    timeouts), ``completion_routes`` (path without trailing slash → route key: a ``POST`` there is read whole,
    within ``max_body_bytes``, and given to ``handle_completion(route, exchange)``), and an ASGI app
    (``__call__``) for every other request."""

    @property
    def settings(self) -> Settings: ...

    @property
    def completion_routes(self) -> Mapping[str, str]: ...

    async def handle_completion(self, route: str, ex: Exchange) -> None: ...

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None: ...
"""The generation routes served through PD (chat, completions, Responses, Anthropic Messages), read whole here."""
MAX_URL_BYTES = 8 * 1024


def _status_line(code: int) -> bytes:
    try:
        phrase = http.HTTPStatus(code).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {code} {phrase}\r\n".encode("latin-1")


_STATUS_LINES = {code: _status_line(code) for code in range(100, 600)}


def _ignore(data: bytes) -> None:
    """A body writer with nowhere to write."""


_CHUNK_SIZES = [b"%x\r\n" % n for n in range(1 << 14)]
_CRLF = b"\r\n"


def _write_chunk(writelines: Callable[[Any], None], data: bytes) -> None:
    """One chunk of a chunked body, written without copying ``data`` (one ``writev``): the size line comes from a
    table (a ``%``-formatted frame costs ~2× the instructions, loadtest/RESULTS.md)."""
    n = len(data)
    writelines((_CHUNK_SIZES[n] if n < 16384 else b"%x\r\n" % n, data, _CRLF))


class _Reject(Exception):
    """Raised inside a parser callback: answer ``status`` with ``message`` and close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Exchange:
    """One request on a connection and the writer of its response.

    Request side: ``method`` (str), ``path`` (str, percent-decoded), ``raw_path``/``query`` (bytes),
    ``version`` (``"1.1"`` / ``"1.0"``), ``headers`` (lower-case name, value) byte pairs in arrival order,
    ``body`` (bytes, once ``complete``).

    Response side (:class:`pdproxy.pd.responder.ClientConnection`): :meth:`start`, :meth:`write`, :meth:`finish` write
    to the transport at once (no buffering here); :attr:`paused` is True while the client's transport is above
    its high-water mark; ``flow`` (an object with ``client_paused()`` / ``client_resumed()`` / ``client_gone()``)
    is told when that changes and when the connection is lost; :meth:`body_writer` gives the splice a direct
    writer; ``on_disconnect`` (a callable) is called once if the client goes away before :meth:`finish`.
    """

    __slots__ = ("_parts", "_proto", "api", "body", "chunked", "complete", "continue_expected", "declared",
                 "finished", "flow", "head_only", "headers", "keep_alive", "method", "on_disconnect", "path",
                 "query", "raw_path", "size", "started", "version")

    def __init__(self, proto: ServerProtocol) -> None:
        self._proto = proto
        self.method = ""
        self.path = ""
        self.raw_path = b""
        self.query = b""
        self.version = "1.1"
        self.headers: list[tuple[bytes, bytes]] = []
        self.api: str | None = None  # the completion route key, when the request is one (ServedApp)
        self._parts: list[bytes] = []
        self.body = b""
        self.size = 0
        self.declared: int | None = None
        self.complete = False
        self.keep_alive = True
        self.continue_expected = False
        self.head_only = False
        self.started = False
        self.finished = False
        self.chunked = False
        self.flow: Any = None
        self.on_disconnect: Callable[[], None] | None = None

    def header(self, name: bytes) -> str | None:
        """The first value of header ``name`` (lower-case bytes) as str, or None."""
        for k, v in self.headers:
            if k == name:
                return v.decode("latin-1")
        return None

    # --- response --------------------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        """True while the client's transport buffer is above its high-water mark."""
        return self._proto.write_paused is not None

    @property
    def closing(self) -> bool:
        """True once the client connection is closing or gone."""
        return self._proto.transport is None or self._proto.transport.is_closing()

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Write the status line and ``headers`` (lower-case names).  Without ``content-length`` the body is
        chunked (HTTP/1.1) or ends when the connection closes (HTTP/1.0)."""
        if self.started:
            raise RuntimeError("response already started")
        self.started = True
        sized = False
        parts = [_STATUS_LINES.get(status) or _status_line(status)]
        for name, value in headers:
            if name == b"content-length":
                sized = True
            elif name == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                continue
            parts += (name, b": ", value, b"\r\n")
        bodyless = self.head_only or status in (204, 304) or status < 200
        if not sized and not bodyless:
            if self.version == "1.1":
                self.chunked = True
                parts.append(b"transfer-encoding: chunked\r\n")
            else:
                self.keep_alive = False
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        elif self.version == "1.0":
            parts.append(b"connection: keep-alive\r\n")
        parts.append(b"\r\n")
        self._proto.write(b"".join(parts))

    def write(self, data: bytes) -> None:
        """Write one body piece (bytes, may be empty) now; the response continues."""
        if not data or self.finished or self.head_only:
            return
        if self.chunked:
            self._proto.write(b"%x\r\n%b\r\n" % (len(data), data))
        else:
            self._proto.write(data)

    def body_writer(self) -> Callable[[bytes], None]:
        """A callable that writes one body piece (bytes, not empty) with this response's framing straight to the
        transport — the transport's own ``write`` when unframed — for the relay's splice, which calls it per
        event; it must stop calling it once told ``client_gone()``."""
        t = self._proto.transport
        if t is None or self.head_only:
            return _ignore
        if self.chunked:
            return functools.partial(_write_chunk, t.writelines)
        return t.write

    def finish(self, data: bytes = b"") -> None:
        """Write the last body piece ``data`` and end the response; a no-op once finished."""
        if self.finished:
            return
        if data and not self.head_only:
            if self.chunked:
                self._proto.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data))
            else:
                self._proto.write(data)
        elif self.chunked and not self.head_only:
            self._proto.write(b"0\r\n\r\n")
        self.finished = True
        self.on_disconnect = None
        self._proto.response_done(self)

    async def drain(self) -> None:
        """Wait until the client's transport is below its low-water mark (or the connection is gone)."""
        waiter = self._proto.write_paused
        if waiter is not None:
            await asyncio.shield(waiter)

    def abort(self) -> None:
        """Drop the client connection at once (RST): a client that stopped reading."""
        t = self._proto.transport
        if t is not None:
            t.abort()


class ServerProtocol(asyncio.Protocol):
    """One client connection.  Built by uvicorn's ``Server`` with ``config``, ``server_state`` and
    ``app_state`` (keywords, see :func:`protocol_factory`); ``proxy`` is the :class:`ServedApp`."""

    def __init__(self, config: Any = None, server_state: Any = None, app_state: dict[str, Any] | None = None,
                 _loop: asyncio.AbstractEventLoop | None = None, *, proxy: ServedApp) -> None:
        self.proxy = proxy
        self.asgi = config.loaded_app if config is not None and getattr(config, "loaded", False) else proxy
        s = proxy.settings
        self.routes = proxy.completion_routes
        self.keep_alive_s = s.timeout_keep_alive_s
        self.max_head = s.max_request_head_bytes
        self.max_body = s.max_body_bytes
        self.server_state = server_state
        self.app_state = app_state if app_state is not None else {}
        self.loop = _loop or asyncio.get_event_loop()
        self.transport: asyncio.Transport | None = None
        self.parser: Any = httptools.HttpRequestParser(self)
        with contextlib.suppress(AttributeError):  # httptools ≥ 0.6.3: parse (and ignore) bytes after a "close"
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        self.no_more = False  # a request without keep-alive was read: later bytes are ignored (RFC 9112 §9.6)
        self.parsing: Exchange | None = None
        self.current: Exchange | None = None
        self.queue: deque[Exchange] = deque()
        self.head_bytes = 0
        self.url = b""
        self.write_paused: asyncio.Future[None] | None = None
        self.idle_timer: asyncio.TimerHandle | None = None
        self.reading_paused = False
        self.closing = False
        self.scheme = "http"
        self.client: tuple[str, int] | None = None
        self.server: tuple[str, int] | None = None

    # --- connection ------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.server_state is not None:
            self.server_state.connections.add(self)
        if transport.get_extra_info("sslcontext") is not None:
            self.scheme = "https"
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.client = (str(peer[0]), int(peer[1]))
        sock = transport.get_extra_info("sockname")
        if isinstance(sock, tuple) and len(sock) >= 2:
            self.server = (str(sock[0]), int(sock[1]))
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.server_state is not None:
            self.server_state.connections.discard(self)
        self._cancel_idle()
        self.closing = True
        w = self.write_paused
        self.write_paused = None
        if w is not None and not w.done():
            w.set_result(None)
        ex = self.current
        self.current = None
        self.parsing = None
        self.queue.clear()
        self.transport = None
        self.parser = None  # it holds bound methods of this protocol: drop the cycle, refcounting frees us
        if ex is not None and ex.flow is not None:
            ex.flow.client_gone()
        if ex is not None and not ex.finished and ex.on_disconnect is not None:
            cb, ex.on_disconnect = ex.on_disconnect, None
            cb()

    def pause_writing(self) -> None:
        if self.write_paused is None:
            self.write_paused = self.loop.create_future()
            ex = self.current
            if ex is not None and ex.flow is not None:
                ex.flow.client_paused()

    def resume_writing(self) -> None:
        w = self.write_paused
        if w is not None:
            self.write_paused = None
            if not w.done():
                w.set_result(None)
            ex = self.current
            if ex is not None and ex.flow is not None:
                ex.flow.client_resumed()

    def write(self, data: bytes) -> None:
        """Write to the client (dropped once the connection is gone)."""
        t = self.transport
        if t is not None:
            t.write(data)

    def shutdown(self) -> None:
        """Graceful shutdown (uvicorn calls it): idle connections close now, busy ones after their response."""
        self.closing = True
        if self.current is None and self.transport is not None:
            self.transport.close()
        elif self.current is not None:
            self.current.keep_alive = False

    def _arm_idle(self) -> None:
        self._cancel_idle()
        self.idle_timer = self.loop.call_later(self.keep_alive_s, self._idle_expired)

    def _cancel_idle(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def _idle_expired(self) -> None:
        self.idle_timer = None
        if self.current is None and self.parsing is None and self.transport is not None:
            self.transport.close()

    # --- parsing ---------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self._cancel_idle()
        if self.parser is None:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Reject):
                self._refuse(cause.status, cause.message)
            else:
                self._refuse(400, "Invalid HTTP request received.")
        else:
            if self.current is None and self.parsing is None and not self.queue and not self.closing:
                self._arm_idle()

    def on_message_begin(self) -> None:
        self.parsing = None if self.no_more else Exchange(self)
        self.head_bytes = 0
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_URL_BYTES:
            raise _Reject(414, f"request URL longer than {MAX_URL_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        ex = self.parsing
        if ex is None:
            return
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes + len(self.url) > self.max_head:
            raise _Reject(431, f"request header fields larger than {self.max_head} bytes")
        name = name.lower()
        ex.headers.append((name, value))
        if name == b"expect" and value.lower() == b"100-continue":
            ex.continue_expected = True
        elif name == b"content-length" and value.isdigit():
            ex.declared = int(value)

    def on_headers_complete(self) -> None:
        ex = self.parsing
        if ex is None:
            return
        p = self.parser
        ex.version = p.get_http_version()
        ex.method = p.get_method().decode("ascii", "replace")
        ex.keep_alive = p.should_keep_alive() and not self.closing
        if not ex.keep_alive:
            self.no_more = True
        ex.head_only = ex.method == "HEAD"
        try:
            parsed = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            raise _Reject(400, "invalid request target") from None
        ex.raw_path = parsed.path or b"/"
        ex.query = parsed.query or b""
        path = ex.raw_path.decode("latin-1")
        ex.path = urllib.parse.unquote(path) if "%" in path else path
        if ex.method == "POST":
            ex.api = self.routes.get(ex.path.rstrip("/"))
        if ex.api is not None and ex.declared is not None and ex.declared > self.max_body:
            raise _Reject(413, f"request body of {ex.declared} bytes exceeds the limit of {self.max_body} bytes")
        if self.current is None:
            self._begin(ex)
        else:
            self.queue.append(ex)
            self._pause_reading()

    def on_body(self, body: bytes) -> None:
        ex = self.parsing
        if ex is None:
            return
        ex.size += len(body)
        if ex.api is not None and ex.size > self.max_body:
            raise _Reject(413, f"request body exceeds the limit of {self.max_body} bytes")
        ex._parts.append(body)
        if ex.api is None and ex is self.current and ex.flow is not None:
            ex.flow.body_arrived()

    def on_message_complete(self) -> None:
        ex = self.parsing
        if ex is None:
            return
        self.parsing = None
        parts = ex._parts
        if ex.api is not None:
            ex.body = parts[0] if len(parts) == 1 else b"".join(parts)
            ex._parts = []
        ex.complete = True
        if ex is self.current:
            if ex.api is not None:
                self._run_completion(ex)
            elif ex.flow is not None:
                ex.flow.body_arrived()

    # --- requests in order -----------------------------------------------------------------------------------
    def _begin(self, ex: Exchange) -> None:
        """``ex`` is the connection's current request: send ``100 Continue`` if asked, start its handler (a
        completion route once its body is whole)."""
        self.current = ex
        if ex.continue_expected and not ex.complete:
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if ex.api is None:
            cycle = _AsgiCycle(self, ex)
            ex.flow = cycle
            self._spawn(cycle.run())
        elif ex.complete:
            self._run_completion(ex)

    def _run_completion(self, ex: Exchange) -> None:
        assert ex.api is not None
        self._spawn(self.proxy.handle_completion(ex.api, ex))

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        tasks = getattr(self.server_state, "tasks", None)
        if tasks is not None:
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    def response_done(self, ex: Exchange) -> None:
        """``ex``'s response was fully written: close, or start the next pipelined request, or wait idle."""
        if ex is not self.current:
            return
        self.current = None
        if self.transport is None:
            return
        if not ex.keep_alive or not ex.complete or self.closing:
            # an unread request body (or HTTP/1.0 without keep-alive) leaves no reliable next message start
            self.transport.close()
            return
        if self.server_state is not None:
            self.server_state.total_requests += 1
        if self.queue:
            self._begin(self.queue.popleft())
            if not self.queue:
                self._resume_reading()
        else:
            self._resume_reading()
            if self.parsing is None:
                self._arm_idle()

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request the server itself refuses (after any response in progress) and close."""
        self.closing = True
        self.no_more = True
        self.queue.clear()
        self.parsing = None
        if self.transport is None:
            return
        ex = self.current
        if ex is not None and ex.started and not ex.finished:
            ex.keep_alive = False  # the bad bytes come after a response in progress: it ends, then we close
            return
        self.current = None
        if ex is not None and ex.on_disconnect is not None:
            cb, ex.on_disconnect = ex.on_disconnect, None
            cb()
        body = orjson.dumps(error_body(status, message))
        self.write(b"".join([_STATUS_LINES[status], b"content-type: application/json\r\ncontent-length: ",
                             str(len(body)).encode(), b"\r\nconnection: close\r\n\r\n", body]))
        self.transport.close()


class _AsgiCycle:
    """Runs the ASGI app for one non-completion request on an :class:`Exchange` (the control plane)."""

    def __init__(self, proto: ServerProtocol, ex: Exchange) -> None:
        self.proto = proto
        self.ex = ex
        self.event = asyncio.Event()
        self.gone = False
        self.done = False
        ex.on_disconnect = self._disconnected

    def body_arrived(self) -> None:
        self.event.set()

    def client_paused(self) -> None:
        pass

    def client_resumed(self) -> None:
        pass

    def client_gone(self) -> None:
        pass

    def _disconnected(self) -> None:
        self.gone = True
        self.event.set()

    def scope(self) -> dict[str, Any]:
        ex, proto = self.ex, self.proto
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": ex.version,
                "method": ex.method, "scheme": proto.scheme, "path": ex.path, "raw_path": ex.raw_path,
                "query_string": ex.query, "root_path": "", "headers": ex.headers, "client": proto.client,
                "server": proto.server, "state": dict(proto.app_state)}

    async def run(self) -> None:
        ex = self.ex
        try:
            await self.proto.asgi(self.scope(), self.receive, self.send)
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("control-plane request %s %s failed", ex.method, ex.path)
            if not ex.started and not self.gone:
                self._plain(500, b"Internal Server Error")
            elif not ex.finished:
                ex.abort()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if not ex.finished and not self.gone:
            if not ex.started:
                self._plain(500, b"Internal Server Error")
            else:
                ex.abort()

    def _plain(self, status: int, body: bytes) -> None:
        self.ex.keep_alive = False
        self.ex.start(status, [(b"content-type", b"text/plain; charset=utf-8"),
                               (b"content-length", str(len(body)).encode())])
        self.ex.finish(body)

    async def receive(self) -> dict[str, Any]:
        ex = self.ex
        while True:
            if self.gone or ex.finished:
                return {"type": "http.disconnect"}
            if ex._parts or (ex.complete and not self.done):
                parts, ex._parts = ex._parts, []
                self.done = ex.complete
                return {"type": "http.request", "body": b"".join(parts), "more_body": not ex.complete}
            self.event.clear()
            await self.event.wait()

    async def send(self, message: dict[str, Any]) -> None:
        ex = self.ex
        if self.gone:
            return
        kind = message["type"]
        if kind == "http.response.start":
            headers = []
            for name, value in message.get("headers", []):
                if b"\r" in value or b"\n" in value:
                    raise RuntimeError("invalid HTTP header value")
                headers.append((bytes(name).lower(), bytes(value)))
            ex.start(int(message["status"]), headers)
        elif kind == "http.response.body":
            body = bytes(message.get("body", b""))
            if message.get("more_body", False):
                ex.write(body)
                if ex.paused:
                    await ex.drain()
            else:
                ex.finish(body)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r}")


def protocol_factory(proxy: ServedApp) -> Callable[..., ServerProtocol]:
    """The ``http`` argument of ``uvicorn.Config`` that serves ``proxy`` with :class:`ServerProtocol`."""
    return functools.partial(ServerProtocol, proxy=proxy)


def uvicorn_config(proxy: ServedApp, **kwargs: Any) -> Any:
    """A ``uvicorn.Config`` for ``proxy`` on :class:`ServerProtocol` (uvloop when installed, lifespan on, no
    access log); ``kwargs`` override or add any ``uvicorn.Config`` argument (``host``, ``port`` …).  TLS: give the
    config an ``ssl.SSLContext`` with ``pdproxy.http.tls.apply_to_uvicorn(config, ctx)`` — the protocol is
    TLS-agnostic (the listening socket's transport does the TLS), so every route is served over it."""
    import uvicorn

    options: dict[str, Any] = {"loop": "uvloop", "log_level": "warning", "access_log": False, "lifespan": "on",
                               "timeout_keep_alive": int(proxy.settings.timeout_keep_alive_s)}
    options.update(kwargs)
    return uvicorn.Config(proxy, http=protocol_factory(proxy), **options)  # type: ignore[arg-type]  # any factory
