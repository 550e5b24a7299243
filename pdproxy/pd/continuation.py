"""Stream continuation: a chat / text completions stream whose decoder is lost after the first byte continues,
token-exact, on another P→D pair; the client sees one stream (docs/stream-continuation.md).

**Record (hot path).**  An eligible stream's decode leg asks the decoder for ``return_token_ids`` (vLLM 0.32:
``prompt_token_ids`` in the first chunk — top level for chat, in the choice for completions — and ``token_ids``
in every choice chunk; ``vllm/entrypoints/openai/chat_completion/serving.py``, ``completion/serving.py``).
:class:`RecordIds` keeps each relayed block as it came (one list append, no parsing) and, unless the client asked
for the ids itself, rewrites every ``"token_ids":[…]`` / ``"prompt_token_ids":[…]`` array to ``null`` with one regular-expression pass over the
block — the client gets vLLM's plain shape (``"token_ids":null``).  One byte search per block looks for vLLM's
in-band error event (``data: {"error": …}``, e.g. a failed KV load), which ends the client's part of this leg.

**On loss.**  The relay raises :class:`StreamLost` instead of sending its error event (a reset, an end of body
without ``data: [DONE]``, the relay's silence limit, vLLM's in-band error event).  Only then is the transcript
parsed (:meth:`Resume.read_transcript`): the prompt's ids, every delivered id, the first chunk's
``id``/``created``/``model``, and whether a tool call or reasoning was streamed.  :meth:`Resume.next_leg` builds
the continuation — ``/v1/completions`` with the token-id ``prompt`` = prompt ids + delivered ids, ``max_tokens``
and ``min_tokens`` lowered by what was delivered, the client's sampling fields — which the director runs through
the usual prefill and decode legs, the lost decoder excluded (and its breaker told).

**Re-frame.**  :class:`Reframe` turns the continuation's completions chunks into the client's API shape with the
first chunk's ``id``/``created``/``model``: no second role chunk (chat), ``prompt_token_ids`` dropped, the usage
chunk (only if the client asked for one) with the original ``prompt_tokens`` and every delivered token as
``completion_tokens``.  The re-prefill of the delivered tokens is never in usage.

A client that leaves cancels the director's task: a stream is continued only while its client is connected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from pdproxy.apis.request import Api, ProxyRequest, parse_request
from pdproxy.endpoints import Endpoint
from pdproxy.errors import ProxyError
from pdproxy.http import sse
from pdproxy.timeline import RequestContext

_IDS_RE = re.compile(rb'token_ids":\[[0-9,\s]*\]')  # "token_ids" and "prompt_token_ids"
_NULL_IDS = b'token_ids":null'
_ERROR_EVENT = b'data: {"error"'
# request fields that make a continuation unfaithful or unparseable (docs/stream-continuation.md lists why)
_INELIGIBLE = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "guided_decoding_backend", "stop", "echo", "logprobs", "top_logprobs",
               "prompt_logprobs", "best_of", "use_beam_search", "suffix", "prompt_embeds")
# sampling fields copied onto the continuation's completions body
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",
             "spaces_between_special_tokens", "logit_bias", "cache_salt", "priority", "user", "bad_words",
             "allowed_token_ids", "truncate_prompt_tokens")


class StreamLost(Exception):
    """The decoder of a started, continuable stream was lost (internal: raised by the relay instead of its error
    event; the director continues the stream or sends ``error``, the typed error the client would have had)."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(error.message)
        self.error = error


def eligible(req: ProxyRequest, enabled: bool) -> bool:
    """Whether a stream of ``req`` is continued should its decoder be lost: chat or text completions, streamed,
    one sequence, no structured output, stop strings, echo, logprobs or beam search, and ``continuous_usage``
    off; ``enabled`` is the ``stream_continuation`` setting."""
    if not enabled or not req.stream or req.api not in (Api.CHAT, Api.COMPLETIONS) or req.sequences != 1:
        return False
    if req.decoder_prefills or req.engine_judges or req.continuous_usage:
        return False
    body = req.body
    return not any(body.get(k) not in (None, False) for k in _INELIGIBLE)


def ask_token_ids(body: bytes) -> bytes:
    """Decode-leg body bytes with ``return_token_ids: true`` appended as the object's last member (vLLM keeps the
    last duplicate key)."""
    end = body.rstrip().rfind(b"}")
    return body[:end].rstrip() + b',"return_token_ids":true}'


@dataclass
class Resume:
    """The state of one continuable client stream across its legs.

    ``req``: the client's request; ``keep_ids``: the client asked for ``return_token_ids`` (ids not stripped);
    ``blocks``: the first leg's relayed blocks, unparsed; ``prompt_ids`` / ``generated``: token ids read from
    them on loss (and from every continuation chunk); ``head``: the first chunk's ``id``/``created``/``model``;
    ``lost``: decoders lost so far (excluded from later picks); ``legs``: decode legs run (1 = the original);
    ``finish``: a finish reason was delivered; ``unsafe``: a tool call or reasoning was streamed (a continuation
    would mis-parse it); ``cached_tokens``: the original prefill's prefix-cache hits for usage."""

    req: ProxyRequest
    keep_ids: bool
    blocks: list[bytes] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    head: dict[str, Any] = field(default_factory=dict)
    lost: list[Endpoint] = field(default_factory=list)
    legs: int = 1
    finish: bool = False
    unsafe: bool = False
    cached_tokens: int | None = None

    @classmethod
    def of(cls, req: ProxyRequest, enabled: bool) -> Resume | None:
        """The state for ``req`` when it is :func:`eligible`, else None."""
        if not eligible(req, enabled):
            return None
        return cls(req, keep_ids=req.body.get("return_token_ids") is True)

    # --- the rare path: read what was delivered ---------------------------------------------------------------
    def read_transcript(self) -> None:
        """Parse the first leg's blocks into ``prompt_ids``, ``generated``, ``head``, ``finish``, ``unsafe``."""
        blocks, self.blocks = self.blocks, []
        for block in blocks:
            for event in sse.split_events(block):
                obj = _event_obj(event)
                if obj is not None:
                    self.observe(obj)

    def observe(self, obj: dict[str, Any]) -> None:
        """Account one chunk of a leg (first leg: chat or completions shape; continuation: completions)."""
        if not self.head and "id" in obj:
            self.head = {k: obj[k] for k in ("id", "created", "model") if k in obj}
        ids = obj.get("prompt_token_ids")
        choices = obj.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if choice is not None and ids is None:
            ids = choice.get("prompt_token_ids")
        if self.prompt_ids is None and isinstance(ids, list):
            self.prompt_ids = [int(i) for i in ids]
        if choice is None:
            return
        out = choice.get("token_ids")
        if isinstance(out, list):
            self.generated.extend(int(i) for i in out)
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("tool_calls") or delta.get("reasoning")
                                        or delta.get("reasoning_content")):
            self.unsafe = True
        if choice.get("finish_reason") is not None:
            self.finish = True

    def refusal(self, max_legs: int) -> str | None:
        """Why this stream cannot be continued (None: it can)."""
        if self.unsafe:
            return "a tool call or reasoning block was in flight"
        if self.prompt_ids is None:
            return "the decoder sent no prompt token ids"
        if self.legs > max_legs:
            return f"it was already continued {max_legs} times"
        return None

    def next_leg(self, ctx: RequestContext) -> ProxyRequest | None:
        """The continuation request (``/v1/completions``, token-id prompt), or None when nothing is left to
        generate (the budget is spent or a finish reason was delivered: the stream only needs its end)."""
        assert self.prompt_ids is not None
        body = self.req.body
        sent = len(self.generated)
        limit = self.req.max_output_tokens
        if self.finish or (limit is not None and limit - sent < 1):
            return None
        cont: dict[str, Any] = {k: body[k] for k in _SAMPLING if k in body}
        cont.update({"model": body.get("model") or self.head.get("model"), "prompt": self.prompt_ids + self.generated,
                     "max_tokens": None if limit is None else limit - sent, "stream": True,
                     "stream_options": {"include_usage": True}, "return_token_ids": True})
        for key in ("min_tokens", "min_completion_tokens"):
            if isinstance(body.get(key), int):
                cont["min_tokens"] = max(0, body[key] - sent)
        leg = parse_request(orjson.dumps(cont), Api.COMPLETIONS)
        leg.prompt_tokens = len(self.prompt_ids) + sent
        self.legs += 1
        return leg

    def usage(self) -> dict[str, Any]:
        """The client's usage: the original prompt, every delivered token (the re-prefill never counts)."""
        prompt = len(self.prompt_ids or ())
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + len(self.generated),
                                 "completion_tokens": len(self.generated)}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    def ending(self, include_usage: bool) -> bytes:
        """The end of a stream whose last content was delivered before the loss: usage (if asked) and
        ``[DONE]``."""
        tail = b""
        if include_usage:
            kind = "chat.completion.chunk" if self.req.api is Api.CHAT else "text_completion"
            tail = sse.data_event(orjson.dumps({**self.head, "object": kind, "choices": [], "usage": self.usage()}))
        return tail + sse.DONE_EVENT


def _event_obj(event: bytes) -> dict[str, Any] | None:
    data = sse.event_data(event)
    if data is None or data == b"[DONE]":
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


class RecordIds:
    """The first leg's transform (every block): keep the block for :meth:`Resume.read_transcript`, strip the ids
    unless the client asked for them; vLLM's in-band error event ends the leg for the client (``recomputed``
    set, the relay then raises :class:`StreamLost`)."""

    __slots__ = ("blocks", "keep", "recomputed")
    trigger = b""

    def __init__(self, resume: Resume) -> None:
        self.blocks = resume.blocks
        self.keep = resume.keep_ids
        self.recomputed = False

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        """The block for the client (see class docstring)."""
        if self.recomputed:
            return b""
        if block.find(_ERROR_EVENT) >= 0:
            kept = []
            for event in sse.split_events(block):
                if event.startswith(_ERROR_EVENT):
                    self.recomputed = True
                    break
                kept.append(event)
            block = b"".join(kept)
            if not block:
                return b""
        self.blocks.append(block)
        return block if self.keep else _IDS_RE.sub(_NULL_IDS, block)


class Reframe:
    """A continuation leg's transform (every block; parses each event — the rare path): completions chunks in,
    the client's chunks out (see the module docstring); vLLM's in-band error event ends the leg for the client
    (``recomputed``)."""

    __slots__ = ("chat", "ctx", "include_usage", "recomputed", "resume")
    trigger = b""

    def __init__(self, resume: Resume, ctx: RequestContext) -> None:
        self.resume = resume
        self.ctx = ctx
        self.chat = resume.req.api is Api.CHAT
        self.include_usage = resume.req.include_usage
        self.recomputed = False

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        """The client's events for ``block``."""
        out: list[bytes] = []
        for event in sse.split_events(block):
            if self.recomputed:
                break
            if event.startswith(_ERROR_EVENT):
                self.recomputed = True
                break
            data = sse.event_data(event)
            if data == b"[DONE]":
                out.append(event)
                continue
            obj = _event_obj(event)
            if obj is None:
                continue
            chunk = self.chunk(obj)
            if chunk is not None:
                out.append(sse.data_event(orjson.dumps(chunk)))
        return b"".join(out)

    def chunk(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """One continuation chunk in the client's shape (None: nothing for the client)."""
        r = self.resume
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        choices = obj.get("choices")
        if not choices:
            if not isinstance(obj.get("usage"), dict):
                return None
            usage = r.usage()
            self.ctx.completion_tokens = usage["completion_tokens"]
            return {**r.head, "object": kind, "choices": [], "usage": usage} if self.include_usage else None
        src = choices[0]
        ids = src.get("token_ids")
        if isinstance(ids, list):
            r.generated.extend(int(i) for i in ids)
        self.ctx.completion_tokens = len(r.generated)
        text = src.get("text") or ""
        finish = src.get("finish_reason")
        if not text and finish is None and not (r.keep_ids and ids):
            return None
        if finish is not None:
            r.finish = True
        shown = ids if r.keep_ids else None
        choice: dict[str, Any]
        if self.chat:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                      "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = src.get("stop_reason")
            choice["token_ids"] = shown
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                      "stop_reason": src.get("stop_reason"), "prompt_token_ids": None, "token_ids": shown}
        return {**r.head, "object": kind, "choices": [choice]}
