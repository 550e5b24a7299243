"""The per-block transforms of a chat / text completions decoder's SSE stream, as the relay's splice runs them
(:mod:`pdproxy.pd.relay` says what a transform is: ``trigger``, ``feed``, ``ending``, ``recomputed``).

A *block* (bytes) is one or more complete SSE events from the decoder, each ending in its blank line; ``prev`` is
the block written to the client before it.  A transform returns the bytes for the client (may be ``b""``: nothing
to send).  Token figures (``cached_tokens``, ``completion_tokens``) are counts of tokens.

Transforms search bytes with ``block.find(b'"usage"') >= 0`` — never ``b'"usage"' in block``, which in CPython
first tries the needle as an integer and formats a ``TypeError`` it then discards: ~2.5× the cost, 15 % of the
splice's instructions when measured — and parse only the events they rewrite.  This module owns:

- :class:`ChatUsage` (chat and text completions; trigger ``"usage"``): ``completion_tokens`` read from the
  usage; ``prompt_tokens_details.cached_tokens`` set to the prefiller's figure; the usage chunk dropped when
  the proxy forced it upstream for a client that did not ask; with detection on (below) its ``ending`` looks
  for a ``recomputed`` chunk in the last blocks;
- :class:`RecordTranscript` / :class:`ContinueTranscript` (vLLM-Ascend ``stop_reason: "recomputed"``, only for
  decoders known to send it; every block): keep what the client got, cut at the ``recomputed`` chunk / rewrite
  a continuation's ids and usage (:mod:`pdproxy.apis.recompute`);
- :class:`DetectRecomputed` (other decoders, when continuation is enabled; run by :class:`ChatUsage` on the
  last blocks only): a decoder that does end a stream with ``recomputed`` is reported (the director keeps
  transcripts for it from then on) and that stream ends with an error event;
- :class:`Chain`: several transforms applied in order, as one (:class:`ChatUsage` then :class:`RecordTranscript`);
- :func:`first_event_error`: the decoder's first block as an HTTP error when it is an error object, so the client
  gets a real status instead of a 200 stream that only carries an error.

The Responses and Messages streams' transforms are in :mod:`pdproxy.apis.streams`.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson

from pdproxy.apis import recompute
from pdproxy.apis.request import completion_tokens_in, patch_usage
from pdproxy.apis.transform import Transform
from pdproxy.errors import UpstreamHTTPError, dumps_or_none, error_status
from pdproxy.http import sse
from pdproxy.timeline import RequestContext


def _patch_block(block: bytes, cached_tokens: int | None, strip_usage: bool = False) -> bytes:
    """Rewrite ``usage.prompt_tokens_details.cached_tokens`` in every event of ``block`` that has a usage; with
    ``strip_usage`` drop the usage-only chunk (``choices: []``) the proxy asked for but the client did not.

    Only the events with usage are split and parsed.  vLLM sends usage in the last chunk before ``[DONE]``, or in
    every chunk with ``continuous_usage_stats`` (``vllm/entrypoints/openai/chat_completion/serving.py``): the
    usage events are found from the end, walking back while the event before holds usage too, so a large
    full-speed block costs a few events' bytes (a forward ``bytes.find`` of ``"usage"`` crawls through JSON,
    where ``"`` is everywhere).  ``block``: whole events, ``\n`` line endings (the relay's framing)."""
    last = block.rfind(b'"usage"')
    if last < 0:
        return block
    start = sse.event_start(block, last)
    while start > 0:                           # continuous usage: every event before holds it too
        before = sse.event_start(block, start - 2)
        if block.find(b'"usage"', before, start) < 0:
            break
        start = before
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
                        written = dumps_or_none(obj)  # None: nested past what orjson writes, the event relayed
                        if written is not None:       # as it came, unpatched (as patch_usage_bytes does)
                            event = sse.data_event(written)
        out.append(event)
    return b"".join(out)


def _split_recomputed(block: bytes, transcript: recompute.Transcript) -> tuple[bytes, bool]:
    """Cut ``block`` at a ``stop_reason "recomputed"`` chunk (vLLM-Ascend, :mod:`pdproxy.apis.recompute`): the events
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


def first_event_error(block: bytes) -> UpstreamHTTPError | None:
    """If the decoder's first event is an error object (e.g. a failed KV pull, as in the
    ``tests/real_vllm/captures/decode_bad_remote_stream.json`` capture), return it as an HTTP error so the client
    gets a real status instead of a 200 stream that only carries an error: its status
    :func:`pdproxy.errors.error_status` of ``error.code`` (500 when the event is no JSON or its ``error`` no
    object), its body the event's data as sent."""
    if not block.startswith(b"data: {\"error\"") and not block.startswith(b"data:{\"error\""):
        return None
    data = sse.event_data(sse.split_events(block)[0]) or b""
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        obj = None
    inner = obj.get("error") if isinstance(obj, dict) else None
    return UpstreamHTTPError(error_status(inner.get("code") if isinstance(inner, dict) else None), data)


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
        n = completion_tokens_in(block)  # searched from the end, where the usage chunk is
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

    def ending(self, block: bytes, prev: bytes) -> bytes:
        """The stream's last block, as is."""
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
        n = completion_tokens_in(block)
        if n is not None:
            self.ctx.completion_tokens = n + self.transcript.completion_tokens
        if self.recomputed:
            self.transcript.rewrite(block, keep_usage=self.keep_usage)  # accounting only
            return b""
        out, self.recomputed = self.transcript.rewrite(block, keep_usage=self.keep_usage)
        return out

    def ending(self, block: bytes, prev: bytes) -> bytes:
        """The stream's last block, as is."""
        return block


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


class Chain:
    """Several transforms applied in order, as one (each to the blocks holding its ``trigger``)."""

    __slots__ = ("parts",)
    trigger = b""

    def __init__(self, parts: list[Transform]) -> None:
        self.parts = parts

    @property
    def recomputed(self) -> bool:
        return any(p.recomputed for p in self.parts)

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        for p in self.parts:
            if block and block.find(p.trigger) >= 0:
                block = p.feed(block, prev)
        return block

    def ending(self, block: bytes, prev: bytes) -> bytes:
        """The stream's last block through each part's ending, in order."""
        for p in self.parts:
            block = p.ending(block, prev)
        return block
