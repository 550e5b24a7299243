"""The relay of a decoder's SSE stream to the client: a splice with transforms.

**Status line rule.**  The client's status line goes out only when the decoder's first event is in hand, so a
decoder error before it reaches the client with the engine's status and body (and the director may still fail
over).  After the first byte the relay never replays: a failure becomes ``data: {"error": …}`` then
``data: [DONE]``, so a stream is never silently truncated.  The client side — status line, errors, the
connection written to — is :mod:`pdproxy.pd.responder`'s.

**The splice.**  The first event is read with an ordinary ``await`` (it carries the first-event timeout and the
error check).  From then on the decoder connection hands the body straight to :class:`_Splice` from its
``data_received`` (:meth:`pdproxy.http.client.H1Response.splice`): the body segments of one socket read (one HTTP
chunk per event from vLLM) as one piece, which the splice writes to the client's transport in the same call — no
coroutine switch, ASGI message or dict per event, and one client write per read however many events it holds.  The block that
holds ``data: [DONE]`` (or ``data:[DONE]``, valid SSE without the optional space: the client gets ``data:
[DONE]``) ends the client's response in the same write (a client that closes its connection right
after ``[DONE]`` has its whole answer); the decoder's end of body is then awaited only to pool its connection.  Per write it
costs: the SSE boundary check (complete events are forwarded; an incomplete tail waits for its rest), the
transforms' byte searches, one ``[DONE]`` search, one clock read and one ITL bucket increment
(:class:`pdproxy.timeline.GapCounts`).  The common read — whole events as vLLM frames them, no tail held, no
trigger, not the end — is one C call (:mod:`pdproxy.pd.splice`, ``pdproxy/pd/_splice.c``) that writes through the
compiled chunk writer (``pdproxy/http/_chunked.c``); every other read runs :meth:`_Splice._slow`, the whole step in
Python.  The director's coroutine waits on one future for the whole stream.

**Flow control.**  Client → decoder: when the client's transport goes above its high-water mark the splice
pauses reading the decoder socket (so a slow reader holds at most one transport buffer, ~64 KiB, plus the kernel's
socket buffers, whatever it does) and resumes below the low-water mark; a paused client that takes none of the
bytes written to it for ``client_send_timeout_s`` (nginx's ``send_timeout``; a slow reader, whose untaken bytes
shrink, is not) is cut — its connection aborted, so the director's task is cancelled and the decode connection
closed, which makes vLLM abort the request and frees the decoder's reservation.  Decoder silence:
``decode_idle_timeout_s``, one lazy timer re-armed once per timeout period, never per event.

**Transforms** (chosen once, when the stream starts; :meth:`StreamRelay.transforms`).  A transform
(:class:`pdproxy.apis.transform.Transform`) has

- ``trigger`` (bytes): the splice calls ``feed`` only for blocks that contain it (one ``bytes.rfind`` per
  block; ``b""``: every block), so a plain token event costs no Python call of the transform;
- ``feed(block, prev) -> bytes``: a block of complete SSE events from the decoder in (``prev``: the block
  written before it), the bytes for the client out (may be empty);
- ``ending(block, prev) -> bytes``: the block that holds the stream's end event (``done_event``),
  before it is written as the response's last piece (most return it as is);
- ``recomputed`` (bool): True once the client's part of the stream is over and the director must continue the
  request elsewhere (later blocks must then give ``b""``).

The chat and text completions transforms — :class:`~pdproxy.apis.chat.ChatUsage` (usage rewriting,
``recomputed`` detection), :class:`~pdproxy.apis.chat.RecordTranscript` /
:class:`~pdproxy.apis.chat.ContinueTranscript` (vLLM-Ascend continuation) — and the byte-search rule
every transform follows are in :mod:`pdproxy.apis.chat`.

Adding an API (e.g. ``/v1/responses`` with usage inside ``response.completed``, or Anthropic ``/v1/messages``
with usage in ``message_start`` and ``message_delta`` and no ``[DONE]``) is a new transform class (trigger
``"usage"``, a ``feed`` that patches those events) returned by :meth:`StreamRelay.transforms` for that API, plus
the ``done_event`` that ends its stream (e.g. ``event: message_stop``; None: the stream ends at the decoder's
end of body), passed to :class:`StreamRelay`; the splice does not change.  ``/v1/responses`` and ``/v1/messages``
are relayed that way: :class:`pdproxy.apis.streams.ResponsesStream` / :class:`~pdproxy.apis.streams.MessagesStream`
(the ``api_stream`` of :class:`StreamRelay`) are their transforms, and also say which opening events the first
block holds back (sent before the engine ran), how a first error event looks, and the error event that ends the
stream when pdproxy must (:class:`pdproxy.pd.responder.Responder` sends it once the stream started).
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_left
from collections.abc import Callable

from pdproxy.apis import recompute
from pdproxy.apis import streams as api_streams
from pdproxy.apis.chat import Chain, ChatUsage, ContinueTranscript, RecordTranscript, first_event_error
from pdproxy.apis.request import ProxyRequest
from pdproxy.apis.transform import Transform
from pdproxy.errors import ProxyError, UpstreamTimeout, UpstreamUnavailable
from pdproxy.http import sse
from pdproxy.http.client import H1Response, ReadTimeout, TransportError
from pdproxy.http.errors import transport_error
from pdproxy.pd.continuation import LossCause, RecordIds, Reframe, Resume, StreamLost, ineligible_reason
from pdproxy.pd.responder import SSE_HEADERS, Responder
from pdproxy.pd.splice import PySpliceBase, SpliceBase
from pdproxy.timeline import GapCounts, RequestContext


def _drop(data: bytes) -> None:
    """The body writer once the client is gone."""


def _same(block: bytes, prev: bytes) -> bytes:
    """No transform."""
    return block


_ERROR_EVENT_LINES = (b'data: {"error"', b"event: error\n")


ERROR_EVENT_TAIL = 4
"""How many of a stream's last events :func:`carries_error_event` looks at: vLLM ends a failed stream with its
error event and ``[DONE]`` (``vllm/entrypoints/openai/chat_completion/serving.py``); a usage chunk and a finish
chunk may sit between."""


def carries_error_event(blocks: bytes) -> bool:
    """True when one of the last :data:`ERROR_EVENT_TAIL` events of ``blocks`` (whole SSE events, ``\n`` line
    endings as the relay frames them) is an error event: a chat / completions ``data: {"error": ...}`` (vLLM's
    in-band error) or a Responses / Messages ``event: error``.  Looked for at line starts only (a JSON string
    never holds a raw newline, so no content can fake one).  Cost: the tail events' bytes, not the block's — a
    full-speed stream's ending is its whole answer, and ``bytes.find`` of a needle ending in ``"`` crawls JSON."""
    start = len(blocks)
    for _ in range(ERROR_EVENT_TAIL):       # back to the start of the tail's first event
        if start <= 0:
            break
        start = sse.event_start(blocks, start - 2)
    return any(blocks.startswith(line, start) or blocks.find(b"\n" + line, start) >= 0 for line in _ERROR_EVENT_LINES)


class _NoDone(Exception):
    """The decoder's body ended without the stream's end event."""


class _Moved(Exception):
    """An operator's drain moves the stream to another decoder (:meth:`StreamRelay.move`)."""


class _Splice(SpliceBase):
    """The streaming phase of one relay (see module docstring): an :class:`pdproxy.http.client.BodySink` for the
    decoder's body and the ``flow`` listener of the client's connection.  ``done`` resolves with True (the
    client's part ended with ``recomputed``), False (the stream ended and the response is finished), or raises
    :class:`TransportError` / :class:`_NoDone`.  Its ``data`` is :class:`pdproxy.pd.splice.SpliceBase`'s (compiled:
    the common read in one C call), which hands every other read to :meth:`_slow`."""

    __slots__ = ("conn", "ctx", "done", "done_alt", "done_event", "ending", "first", "idle_s", "idle_timer",
                 "loop", "lost_when", "resp", "stall_timer", "transform", "unsent")

    def __init__(self, relay: StreamRelay, transform: Transform | None, tail: bytes, last_write: float) -> None:
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
        # ``data:[DONE]`` (no space) ends a chat / completions stream too; it has the same byte before the blank line,
        # so it is looked for only after the pre-test passed and ``done_event`` did not match: no cost per event
        self.done_alt = sse.DONE_EVENT_NO_SPACE if relay.done_event == sse.DONE_EVENT else None
        ends = [e for e in (relay.done_event, self.done_alt) if e]
        self.done_len = min(map(len, ends)) if ends else 1 << 62   # the shortest end event
        self.done_mark = self.done_event[-3]  # the byte before the blank line: a cheap pre-test
        self.prev = b""
        self.ending = b""  # the decoder's last two blocks as it sent them, once its end event came (_end)
        self.tail: bytes | bytearray = tail   # an incomplete event held for its rest (sse.reassemble)
        self.writes = 0
        self.last = last_write
        self.first = time.monotonic()  # this leg's start: its own inter-token time, not the stream's history
        self.lost_when = relay.lost_when
        self.gaps = relay.ctx.gaps or GapCounts((float("inf"),))
        self.bounds = self.gaps.bounds
        self.counts = self.gaps.counts
        self.clock = time.monotonic   # read as the module's ``time`` is now (a test may give it a fake clock)
        self.done: asyncio.Future[bool] = self.loop.create_future()
        self.idle_s = relay.idle_timeout_s
        self.idle_timer: asyncio.TimerHandle | None = None
        self.stall_timer: asyncio.TimerHandle | None = None
        self.unsent = 0       # the client's untaken bytes when the stall timer was (re)armed

    # --- the hot path --------------------------------------------------------------------------------------
    def _slow(self, chunk: bytes) -> None:
        """One decoder read's body: forward its complete events now (called from the decoder's protocol through
        :meth:`pdproxy.pd.splice.SpliceBase.data`, which does the common read itself when compiled).

        The common case — whole events framed as vLLM frames them (``\\n`` endings, the last ending in a blank
        line), no tail held — runs straight through; anything else is reassembled first (:meth:`_reframe`).  Byte
        tests are index comparisons where they can be (``chunk[-1] == 10``): in CPython an index costs a fraction
        of ``endswith``.  A read holding a ``\\r`` anywhere is reframed too (its end marker is then found, and one
        read may hold events framed differently: its last event alone does not tell; JSON never holds a raw
        ``\\r``, so vLLM's events never take this path; one ``memchr`` per read); a segment of one or two bytes
        raises IndexError, free to catch (exception tables, CPython 3.11+)."""
        try:
            odd = self.tail or chunk[-1] != 10 or chunk[-2] != 10 or chunk[-3] == 13 or chunk.find(b"\r") >= 0
        except IndexError:
            odd = True
        if odd:
            chunk = self._reframe(chunk)
            if not chunk:
                return
        trigger = self.trigger
        # b"": every block (a continuable stream's record); searched from the end, where the triggers' chunks are
        # (usage is the last before [DONE]): a full-speed answer's one block costs a few bytes, not a crawl
        if not trigger or chunk.rfind(trigger) >= 0:
            chunk = self.feed(chunk, self.prev)
            if not chunk:
                return
        self._emit(chunk)

    if SpliceBase is PySpliceBase:   # no C part: the read goes straight to the Python step, no frame between
        data = _slow

    def _emit(self, chunk: bytes) -> None:
        """A block of complete events, past the transform (not empty): to the client, counted, or the end.  The
        compiled :meth:`data` calls it for a fed block it does not write itself (a comment, the end, not bytes)."""
        out = self.out
        if out.ended:
            return  # after the stream's end event: nothing more is for the client
        if chunk[0] == 58 and sse.only_comments(chunk):   # ":": keep-alive comments only (vLLM sends none)
            self.write(chunk)        # passed on, but not a token: the decoder's silence (idle_s) goes on counting
            return
        now = self.clock()
        if self.writes:
            gap = now - self.last
            self.counts[bisect_left(self.bounds, gap)] += 1
            self.gaps.total += gap
        self.last = now
        self.writes += 1
        if len(chunk) >= self.done_len and chunk[-3] == self.done_mark:
            if chunk.endswith(self.done_event):
                self._end(chunk, now)
                return
            alt = self.done_alt
            if alt is not None and chunk.endswith(alt):       # the client's stream ends as vLLM's does
                self._end(chunk[:-len(alt)] + sse.DONE_EVENT, now)
                return
        self.prev = chunk
        self.write(chunk)

    def _end(self, chunk: bytes, now: float) -> None:
        """The block that ends the stream (``done_event`` last): transformed by the transform's ``ending`` hook,
        then written as the last piece of the client's response."""
        out = self.out
        transform = self.transform
        self.ending = self.prev + chunk
        if transform is not None:
            chunk = transform.ending(chunk, self.prev)
            # detected only now (a ``recomputed`` chunk, a decoder's error event): the relay ends the response with
            # an error or continues it — unless the block still ends with the end event, which the client then has
            # in full: a loss signalled after the end (vLLM's error event after ``[DONE]``) changes nothing
            if transform.recomputed and not chunk.endswith(self.done_event):
                if chunk:
                    self.write(chunk)
                return
        if out.done_sent:
            chunk = chunk.replace(sse.DONE_EVENT, b"")
        out.done_sent = True
        self.ctx.timeline.last_token_at = now
        out.end_nowait(chunk)  # the client has everything: end its response now, in the same write

    def _reframe(self, chunk: bytes) -> bytes:
        """``chunk`` after any held tail, cut after its last complete event (the rest is held), with ``\\n`` line
        endings (:func:`pdproxy.http.sse.frame`); may be empty."""
        try:
            chunk, self.tail = sse.reassemble(self.tail, chunk)
        except sse.EventTooLarge:   # a ProtocolError: the stream breaks; its held bytes go now, not with the error
            self.tail = b""
            raise
        return chunk

    # --- end of the decoder's body -------------------------------------------------------------------------
    def eof(self) -> None:
        tail, self.tail = bytes(self.tail), b""
        if tail.strip():
            self.data(sse.normalize(tail).rstrip(b"\n") + b"\n\n")  # the engine's last event lacked its blank line
        if self.done.done():
            return
        if self.out.ended:      # the client has its whole stream: nothing after its end is continued
            self.done.set_result(False)
            return
        self.ctx.timeline.last_token_at = time.monotonic()
        if self.transform is not None and self.transform.recomputed:
            self.done.set_result(True)
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
        objects at once instead of a full garbage collection later (see :mod:`pdproxy.ops.gcpolicy`)."""
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

    def check_lost(self, now: float) -> None:
        """End the leg as lost (:class:`ReadTimeout`) when a continuable stream's decoder has been silent for
        ``factor`` × the stream's own mean gap between writes, at least ``min_s`` seconds (``lost_when``) at
        monotonic time ``now``; not while the client holds the stream paused.  Called by the registry's sweep
        (:meth:`pdproxy.pd.continuation.LiveStreams.sweep`, every ``min_s / 4`` seconds): one timer for all streams,
        none per stream or per event."""
        if self.lost_when is None or self.stall_timer is not None or self.done.done() or self.out.ended:
            return
        factor, min_s = self.lost_when
        quiet = now - self.last
        if quiet < min_s:
            return
        limit = max(min_s, factor * (self.last - self.first) / max(self.writes - 1, 1))
        if quiet >= limit:
            stall = ReadTimeout(f"no token for {quiet:.1f} s (over {factor:g}× the stream's inter-token time)")
            stall.public = str(stall)   # pdproxy's own words: the client reads them too
            self.done.set_exception(stall)

    def client_paused(self) -> None:
        """The client's transport went above its high-water mark: stop reading the decoder, and cut the client
        once it takes none of its bytes for ``client_send_timeout_s`` (nginx's ``send_timeout``): the decoder's
        reservation must not wait for a client that stopped reading."""
        self.resp.pause_reading()
        if self.stall_timer is None:
            self.unsent = self.conn.unsent()
            self.stall_timer = self.loop.call_later(self.conn.send_timeout_s, self._stalled)

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
        unsent, timeout_s = self.conn.unsent(), self.conn.send_timeout_s
        if unsent < self.unsent:          # it took some: a slow reader, not a gone one
            self.unsent = unsent
            self.stall_timer = self.loop.call_later(timeout_s, self._stalled)
            return
        self.ctx.error = f"the client took nothing for {timeout_s:g} s; connection closed, decode aborted"
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
    ``api_stream``: a Responses or Messages stream (:mod:`pdproxy.apis.streams`): its transform, opening events,
    first-error rule, end event and error event replace the chat ones (None: chat / completions).
    ``resume``: the stream is continuable (:mod:`pdproxy.pd.continuation`): its first leg records the blocks, a
    continuation leg is re-framed into the client's stream, and a mid-stream loss raises
    :class:`~pdproxy.pd.continuation.StreamLost` instead of sending the error event (None: today's rule).
    ``lost_when``: ``(factor, min_s)``: a silence of ``factor`` × the stream's mean inter-event gap (at least
    ``min_s`` seconds) is a lost decoder (None: only ``idle_timeout_s``).  ``not_continued``: the request of a
    stream not continued (no ``resume``) with ``stream_continuation`` on: a mid-stream loss's error event then says
    why (:func:`~pdproxy.pd.continuation.ineligible_reason`, worked out only then).
    """

    def __init__(self, resp: H1Response, out: Responder, ctx: RequestContext, *,
                 cached_tokens: int | None, first_event_timeout_s: float,
                 on_first_event: Callable[[], None] | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None,
                 transcript: recompute.Transcript | None = None, strip_usage: bool = False,
                 idle_timeout_s: float | None = None, on_recomputed: Callable[[], None] | None = None,
                 done_event: bytes | None = sse.DONE_EVENT,
                 api_stream: api_streams.ApiStream | None = None, resume: Resume | None = None,
                 lost_when: tuple[float, float] | None = None, not_continued: ProxyRequest | None = None) -> None:
        self.api_stream = api_stream
        self.not_continued = not_continued
        self.resume = resume
        self.lost_when = lost_when if resume is not None else None
        self.splice: _Splice | None = None
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
        self.failure: ProxyError | None = None
        """The decoder's failure after the first event when the stream ended with the error event (reset, timed out,
        ended without its end event); None otherwise, and for a planned move (a drain).  The decode leg tells the
        decoder's breaker (pdproxy/pd/decode.py), as a continuable stream's loss is told."""

    def transforms(self) -> Transform:
        """The transform for this stream (see module docstring), chosen once when it starts."""
        if self.resume is not None:
            if self.resume.legs > 1:
                return Reframe(self.resume, self.ctx, self.out)
            if self.api_stream is not None:
                return RecordIds(self.resume, self.api_stream)
            return RecordIds(self.resume, ChatUsage(self.ctx, self.cached_tokens, self.strip_usage))
        if self.api_stream is not None:
            return self.api_stream
        t = self.transcript
        if t is not None and t.attempts > 1:
            return ContinueTranscript(self.ctx, t, keep_usage=not self.strip_usage)
        usage = ChatUsage(self.ctx, self.cached_tokens, self.strip_usage,
                          self.on_recomputed if t is None else None)
        return usage if t is None else Chain([usage, RecordTranscript(t)])

    async def _first_block(self, framer: sse.EventFramer) -> bytes:
        """The first complete event(s), within ``first_event_timeout_s`` (a deadline on the response's reads, not
        an ``asyncio.timeout``: no task lookup, no extra timer).  Raises :class:`TransportError` (a
        :class:`ReadTimeout` when the deadline passes).  A Responses / Messages stream's opening events (sent before
        the engine ran, :mod:`pdproxy.apis.streams`) are held back until a later event is in: ``b""`` if the stream
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
                block = framer.feed(chunk)      # sse.EventTooLarge: a ProtocolError
                if block and block[0] == 58 and sse.only_comments(block):
                    continue      # keep-alive comments are not a first event: its timeout goes on counting
                if block:
                    if opening and api_streams.only_opening(block, opening):
                        held += block
                        continue
                    return held + block if held else block
        finally:
            resp.deadline_at = before

    def check_lost(self, now: float) -> None:
        """Whether its decoder is lost by now (monotonic ``now``; :meth:`_Splice.check_lost`); nothing before the
        first event (``first_event_timeout_s`` applies then)."""
        if self.splice is not None:
            self.splice.check_lost(now)

    @property
    def movable(self) -> bool:
        """Whether :meth:`move` would move this leg now: past its first event and not ended."""
        splice = self.splice
        return splice is not None and not splice.done.done() and not self.out.ended

    def move(self) -> bool:
        """End this leg as lost (planned): a continuable stream moves to another decoder (a drain with
        ``migrate``); no-op before the first event (the decoder finishes that stream) or after the end.  Returns
        whether it moves."""
        if not self.movable:
            return False
        assert self.splice is not None
        self.splice.done.set_exception(_Moved())
        return True

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
            raise transport_error(exc, who, ctx.decoder or "", " before its first event") from None
        if not block:
            raise UpstreamUnavailable(f"{who} closed the stream before its first event", endpoint=ctx.decoder or "")
        if self.done_event is not None and sse.ends_before_content(block, self.done_event):  # vLLM: a chunk first
            raise UpstreamUnavailable(f"{who} ended the stream before its first event", endpoint=ctx.decoder or "")
        fmt = self.api_stream
        err = first_event_error(block) if fmt is None else fmt.first_error(block)
        if err is not None:
            err.endpoint = ctx.decoder or ""
            err.message = f"{who} answered an error event ({err.status_code}) as its first event"
            raise err
        if fmt is not None:
            fmt.responder = out                 # the stream's end event marks the response done
            out.api_stream = fmt
        if self.on_first_event is not None:
            self.on_first_event()
        leg_start = time.monotonic()   # a later leg's (continuation, recompute) silence counts from its own start
        if not out.started:
            ctx.timeline.first_token_at = leg_start
            out.start_nowait(200, [*SSE_HEADERS, *self.headers])
        transform = self.transforms()
        base = ctx.events if self.resume is not None and self.resume.legs > 1 else 0  # a continued stream's count
        splice = self.splice = _Splice(self, transform, b"", leg_start)
        try:
            splice.data(block)
            splice.tail = framer.pending  # what came after the first events, held for its rest
            splice.start()
            try:
                self.recomputed = await splice.done
            except (TransportError, _NoDone, _Moved) as exc:
                failure: ProxyError
                if isinstance(exc, _Moved):
                    failure = UpstreamUnavailable(f"{who} was drained mid-stream; the response is incomplete",
                                                  endpoint=ctx.decoder or "")
                elif isinstance(exc, _NoDone):
                    end = fmt.end_name if fmt is not None else "data: [DONE]"
                    failure = UpstreamUnavailable(f"{who} ended the stream without {end}; the response may "
                                                  "be incomplete", endpoint=ctx.decoder or "")
                else:
                    failure = transport_error(exc, who, ctx.decoder or "", " mid-stream")
                    failure.note("; the response is incomplete")
                if self.resume is not None and not out.ended:
                    cause = (LossCause.NO_END if isinstance(exc, _NoDone) else LossCause.STALL
                             if isinstance(exc, ReadTimeout) else LossCause.RESET)
                    raise StreamLost(failure, planned=isinstance(exc, _Moved), cause=cause,
                                     last_write=splice.last) from None
                why = ineligible_reason(self.not_continued) if self.not_continued is not None else None
                if why is not None:           # its shape, not a failed continuation (those are the director's)
                    failure.note(f" (not continued: {why})")
                ctx.outcome = "upstream_error"
                self.failure = None if isinstance(exc, _Moved) else failure
                out.error_nowait(failure)
                return False
        finally:                                # also when cancelled (shutdown, a deadline): what the client got
            ctx.events = base + splice.writes
            splice.stop()
            self.splice = None
        if not self.recomputed and carries_error_event(splice.ending):   # relayed as sent, but not a success
            ctx.outcome = "upstream_error"
            ctx.error = f"{who} sent an error event mid-stream; the response is incomplete"
        if self.recomputed and self.resume is not None:
            raise StreamLost(UpstreamUnavailable(f"{who} sent an error event mid-stream; the response is incomplete",
                                                 endpoint=ctx.decoder or ""),
                             cause=LossCause.ERROR_EVENT, last_write=splice.last)
        if self.recomputed and self.transcript is None:
            ctx.outcome = "upstream_error"
            out.error_nowait(UpstreamUnavailable(
                f"{who} preempted the request (stop_reason \"recomputed\"); the response is incomplete (this "
                "decoder's later streams can be continued)", endpoint=ctx.decoder or ""))
            return False
        return self.recomputed
