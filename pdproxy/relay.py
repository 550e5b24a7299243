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

from pdproxy import sse
from pdproxy.errors import ProxyError, UpstreamHTTPError, UpstreamTimeout, UpstreamUnavailable, sse_error_event
from pdproxy.protocol import patch_usage
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
        self.started = True
        self.ctx.status = status
        await self.send({"type": "http.response.start", "status": status, "headers": headers + self.headers})

    async def write(self, data: bytes) -> None:
        await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        if not self.ended:
            self.ended = True
            await self.send({"type": "http.response.body", "body": data, "more_body": False})

    async def json(self, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
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


def _patch_block(block: bytes, cached_tokens: int) -> bytes:
    """Rewrite ``usage.prompt_tokens_details.cached_tokens`` in every event of ``block`` that has a usage."""
    out = []
    for event in sse.split_events(block):
        if b'"usage"' in event:
            data = sse.event_data(event)
            if data is not None and data != b"[DONE]":
                try:
                    obj = orjson.loads(data)
                except orjson.JSONDecodeError:
                    obj = None
                if isinstance(obj, dict) and patch_usage(obj, cached_tokens):
                    event = sse.data_event(orjson.dumps(obj))
        out.append(event)
    return b"".join(out)


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
    """

    def __init__(self, resp: aiohttp.ClientResponse, out: Responder, ctx: RequestContext, *,
                 cached_tokens: int | None, first_event_timeout_s: float,
                 on_first_event: Callable[[], None] | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.resp = resp
        self.out = out
        self.ctx = ctx
        self.cached_tokens = cached_tokens
        self.first_event_timeout_s = first_event_timeout_s
        self.on_first_event = on_first_event
        self.headers = headers or []

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

    async def run(self) -> None:
        """Relay until the decoder ends.  Raises :class:`ProxyError` only before the client's status line went
        out (so the director may still fail over); afterwards failures become an SSE error event + [DONE]."""
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
        if self.on_first_event is not None:
            self.on_first_event()
        ctx.timeline.first_token_at = time.monotonic()
        await out.start(200, SSE_HEADERS + self.headers)
        cached = self.cached_tokens
        content = self.resp.content
        events = 0
        try:
            while True:
                if cached is not None and b'"usage"' in block:
                    block = _patch_block(block, cached)
                if b"data: [DONE]" in block:
                    if out.done_sent:
                        block = block.replace(sse.DONE_EVENT, b"")
                    out.done_sent = True
                events += 1
                await out.write(block)
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
            return
        ctx.events = events
        ctx.timeline.last_token_at = time.monotonic()
        if not out.done_sent:
            ctx.outcome = "upstream_error"
            await out.error(UpstreamUnavailable(f"decoder {ctx.decoder} ended the stream without data: [DONE]; "
                                                "the response may be incomplete", endpoint=ctx.decoder or ""))
            return
        await out.end()
