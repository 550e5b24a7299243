"""Continuing a stream that a vLLM-Ascend decoder ended with ``stop_reason: "recomputed"``.

vLLM-Ascend's RecomputeScheduler (``--additional-config '{"recompute_scheduler_enable": true}'``,
``vllm_ascend/core/recompute_scheduler.py::_add_recomputed_outputs``) does not preempt on a KV consumer: it
finishes the victim with ``finish_reason "stop"``, ``stop_reason "recomputed"`` and empty text.
vLLM-Ascend's example proxy (``examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py``) then
re-runs P→D with the text so far, but rewrites only ``messages[0]``, assumes one token per SSE chunk and uses a
default budget of 16.  Here:

- the client never sees the ``recomputed`` chunk, nor the first attempt's usage chunk or ``[DONE]``;
- the continuation re-prefills the original request plus the text already sent: chat gets an assistant message
  with that text and ``continue_final_message: true, add_generation_prompt: false`` (vLLM chat params; if the
  client itself was continuing a final assistant message, the text is appended to it), so multi-part content and
  ``tools`` stay intact; completions get ``prompt + text`` (token-id prompts cannot be continued → error event);
- budget: the original ``max_completion_tokens`` / ``max_tokens`` minus the tokens already sent (``min_tokens``
  likewise); none left → the stream ends with ``finish_reason "length"``;
- tokens sent are read from the attempt's usage (the director forces ``stream_options.include_usage`` upstream
  and strips that chunk for clients that did not ask), else counted as content events;
- continuation events keep the first attempt's ``id``/``created``; its role chunk is dropped (one role chunk);
  the final usage covers both attempts (first attempt's ``prompt_tokens`` and ``cached_tokens``, summed
  ``completion_tokens``).

A :class:`Transcript` records what the client got.  To keep the relay's hot path cheap it stores the relayed
blocks (no parsing) and parses them into text only on a recompute or when more than ``COMPACT_BYTES`` are held.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from pdproxy.http import sse

RECOMPUTED = "recomputed"
# a JSON string value of "content" (chat delta) / "text" (completion choice): escapes kept for orjson to decode
_CONTENT_RE = re.compile(rb'"content":\s*("(?:[^"\\]|\\.)*")')
_TEXT_RE = re.compile(rb'"text":\s*("(?:[^"\\]|\\.)*")')
MARKER = b'"recomputed"'
COMPACT_BYTES = 64 * 1024


def parse_event(event: bytes) -> dict[str, Any] | None:
    """The JSON object of one SSE event, or None (no data, ``[DONE]``, not an object)."""
    data = sse.event_data(event)
    if data is None or data == b"[DONE]":
        return None
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _choice(obj: dict[str, Any]) -> dict[str, Any] | None:
    choices = obj.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


def is_recomputed(obj: dict[str, Any]) -> bool:
    """True if a chunk or response dict ends its choice with ``stop_reason "recomputed"``."""
    choice = _choice(obj)
    return choice is not None and choice.get("stop_reason") == RECOMPUTED


class Transcript:
    """What one client request has been sent so far, across decode attempts (text, tokens, ids)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.text_parts: list[str] = []
        self.completion_tokens = 0       # tokens of finished (recomputed) attempts
        self.attempt_tokens: int | None = None  # the current attempt's usage.completion_tokens, when seen
        self.content_events = 0
        self.tool_calls = False
        self.head: dict[str, Any] | None = None  # id / created / model of the first attempt
        self.prompt_tokens: int | None = None
        self.cached_tokens: int | None = None
        self.attempts = 1
        self._blocks: list[bytes] = []
        self._held = 0

    # --- hot path: store, parse later -------------------------------------------------------------------------
    def add(self, block: bytes) -> None:
        """Record a block of complete events relayed to the client (attempt 1; no parsing unless large)."""
        self._blocks.append(block)
        self._held += len(block)
        if self._held > COMPACT_BYTES:
            self.compact()

    def compact(self) -> None:
        """Turn the stored blocks into text/tokens/ids and drop them.  Plain content blocks are read with one
        regular expression over the block (~0.5 µs per event); blocks with usage or tool calls, and the first
        event (for the id), are parsed as JSON."""
        blocks, self._blocks, self._held = self._blocks, [], 0
        pattern = _CONTENT_RE if self.chat else _TEXT_RE
        for block in blocks:
            if self.head is None or b'"usage"' in block or b'"tool_calls"' in block or b"\r" in block:
                for event in sse.split_events(block):
                    obj = parse_event(event)
                    if obj is not None:
                        self.observe(obj)
                continue
            for literal in pattern.findall(block):
                if len(literal) > 2:
                    self.text_parts.append(orjson.loads(literal) if b"\\" in literal else literal[1:-1].decode())
                    self.content_events += 1

    def observe(self, obj: dict[str, Any]) -> None:
        """Account one parsed chunk: text, tool calls, usage, the first attempt's id."""
        if self.head is None and "id" in obj:
            self.head = {k: obj[k] for k in ("id", "created", "model") if k in obj}
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.attempt_tokens = usage["completion_tokens"]
            if self.prompt_tokens is None and isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
        choice = _choice(obj)
        if choice is None:
            return
        if self.chat:
            delta = choice.get("delta") or choice.get("message") or {}
            text = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(delta, dict) and delta.get("tool_calls"):
                self.tool_calls = True
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            self.text_parts.append(text)
            self.content_events += 1

    @property
    def text(self) -> str:
        """All text the client has received so far."""
        self.compact()
        return "".join(self.text_parts)

    def end_attempt(self) -> int:
        """Close a recomputed attempt; returns the total tokens sent so far (usage, else content events)."""
        self.compact()
        sent = self.attempt_tokens if self.attempt_tokens is not None else self.content_events
        self.completion_tokens += sent
        self.content_events = 0
        self.attempt_tokens = None
        self.attempts += 1
        return self.completion_tokens

    # --- continuation attempts: parse every event (rare path) -------------------------------------------------
    def rewrite(self, block: bytes, *, keep_usage: bool) -> tuple[bytes, bool]:
        """Rewrite a continuation block for the client: first attempt's id, no role chunk, usage covering all
        attempts (dropped unless ``keep_usage``).  Returns ``(bytes to send, recomputed again)``; events after a
        ``recomputed`` chunk are withheld."""
        out: list[bytes] = []
        again = False
        for event in sse.split_events(block):
            obj = parse_event(event)
            if obj is None:
                if not again:
                    out.append(event)
                continue
            self.observe_continuation(obj)
            if again or is_recomputed(obj):
                again = True
                continue
            choice = _choice(obj)
            if choice is not None and isinstance(choice.get("delta"), dict) and "role" in choice["delta"]:
                delta = {k: v for k, v in choice["delta"].items() if k != "role"}
                if not delta.get("content") and not delta.get("tool_calls"):
                    continue
                choice["delta"] = delta
            if isinstance(obj.get("usage"), dict):
                if not keep_usage and not obj.get("choices"):
                    continue
                self.merge_usage(obj["usage"])
            if self.head:
                obj.update(self.head)
            out.append(sse.data_event(orjson.dumps(obj)))
        return b"".join(out), again

    def observe_continuation(self, obj: dict[str, Any]) -> None:
        """Account a continuation chunk (text for a further recompute; this attempt's usage)."""
        head = self.head
        self.observe(obj)
        self.head = head

    def merge_usage(self, usage: dict[str, Any]) -> None:
        """Make a continuation's usage cover every attempt (in place)."""
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            usage["completion_tokens"] = completion + self.completion_tokens
        if self.prompt_tokens is not None:
            usage["prompt_tokens"] = self.prompt_tokens
        if isinstance(usage.get("prompt_tokens"), int) and isinstance(usage.get("completion_tokens"), int):
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        if self.cached_tokens is not None:
            details = usage.get("prompt_tokens_details")
            details = details if isinstance(details, dict) else {}
            details["cached_tokens"] = self.cached_tokens
            usage["prompt_tokens_details"] = details

    # --- non-streaming ------------------------------------------------------------------------------------------
    def merge_json(self, obj: dict[str, Any]) -> dict[str, Any]:
        """A continuation's JSON answer with the earlier attempts' text prepended and usage covering all."""
        prefix = "".join(self.text_parts)
        choice = _choice(obj)
        if choice is not None and prefix:
            if self.chat and isinstance(choice.get("message"), dict):
                msg = choice["message"]
                msg["content"] = prefix + (msg.get("content") or "")
            elif not self.chat:
                choice["text"] = prefix + (choice.get("text") or "")
        if isinstance(obj.get("usage"), dict):
            self.merge_usage(obj["usage"])
        if self.head:
            obj.update({k: v for k, v in self.head.items() if k != "model"})
        return obj


def budget_keys(body: dict[str, Any], chat: bool) -> list[str]:
    """The body's output-token limit keys in precedence order (chat: ``max_completion_tokens`` wins)."""
    keys = ["max_completion_tokens", "max_tokens"] if chat else ["max_tokens"]
    return [k for k in keys if isinstance(body.get(k), int)]


def continuation_body(original: dict[str, Any], chat: bool, text: str, tokens_sent: int
                      ) -> dict[str, Any] | None:
    """A new request body that continues ``original`` after ``text`` (``tokens_sent`` tokens) was sent.

    Returns None when the budget is spent (caller ends with ``finish_reason "length"``).  Raises ``ValueError``
    when the request cannot be continued (a token-id completions prompt).
    """
    body = dict(original)
    body.pop("request_id", None)
    keys = budget_keys(original, chat)
    for key in keys:
        left = original[key] - tokens_sent
        if left < 1:
            return None
        body[key] = left
    for key in ("min_tokens", "min_completion_tokens"):
        if isinstance(original.get(key), int):
            body[key] = max(0, original[key] - tokens_sent)
    if chat:
        messages = [dict(m) for m in original["messages"]]
        last = messages[-1]
        if original.get("continue_final_message") and last.get("role") == "assistant":
            content = last.get("content")
            if isinstance(content, list):
                last["content"] = [*content, {"type": "text", "text": text}]
            else:
                last["content"] = (content or "") + text
        else:
            messages.append({"role": "assistant", "content": text})
        body["messages"] = messages
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
        return body
    prompt = original.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ValueError("a token-id prompt cannot be continued with generated text")
    body["prompt"] = prompt + text
    return body


def force_usage_bytes(body: bytes, original: dict[str, Any]) -> bytes:
    """Decode-leg body bytes with ``stream_options.include_usage`` forced on (appended as the object's last
    member; vLLM's JSON parsing keeps the last duplicate key), keeping any other client stream options."""
    options = original.get("stream_options")
    merged = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    end = body.rstrip().rfind(b"}")
    return body[:end].rstrip() + b',"stream_options":' + orjson.dumps(merged) + b"}"


async def finish_length(out: Any, transcript: Transcript, *, stream: bool, include_usage: bool) -> None:
    """End a response whose budget was used up by earlier attempts: a last chunk with ``finish_reason "length"``
    (+ usage chunk when asked) and ``[DONE]`` for a stream, else the JSON answer with the text so far.
    ``out`` is the request's :class:`pdproxy.pd.responder.Responder`."""
    head = dict(transcript.head or {})
    usage: dict[str, Any] = {"prompt_tokens": transcript.prompt_tokens or 0, "completion_tokens": 0}
    transcript.merge_usage(usage)
    if transcript.chat:
        kind, choice = "chat.completion", {"index": 0, "message": {"role": "assistant", "content": transcript.text},
                                           "finish_reason": "length", "stop_reason": None}
    else:
        kind, choice = "text_completion", {"index": 0, "text": transcript.text, "finish_reason": "length",
                                           "stop_reason": None}
    if not stream:
        await out.json(200, orjson.dumps({**head, "object": kind, "choices": [choice], "usage": usage}))
        return
    if transcript.chat:
        last = {"index": 0, "delta": {}, "finish_reason": "length", "stop_reason": None}
        kind = "chat.completion.chunk"
    else:
        last = {"index": 0, "text": "", "finish_reason": "length", "stop_reason": None}
    tail = sse.data_event(orjson.dumps({**head, "object": kind, "choices": [last]}))
    if include_usage:
        tail += sse.data_event(orjson.dumps({**head, "object": kind, "choices": [], "usage": usage}))
    out.done_sent = True
    await out.end(tail + sse.DONE_EVENT)
