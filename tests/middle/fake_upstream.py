"""Fake engines in process, for driving the real :class:`pdproxy.pd.director.Director` and relay (no sockets).

- :class:`FakeUpstream` replaces :class:`pdproxy.http.upstream.Upstream` — the only engine I/O of the legs
  (``post_json``: the prefill leg, the KV release leg, ``/tokenize``; ``open_stream``: the decode leg).  Each call
  takes the next scripted :data:`Outcome` of its request (keyed by the client's ``X-Request-Id``, the prefix of
  the engine request id) and kind, else of its endpoint, else the default (a prefiller answers with a fresh KV
  handle, a decoder streams three chat chunks and ``data: [DONE]``).  Failures raise exactly what ``Upstream``
  raises for them (:func:`pdproxy.http.errors.transport_error` of the transport error it would have met).
- :class:`FakeResponse` is what ``open_stream`` yields: the part of :class:`pdproxy.http.client.H1Response` the relay
  and ``relay_json`` use (``readany``/``read`` with the idle timeout and deadline, ``splice`` into a
  :class:`~pdproxy.http.client.BodySink`, ``pause_reading``/``resume_reading``, ``release``/``close``), fed by a
  driver task of the fake engine on the test's event loop.
- :class:`Gate`: a point a fake engine stops at until the test opens it (``reached`` says it got there).  With
  ``stepping=True`` every step of every engine waits at a fresh gate in :attr:`FakeUpstream.pending`, so a test
  (the lease property) chooses the interleaving.
- :class:`FakeEngines`: the health monitor's engine client (``/health`` probes after a failure), answering in
  process.
- :class:`FakeClient`: the client side, an :class:`pdproxy.http.server.Exchange` stand-in (request side for
  :meth:`pdproxy.app.application.PDProxyApp.handle_completion`, :class:`pdproxy.pd.responder.ClientConnection` for the response)
  that records what it was sent and can disconnect the way the server signals it (``flow.client_gone()``, then
  ``on_disconnect()``, as ``ServerProtocol.connection_lost`` does).

Everything an engine got is recorded (:class:`Call`: kind, endpoint, body, headers, how it ended), and every KV
handle a prefiller gave out has its fates (:attr:`FakeUpstream.fates`): ``pulled`` (a decoder delivered its first
event, or a JSON status line, to the proxy), ``rejected`` (a decoder answered an error for it: vLLM frees the KV),
``released`` (a release leg carried it to a decoder).
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineInfo
from pdproxy.errors import UpstreamHTTPError, UpstreamTimeout
from pdproxy.http import sse
from pdproxy.http.client import BodySink, ConnectError, Disconnected, ReadTimeout, TransportError
from pdproxy.http.errors import transport_error
from pdproxy.http.upstream import Upstream

MODEL = "sim-model"
Kind = Literal["prefill", "decode", "release", "tokenize"]


# ------------------------------------------------------------------------------------------------------- gates
class Gate:
    """A point an engine waits at until :meth:`open`; ``reached`` is set once something waits there."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.reached = asyncio.Event()
        self._opened = asyncio.Event()

    def open(self) -> None:
        self._opened.set()

    @property
    def is_open(self) -> bool:
        return self._opened.is_set()

    async def wait(self) -> None:
        self.reached.set()
        await self._opened.wait()

    def __repr__(self) -> str:
        return f"Gate({self.name!r}{', open' if self.is_open else ''})"


# ---------------------------------------------------------------------------------------------------- outcomes
@dataclass(kw_only=True)
class Outcome:
    """``connect``: waited at before the engine has the request (cancelled there, it never saw it); ``gate``:
    waited at after it has it, before its answer (status line) starts."""

    connect: Gate | None = None
    gate: Gate | None = None


@dataclass
class Refuse(Outcome):
    """Connection refused: the engine never saw the request (``UpstreamRefused``)."""


def refused(endpoint: Endpoint) -> ConnectError:
    """The client's error for a refused connect, as ``pdproxy.http.client``'s ``connect`` raises it: the OS's
    ``ConnectionRefusedError`` in its context (``from None`` hides it from the traceback, not from the chain)."""
    err = ConnectError(f"connect ({endpoint.host}:{endpoint.port}) failed: [Errno 111] Connection refused")
    err.__context__ = ConnectionRefusedError(111, "Connection refused")
    return err


@dataclass
class Reset(Outcome):
    """The engine took the request and closed the connection before any answer byte (``UpstreamUnavailable``)."""


@dataclass
class TimeOut(Outcome):
    """The leg's timeout passed before the answer (``UpstreamTimeout``), without waiting for it."""


@dataclass
class Hang(Outcome):
    """The engine took the request and never answers; the exchange ends only when the proxy gives up."""


@dataclass
class Status(Outcome):
    """An error status with ``body`` (default: vLLM's envelope) and an optional ``Retry-After``."""

    status: int
    body: bytes = b""
    retry_after: str | None = None

    def payload(self) -> bytes:
        return self.body or orjson.dumps({"error": {"message": f"fake engine error {self.status}",
                                                    "type": "FakeError", "param": None, "code": self.status}})


@dataclass
class Answer(Outcome):
    """A JSON answer: ``body`` (default: a chat completion; a prefiller's with a fresh KV handle unless
    ``handle`` is False).  ``body_gate``: a decoder's answer waits there between its status line and its body.
    A decoder's answer may instead be ``raw`` bytes with ``status`` (a broken engine's: empty, not JSON, a 204)."""

    body: dict[str, Any] | None = None
    handle: bool = True
    body_gate: Gate | None = None
    raw: bytes | None = None
    status: int = 200


End = Literal["done", "eof", "hang"]


@dataclass
class Stream(Outcome):
    """A decoder's SSE answer (status 200): ``events`` (a count of chat chunks, or the event bytes), then
    ``end``: ``"done"`` (``data: [DONE]``, then the end of the body), ``"eof"`` (the body ends without it),
    ``"hang"`` (nothing more, the connection stays open) or a transport error (the connection breaks: e.g.
    :class:`~pdproxy.http.client.Disconnected`, :class:`~pdproxy.http.client.ReadTimeout`).  ``gates[i]``: waited at
    before piece ``i`` (the events, then ``[DONE]`` if any, then the end)."""

    events: int | list[bytes] = 3
    end: End | TransportError = "done"
    gates: dict[int, Gate] = field(default_factory=dict)

    def pieces(self) -> list[bytes]:
        events = chat_chunks(self.events) if isinstance(self.events, int) else list(self.events)
        return events + [sse.DONE_EVENT] if self.end == "done" else events


def chat_chunks(n: int, start: int = 0) -> list[bytes]:
    """``n`` chat completion chunks, one token each (``" t0"``, ``" t1"`` …)."""
    return [chat_chunk(f" t{i}") for i in range(start, start + n)]


def chat_chunk(text: str, finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1,
                                     "model": MODEL, "choices": [{"index": 0, "delta": {"content": text},
                                                                  "finish_reason": finish}]}) + b"\n\n"


def error_event(status: int = 500, message: str = "failed to pull the KV") -> bytes:
    """An SSE error object as a decoder's first event (a failed KV pull)."""
    return b"data: " + orjson.dumps({"error": {"message": message, "type": "InternalServerError", "param": None,
                                               "code": status}}) + b"\n\n"


def completion(text: str = "fake answer", finish: str = "length", prompt_tokens: int = 12,
               completion_tokens: int = 3) -> dict[str, Any]:
    """A chat completion JSON answer."""
    return {"id": "chatcmpl-fake", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def handle_id(params: Any) -> int | None:
    """The fake handle's number (its ``remote_block_ids``), or None for anything else (the prefill stub)."""
    if isinstance(params, dict) and params.get("do_remote_prefill") and isinstance(params.get("remote_block_ids"),
                                                                                   list):
        return int(params["remote_block_ids"][0][0])
    return None


# ------------------------------------------------------------------------------------------------------- calls
@dataclass(eq=False)
class Call:
    """One request an engine was sent.  ``received``: past its connect (the engine has it); ``result``:
    ``pending`` → ``refused`` | ``reset`` | ``timeout`` | ``status`` | ``answered`` | ``aborted`` (the proxy gave
    up while it was pending: the engine saw a disconnect); ``open``: the exchange is not over; ``response``: the
    stream of an answered decode leg; ``handle``: the KV handle a prefiller answered with."""

    kind: Kind
    endpoint: Endpoint
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    outcome: Outcome
    received: bool = False
    result: str = "pending"
    open: bool = True
    response: FakeResponse | None = None
    handle: dict[str, Any] | None = None

    @property
    def key(self) -> str:
        """The client's ``X-Request-Id`` (the engine request id without pdproxy's suffix)."""
        return request_key(self.headers)

    @property
    def request_id(self) -> str:
        return self.headers.get("X-Request-Id", "")

    @property
    def handle_in(self) -> int | None:
        """The fake handle this request carried as its ``kv_transfer_params`` (None: none, or the stub)."""
        return handle_id(self.body.get("kv_transfer_params"))

    @property
    def streaming(self) -> bool:
        return bool(self.body.get("stream"))

    def __repr__(self) -> str:
        extra = f" handle={self.handle_in}" if self.handle_in is not None else ""
        resp = f" response={self.response.ended}" if self.response is not None else ""
        return (f"<{self.kind} {self.key} → {self.endpoint.name}: {type(self.outcome).__name__} {self.result}"
                f"{' open' if self.open else ''}{extra}{resp}>")


_REQUEST_ID = re.compile(r"^(.*)-[0-9a-f]{16}(?:-\d+)?$")


def request_key(headers: dict[str, str]) -> str:
    """The client's ``X-Request-Id`` in an engine request id: ``<client id>-<16 hex>``, plus ``-<i>`` for
    sequence ``i`` of a fanned-out request (:mod:`pdproxy.pd.fanout`)."""
    rid = headers.get("X-Request-Id", "")
    m = _REQUEST_ID.match(rid)
    return m.group(1) if m else rid


# ---------------------------------------------------------------------------------------------------- response
class FakeResponse:
    """An answered decode leg as the relay sees an :class:`~pdproxy.http.client.H1Response` (see module docstring).
    ``ended``: None while open, ``"released"`` (the whole body arrived: the connection would be pooled) or
    ``"closed"`` (dropped before the end: the engine sees a disconnect and aborts); ``taken``: the body bytes the
    proxy took (reads and splice); ``pauses``: times the proxy paused reading it."""

    def __init__(self, call: Call, status: int, idle_timeout_s: float | None,
                 on_first: Callable[[bytes], bool]) -> None:
        self.call = call
        self.status = status
        self.idle_timeout_s = idle_timeout_s
        self.deadline_at: float | None = None
        self.sink: BodySink | None = None
        self.ended: str | None = None
        self.taken: list[bytes] = []
        self.pauses = 0
        self.paused = False
        self._loop = asyncio.get_running_loop()
        self._body_sink: Callable[[bytes], None] | None = None  # the connection's: the splice keeps it until done
        self._buf: list[bytes] = []
        self._eof = False
        self._exc: TransportError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._on_first: Callable[[bytes], bool] | None = on_first   # True once it decided
        self.driver: asyncio.Task[None] | None = None

    # --- what the relay uses -------------------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def at_eof(self) -> bool:
        return self._eof and not self._buf

    def set_idle_timeout(self, seconds: float | None) -> None:
        """As :meth:`H1Response.set_idle_timeout <pdproxy.http.client.H1Response.set_idle_timeout>`, for the reads
        that start from now on (the decode leg sets it once a non-streamed answer's status line is in)."""
        self.idle_timeout_s = seconds

    async def readany(self) -> bytes:
        if not self._buf:
            if self._eof:
                return b""
            await self._wait()
            if not self._buf:
                return b""
        data = self._take()
        if self._on_first is not None and self._on_first(data):   # the decoder's first event is in hand now
            self._on_first = None
        return data

    async def read(self, n: int = -1) -> bytes:
        """The rest of the body, or at least its next ``n`` bytes when ``n`` ≥ 0 (the relay reads a bounded answer:
        ``engine_answer_max_bytes`` + 1); what passes ``n`` is dropped, the body not being read on."""
        parts = []
        size = 0
        while (n < 0 or size < n) and (chunk := await self.readany()):
            parts.append(chunk)
            size += len(chunk)
        data = b"".join(parts)
        return data if n < 0 else data[:n]

    def splice(self, sink: BodySink) -> None:
        self.sink = sink
        if self._buf:
            sink.data(self._take())
        if self._exc is not None:
            sink.fail(self._exc)
        elif self._eof:
            sink.eof()
        elif self.sink is sink:
            self._body_sink = sink.data

    def pause_reading(self) -> None:
        if self.ended is None and not self.paused:
            self.paused = True
            self.pauses += 1
            self._resumed.clear()

    def resume_reading(self) -> None:
        if self.paused:
            self.paused = False
            self._resumed.set()

    def release(self) -> None:
        self._done("released" if self._eof else "closed")

    def close(self) -> None:
        self.sink = None
        self._done("closed")
        if not self._eof and self._exc is None:
            self._exc = Disconnected("response closed")
            self._wake(self._exc)

    # --- internals -----------------------------------------------------------------------------------------
    def _done(self, how: str) -> None:
        if self.ended is None:
            self.ended = how
            self._body_sink = None
            if self.driver is not None and not self.driver.done():
                self.driver.cancel()  # the engine's connection is gone (or pooled): it sends nothing more

    def _take(self) -> bytes:
        data = b"".join(self._buf)
        self._buf = []
        self.taken.append(data)
        return data

    async def _wait(self) -> None:
        if self._exc is not None:
            raise self._exc
        loop = self._loop
        self._waiter = waiter = loop.create_future()
        now = loop.time()
        due = min(now + self.idle_timeout_s if self.idle_timeout_s is not None else float("inf"),
                  self.deadline_at if self.deadline_at is not None else float("inf"))
        timer = loop.call_at(due, self._late, waiter) if due != float("inf") else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    @staticmethod
    def _late(waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_exception(ReadTimeout("no data in time (fake engine)"))

    def _wake(self, exc: TransportError | None = None) -> None:
        w = self._waiter
        if w is not None and not w.done():
            if exc is None:
                w.set_result(None)
            else:
                w.set_exception(exc)

    # --- the engine side -----------------------------------------------------------------------------------
    async def sendable(self) -> None:
        """Wait while the proxy has reading paused (the engine's bytes stay in the kernel meanwhile)."""
        await self._resumed.wait()

    def feed(self, data: bytes) -> None:
        if self.ended is not None:
            return
        if self._body_sink is not None:
            self.taken.append(data)
            self._body_sink(data)
        else:
            self._buf.append(data)
            self._wake()

    def feed_eof(self) -> None:
        if self.ended is not None or self._eof or self._exc is not None:
            return
        self._eof = True
        if self.sink is not None:
            self.sink.eof()
        else:
            self._wake()

    def fail(self, exc: TransportError) -> None:
        if self.ended is not None or self._eof or self._exc is not None:
            return
        self._exc = exc
        if self.sink is not None:
            self.sink.fail(exc)
        else:
            self._wake(exc)


# ---------------------------------------------------------------------------------------------------- upstream
def _forever() -> asyncio.Future[None]:
    """Awaited by an engine that never answers (cancelled when the proxy gives up)."""
    return asyncio.get_running_loop().create_future()


class FakeUpstream(Upstream):
    """See the module docstring.  ``stepping``: every engine step waits at a gate in :attr:`pending`.

    ``calls``: every request, in order; ``fates``: per fake handle number, what became of it; ``problems``: what
    the fake found wrong (an unknown path, a leg carrying a handle no prefiller gave out) — a test asserts it
    empty."""

    def __init__(self, *, stepping: bool = False) -> None:
        super().__init__(connect_timeout_s=1.0)   # never started: a call site the fake misses fails loudly
        self.stepping = stepping
        self.pending: list[Gate] = []
        self.calls: list[Call] = []
        self.fates: dict[int, list[str]] = {}
        self.problems: list[str] = []
        self.engines = FakeEngines()
        self._by_key: dict[tuple[str, Kind], list[Outcome]] = {}
        self._by_endpoint: dict[tuple[str, Kind], list[Outcome]] = {}
        self._handles = itertools.count(1)
        self._drivers: set[asyncio.Task[None]] = set()

    # --- scripting -----------------------------------------------------------------------------------------
    def script(self, key: str, *, prefill: Iterable[Outcome] = (), decode: Iterable[Outcome] = (),
               release: Iterable[Outcome] = ()) -> None:
        """The outcomes of request ``key``'s prefill legs, decode legs and release legs, in call order."""
        for kind, outcomes in (("prefill", prefill), ("decode", decode), ("release", release)):
            self._by_key.setdefault((key, kind), []).extend(outcomes)  # type: ignore[arg-type]

    def script_endpoint(self, url: str, kind: Kind, *outcomes: Outcome) -> None:
        """The outcomes of ``kind`` calls to the endpoint at ``url`` with no request script left, in order."""
        self._by_endpoint.setdefault((url, kind), []).extend(outcomes)

    def _outcome(self, kind: Kind, endpoint: Endpoint, key: str, streaming: bool) -> Outcome:
        for table, k in ((self._by_key, (key, kind)), (self._by_endpoint, (endpoint.url, kind))):
            queue = table.get(k)
            if queue:
                return queue.pop(0)
        if kind == "decode" and streaming:
            return Stream()
        return Answer()

    # --- inspection ----------------------------------------------------------------------------------------
    def of(self, kind: Kind | None = None, key: str | None = None) -> list[Call]:
        """The calls of ``kind`` (all kinds: None) for request ``key`` (all: None), in order."""
        return [c for c in self.calls if (kind is None or c.kind == kind) and (key is None or c.key == key)]

    def handles_of(self, key: str) -> list[int]:
        """The handles the prefillers gave request ``key``, in order."""
        return [n for c in self.of("prefill", key) if (n := handle_id(c.handle)) is not None]

    def open_calls(self) -> list[Call]:
        """Exchanges not over: a pending request, or an answered stream neither released nor closed."""
        return [c for c in self.calls if c.open or (c.response is not None and c.response.ended is None)]

    def unsettled_handles(self) -> dict[int, list[str]]:
        """Handles without exactly one fate (leaked: none; or released though pulled or rejected)."""
        return {n: f for n, f in self.fates.items() if len(f) != 1}

    async def aclose(self) -> None:
        """Stop every engine driver still running (tests call this after the proxy is done)."""
        for task in list(self._drivers):
            task.cancel()
        await asyncio.gather(*self._drivers, return_exceptions=True)

    # --- the engine steps ----------------------------------------------------------------------------------
    def _begin(self, kind: Kind, endpoint: Endpoint, path: str, body: bytes, headers: dict[str, str]) -> Call:
        parsed = orjson.loads(body)
        assert isinstance(parsed, dict)
        key = request_key(headers)
        call = Call(kind, endpoint, path, parsed, dict(headers),
                    self._outcome(kind, endpoint, key, bool(parsed.get("stream"))))
        self.calls.append(call)
        n = call.handle_in
        if n is not None and n not in self.fates:
            self.problems.append(f"{call!r} carries handle {n}, which no prefiller gave out")
        return call

    async def _step(self, call: Call, gate: Gate | None, label: str) -> None:
        if gate is not None:
            await gate.wait()
        if self.stepping:
            g = Gate(f"{call.key} {call.kind} {call.endpoint.name} {label}")
            self.pending.append(g)
            try:
                await g.wait()
            finally:
                self.pending.remove(g)

    def _fate(self, call: Call, fate: str) -> None:
        n = call.handle_in
        if n is not None and n in self.fates:
            self.fates[n].append(fate)

    def _new_handle(self, call: Call) -> dict[str, Any]:
        n = next(self._handles)
        self.fates[n] = []
        e = call.endpoint
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"engine-{e.host}",
                "remote_block_ids": [[n, n + 1000]], "remote_request_id": call.request_id,
                "remote_host": e.host, "remote_port": 5600, "tp_size": 1, "remote_num_tokens": 12}

    async def post_json(self, endpoint: Endpoint, path: str, body: bytes, headers: dict[str, str], *,
                        timeout_s: float, parse: Callable[[bytes], Any] = orjson.loads) -> dict[str, Any]:
        if path == "/tokenize":
            kind: Kind = "tokenize"
        elif endpoint.role is Role.PREFILL:
            kind = "prefill"
        else:
            kind = "release"
        call = self._begin(kind, endpoint, path, body, headers)
        if kind == "tokenize":
            self.problems.append(f"unexpected /tokenize call {call!r}")
        who = f"{endpoint.role.value} {endpoint.name}"
        o = call.outcome
        try:
            await self._step(call, o.connect, "connect")
            if isinstance(o, Refuse):
                call.result = "refused"
                raise transport_error(refused(endpoint), who, endpoint.name)
            call.received = True
            if kind == "release":
                self._fate(call, "released")     # the decoder has the params: it ends, the prefiller frees
            await self._step(call, o.gate, "answer")
            if isinstance(o, Hang):
                await _forever()
            if isinstance(o, Reset):
                call.result = "reset"
                raise transport_error(Disconnected("engine closed the connection"), who, endpoint.name)
            if isinstance(o, TimeOut):
                call.result = "timeout"
                raise UpstreamTimeout(f"{who} did not answer within {timeout_s:.1f} s", endpoint=endpoint.name)
            if isinstance(o, Status):
                call.result = "status"
                raise UpstreamHTTPError(o.status, o.payload(), endpoint=endpoint.name, retry_after=o.retry_after)
            if not isinstance(o, Answer):
                raise AssertionError(f"{type(o).__name__} is no answer to a JSON leg ({call!r})")
            reply = dict(o.body) if o.body is not None else completion(finish="length", completion_tokens=1)
            if kind == "prefill" and o.handle:
                reply["kv_transfer_params"] = call.handle = self._new_handle(call)
            call.result = "answered"
            return parse(orjson.dumps(reply))             # the bytes through the leg's own parser
        except asyncio.CancelledError:
            call.result = "aborted"
            raise
        finally:
            call.open = False

    @asynccontextmanager
    async def open_stream(self, endpoint: Endpoint, path: str, body: bytes, headers: dict[str, str], *,
                          first_byte_timeout_s: float) -> AsyncIterator[Any]:
        call = self._begin("decode", endpoint, path, body, headers)
        assert endpoint.role is Role.DECODE, call
        o = call.outcome
        resp: FakeResponse | None = None
        try:
            await self._step(call, o.connect, "connect")
            if isinstance(o, Refuse):
                call.result = "refused"
                raise transport_error(refused(endpoint), f"decoder {endpoint.name}", endpoint.name)
            call.received = True
            await self._step(call, o.gate, "head")
            if isinstance(o, Hang):
                await _forever()
            if isinstance(o, Reset):
                call.result = "reset"
                raise transport_error(Disconnected("engine closed the connection"), f"decoder {endpoint.name}",
                                  endpoint.name)
            if isinstance(o, TimeOut):
                call.result = "timeout"
                raise UpstreamTimeout(f"decoder {endpoint.name} sent no response headers within "
                                      f"{first_byte_timeout_s:.1f} s", endpoint=endpoint.name)
            if isinstance(o, Status):
                call.result = "status"
                self._fate(call, "rejected")     # vLLM frees the KV of a request it rejects
                raise UpstreamHTTPError(o.status, o.payload(), endpoint=endpoint.name, retry_after=o.retry_after)
            call.result = "answered"
            if isinstance(o, Answer):
                resp = FakeResponse(call, o.status, first_byte_timeout_s, lambda _data: True)
                if not call.streaming:
                    self._fate(call, "pulled")   # the proxy consumes the handle at a JSON status line
                resp.driver = self._drive(self._json_body(call, resp, o))
            elif isinstance(o, Stream):
                resp = FakeResponse(call, 200, first_byte_timeout_s, lambda data: self._first_bytes(call, data))
                resp.driver = self._drive(self._stream_body(call, resp, o))
            else:
                raise AssertionError(f"{type(o).__name__} is no answer to a decode leg ({call!r})")
            call.response = resp
            yield resp
        except asyncio.CancelledError:
            if resp is None:
                call.result = "aborted"
            raise
        finally:
            if resp is not None:                 # as Upstream.open_stream: pooled if read to the end, else closed
                if resp.at_eof():
                    resp.release()
                else:
                    resp.close()
            call.open = False

    def _first_bytes(self, call: Call, data: bytes) -> bool:
        """The KV's fate once the proxy holds the decoder's first bytes with data in them (comments, empty data: not
        yet, False); a stream that ends before any content never ran the request."""
        if not call.streaming:
            return True
        if sse.no_data(data):
            return False
        if not sse.ends_before_content(data, sse.DONE_EVENT):
            self._fate(call, "rejected" if data.startswith(b'data: {"error"') else "pulled")
        return True

    def _drive(self, body: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(body)
        self._drivers.add(task)
        task.add_done_callback(self._drivers.discard)
        return task

    async def _json_body(self, call: Call, resp: FakeResponse, o: Answer) -> None:
        await self._step(call, o.body_gate, "body")
        await resp.sendable()
        data = o.raw if o.raw is not None else orjson.dumps(o.body if o.body is not None else completion())
        if data:
            resp.feed(data)
        resp.feed_eof()

    async def _stream_body(self, call: Call, resp: FakeResponse, o: Stream) -> None:
        pieces = o.pieces()
        for i, piece in enumerate(pieces):
            await self._step(call, o.gates.get(i), f"piece {i}")
            await resp.sendable()
            resp.feed(piece)
        await self._step(call, o.gates.get(len(pieces)), "end")
        await resp.sendable()
        if o.end == "hang":
            await _forever()
        elif isinstance(o.end, TransportError):
            resp.fail(o.end)
        else:
            resp.feed_eof()


class FakeEngines:
    """The health monitor's engine client: ``/health`` answers 200 unless the endpoint's URL is in ``down``;
    a refresh marks the engine reachable.  ``probes``: the endpoints probed, in order."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.probes: list[str] = []

    async def health(self, endpoint: Endpoint) -> bool:
        self.probes.append(endpoint.name)
        return endpoint.url not in self.down

    async def refresh(self, endpoint: Endpoint, info: EngineInfo) -> EngineInfo:
        info.reachable = endpoint.url not in self.down
        info.refreshed_at = time.monotonic()
        info.error = None
        return info

    def health_failure(self, endpoint: Endpoint) -> str | None:
        """Why the last ``/health`` was not 200 (``EngineClient.health_failure``)."""
        return "refused the connection" if endpoint.url in self.down else None

    async def aclose(self) -> None:
        return None


# ------------------------------------------------------------------------------------------------------ client
class FakeClient:
    """The client's side of one request (see module docstring).  ``status``/``response_headers``: the status
    line; ``pieces``: body pieces as written (unframed); ``finished``: the response ended; ``gone``: the
    connection was lost; ``after_gone``: pieces written after that (the server would drop them); ``aborted``: the
    proxy cut the connection (a stalled reader)."""

    def __init__(self, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        self.body = body
        self.headers = headers
        self.method = "POST"
        self.on_disconnect: Callable[[], None] | None = None
        self.flow: Any = None
        self.status = 0
        self.response_headers: list[tuple[bytes, bytes]] = []
        self.pieces: list[bytes] = []
        self.after_gone: list[bytes] = []
        self.finished = False
        self.gone = False
        self.aborted = False
        self._drain: asyncio.Future[None] | None = None
        self.send_timeout_s = 60.0      # the server's client_send_timeout_s (the rig sets its settings')
        self.untaken = 0                # what unsent() reports: bytes written and not taken (a test moves it)

    # --- request side (pdproxy.http.server.Exchange) ------------------------------------------------------------
    def header(self, name: bytes) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v.decode("latin-1")
        return None

    # --- ClientConnection ----------------------------------------------------------------------------------
    @property
    def paused(self) -> bool:
        return self._drain is not None

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self.status:
            raise RuntimeError("response already started")
        self.status = status
        self.response_headers = list(headers)

    def write(self, data: bytes) -> None:
        if data and not self.finished:
            self._put(data)

    def finish(self, data: bytes = b"") -> None:
        if self.finished:
            return
        if data:
            self._put(data)
        self.finished = True
        self.on_disconnect = None                # as Exchange.finish: the response is complete

    def body_writer(self) -> Callable[[bytes], None]:
        return self._put

    def unsent(self) -> int:
        return self.untaken

    async def drain(self) -> None:
        if self._drain is not None:
            await asyncio.shield(self._drain)

    def abort(self) -> None:
        self.aborted = True
        asyncio.get_running_loop().call_soon(self.disconnect)  # the transport's connection_lost follows

    def _put(self, data: bytes) -> None:
        (self.after_gone if self.gone else self.pieces).append(data)

    # --- what the test does --------------------------------------------------------------------------------
    def pause(self) -> None:
        """The client's transport went above its high-water mark (``ServerProtocol.pause_writing``)."""
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_future()
            if self.flow is not None:
                self.flow.client_paused()

    def resume(self) -> None:
        w, self._drain = self._drain, None
        if w is not None:
            w.set_result(None)
            if self.flow is not None:
                self.flow.client_resumed()

    def disconnect(self) -> None:
        """The connection is lost, signalled as ``ServerProtocol.connection_lost`` does."""
        if self.gone:
            return
        self.gone = True
        w, self._drain = self._drain, None
        if w is not None and not w.done():
            w.set_result(None)
        if self.flow is not None:
            self.flow.client_gone()
        if not self.finished and self.on_disconnect is not None:
            cb, self.on_disconnect = self.on_disconnect, None
            cb()

    # --- what it got ---------------------------------------------------------------------------------------
    @property
    def text(self) -> bytes:
        return b"".join(self.pieces)

    def events(self) -> list[bytes]:
        """The SSE events' data fields, in order (``b"[DONE]"`` included)."""
        out = []
        for event in self.text.split(b"\n\n"):
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    out.append(line[5:].strip())
        return out

    def json(self) -> Any:
        return orjson.loads(self.text)

    def header_of(self, name: bytes) -> bytes | None:
        for k, v in self.response_headers:
            if k == name:
                return v
        return None
