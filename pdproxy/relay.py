"""Writing to the client over raw ASGI, and relaying the decoder's SSE stream byte-faithfully.

The completion routes bypass FastAPI's ``StreamingResponse`` (see README "Why a raw ASGI path"): the status
line goes out only when the decoder's first event is in hand, each upstream read becomes at most one client
write of complete events, and an event is parsed only when it must be rewritten (a usage object whose
``cached_tokens`` becomes the prefiller's value).  After the first byte the relay never replays: a failure
becomes ``data: {"error": …}`` then ``data: [DONE]``, so a stream is never silently truncated.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from pdproxy import recompute, sse
from pdproxy.errors import ProxyError, UpstreamHTTPError, UpstreamTimeout, UpstreamUnavailable, sse_error_event
from pdproxy.h1client import H1Response
from pdproxy.protocol import completion_tokens_in, patch_usage
from pdproxy.timeline import RequestContext

Send = Callable[[dict[str, Any]], Awaitable[None]]

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class Responder:
    """The client side of one request: tracks whether the status line went out, so errors are sent right.

    Before ``start()``: an error becomes an HTTP status with a JSON envelope.  After: an SSE error event
    followed by ``data: [DONE]`` (if not already sent).
    """

    __slots__ = ("ctx", "done_sent", "ended", "headers", "send", "started")

    def __init__(self, send: Send, ctx: RequestContext, headers: list[tuple[bytes, bytes]]) -> None:
        self.send = send
        self.ctx = ctx
        self.headers = headers
        self.started = False
        self.ended = False
        self.done_sent = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """Send the status line and ``headers`` (plus the proxy's own) to the client; records ``status`` on the
        request context."""
        self.started = True
        self.ctx.status = status
        await self.send({"type": "http.response.start", "status": status, "headers": headers + self.headers})

    async def write(self, data: bytes) -> None:
        """Send ``data`` (bytes) as a body chunk; more follows."""
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        """Send the last body chunk ``data`` (bytes, may be empty); no-op if the body already ended."""
        if not self.ended:
            self.ended = True
            await self.send({"type": "http.response.body", "body": data, "more_body": False})

    async def json(self, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """A complete JSON response: ``status``, ``body`` (JSON bytes, with Content-Length) and ``extra`` headers."""
        await self.start(status, [(b"content-type", b"application/json"),
                                  (b"content-length", str(len(body)).encode())] + (extra or []))
        await self.end(body)

    async def error(self, err: ProxyError) -> None:
        """Send ``err`` the only way still possible (see class docstring)."""
        self.ctx.error = err.message
        if not self.started:
            extra = [(k.encode(), v.encode()) for k, v in err.headers.items()]
            ctype = err.content_type if isinstance(err, UpstreamHTTPError) else "application/json"
            body = err.body_bytes()
            await self.start(err.status_code, [(b"content-type", ctype.encode()),
                                               (b"content-length", str(len(body)).encode())] + extra)
            await self.end(body)
            return
        if self.ended:
            return
        tail = sse_error_event(err)
        if not self.done_sent:
            tail += sse.DONE_EVENT
            self.done_sent = True
        await self.end(tail)


def _patch_block(block: bytes, cached_tokens: int | None, strip_usage: bool = False) -> bytes:
    """Rewrite ``usage.prompt_tokens_details.cached_tokens`` in every event of ``block`` that has a usage; with
    ``strip_usage`` drop the usage-only chunk (``choices: []``) the proxy asked for but the client did not.

    Only the events from the first one mentioning ``"usage"`` on are split and parsed (vLLM sends usage in the
    last chunk before ``[DONE]``, reference §2.3), so a large full-speed block costs one scan, not one parse per
    event."""
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
    """Cut ``block`` at a ``stop_reason "recomputed"`` chunk (vLLM-Ascend, reference §4): the events before it
    are returned for the client; it and everything after are only recorded in ``transcript``."""
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
    """If the decoder's first event is an error object (e.g. a failed KV pull, reference §1.4), return it as
    an HTTP error so the client gets a real status instead of a 200 stream that only carries an error."""
    if not block.startswith(b"data: {\"error\"") and not block.startswith(b"data:{\"error\""):
        return None
    data = sse.event_data(sse.split_events(block)[0]) or b""
    try:
        obj = orjson.loads(data)
        code = int(obj["error"].get("code") or 500)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        code = 500
    return UpstreamHTTPError(code if 400 <= code < 600 else 500, data)


class StreamRelay:
    """Relays one decoder SSE response to the client.

    ``cached_tokens``: the prefiller's prefix-cache hits to write into usage objects (None: leave as is).
    ``on_first_event``: called once when the first complete event arrives, before the status line goes out
    (the director releases the prefill lease there: the decoder has pulled the KV).
    ``transcript``: records what the client got, for a vLLM-Ascend ``recomputed`` continuation (None: off);
    its ``attempts > 1`` means this leg continues an earlier one (ids/usage rewritten, no second role chunk).
    ``strip_usage``: the usage chunk was forced upstream and is not for the client.
    ``idle_timeout_s``: once the first event is in, ``resp`` reads time out after this many seconds without data
    (``decode_idle_timeout_s``); until then the response keeps the timeout it was opened with (the decode leg
    opens with ``decode_first_byte_timeout_s``, so a slow first token is not cut by the inter-event timeout).
    None: keep it throughout.
    """

    def __init__(self, resp: H1Response, out: Responder, ctx: RequestContext, *,
                 cached_tokens: int | None, first_event_timeout_s: float,
                 on_first_event: Callable[[], None] | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None,
                 transcript: recompute.Transcript | None = None, strip_usage: bool = False,
                 idle_timeout_s: float | None = None) -> None:
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
        self.recomputed = False

    async def _first_block(self, framer: sse.EventFramer) -> bytes:
        content = self.resp.content
        async with asyncio.timeout(self.first_event_timeout_s):
            while True:
                chunk = await content.readany()
                if not chunk:
                    return b""
                block = framer.feed(chunk)
                if block:
                    return block

    async def run(self) -> bool:
        """Relay until the decoder ends.  Raises :class:`ProxyError` only before this decoder's first event
        reached the client (so the director may still fail over); afterwards failures become an SSE error event
        + [DONE].  Returns True when the decoder ended with ``stop_reason "recomputed"`` (nothing of that ending
        was sent; the director continues on a new P→D pair)."""
        framer = sse.EventFramer()
        ctx, out = self.ctx, self.out
        try:
            block = await self._first_block(framer)
        except TimeoutError:
            raise UpstreamTimeout(f"decoder {ctx.decoder} sent no event within {self.first_event_timeout_s:.1f} s",
                                  endpoint=ctx.decoder or "") from None
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(f"decoder {ctx.decoder} failed before its first event: "
                                      f"{exc.__class__.__name__}: {exc}", endpoint=ctx.decoder or "") from None
        if not block:
            raise UpstreamUnavailable(f"decoder {ctx.decoder} closed the stream before its first event",
                                      endpoint=ctx.decoder or "")
        err = _first_event_error(block)
        if err is not None:
            err.endpoint = ctx.decoder or ""
            raise err
        if self.idle_timeout_s is not None:
            self.resp.set_idle_timeout(self.idle_timeout_s)
        if self.on_first_event is not None:
            self.on_first_event()
        if not out.started:
            ctx.timeline.first_token_at = time.monotonic()
            await out.start(200, SSE_HEADERS + self.headers)
        cached, strip = self.cached_tokens, self.strip_usage
        transcript = self.transcript
        continuing = transcript is not None and transcript.attempts > 1
        content = self.resp.content
        events = 0
        observe_gap = ctx.observe_gap  # ITL: one observation per gap between client writes (metrics.py)
        last_write = ctx.timeline.first_token_at or time.monotonic()
        try:
            while True:
                if b'"completion_tokens"' in block:
                    n = completion_tokens_in(block)
                    if n is not None:
                        ctx.completion_tokens = n + (transcript.completion_tokens if continuing and transcript
                                                     else 0)
                if continuing:
                    assert transcript is not None
                    block, self.recomputed = transcript.rewrite(block, keep_usage=not strip)
                elif (cached is not None or strip) and b'"usage"' in block:
                    block = _patch_block(block, cached, strip)
                if transcript is not None and not continuing:
                    if recompute.MARKER in block:
                        block, self.recomputed = _split_recomputed(block, transcript)
                    else:
                        transcript.add(block)
                if self.recomputed:
                    if block:
                        await out.write(block)
                    await self._drain_into(transcript, framer)
                    ctx.events = events
                    return True
                if b"data: [DONE]" in block:
                    if out.done_sent:
                        block = block.replace(sse.DONE_EVENT, b"")
                    out.done_sent = True
                if block:
                    if events and observe_gap is not None:
                        now = time.monotonic()
                        observe_gap(now - last_write)
                        last_write = now
                    await out.write(block)
                events += 1
                block = b""
                while not block:
                    chunk = await content.readany()
                    if not chunk:
                        break
                    block = framer.feed(chunk)
                if not block:
                    tail = framer.pending
                    if not tail.strip():
                        break
                    block = tail + b"\n\n"  # the engine's last event lacked its blank line
                    framer = sse.EventFramer()
        except (aiohttp.ClientError, TimeoutError) as exc:
            ctx.events = events
            kind = "timed out" if isinstance(exc, TimeoutError) else f"failed: {exc.__class__.__name__}"
            await out.error(UpstreamUnavailable(f"decoder {ctx.decoder} {kind} mid-stream; the response is "
                                                "incomplete", endpoint=ctx.decoder or ""))
            ctx.outcome = "upstream_error"
            return False
        ctx.events = events
        ctx.timeline.last_token_at = time.monotonic()
        if not out.done_sent:
            ctx.outcome = "upstream_error"
            await out.error(UpstreamUnavailable(f"decoder {ctx.decoder} ended the stream without data: [DONE]; "
                                                "the response may be incomplete", endpoint=ctx.decoder or ""))
            return False
        await out.end()
        return False

    async def _drain_into(self, transcript: recompute.Transcript | None, framer: sse.EventFramer) -> None:
        """After a ``recomputed`` chunk: read the rest of the decoder's stream (its usage chunk and ``[DONE]``)
        into the transcript without sending it; errors only end the reading."""
        if transcript is None:
            return
        try:
            async with asyncio.timeout(self.first_event_timeout_s):
                while chunk := await self.resp.content.readany():
                    for event in sse.split_events(framer.feed(chunk)):
                        obj = recompute.parse_event(event)
                        if obj is not None:
                            transcript.observe(obj)
        except (aiohttp.ClientError, TimeoutError):
            return
