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
  while one is queued, reading pauses; the next starts only once the client has taken the last answer down to
  the transport's low-water mark, so a client that sends and never reads holds one answer, not all of them;
  meanwhile the socket is polled for the client's hang-up (:data:`HANGUP_CHECK_S`), which a paused read would
  not see: a client that pipelines and leaves has its running request cancelled as one that just leaves;
- **keep-alive**: an idle connection is closed after ``timeout_keep_alive_s`` (default 75 s: longer than the
  clients' own pools keep idle connections — httpx 5 s, aiohttp 15 s — so the client always drops first and never
  sends a request on a connection the proxy is closing);
- **limits** (docs/limits.md): a request line + header fields over ``max_request_head_bytes`` get 431 (a URL over
  8 KiB: 414) — counted as the bytes arrive, so a header line that never ends is refused once the bytes read for
  the head pass the limit + 4 KiB (as Go's ``MaxHeaderBytes``), never buffered whole; the same bound holds for
  the trailer section of a chunked body.  A completion body over ``max_body_bytes`` gets 413 (at once when
  ``Content-Length`` says so); a control-plane body is read as its app takes it (at most
  :data:`CONTROL_BODY_HIGH_WATER` bytes wait, then reading pauses); a malformed request gets 400; each of these
  closes the connection, lingering (RFC 9112 §9.6: what the client still sends is dropped unparsed, for at most
  :data:`LINGER_S`), as does an answer given before its request's body was read;
- **timeouts**: a head must arrive whole within ``request_headers_timeout_s`` of its first byte, and a body may
  not pause longer than ``request_body_timeout_s`` between reads (408 and close; a response in progress is cut);
  one timer per connection, re-armed only when the phase changes (the body's idle gap is checked lazily).
  Bytes written to a client must move: a connection that closes, waits for its client to take an answer before
  the next request, or waits in :meth:`Exchange.drain` (a response sent in parts) is aborted when none is taken
  for ``client_send_timeout_s`` (nginx's ``send_timeout``; a close alone would wait forever for a client that
  never reads);
- **connections**: past ``max_client_connections`` open connections a new one is answered 503 (OpenAI error
  body, ``Connection: close``) and closed;
- **strictness** (RFC 9112): trailer fields of a chunked request are read and dropped (never headers); an HTTP/1.0
  request framed by ``Transfer-Encoding`` is answered then the connection closed (§6.1); a request line without
  a version (HTTP/0.9) or an HTTP/1.1 request without exactly one ``Host`` (§3.2) or a target that is not
  origin-form (``/path``) gets 400, another version 505, and the connection closes.  (§3.2.2 asks servers to
  accept an absolute-form target too; pdproxy is no forward proxy and refuses it, so the authority a client names
  can never differ from the ``Host`` the control plane sees.)  An ``X-Request-Id`` longer than
  :data:`pdproxy.timeline.CLIENT_REQUEST_ID_MAX` characters is cut to that length before anything reads it
  (answers, logs and engine ids alike);
- ``Expect: 100-continue``: ``100 Continue`` is sent when the request's turn comes (never for a body that is
  refused by its ``Content-Length``);
- **client keys** (setting ``api_keys``): a generation route's request without an accepted key gets its 401 once
  its head is read, and the connection closes: none of its body is read, budgeted or answered with ``100
  Continue`` (:mod:`pdproxy.http.auth`; other routes are guarded by the application, before it reads a body);
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
import itertools
import logging
import resource
import select
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, NamedTuple, Protocol

import httptools
import orjson

from pdproxy.compiled import compiled_or
from pdproxy.errors import error_body
from pdproxy.http.auth import INVALID_KEY, key_accepted
from pdproxy.http.cors import CorsPolicy
from pdproxy.timeline import CLIENT_REQUEST_ID_MAX

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

    @property
    def error_routes(self) -> Mapping[str, str]:
        """Path without trailing slash → the route key whose error shape (``refusal_body``) the server's own
        refusals of a request to that path take, whatever its method: the completion routes and any other route
        answering in one of their shapes (Anthropic's ``/v1/messages/count_tokens``); elsewhere vLLM's envelope."""
        ...

    async def handle_completion(self, route: str, ex: Exchange) -> None: ...

    def refusal_body(self, route: str, status: int, message: str) -> bytes:
        """The JSON body of a refusal the server answers itself (408, 413, 431, 400, 500) to a request on the
        route ``route`` (an ``error_routes`` value): in that API's error shape."""
        ...

    def edge_refused(self, route: str, status: int, message: str, client_request_id: str | None) -> str | None:
        """A request on the generation route ``route`` (a ``completion_routes`` value) that the server refused
        itself with ``status`` and ``message`` before it reached ``handle_completion`` (its body not whole): for
        the application to count and log as it does its own refusals.  ``client_request_id``: the request's
        ``X-Request-Id`` (None: none, or its head was not read).  Returns the ``X-Request-Id`` the refusal answers
        with, as ``handle_completion``'s answers do (the client's own, else the id it was logged under), None when
        it could not be recorded.  Never raises."""
        ...

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None: ...
"""The generation routes served through PD (chat, completions, Responses, Anthropic Messages), read whole here."""
MAX_URL_BYTES = 8 * 1024
HEAD_SLACK_BYTES: Final = 4096
"""Bytes read for a head beyond ``max_request_head_bytes`` before it is refused while still arriving: the request
line's method and version, separators and line ends are not in the header count (Go's ``MaxHeaderBytes`` adds
4,096 the same way)."""
ENGINE_FD_RESERVE: Final = 64
"""Open files kept back from the client-connection cap for the listening socket, logs, KV-event sockets and the
like; what remains is split in half between clients and engine connections (one each per in-flight request)."""
OPEN_FILE_TARGET: Final = 65535
"""The soft RLIMIT_NOFILE pdproxy raises itself to at start, within the hard limit (vLLM's ``set_ulimit`` does the
same for the API server: vllm/utils/system_utils.py)."""
MAX_HEADER_FIELDS: Final = 100
"""Header fields one request head may carry; one more is refused with 431 (Apache's ``LimitRequestFields`` and
Envoy's ``max_headers_count`` default to the same 100).  The head's byte limit alone would let 12,000 empty fields
of a 48 KB head cost ~1.2 MB each as Python objects, on every open connection."""
SMALL_BODY_PIECE: Final = 4096
"""A body piece shorter than this (a small chunk of a chunked body) is appended to the bytearray ending the body's
pieces rather than kept as a ``bytes`` object of its own (~33 bytes of header and a list slot each): a body costs
about its size however it is chunked (before: a 20 MB body of 1-byte chunks peaked at 2 GB of RSS)."""
FREE_CHUNKS: Final = 1024
"""Chunks a chunked body may have whatever their sizes; past them the chunks must average at least
:data:`MIN_MEAN_CHUNK_BYTES` of data, or the request is refused (400).  The parser calls back into Python once per
chunk: a 20 MB body of 1-byte chunks (120 MB on the wire) cost ~14 s of the event loop and kept other clients'
requests waiting up to 3.4 s, where an SDK's or a proxy's chunks (kilobytes each) cost microseconds a body."""
MIN_MEAN_CHUNK_BYTES: Final = 256
CHUNK_LINE_BYTES: Final = 16
"""Framing bytes allowed per chunk of a chunked body (its size line and line ends) beyond twice its data.  What a
chunked body carries besides its data — size lines, chunk extensions (``1;name=value``, which the parser skips
without buffering and pdproxy ignores), line ends, the trailer section — may total at most the head limit
(``max_request_head_bytes`` + :data:`HEAD_SLACK_BYTES`, the trailer section's own bound) + this many bytes a chunk
+ twice the data's bytes, else 400: a chunk extension that never ends would otherwise be read for as long as its
bytes keep coming — gigabytes at the parser's speed on the event loop, the connection held, the body never
refused by ``max_body_bytes`` (``tests/security/test_server_limits.py``)."""
CONTROL_BODY_HIGH_WATER: Final = 65536
"""Bytes of a control-plane request's body held for its ASGI app before the connection stops reading (resumed when
the app's ``receive()`` takes them): uvicorn's ``HIGH_WATER_LIMIT``.  A handler that never reads its body (``GET
/health`` with one) so holds at most this much (and a read's worth) of it."""
HANGUP_CHECK_S: Final = 1.0
"""While reading is paused behind a pipelined request (the one before it still running), how often the connection's
socket is polled for the client's hang-up: ``POLLRDHUP`` says the client's FIN came, even behind request bytes not
read yet, which a paused transport cannot see.  The connection is then aborted, which cancels the running request
(its engine legs closed, vLLM aborts them) — a client that sends a pipelined request and leaves is treated as one
that just leaves.  A half-close (``shutdown(SHUT_WR)``) reads the same — TCP does not tell it from a close
until something is written — and is a hang-up here as it is without pipelining (the client's EOF ends the
connection, as uvicorn's does).  Linux only (``select.POLLRDHUP``); elsewhere the running request's own
timeouts bound it."""
_POLLRDHUP: Final = getattr(select, "POLLRDHUP", 0)


def peer_hung_up(transport: asyncio.BaseTransport) -> bool:
    """Whether the peer of ``transport``'s socket has closed or shut down its side (``POLLRDHUP``, ``POLLHUP`` or
    ``POLLERR`` now), without reading; False where that cannot be told (no socket, not Linux)."""
    sock = transport.get_extra_info("socket")
    fd = sock.fileno() if sock is not None else -1
    if fd < 0 or not _POLLRDHUP:
        return False
    poller = select.poll()
    poller.register(fd, _POLLRDHUP)
    return any(events & (_POLLRDHUP | select.POLLHUP | select.POLLERR) for _, events in poller.poll(0))


LINGER_S: Final = 1.0
"""How long a connection the server refuses (a 503 at the connection cap, a 4xx/500 of its own) stays half-closed,
its input read and dropped, so the client reads the answer before the close (an unread request in the socket would
otherwise turn the close into a reset)."""

# What one connection is reading (ServerProtocol.phase) and what its one timer is for (ServerProtocol.timer_kind).
_WAIT, _HEAD, _BODY = 0, 1, 2
_NO_TIMER, _IDLE_TIMER, _HEAD_TIMER, _BODY_TIMER, _SEND_TIMER = 0, 1, 2, 3, 4


def raise_open_file_limit(target: int = OPEN_FILE_TARGET) -> int:
    """Raise this process's soft RLIMIT_NOFILE to ``min(target, hard)`` if it is lower; return the soft limit now
    in force.  Never lowers it; a refusal by the OS leaves it as it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
    return int(soft) if soft != resource.RLIM_INFINITY else target


class PendingBodies:
    """The bytes of request bodies (every route's) on one server's connections, all together (``held``), against
    ``limit`` (setting ``max_pending_body_bytes``, at least ``max_body_bytes``): each connection adds what it reads
    of a body; a control route's body is given back once whole (its app reads it at its pace) or refused
    (:meth:`ServerProtocol._release_body`), a generation route's once its request ends — its bytes are held that
    long (:meth:`Exchange.release_counted`) — or once it is dropped unrun (a pipelined request behind a closed
    connection).  ``running``: the part of ``held`` that is whole generation bodies; a control route's body
    (admin, metrics, passthrough) is weighed without it, so requests under way never lock the operator out."""

    __slots__ = ("held", "limit", "running")

    def __init__(self, limit: int) -> None:
        self.held = 0
        self.running = 0
        self.limit = limit


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """The client edge's limits, read once from the settings (docs/limits.md): seconds, bytes, connections."""

    keep_alive_s: float
    head_timeout_s: float
    body_timeout_s: float
    send_timeout_s: float
    max_head: int
    max_body: int
    max_connections: int
    cors: CorsPolicy | None = None
    """The CORS headers of the generation routes' answers (None: ``allowed_origins`` empty)."""
    max_pending_body: int | None = None
    """The limit of a server's :class:`PendingBodies` (setting ``max_pending_body_bytes``, at least ``max_body``;
    None: no budget)."""
    api_keys: tuple[str, ...] = ()
    """The client keys a generation route's request must present (setting ``api_keys``; empty: none), checked
    once its head is read (:func:`pdproxy.http.auth.key_accepted`)."""

    @classmethod
    def of(cls, s: Settings, open_files: int | None = None) -> EdgeLimits:
        """``open_files``: the soft RLIMIT_NOFILE (default: this process's) that sizes an unset
        ``max_client_connections``: ``(open_files - ENGINE_FD_RESERVE) // 2``, at least 16."""
        cap = s.max_client_connections
        if cap is None:
            if open_files is None:
                open_files = int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
            cap = max(16, (open_files - ENGINE_FD_RESERVE) // 2)
        return cls(keep_alive_s=s.timeout_keep_alive_s, head_timeout_s=s.request_headers_timeout_s,
                   body_timeout_s=s.request_body_timeout_s, send_timeout_s=s.client_send_timeout_s,
                   max_head=s.max_request_head_bytes,
                   max_body=s.max_body_bytes, max_connections=cap, cors=CorsPolicy.of(s),
                   max_pending_body=max(s.max_pending_body_bytes, s.max_body_bytes), api_keys=tuple(s.api_keys))




def _status_line(code: int) -> bytes:
    try:
        phrase = http.HTTPStatus(code).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {code} {phrase}\r\n".encode("latin-1")


_STATUS_LINES: Final[Mapping[int, bytes]] = {code: _status_line(code) for code in range(100, 600)}


def _decoded_path(raw_path: bytes) -> str:
    """A request target's path (bytes as sent) as a ``str``: latin-1, percent-escapes decoded (UTF-8), as
    Starlette's ``scope["path"]``."""
    path = raw_path.decode("latin-1")
    return urllib.parse.unquote(path) if "%" in path else path


def _ignore(data: bytes) -> None:
    """A body writer with nowhere to write."""


_CHUNK_SIZES: Final = tuple(b"%x\r\n" % n for n in range(1 << 14))
_CRLF = b"\r\n"


def _write_chunk(writelines: Callable[[Any], None], data: bytes) -> None:
    """One chunk of a chunked body, written without copying ``data`` (one ``writev``): the size line comes from a
    table (a ``%``-formatted frame costs ~2× the instructions, loadtest/RESULTS.md)."""
    n = len(data)
    writelines((_CHUNK_SIZES[n] if n < 16384 else b"%x\r\n" % n, data, _CRLF))


def _py_chunk_writer(writelines: Callable[[Any], None]) -> Callable[[bytes], None]:
    """The chunk writer of ``writelines`` in Python: :func:`_write_chunk` bound to it."""
    return functools.partial(_write_chunk, writelines)


def _chunk_writers() -> Callable[[Callable[[Any], None]], Callable[[bytes], None]]:
    """What makes a chunked body's writer from a transport's ``writelines``: the compiled ``ChunkWriter``
    (``pdproxy/http/_chunked.c``: the same writes, no Python frame per piece) when it is built and
    ``PDPROXY_NO_EXTENSIONS`` is not set, else :func:`_py_chunk_writer`."""
    return compiled_or("pdproxy.http._chunked", "ChunkWriter", _py_chunk_writer)


_chunk_writer = _chunk_writers()


class _Refusal(NamedTuple):
    """A refusal the server answers itself: ``status``, ``message``, the completion ``route`` the request was on
    (None: none), the error ``shape`` of its path (``ServedApp.error_routes``; None: vLLM's envelope), its
    ``origin`` (CORS) and the ``x-request-id`` it answers with (None: none)."""

    status: int
    message: str
    route: str | None
    shape: str | None
    origin: bytes | None
    request_id: str | None = None


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

    __slots__ = ("_parts", "_proto", "api", "body", "chunked", "complete", "continue_expected", "counted",
                 "declared", "finished", "flow", "head_only", "headers", "held", "hosts", "keep_alive", "method",
                 "on_disconnect", "origin", "path", "query", "raw_path", "size", "started", "transfer_encoded",
                 "version")

    def __init__(self, proto: ServerProtocol) -> None:
        self._proto = proto
        self.method = ""
        self.path = ""
        self.raw_path = b""
        self.query = b""
        self.version = "1.1"
        self.headers: list[tuple[bytes, bytes]] = []
        self.api: str | None = None  # the completion route key, when the request is one (ServedApp)
        self._parts: list[bytes | bytearray] = []  # bytearray: small pieces joined (SMALL_BODY_PIECE)
        self.held = 0  # bytes in _parts (a control-plane body not yet taken by its app)
        self.counted = 0  # a whole completion body's bytes still counted in the server's PendingBodies
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
        self.hosts = 0  # Host header fields received
        self.transfer_encoded = False  # a Transfer-Encoding header field was received
        self.origin: bytes | None = None  # the first Origin header's value (a browser's request: CORS)
        self.flow: Any = None
        self.on_disconnect: Callable[[], None] | None = None

    def release_counted(self, _task: object = None) -> None:
        """Give back to the server's :class:`PendingBodies` the whole body this request holds there: once its
        handler has ended (a done callback of its task, ``_task``), or when it is dropped unrun."""
        if self.counted:
            bodies = self._proto.bodies
            if bodies is not None:
                bodies.held -= self.counted
                bodies.running -= self.counted
            self.counted = 0

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
        if not self.complete:    # answered before its body is in (a 404, 401, 405): the connection ends after this
            self.keep_alive = False   # answer (response_done), and the answer says so
        sized = False
        parts = [_STATUS_LINES.get(status) or _status_line(status)]
        for name, value in headers:
            if name == b"content-length":
                sized = True
            elif name == b"connection" and b"close" in value.lower():
                self.keep_alive = False
                continue
            parts += (name, b": ", value, b"\r\n")
        if self.api is not None and self._proto.limits.cors is not None:
            for name, value in self._proto.limits.cors.headers(self.origin):
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

    @property
    def send_timeout_s(self) -> float:
        """``client_send_timeout_s``: how long the client may take none of the bytes written to it."""
        return self._proto.limits.send_timeout_s

    def unsent(self) -> int:
        """Bytes written to the client that it has not taken yet (0 once the connection is gone)."""
        t = self._proto.transport
        return t.get_write_buffer_size() if t is not None else 0

    def body_writer(self) -> Callable[[bytes], None]:
        """A callable that writes one body piece (bytes, not empty) with this response's framing straight to the
        transport — the transport's own ``write`` when unframed — for the relay's splice, which calls it per
        event; it must stop calling it once told ``client_gone()``."""
        t = self._proto.transport
        if t is None or self.head_only:
            return _ignore
        if self.chunked:
            return _chunk_writer(t.writelines)
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
        """Wait until the client's transport is below its low-water mark (or the connection is gone).  The bytes
        must move: a client that takes none of them for ``client_send_timeout_s`` has its connection aborted
        (which ends its request: ``on_disconnect``), and this returns."""
        proto = self._proto
        waiter = proto.write_paused
        while waiter is not None and not waiter.done() and proto.transport is not None:
            unsent = proto.transport.get_write_buffer_size()
            await asyncio.wait((waiter,), timeout=proto.limits.send_timeout_s)   # never cancels the waiter
            t = proto.transport
            if not waiter.done() and t is not None and t.get_write_buffer_size() >= unsent:
                t.abort()
                return

    def abort(self) -> None:
        """Drop the client connection at once (RST): a client that stopped reading."""
        t = self._proto.transport
        if t is not None:
            t.abort()


def close_draining(transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, send_timeout_s: float) -> None:
    """Close ``transport`` once the bytes it holds are sent.  A close waits for its client to take them — forever
    for a client that never reads, holding the connection, its place under ``max_client_connections`` and the
    bytes — so they must move: when none is taken for ``send_timeout_s`` seconds the connection is aborted."""
    transport.close()
    unsent = transport.get_write_buffer_size()
    if unsent:
        loop.call_later(send_timeout_s, _send_check, transport, unsent, loop, send_timeout_s)


def _send_check(transport: asyncio.Transport, before: int, loop: asyncio.AbstractEventLoop,
                send_timeout_s: float) -> None:
    unsent = transport.get_write_buffer_size()         # 0 once the connection is lost
    if unsent >= before:
        transport.abort()
    elif unsent:
        loop.call_later(send_timeout_s, _send_check, transport, unsent, loop, send_timeout_s)


class ServerProtocol(asyncio.Protocol):
    """One client connection.  Built by uvicorn's ``Server`` with ``config``, ``server_state`` and
    ``app_state`` (keywords, see :func:`protocol_factory`); ``proxy`` is the :class:`ServedApp`, ``limits`` its
    :class:`EdgeLimits` (read from its settings when not given), ``bodies`` the server's :class:`PendingBodies`,
    shared by all its connections (None: bodies still arriving are not budgeted together)."""

    def __init__(self, config: Any = None, server_state: Any = None, app_state: dict[str, Any] | None = None,
                 _loop: asyncio.AbstractEventLoop | None = None, *, proxy: ServedApp,
                 limits: EdgeLimits | None = None, bodies: PendingBodies | None = None) -> None:
        self.proxy = proxy
        self.asgi = config.loaded_app if config is not None and getattr(config, "loaded", False) else proxy
        self.limits = lim = limits or EdgeLimits.of(proxy.settings)
        self.routes = proxy.completion_routes
        self.error_routes = proxy.error_routes
        self.keep_alive_s = lim.keep_alive_s
        self.max_head = lim.max_head
        self.max_body = lim.max_body
        self.api_keys = lim.api_keys
        self.head_limit = lim.max_head + HEAD_SLACK_BYTES
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
        # reading: what the parser is in (_WAIT between requests, _HEAD, _BODY), the bytes read for the head (or a
        # chunked body's trailer section) so far, how many heads were completed (to tell a read that finished one)
        self.phase = _WAIT
        self.head_fed = 0
        self.heads = 0
        self.tail_fed = 0
        self.chunk_open = False  # a chunk-size line was the last thing parsed: the trailer section may follow
        self.chunks = 0
        self.body_chunks = 0  # chunks of the message being read (FREE_CHUNKS)
        self.body_framing = 0  # bytes of the chunked body being read that were not its data (CHUNK_LINE_BYTES)
        self.bodies = bodies
        self.body_held = 0  # bytes of the body being read counted in ``bodies``
        self.refused = False  # the server refused this connection's input: later bytes are dropped unparsed
        self.pending: _Refusal | None = None  # a refusal written once the response in progress before it has ended
        # the connection's one timer: what it is for and when the body was last read (a lazily checked idle gap)
        self.timer: asyncio.TimerHandle | None = None
        self.timer_kind = _NO_TIMER
        self.read_at = 0.0
        self.unsent = 0  # the transport's unsent bytes when the send timer was armed (_SEND_TIMER)
        self.reading_paused = False
        self.hangup_timer: asyncio.TimerHandle | None = None   # the hang-up watch behind a pipelined request
        self.closing = False
        self.scheme = "http"
        self.client: tuple[str, int] | None = None
        self.server: tuple[str, int] | None = None

    # --- connection ------------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.server_state is not None:
            if len(self.server_state.connections) >= self.limits.max_connections:
                self._over_capacity()
                return
            self.server_state.connections.add(self)
        if transport.get_extra_info("sslcontext") is not None:
            self.scheme = "https"
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self.client = (str(peer[0]), int(peer[1]))
        sock = transport.get_extra_info("sockname")
        if isinstance(sock, tuple) and len(sock) >= 2:
            self.server = (str(sock[0]), int(sock[1]))
        self._set_timer()

    def _over_capacity(self) -> None:
        """Answer 503 at once (the request is never read) and close: half-close now, close when the client does
        or after :data:`LINGER_S`, so the client reads the answer rather than a reset."""
        self.refused = True
        self.parser = None
        t = self.transport
        assert t is not None
        body = orjson.dumps(error_body(503, "too many open connections to this server; retry later",
                                       error_type="ServiceUnavailableError"))
        t.write(b"".join([_STATUS_LINES[503], b"content-type: application/json\r\ncontent-length: ",
                          str(len(body)).encode(), b"\r\nretry-after: 1\r\nconnection: close\r\n\r\n", body]))
        self._linger_close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.server_state is not None:
            self.server_state.connections.discard(self)
        self._cancel_timer()
        if self.hangup_timer is not None:
            self.hangup_timer.cancel()
            self.hangup_timer = None
        self._release_body()
        self.closing = True
        w = self.write_paused
        self.write_paused = None
        if w is not None and not w.done():
            w.set_result(None)
        ex = self.current
        self.current = None
        self.parsing = None
        for queued in self.queue:           # pipelined requests that will not run
            queued.release_counted()
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
            elif ex is None and self.timer_kind == _SEND_TIMER and self.transport is not None and not self.closing:
                self._cancel_timer()           # the client took the last answer: on to the next request
                self._next()

    def write(self, data: bytes) -> None:
        """Write to the client (dropped once the connection is gone)."""
        t = self.transport
        if t is not None:
            t.write(data)

    def shutdown(self) -> None:
        """Graceful shutdown (uvicorn calls it): idle connections close now, busy ones after their response."""
        self.closing = True
        if self.current is None and self.transport is not None:
            self._close()
        elif self.current is not None:
            self.current.keep_alive = False

    # --- the connection's timer: keep-alive idle, head deadline, body idle gap ---------------------------------
    def _set_timer(self) -> None:
        """Arm the timer the connection's state calls for, unless it is already armed for it (a head's deadline
        runs from its first read; the body's idle gap is re-checked when the timer fires).  A refused connection
        keeps the one timer it has: its lingering close's (:meth:`_linger_close`)."""
        if self.refused or self.timer_kind == _SEND_TIMER:
            return
        phase = self.phase
        if phase == _HEAD:
            kind = _HEAD_TIMER
        elif phase == _BODY:
            kind = _NO_TIMER if self.reading_paused else _BODY_TIMER
        elif self.current is None and not self.queue and not self.closing and not self.refused:
            kind = _IDLE_TIMER
        else:
            kind = _NO_TIMER
        if kind == self.timer_kind:
            return
        self._cancel_timer()
        self.timer_kind = kind
        if kind == _IDLE_TIMER:
            self.timer = self.loop.call_later(self.keep_alive_s, self._timer_fired)
        elif kind == _HEAD_TIMER:
            self.timer = self.loop.call_later(self.limits.head_timeout_s, self._timer_fired)
        elif kind == _BODY_TIMER:
            self.read_at = self.loop.time()
            self.timer = self.loop.call_later(self.limits.body_timeout_s, self._timer_fired)

    def _cancel_timer(self) -> None:
        self.timer_kind = _NO_TIMER
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _timer_fired(self) -> None:
        kind, self.timer, self.timer_kind = self.timer_kind, None, _NO_TIMER
        if self.transport is None or self.refused:
            return
        if kind == _IDLE_TIMER:
            if self.current is None and self.phase == _WAIT:
                self._close()
        elif kind == _HEAD_TIMER:
            self._timed_out(f"request head not received within {self.limits.head_timeout_s:g} s")
        elif kind == _BODY_TIMER:
            left = self.read_at + self.limits.body_timeout_s - self.loop.time()
            if left > 0:
                self.timer_kind = _BODY_TIMER
                self.timer = self.loop.call_later(left, self._timer_fired)
            else:
                self._timed_out(f"request body stalled for {self.limits.body_timeout_s:g} s", body=True)
        elif kind == _SEND_TIMER:
            unsent = self.transport.get_write_buffer_size()
            if unsent >= self.unsent:          # nothing taken in send_timeout_s: a client that does not read
                self.transport.abort()
            else:
                self.unsent = unsent
                self.timer_kind = _SEND_TIMER
                self.timer = self.loop.call_later(self.limits.send_timeout_s, self._timer_fired)

    def _timed_out(self, message: str, body: bool = False) -> None:
        """408 and close.  A stalled head after a response in progress lets that response end first; a stalled
        body whose response is already under way (a control-plane route answering before reading it whole) cuts
        the response, since the request it answers can no longer complete."""
        ex = self.current
        if body and ex is not None and ex.started and not ex.finished and self.transport is not None:
            self.refused = True
            self._close()
            return
        self._refuse(408, message)

    # --- parsing ---------------------------------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self.parser is None or self.refused:
            return
        phase = self.phase
        if phase == _BODY and self.timer_kind == _BODY_TIMER:
            self.read_at = self.loop.time()
        heads, chunks = self.heads, self.chunks
        ex = self.parsing
        size = ex.size if ex is not None else 0
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:   # its head is whole: the request is the last one parsed
            last = self.parsing or (self.queue[-1] if self.queue else self.current)
            self._refuse(400, "protocol upgrades are not supported", last)
            return
        except httptools.HttpParserError as exc:
            cause = exc.__context__
            if isinstance(cause, _Reject):
                self._refuse(cause.status, cause.message)
            else:
                self._refuse(400, "Invalid HTTP request received.")
            return
        if self.refused:
            return
        # Bytes the parser holds for a line still arriving (httptools accumulates a header field until its line
        # ends): bounded by counting the reads that ended inside a head or a trailer section.  A read in which a
        # head (or the trailer section) began after other bytes is not counted: one read at most goes uncounted.
        if self.phase == _HEAD:
            if phase != _BODY and heads == self.heads:
                self.head_fed += len(data)
                if self.head_fed > self.head_limit:
                    self._refuse(431, f"request header fields larger than {self.max_head} bytes")
                    return
        elif self.chunk_open and chunks == self.chunks:
            self.tail_fed += len(data)
            if self.tail_fed > self.head_limit:
                self._refuse(431, f"request trailer fields larger than {self.max_head} bytes")
                return
        if phase == _BODY and self.phase == _BODY and heads == self.heads and ex is not None and ex.transfer_encoded:
            # a read inside one chunked body (the reads that begin or end it are not counted: one each at most)
            data_bytes = ex.size - size
            self.body_framing += len(data) - data_bytes
            if self.body_framing > self.head_limit + CHUNK_LINE_BYTES * self.body_chunks + 2 * ex.size:
                self._refuse(400, "a chunked request body with too many bytes besides its data (chunk extensions, "
                                  "size lines, trailer fields): send its data in chunks without extensions")
                return
        if self.timer_kind == _NO_TIMER or self.phase != phase or heads != self.heads:
            if heads != self.heads and self.timer_kind == _HEAD_TIMER:
                self._cancel_timer()  # a new head began in this read: its own deadline
            self._set_timer()

    def on_message_begin(self) -> None:
        self.body_chunks = 0
        self.body_framing = 0
        self.parsing = None if self.no_more else Exchange(self)
        self.phase = _HEAD
        self.head_fed = 0
        self.head_bytes = 0
        self.url = b""

    def on_url(self, url: bytes) -> None:
        self.url += url
        if len(self.url) > MAX_URL_BYTES:
            raise _Reject(414, f"request URL longer than {MAX_URL_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.phase != _HEAD:
            return  # a trailer field of a chunked body: read (within the head limit) and dropped
        ex = self.parsing
        if ex is None:
            return
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes + len(self.url) > self.max_head:
            raise _Reject(431, f"request header fields larger than {self.max_head} bytes")
        if len(ex.headers) >= MAX_HEADER_FIELDS:
            raise _Reject(431, f"more than {MAX_HEADER_FIELDS} request header fields")
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            ex.continue_expected = True
        elif name == b"content-length" and value.isdigit():
            ex.declared = int(value)
        elif name == b"host":
            ex.hosts += 1
        elif name == b"transfer-encoding":
            ex.transfer_encoded = True
            for coding in value.split(b","):          # RFC 9112 §6.1: a coding not understood is a 501
                coding = coding.strip(b" \t").lower()
                if coding and coding != b"chunked":
                    raise _Reject(501, f"transfer coding {coding[:32].decode('latin-1')!r} is not implemented: "
                                       "send Transfer-Encoding: chunked")
        elif name == b"x-request-id" and len(value) > CLIENT_REQUEST_ID_MAX:
            value = value[:CLIENT_REQUEST_ID_MAX]
        elif name == b"origin" and ex.origin is None:      # the first, as Starlette reads it
            ex.origin = value
        ex.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.phase = _BODY
        self.heads += 1
        self.head_fed = 0
        self.tail_fed = 0
        ex = self.parsing
        if ex is None:
            return
        p = self.parser
        ex.version = version = p.get_http_version()
        ex.method = p.get_method().decode("ascii", "replace")
        if version != "1.1" and version != "1.0":
            if version == "0.9":
                raise _Reject(400, "the request line has no HTTP version (HTTP/0.9 is not served)")
            raise _Reject(505, f"HTTP/{version} is not served on this port: send HTTP/1.1")
        if ex.hosts > 1 or (ex.hosts == 0 and version == "1.1"):
            raise _Reject(400, "an HTTP/1.1 request needs exactly one Host header field")
        if self.url[:1] != b"/" and not (self.url == b"*" and ex.method == "OPTIONS"):
            raise _Reject(400, "the request target must be a path (origin-form, e.g. /v1/models)")
        ex.keep_alive = p.should_keep_alive() and not self.closing and not (ex.transfer_encoded
                                                                            and version == "1.0")
        if not ex.keep_alive:
            self.no_more = True
        ex.head_only = ex.method == "HEAD"
        try:
            parsed = httptools.parse_url(self.url)
        except httptools.HttpParserInvalidURLError:
            raise _Reject(400, "invalid request target") from None
        ex.raw_path = parsed.path or b"/"
        ex.query = parsed.query or b""
        ex.path = _decoded_path(ex.raw_path)
        ex.api = self._api_of(ex.method, ex.path)
        if ex.api is not None and self.api_keys and not key_accepted(self.api_keys, ex.header):
            raise _Reject(401, INVALID_KEY)   # before any of its body is read or budgeted, no 100 Continue
        if ex.api is not None and ex.declared is not None and ex.declared > self.max_body:
            raise _Reject(413, f"request body of {ex.declared} bytes exceeds the limit of {self.max_body} bytes")
        if self.current is None:
            self._begin(ex)
        else:
            self.queue.append(ex)
            self._pause_reading()
            if self.hangup_timer is None and _POLLRDHUP:
                self.hangup_timer = self.loop.call_later(HANGUP_CHECK_S, self._check_hangup)

    def on_chunk_header(self) -> None:
        self.chunk_open = True
        self.chunks += 1
        self.body_chunks += 1
        read = self.body_chunks - 1                 # chunks whose data is in: not this one, whose size line just ended
        if read > FREE_CHUNKS:
            ex = self.parsing
            if ex is not None and ex.size < read * MIN_MEAN_CHUNK_BYTES:
                raise _Reject(400, f"a chunked request body of more than {FREE_CHUNKS} chunks averaging under "
                                   f"{MIN_MEAN_CHUNK_BYTES} bytes: send larger chunks, or a Content-Length body")
        self.tail_fed = 0

    def on_chunk_complete(self) -> None:
        self.chunk_open = False

    def on_body(self, body: bytes) -> None:
        self.chunk_open = False
        ex = self.parsing
        if ex is None:
            return
        ex.size += len(body)
        if ex.api is not None and ex.size > self.max_body:
            raise _Reject(413, f"request body exceeds the limit of {self.max_body} bytes")
        bodies = self.bodies
        if bodies is not None:                  # every route's body: a control route's app buffers it whole too
            if bodies.held - (bodies.running if ex.api is None else 0) + len(body) > bodies.limit:
                raise _Reject(503, "the server holds too many request bodies at once "
                                   f"(max_pending_body_bytes {bodies.limit}); retry later")
            bodies.held += len(body)
            self.body_held += len(body)
        parts = ex._parts
        if len(body) >= SMALL_BODY_PIECE:
            parts.append(body)
        elif parts and type(parts[-1]) is bytearray:
            parts[-1] += body
        else:
            parts.append(bytearray(body))
        if ex.api is None:
            ex.held += len(body)
            if ex.held > CONTROL_BODY_HIGH_WATER:    # the app reads it at its pace (_AsgiCycle.receive resumes):
                if self.timer_kind == _BODY_TIMER:   # the body timer is off meanwhile (re-armed on resuming)
                    self._cancel_timer()
                self._pause_reading()
            if ex is self.current and ex.flow is not None:
                ex.flow.body_arrived()

    def on_message_complete(self) -> None:
        ex = self.parsing
        if self.body_held:
            if ex is not None and ex.api is not None:   # a completion body stays counted until its request ends
                ex.counted, self.body_held = self.body_held, 0
                if self.bodies is not None:
                    self.bodies.running += ex.counted
            else:
                self._release_body()
        self.phase = _WAIT
        self.chunk_open = False
        if self.timer_kind == _BODY_TIMER:
            self._cancel_timer()
        if ex is None:
            return
        self.parsing = None
        parts = ex._parts
        if ex.api is not None:
            ex.body = parts[0] if len(parts) == 1 and type(parts[0]) is bytes else b"".join(parts)
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
        task = self._spawn(self.proxy.handle_completion(ex.api, ex))
        if ex.counted:
            task.add_done_callback(ex.release_counted)
        task.add_done_callback(functools.partial(self._completion_done, ex))

    def _completion_done(self, ex: Exchange, task: asyncio.Task[None]) -> None:
        """A completion handler that raised (it answers every error itself, so this is a defect) must not hold
        the connection: log it, answer 500 and close (or cut a response under way)."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        log.error("%s %s: the request handler raised", ex.method, ex.path, exc_info=exc)
        if ex.finished or self.transport is None or ex is not self.current:
            return
        if ex.started:
            self.refused = True
            ex.abort()
        else:
            self._refuse(500, "internal error while handling the request", ex)

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = self.loop.create_task(coro)
        tasks = getattr(self.server_state, "tasks", None)
        if tasks is not None:
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return task

    def response_done(self, ex: Exchange) -> None:
        """``ex``'s response was fully written: close, or start the next pipelined request, or wait idle."""
        if ex is not self.current:
            return
        self.current = None
        if self.transport is None:
            return
        if self.queue and self.pending is not None and ex.keep_alive and ex.complete:
            # a request whole before a refused one (reading stopped at the refusal: at most one read's worth):
            # its answer, then the next, then the refusal
            if self.server_state is not None:
                self.server_state.total_requests += 1
            self._begin(self.queue.popleft())
            return
        if not ex.keep_alive or not ex.complete or self.closing:
            # an unread request body (or HTTP/1.0 without keep-alive) leaves no reliable next message start
            if self.pending is not None:
                self._write_refusal(*self.pending)
                self.pending = None
            if self.refused or not ex.complete:       # bytes may be left unread: a plain close would reset
                self._linger_close()
            else:
                self._close()
            return
        if self.server_state is not None:
            self.server_state.total_requests += 1
        if self.write_paused is not None:         # the client has not taken this answer: the next one waits
            self._pause_reading()
            self._cancel_timer()
            self.timer_kind = _SEND_TIMER
            self.unsent = self.transport.get_write_buffer_size()
            self.timer = self.loop.call_later(self.limits.send_timeout_s, self._timer_fired)
            return
        self._next()

    def _next(self) -> None:
        """Between requests on a kept-alive connection: start the next pipelined request, or wait idle."""
        if self.queue:
            self._begin(self.queue.popleft())
            if not self.queue:
                self._resume_reading()
        else:
            self._resume_reading()
        self._set_timer()

    def _check_hangup(self) -> None:
        """The hang-up watch (:data:`HANGUP_CHECK_S`): while a pipelined request waits and reading is paused, abort
        the connection once the client has hung up; stops by itself when nothing is queued."""
        self.hangup_timer = None
        t = self.transport
        if t is None or not self.queue or not self.reading_paused:
            return
        if peer_hung_up(t):
            t.abort()       # connection_lost: the running request's on_disconnect cancels it
            return
        self.hangup_timer = self.loop.call_later(HANGUP_CHECK_S, self._check_hangup)

    def _pause_reading(self) -> None:
        if not self.reading_paused and self.transport is not None:
            self.reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.reading_paused and self.transport is not None:
            self.reading_paused = False
            self.transport.resume_reading()
            self._set_timer()

    def _refuse(self, status: int, message: str, refused: Exchange | None = None) -> None:
        """Answer a request the server itself refuses and close; no later byte from the client is parsed.
        ``refused``: the request refused (default: the one being parsed, else the current one); on a completion
        route the body is in that API's error shape (``ServedApp.refusal_body``), elsewhere vLLM's OpenAI envelope.
        Requests before it keep their answers: the one in progress, and those pipelined behind it whose bodies
        are in (answered in order); the refusal follows the last of them (:meth:`response_done`).  A refusal of the
        request whose response is under way only ends it there."""
        if refused is None:
            refused = self.parsing or self.current
        route = refused.api if refused is not None else None
        path = refused.path if refused is not None else ""
        if refused is not None and refused is self.parsing and not path:
            route, path = self._route_of_head()  # refused before its head was read: the request line names the route
        request_id = None
        if route is not None and refused is not None and not refused.complete:   # the application never saw it
            request_id = self.proxy.edge_refused(route, status, message, refused.header(b"x-request-id"))
        shape = self.error_routes.get(path.rstrip("/")) if path else None
        origin = refused.origin if refused is not None else None
        self.closing = True
        self.no_more = True
        self.refused = True
        kept = list(itertools.takewhile(lambda q: q is not refused and q.complete, self.queue))
        for dropped in itertools.islice(self.queue, len(kept), None):
            dropped.release_counted()
        self.queue.clear()
        self.queue.extend(kept)
        self.parsing = None
        self._release_body()
        self._cancel_timer()
        if self.transport is None:
            return
        ex = self.current
        if ex is not None and not ex.finished and (ex.started or ex is not refused):
            if ex is refused:      # its response is under way: it ends there, then the connection closes
                ex.keep_alive = False
            else:                  # the answer before it ends (not saying "close": a response follows), then this
                self.pending = _Refusal(status, message, route, shape, origin, request_id)
            self._pause_reading()
            return
        self.current = None
        if ex is not None and ex.on_disconnect is not None:
            cb, ex.on_disconnect = ex.on_disconnect, None
            cb()
        self._write_refusal(status, message, route, shape, origin, request_id)
        self._linger_close()

    def _release_body(self) -> None:
        """Give back to the server's :class:`PendingBodies` what the body being read holds there (it is whole,
        refused, or its connection is gone)."""
        if self.body_held and self.bodies is not None:
            self.bodies.held -= self.body_held
        self.body_held = 0

    def _api_of(self, method: str, path: str) -> str | None:
        """The completion route key (a ``routes`` value) of a ``method`` request to the decoded ``path``: a ``POST``
        to a completion path (a trailing slash ignored), else None."""
        return self.routes.get(path.rstrip("/")) if method == "POST" else None

    def _route_of_head(self) -> tuple[str | None, str]:
        """:meth:`_api_of` the request whose head is being read and its decoded path, from its request line alone
        (it was refused before its head ended); ``(None, "")`` when the request line is not whole or not valid."""
        try:
            if self.parser is None:
                return None, ""
            method = self.parser.get_method().decode("ascii", "replace")
            path = _decoded_path(httptools.parse_url(self.url).path or b"/")
            return self._api_of(method, path), path
        except (httptools.HttpParserError, httptools.HttpParserInvalidURLError):
            return None, ""

    def _write_refusal(self, status: int, message: str, route: str | None, shape: str | None,
                       origin: bytes | None, request_id: str | None = None) -> None:
        """Write the refusal ``status`` (its JSON body, ``connection: close``) of a request on ``route`` (None: not a
        completion route's POST) from ``origin`` (its CORS headers on a completion route), in the error shape of
        ``shape`` (an ``error_routes`` value; None: vLLM's OpenAI envelope), with ``request_id`` as its
        ``x-request-id`` (None: no such header)."""
        body = (self.proxy.refusal_body(shape, status, message) if shape is not None
                else orjson.dumps(error_body(status, message)))
        cors = self.limits.cors.headers(origin) if route is not None and self.limits.cors is not None else ()
        self.write(b"".join([_STATUS_LINES[status], b"content-type: application/json\r\ncontent-length: ",
                             str(len(body)).encode(), b"\r\nretry-after: 1" if status == 503 else b"",
                             b"\r\nconnection: close\r\n",
                             b"x-request-id: %s\r\n" % request_id.encode("latin-1") if request_id else b"",
                             *(b"%s: %s\r\n" % pair for pair in cors), b"\r\n", body]))

    def _close(self) -> None:
        """Close the connection once what it holds is sent (:func:`close_draining`)."""
        assert self.transport is not None
        close_draining(self.transport, self.loop, self.limits.send_timeout_s)

    def _linger_close(self) -> None:
        """Close after a refusal the way RFC 9112 §9.6 advises: half-close, keep reading (and dropping) what the
        client still sends, close when it does or after :data:`LINGER_S` — a close with unread bytes in the socket
        is a reset, which can destroy the answer before the client reads it (a 300 KB head once did)."""
        t = self.transport
        assert t is not None
        if not t.can_write_eof():                      # TLS: no half-close (a client still writing may see a reset)
            self._close()
            self.transport = None
            return
        t.write_eof()
        self.refused = True         # what the client still sends is dropped unparsed (and arms no other timer)
        self._resume_reading()
        self._cancel_timer()
        self.transport = None       # nothing more is written: a handler still running sees a connection gone
        self.timer = self.loop.call_later(LINGER_S, close_draining, t, self.loop, self.limits.send_timeout_s)


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
                self._internal_error()
            elif not ex.finished:
                ex.abort()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if not ex.finished and not self.gone:
            if not ex.started:
                self._internal_error()
            else:
                ex.abort()

    def _internal_error(self) -> None:
        """The 500 of a control-plane route that failed before answering, in vLLM's JSON error envelope
        (docs/limits.md); the connection closes after it."""
        body = orjson.dumps(error_body(500, "internal error in pdproxy while handling the request"))
        self.ex.keep_alive = False
        self.ex.start(500, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())])
        self.ex.finish(body)

    async def receive(self) -> dict[str, Any]:
        ex = self.ex
        while True:
            if self.gone or ex.finished:
                return {"type": "http.disconnect"}
            if ex._parts or (ex.complete and not self.done):
                parts, ex._parts, ex.held = ex._parts, [], 0
                proto = self.proto
                if proto.reading_paused and not proto.queue and not ex.complete:
                    proto._resume_reading()
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
    """The ``http`` argument of ``uvicorn.Config`` that serves ``proxy`` with :class:`ServerProtocol`: its
    :class:`EdgeLimits` read once, here, and one :class:`PendingBodies` for all the server's connections."""
    limits = EdgeLimits.of(proxy.settings)
    bodies = PendingBodies(limits.max_pending_body) if limits.max_pending_body is not None else None
    return functools.partial(ServerProtocol, proxy=proxy, limits=limits, bodies=bodies)


def uvicorn_config(proxy: ServedApp, **kwargs: Any) -> Any:
    """A ``uvicorn.Config`` for ``proxy`` on :class:`ServerProtocol` (uvloop when installed, lifespan on, no
    access log), after raising the soft open-file limit (:func:`raise_open_file_limit`, which sizes
    ``max_client_connections``); ``kwargs`` override or add any ``uvicorn.Config`` argument (``host``, ``port`` …).  TLS: give the
    config an ``ssl.SSLContext`` with ``pdproxy.http.tls.apply_to_uvicorn(config, ctx)`` — the protocol is
    TLS-agnostic (the listening socket's transport does the TLS), so every route is served over it."""
    import uvicorn

    raise_open_file_limit()
    options: dict[str, Any] = {"loop": "uvloop", "log_level": "warning", "access_log": False, "lifespan": "on",
                               "timeout_keep_alive": int(proxy.settings.timeout_keep_alive_s)}
    options.update(kwargs)
    return uvicorn.Config(proxy, http=protocol_factory(proxy), **options)  # type: ignore[arg-type]  # any factory
