"""The client side of a completion response, and the relay of the decoder's SSE stream: a splice with transforms.

**Status line rule.**  The client's status line goes out only when the decoder's first event is in hand, so a
decoder error before it reaches the client with the engine's status and body (and the director may still fail
over).  After the first byte the relay never replays: a failure becomes ``data: {"error": …}`` then
``data: [DONE]``, so a stream is never silently truncated.

**The splice.**  The first event is read with an ordinary ``await`` (it carries the first-event timeout and the
error check).  From then on the decoder connection hands every body segment straight to :class:`_Splice` from its
``data_received`` (:meth:`pdproxy.h1client.H1Response.splice`), which writes it to the client's transport in the
same call: no coroutine switch, ASGI message, dict or copy per event beyond the chunk framing.  The block that
holds ``data: [DONE]`` ends the client's response in the same write (a client that closes its connection right
after ``[DONE]`` has its whole answer); the decoder's end of body is then awaited only to pool its connection.  Per write it
costs: the SSE boundary check (complete events are forwarded; an incomplete tail waits for its rest), the
transforms' byte searches, one ``[DONE]`` search, one clock read and one ITL bucket increment
(:class:`pdproxy.metrics.GapCounts`).  The director's coroutine waits on one future for the whole stream.

**Flow control.**  Client → decoder: when the client's transport goes above its high-water mark the splice
pauses reading the decoder socket (so a slow reader holds at most one transport buffer, ~64 KiB, plus the kernel's
socket buffers, whatever it does) and resumes below the low-water mark; a client that stays paused for
``decode_idle_timeout_s`` is cut (its connection aborted, so the director's task is cancelled and the decode
connection closed, which makes vLLM abort the request).  Decoder silence: the same timeout as one lazy timer,
re-armed once per timeout period, never per event.

**Transforms** (chosen once, when the stream starts; :meth:`StreamRelay.transforms`).  A transform has

- ``trigger`` (bytes): the splice calls ``feed`` only for blocks that contain it (one ``bytes.find`` per
  block; ``b""``: every block), so a plain token event costs no Python call of the transform;
- ``feed(block, prev) -> bytes``: a block of complete SSE events from the decoder in (``prev``: the block
  written before it), the bytes for the client out (may be empty);
- optionally ``ending(block, prev) -> bytes``: the block that holds the stream's end event (``done_event``),
  before it is written as the response's last piece;
- ``recomputed`` (bool): True once the client's part of the stream is over and the director must continue the
  request elsewhere (later blocks must then give ``b""``).

Transforms search bytes with ``block.find(b'"usage"') >= 0`` — never ``b'"usage"' in block``, which in CPython
first tries the needle as an integer and formats a ``TypeError`` it then discards: ~2.5× the cost, 15 % of the
splice's instructions when measured — and parse only the events they rewrite.  Today:

- :class:`ChatUsage` (chat and text completions; trigger ``"usage"``): ``completion_tokens`` read from the
  usage; ``prompt_tokens_details.cached_tokens`` set to the prefiller's figure; the usage chunk dropped when
  the proxy forced it upstream for a client that did not ask; with detection on (below) its ``ending`` looks
  for a ``recomputed`` chunk in the last blocks;
- :class:`RecordTranscript` / :class:`ContinueTranscript` (vLLM-Ascend ``stop_reason: "recomputed"``, only for
  decoders known to send it; every block): keep what the client got, cut at the ``recomputed`` chunk / rewrite
  a continuation's ids and usage;
- :class:`DetectRecomputed` (other decoders, when continuation is enabled; run by :class:`ChatUsage` on the
  last blocks only): a decoder that does end a stream with ``recomputed`` is reported (the director keeps
  transcripts for it from then on) and that stream ends with an error event.

Adding an API (e.g. ``/v1/responses`` with usage inside ``response.completed``, or Anthropic ``/v1/messages``
with usage in ``message_start`` and ``message_delta`` and no ``[DONE]``) is a new transform class (trigger
``"usage"``, a ``feed`` that patches those events) returned by :meth:`StreamRelay.transforms` for that API, plus
the ``done_event`` that ends its stream (e.g. ``event: message_stop``; None: the stream ends at the decoder's
end of body), passed to :class:`StreamRelay`; the splice does not change.  ``/v1/responses`` and ``/v1/messages``
are relayed that way: :class:`pdproxy.api_streams.ResponsesStream` / :class:`~pdproxy.api_streams.MessagesStream`
(the ``api_stream`` of :class:`StreamRelay`) are their transforms, and also say which opening events the first
block holds back (sent before the engine ran), how a first error event looks, and the error event that ends the
stream when pdproxy must (:class:`Responder` sends it once the stream started).
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from pdproxy import api_streams, recompute, sse
from pdproxy.errors import ProxyError, UpstreamHTTPError, UpstreamTimeout, UpstreamUnavailable, sse_error_event
from pdproxy.h1client import H1Response, ReadTimeout, TransportError
from pdproxy.metrics import GapCounts
from pdproxy.protocol import Api, completion_tokens_in, patch_usage
from pdproxy.timeline import RequestContext
from pdproxy.upstream import proxy_error

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class ClientConnection(Protocol):
    """Where one response goes (:class:`pdproxy.server.Exchange`; a test may supply its own).

    ``start`` writes the status line and headers (lower-case byte names; without ``content-length`` the body is
    chunked), ``write`` a body piece, ``finish`` the last piece; all three write at once and never block.
    ``body_writer()``: a callable writing one body piece (framed) straight to the transport, for the splice.
    ``paused``: the client's transport is above its high-water mark; ``drain()`` waits until it is not.
    ``flow``: set by the relay to an object with ``client_paused()`` / ``client_resumed()``, called when
    ``paused`` changes, and ``client_gone()`` when the connection is lost.  ``abort()`` drops the connection
    (RST)."""

    flow: Any

    @property
    def paused(self) -> bool: ...

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    def write(self, data: bytes) -> None: ...

    def finish(self, data: bytes = b"") -> None: ...

    def body_writer(self) -> Callable[[bytes], None]: ...

    async def drain(self) -> None: ...

    def abort(self) -> None: ...


class Responder:
    """The client side of one request: tracks whether the status line went out, so errors are sent right.

    Before ``start()``: an error becomes an HTTP status with a JSON envelope (the Anthropic one on ``/v1/messages``,
    :func:`pdproxy.api_streams.error_json`).  After: an SSE error event followed by ``data: [DONE]`` (if not already
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


def _patch_block(block: bytes, cached_tokens: int | None, strip_usage: bool = False) -> bytes:
    """Rewrite ``usage.prompt_tokens_details.cached_tokens`` in every event of ``block`` that has a usage; with
    ``strip_usage`` drop the usage-only chunk (``choices: []``) the proxy asked for but the client did not.

    Only the events from the first one mentioning ``"usage"`` on are split and parsed (vLLM sends usage in the
    last chunk before ``[DONE]``: ``vllm/entrypoints/openai/chat_completion/serving.py``), so a large full-speed
    block costs one scan, not one parse per event."""
    first = block.find(b'"usage"')
    if first < 0:
        return block
    start = sse.last_boundary(block[:first])
    out = [block[:start]]
    for event in sse.split_events(block[start:]):
        if b'"usage"' in event:
            data = sse.event_data(event)
            if data is not None and data != b"[DONE]":
                try:
                    obj = orjson.loads(data)
                except orjson.JSONDecodeError:
                    obj = None
                if isinstance(obj, dict):
                    if strip_usage and obj.get("choices") == [] and "usage" in obj:
                        continue
                    if patch_usage(obj, cached_tokens):
                        event = sse.data_event(orjson.dumps(obj))
        out.append(event)
    return b"".join(out)


def _split_recomputed(block: bytes, transcript: recompute.Transcript) -> tuple[bytes, bool]:
    """Cut ``block`` at a ``stop_reason "recomputed"`` chunk (vLLM-Ascend, :mod:`pdproxy.recompute`): the events
    before it are returned for the client; it and everything after are only recorded in ``transcript``."""
    out: list[bytes] = []
    after: list[bytes] = []
    for event in sse.split_events(block):
        if after:
            after.append(event)
        elif recompute.MARKER in event and recompute.is_recomputed(recompute.parse_event(event) or {}):
            after.append(event)  # the recomputed chunk itself: empty text, never sent
        else:
            out.append(event)
    kept = b"".join(out)
    if kept:
        transcript.add(kept)
    if after:
        transcript.compact()
        for event in after[1:]:
            obj = recompute.parse_event(event)
            if obj is not None:
                transcript.observe(obj)
    return kept, bool(after)


def _first_event_error(block: bytes) -> UpstreamHTTPError | None:
    """If the decoder's first event is an error object (e.g. a failed KV pull, as in the
    ``tests/real_vllm/captures/decode_bad_remote_stream.json`` capture), return it as an HTTP error so the client
    gets a real status instead of a 200 stream that only carries an error."""
    if not block.startswith(b"data: {\"error\"") and not block.startswith(b"data:{\"error\""):
        return None
    data = sse.event_data(sse.split_events(block)[0]) or b""
    try:
        obj = orjson.loads(data)
        code = int(obj["error"].get("code") or 500)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        code = 500
    return UpstreamHTTPError(code if 400 <= code < 600 else 500, data)


class ChatUsage:
    """Chat / text completions usage (see module docstring): ``completion_tokens`` into ``ctx``, ``cached_tokens``
    patched unless None, the usage-only chunk dropped when ``strip``.  Only blocks holding ``"usage"`` reach it.

    With ``on_recomputed`` it also detects a ``recomputed`` ending without searching every block: that chunk
    is one of the last of a decoder's stream (then usage, then ``[DONE]``), so only a block with usage, the block
    that ends the stream (:meth:`ending`) and the block before either (``prev``) are searched.  The chunk itself
    may then already have reached the client (``finish_reason "stop"``, empty text); what follows it does not,
    and the relay ends the response with an error event."""

    __slots__ = ("cached", "ctx", "detect", "patch", "strip")
    trigger = b'"usage"'

    def __init__(self, ctx: RequestContext, cached_tokens: int | None, strip: bool,
                 on_recomputed: Callable[[], None] | None = None) -> None:
        self.ctx = ctx
        self.cached = cached_tokens
        self.strip = strip
        self.patch = cached_tokens is not None or strip
        self.detect = DetectRecomputed(on_recomputed) if on_recomputed is not None else None

    @property
    def recomputed(self) -> bool:
        """True once a detected ``recomputed`` chunk ended the client's part of the stream."""
        return self.detect is not None and self.detect.recomputed

    def feed(self, block: bytes, prev: bytes) -> bytes:
        """``block`` (it holds ``"usage"``) with its usage events rewritten."""
        if self.detect is not None:
            block = self._detect(block, prev)
            if not block:
                return block
        if block.find(b'"completion_tokens"') >= 0:
            n = completion_tokens_in(block)
            if n is not None:
                self.ctx.completion_tokens = n
        return _patch_block(block, self.cached, self.strip) if self.patch else block

    def ending(self, block: bytes, prev: bytes) -> bytes:
        """The block that ends the stream, searched for a ``recomputed`` ending (with the block before it)."""
        return self._detect(block, prev) if self.detect is not None else block

    def _detect(self, block: bytes, prev: bytes) -> bytes:
        d = self.detect
        assert d is not None
        if d.recomputed:
            return b""
        if prev.find(recompute.MARKER) >= 0:
            d.feed(prev)  # already sent; only tells whether it held a real recomputed chunk
            if d.recomputed:
                return b""  # nothing after that chunk is for the client
        return d.feed(block) if block.find(recompute.MARKER) >= 0 else block


class RecordTranscript:
    """First attempt on a decoder that can send ``recomputed``: what the client gets goes into ``transcript``;
    the ``recomputed`` chunk and everything after it are only recorded (``recomputed`` set)."""

    __slots__ = ("recomputed", "transcript")
    trigger = b""  # every block

    def __init__(self, transcript: recompute.Transcript) -> None:
        self.transcript = transcript
        self.recomputed = False

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        """The events for the client (all of ``block`` unless it holds the ``recomputed`` chunk)."""
        t = self.transcript
        if self.recomputed:
            for event in sse.split_events(block):
                obj = recompute.parse_event(event)
                if obj is not None:
                    t.observe(obj)
            return b""
        if block.find(recompute.MARKER) >= 0:
            block, self.recomputed = _split_recomputed(block, t)
            return block
        t.add(block)
        return block


class ContinueTranscript:
    """A continuation attempt: ids and usage rewritten to continue the first attempt (``keep_usage``: the client
    asked for usage), ``completion_tokens`` counted across attempts; a second ``recomputed`` sets the flag."""

    __slots__ = ("ctx", "keep_usage", "recomputed", "transcript")
    trigger = b""  # every block

    def __init__(self, ctx: RequestContext, transcript: recompute.Transcript, keep_usage: bool) -> None:
        self.ctx = ctx
        self.transcript = transcript
        self.keep_usage = keep_usage
        self.recomputed = False

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        """The rewritten events for the client."""
        if block.find(b'"completion_tokens"') >= 0:
            n = completion_tokens_in(block)
            if n is not None:
                self.ctx.completion_tokens = n + self.transcript.completion_tokens
        if self.recomputed:
            self.transcript.rewrite(block, keep_usage=self.keep_usage)  # accounting only
            return b""
        out, self.recomputed = self.transcript.rewrite(block, keep_usage=self.keep_usage)
        return out


class DetectRecomputed:
    """A decoder not known to send ``recomputed``: one byte search per block; on a real ``recomputed`` chunk,
    ``on_detect()`` is called, the events before it go out and the stream is over for the client (``recomputed``
    set; the relay ends it with an error event, since without a transcript it cannot be continued)."""

    __slots__ = ("on_detect", "recomputed")

    def __init__(self, on_detect: Callable[[], None]) -> None:
        self.on_detect = on_detect
        self.recomputed = False

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        """``block`` up to a ``recomputed`` chunk."""
        if self.recomputed:
            return b""
        if block.find(recompute.MARKER) < 0:
            return block
        out: list[bytes] = []
        for event in sse.split_events(block):
            if recompute.MARKER in event and recompute.is_recomputed(recompute.parse_event(event) or {}):
                self.recomputed = True
                self.on_detect()
                break
            out.append(event)
        return b"".join(out)


class _Chain:
    """Several transforms applied in order, as one (each to the blocks holding its ``trigger``)."""

    __slots__ = ("parts",)
    trigger = b""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts

    @property
    def recomputed(self) -> bool:
        return any(p.recomputed for p in self.parts)

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        for p in self.parts:
            if block and block.find(p.trigger) >= 0:
                block = p.feed(block, prev)
        return block


def _drop(data: bytes) -> None:
    """The body writer once the client is gone."""


def _same(block: bytes, prev: bytes) -> bytes:
    """No transform."""
    return block


class _NoDone(Exception):
    """The decoder's body ended without the stream's end event."""


class _Splice:
    """The streaming phase of one relay (see module docstring): an :class:`pdproxy.h1client.BodySink` for the
    decoder's body and the ``flow`` listener of the client's connection.  ``done`` resolves with True (the
    client's part ended with ``recomputed``), False (the stream ended and the response is finished), or raises
    :class:`TransportError` / :class:`_NoDone`."""

    __slots__ = ("bounds", "conn", "counts", "ctx", "done", "done_event", "done_len", "done_mark", "feed", "gaps",
                 "idle_s", "idle_timer", "last", "loop", "out", "prev", "resp", "stall_timer", "tail", "transform",
                 "trigger", "write", "writes")

    def __init__(self, relay: StreamRelay, transform: Any, tail: bytes, last_write: float) -> None:
        self.loop = relay.resp.loop
        self.resp = relay.resp
        self.out = relay.out
        self.conn = relay.out.conn
        self.ctx = relay.ctx
        self.transform = transform
        self.feed: Callable[[bytes, bytes], bytes] = transform.feed if transform is not None else _same
        self.trigger = transform.trigger if transform is not None else b"\0"  # JSON text never holds a NUL
        self.write = self.conn.body_writer()  # framing and transport write, no Python frame of ours between
        self.done_event = relay.done_event or b"\0\0\0"
        self.done_len = len(relay.done_event) if relay.done_event else 1 << 62
        self.done_mark = self.done_event[-3]  # the byte before the blank line: a cheap pre-test
        self.prev = b""
        self.tail = tail
        self.writes = 0
        self.last = last_write
        self.gaps = relay.ctx.gaps or GapCounts((float("inf"),))
        self.bounds = self.gaps.bounds
        self.counts = self.gaps.counts
        self.done: asyncio.Future[bool] = self.loop.create_future()
        self.idle_s = relay.idle_timeout_s
        self.idle_timer: asyncio.TimerHandle | None = None
        self.stall_timer: asyncio.TimerHandle | None = None

    # --- the hot path --------------------------------------------------------------------------------------
    def data(self, chunk: bytes) -> None:
        """One decoder body segment: forward its complete events now (called from the decoder's protocol).

        The common case — a segment of whole events (ending in a blank line), no tail held — runs straight
        through; anything else is reassembled first (:meth:`_reframe`).  Byte tests are index comparisons
        where they can be (``chunk[-1] == 10``): in CPython an index costs a fraction of ``endswith``."""
        if self.tail or chunk[-1] != 10 or chunk[-2] != 10:
            chunk = self._reframe(chunk)
            if not chunk:
                return
        if chunk.find(self.trigger) >= 0:
            chunk = self.feed(chunk, self.prev)
            if not chunk:
                return
        out = self.out
        if out.ended:
            return  # after the stream's end event: nothing more is for the client
        now = time.monotonic()
        if self.writes:
            gap = now - self.last
            self.counts[bisect_left(self.bounds, gap)] += 1
            self.gaps.total += gap
        self.last = now
        self.writes += 1
        if len(chunk) >= self.done_len and chunk[-3] == self.done_mark and chunk.endswith(self.done_event):
            self._end(chunk, now)
            return
        self.prev = chunk
        self.write(chunk)

    def _end(self, chunk: bytes, now: float) -> None:
        """The block that ends the stream (``done_event`` last): transformed by the transform's ``ending`` hook,
        then written as the last piece of the client's response."""
        out = self.out
        ending = getattr(self.transform, "ending", None)
        if ending is not None:
            chunk = ending(chunk, self.prev)
            if self.transform.recomputed:  # detected only now: the relay ends the response with an error
                if chunk:
                    self.write(chunk)
                return
        if out.done_sent:
            chunk = chunk.replace(sse.DONE_EVENT, b"")
        out.done_sent = True
        self.ctx.timeline.last_token_at = now
        out.end_nowait(chunk)  # the client has everything: end its response now, in the same write

    def _reframe(self, chunk: bytes) -> bytes:
        """``chunk`` after any held tail, cut after its last complete event (the rest is held); may be empty."""
        if self.tail:
            chunk = self.tail + chunk
            self.tail = b""
        if chunk.endswith(b"\n\n"):
            return chunk
        end = sse.last_boundary(chunk)
        self.tail = chunk[end:]
        return chunk[:end]

    # --- end of the decoder's body -------------------------------------------------------------------------
    def eof(self) -> None:
        tail, self.tail = self.tail, b""
        if tail.strip():
            self.data(tail + b"\n\n")  # the engine's last event lacked its blank line
        if self.done.done():
            return
        if not self.out.ended:
            self.ctx.timeline.last_token_at = time.monotonic()
        if self.transform is not None and self.transform.recomputed:
            self.done.set_result(True)
        elif self.out.ended:
            self.done.set_result(False)
        elif self.done_len < 1 << 62 and not self.out.done_sent and self.prev.find(self.done_event) < 0:
            self.done.set_exception(_NoDone())
        else:
            self.out.end_nowait()
            self.done.set_result(False)

    def fail(self, exc: TransportError) -> None:
        if self.done.done():
            return
        if self.out.ended:
            self.done.set_result(False)  # the client's response was complete; only the decoder's tail failed
        elif self.transform is not None and self.transform.recomputed:
            self.done.set_result(True)  # the rest was only for the transcript's accounting
        else:
            self.done.set_exception(exc)

    # --- timers and flow control ---------------------------------------------------------------------------
    def start(self) -> None:
        """Begin: take the decoder's body from now on and listen to the client's flow control."""
        self.conn.flow = self
        if self.idle_s is not None:
            self.idle_timer = self.loop.call_later(self.idle_s, self._check_idle)
        self.resp.splice(self)
        if self.conn.paused and not self.done.done():
            self.client_paused()

    def stop(self) -> None:
        """End: no more timers or flow callbacks (the decoder connection is released by its owner), and no
        reference cycle left (response ↔ splice, connection ↔ splice), so reference counting frees the stream's
        objects at once instead of a full garbage collection later (see :mod:`pdproxy.gcpolicy`)."""
        if self.conn.flow is self:
            self.conn.flow = None
        for timer in (self.idle_timer, self.stall_timer):
            if timer is not None:
                timer.cancel()
        self.idle_timer = self.stall_timer = None
        if self.resp.sink is self:
            self.resp.sink = None
        self.write = _drop
        self.feed = _same
        self.transform = None

    def _check_idle(self) -> None:
        self.idle_timer = None
        if self.done.done() or self.idle_s is None:
            return
        if self.out.ended:
            self.done.set_result(False)  # the decoder owes only its end of body: stop waiting (connection closed)
            return
        if self.stall_timer is None:  # while the client is paused, its own timer applies
            quiet = time.monotonic() - self.last
            if quiet >= self.idle_s:
                self.done.set_exception(ReadTimeout(f"no data for {self.idle_s} s"))
                return
            self.idle_timer = self.loop.call_later(self.idle_s - quiet, self._check_idle)
        else:
            self.idle_timer = self.loop.call_later(self.idle_s, self._check_idle)

    def client_paused(self) -> None:
        """The client's transport went above its high-water mark: stop reading the decoder."""
        self.resp.pause_reading()
        if self.stall_timer is None and self.idle_s is not None:
            self.stall_timer = self.loop.call_later(self.idle_s, self._stalled)

    def client_resumed(self) -> None:
        """The client caught up: read the decoder again."""
        if self.stall_timer is not None:
            self.stall_timer.cancel()
            self.stall_timer = None
        self.last = time.monotonic()
        self.resp.resume_reading()

    def client_gone(self) -> None:
        """The client's connection is gone: later decoder bytes are dropped (the director's task is being
        cancelled)."""
        self.write = _drop

    def _stalled(self) -> None:
        self.stall_timer = None
        if self.done.done():
            return
        self.ctx.error = f"the client read nothing for {self.idle_s} s; connection closed, decode aborted"
        self.write = _drop
        self.conn.abort()  # connection_lost cancels the director's task; the decode leg is then closed


class StreamRelay:
    """Relays one decoder SSE response to the client.

    ``cached_tokens``: the prefiller's prefix-cache hits to write into usage objects (None: leave as is).
    ``on_first_event``: called once when the first complete event arrives, before the status line goes out
    (the director releases the prefill lease there: the decoder has pulled the KV).
    ``transcript``: records what the client got, for a vLLM-Ascend ``recomputed`` continuation (None: off);
    its ``attempts > 1`` means this leg continues an earlier one (ids/usage rewritten, no second role chunk).
    ``strip_usage``: the usage chunk was forced upstream and is not for the client.
    ``idle_timeout_s``: once the first event is in, the longest silence of the decoder, and the longest time the
    client may keep its transport full (``decode_idle_timeout_s``); until then the response keeps the timeout it
    was opened with (the decode leg opens with ``decode_first_byte_timeout_s``).  None: no limit.
    ``on_recomputed``: without a transcript, called if the decoder does end with ``recomputed`` (detection).
    ``done_event``: the event that ends this API's stream (None: the decoder's end of body ends it).
    ``api_stream``: a Responses or Messages stream (:mod:`pdproxy.api_streams`): its transform, opening events,
    first-error rule, end event and error event replace the chat ones (None: chat / completions).
    """

    def __init__(self, resp: H1Response, out: Responder, ctx: RequestContext, *,
                 cached_tokens: int | None, first_event_timeout_s: float,
                 on_first_event: Callable[[], None] | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None,
                 transcript: recompute.Transcript | None = None, strip_usage: bool = False,
                 idle_timeout_s: float | None = None, on_recomputed: Callable[[], None] | None = None,
                 done_event: bytes | None = sse.DONE_EVENT,
                 api_stream: api_streams.ApiStream | None = None) -> None:
        self.api_stream = api_stream
        if api_stream is not None:
            done_event = api_stream.done_event
        self.resp = resp
        self.out = out
        self.ctx = ctx
        self.cached_tokens = cached_tokens
        self.first_event_timeout_s = first_event_timeout_s
        self.on_first_event = on_first_event
        self.headers = headers or []
        self.transcript = transcript
        self.strip_usage = strip_usage
        self.idle_timeout_s = idle_timeout_s
        self.on_recomputed = on_recomputed
        self.done_event = done_event
        self.recomputed = False

    def transforms(self) -> Any:
        """The transform for this stream (see module docstring), chosen once when it starts."""
        if self.api_stream is not None:
            return self.api_stream
        t = self.transcript
        if t is not None and t.attempts > 1:
            return ContinueTranscript(self.ctx, t, keep_usage=not self.strip_usage)
        usage = ChatUsage(self.ctx, self.cached_tokens, self.strip_usage,
                          self.on_recomputed if t is None else None)
        return usage if t is None else _Chain([usage, RecordTranscript(t)])

    async def _first_block(self, framer: sse.EventFramer) -> bytes:
        """The first complete event(s), within ``first_event_timeout_s`` (a deadline on the response's reads, not
        an ``asyncio.timeout``: no task lookup, no extra timer).  Raises :class:`TransportError` (a
        :class:`ReadTimeout` when the deadline passes).  A Responses / Messages stream's opening events (sent before
        the engine ran, :mod:`pdproxy.api_streams`) are held back until a later event is in: ``b""`` if the stream
        ends before one."""
        resp = self.resp
        before = resp.deadline_at
        deadline = resp.loop.time() + self.first_event_timeout_s
        resp.deadline_at = deadline if before is None else min(before, deadline)
        opening = self.api_stream.opening if self.api_stream is not None else ()
        held = b""
        try:
            while True:
                chunk = await resp.readany()
                if not chunk:
                    return b""
                block = framer.feed(chunk)
                if block:
                    if opening and api_streams.only_opening(block, opening):
                        held += block
                        continue
                    return held + block if held else block
        finally:
            resp.deadline_at = before

    async def run(self) -> bool:
        """Relay until the decoder ends.  Raises :class:`ProxyError` only before this decoder's first event
        reached the client (so the director may still fail over); afterwards failures become an SSE error event
        + [DONE].  Returns True when the decoder ended with ``stop_reason "recomputed"`` and a transcript was
        kept (nothing of that ending was sent; the director continues on a new P→D pair)."""
        framer = sse.EventFramer()
        ctx, out = self.ctx, self.out
        who = f"decoder {ctx.decoder}"
        try:
            block = await self._first_block(framer)
        except ReadTimeout:
            raise UpstreamTimeout(f"{who} sent no event within {self.first_event_timeout_s:.1f} s",
                                  endpoint=ctx.decoder or "") from None
        except TransportError as exc:
            raise proxy_error(exc, who, ctx.decoder or "", " before its first event") from None
        if not block:
            raise UpstreamUnavailable(f"{who} closed the stream before its first event", endpoint=ctx.decoder or "")
        fmt = self.api_stream
        err = _first_event_error(block) if fmt is None else fmt.first_error(block)
        if err is not None:
            err.endpoint = ctx.decoder or ""
            raise err
        if fmt is not None:
            fmt.responder = out                 # the stream's end event marks the response done
            out.api_stream = fmt
        if self.on_first_event is not None:
            self.on_first_event()
        if not out.started:
            ctx.timeline.first_token_at = time.monotonic()
            out.start_nowait(200, SSE_HEADERS + self.headers)
        transform = self.transforms()
        splice = _Splice(self, transform, b"", ctx.timeline.first_token_at or time.monotonic())
        try:
            splice.data(block)
            splice.tail = framer.pending  # what came after the first events, held for its rest
            splice.start()
            try:
                self.recomputed = await splice.done
            except (TransportError, _NoDone) as exc:
                ctx.events = splice.writes
                ctx.outcome = "upstream_error"
                failure: ProxyError
                if isinstance(exc, _NoDone):
                    end = fmt.end_name if fmt is not None else "data: [DONE]"
                    failure = UpstreamUnavailable(f"{who} ended the stream without {end}; the response may "
                                                  "be incomplete", endpoint=ctx.decoder or "")
                else:
                    failure = proxy_error(exc, who, ctx.decoder or "", " mid-stream")
                    failure.message += "; the response is incomplete"
                out.error_nowait(failure)
                return False
        finally:
            splice.stop()
        ctx.events = splice.writes
        if self.recomputed and self.transcript is None:
            ctx.outcome = "upstream_error"
            out.error_nowait(UpstreamUnavailable(
                f"{who} preempted the request (stop_reason \"recomputed\"); the response is incomplete (this "
                "decoder's later streams can be continued)", endpoint=ctx.decoder or ""))
            return False
        return self.recomputed
