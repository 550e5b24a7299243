"""Answering the client from the prefiller when the prefill leg already finished the request.

The prefill leg asks for one token with ``min_tokens: 1`` (``kv_transfer.prefill_body``), so vLLM never ends it
on a first-token EOS or stop token; an engine or connector that still does (vLLM-Ascend's Mooncake connector and
older NIXL return ``kv_transfer_params: null`` for a stopped request) has produced the complete answer: the
model said nothing more (``docs/pd-protocol.md``, "When the prefiller returns no handle").  That answer is a vLLM
answer to the client's own request — every sampling field but the leg's token limits was the client's, and a
request that stops before its first token's limit is the same under ``max_tokens`` 1 or N — so it is sent as it
is (JSON) or as the stream vLLM would have sent for it (SSE, shapes as in vLLM 0.32's
``chat_completion/serving.py::chat_completion_stream_generator`` and ``completion/serving.py``).

:func:`usable` says when that holds; otherwise the director lets a decoder prefill the request itself.
Responses and Messages answers are recognised by their own end fields (``kv_transfer.finish_reason``) and sent
as they are to a JSON client; their streams go to a decoder.
"""

from __future__ import annotations

import time
from typing import Any

from pdproxy.apis import kv_transfer
from pdproxy.apis.request import Api, ProxyRequest
from pdproxy.errors import UpstreamUnavailable, dumps_or_none
from pdproxy.http import sse
from pdproxy.pd.responder import SSE_HEADERS, Responder
from pdproxy.timeline import RequestContext


def usable(req: ProxyRequest) -> bool:
    """True when a prefill answer that stopped is a valid answer to ``req``: the client asked for at most one
    ``min_tokens`` (the leg raised it to 1, which only makes stopping less likely), and either wants JSON or
    streams chat / completions (a Responses or Messages stream has many event kinds a JSON answer would have
    to be rebuilt into: a decoder prefills those itself instead, a cost only on this rare path), and carries no
    output constraint the prefill leg may have relaxed (a forced tool call, a structured output: the answer did
    not obey it; :func:`pdproxy.apis.kv_transfer.has_relaxable_constraints`)."""
    return ((req.min_tokens or 0) <= 1 and (not req.stream or req.api in (Api.CHAT, Api.COMPLETIONS))
            and not kv_transfer.has_relaxable_constraints(req.body, req.api))


def _choice(reply: dict[str, Any]) -> dict[str, Any]:
    choices = reply.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return first if isinstance(first, dict) else {}


def chat_events(reply: dict[str, Any], include_usage: bool, continuous_usage: bool = False) -> list[bytes] | None:
    """The SSE events of a chat stream carrying ``reply`` (a ``chat.completion`` JSON answer): the role chunk,
    one chunk with the whole message and the finish reason, the usage chunk when asked for, ``[DONE]``; None when
    a chunk nests past what orjson writes (:func:`pdproxy.errors.dumps_or_none`)."""
    base = {"id": reply.get("id"), "object": "chat.completion.chunk", "created": reply.get("created"),
            "model": reply.get("model")}
    choice = _choice(reply)
    found = choice.get("message")
    message: dict[str, Any] = found if isinstance(found, dict) else {}
    usage = reply.get("usage") if continuous_usage else None
    first = {**base, "choices": [{"index": choice.get("index", 0), "delta": {
        "role": message.get("role", "assistant"), "content": ""}, "logprobs": None, "finish_reason": None}],
        "prompt_token_ids": reply.get("prompt_token_ids"), "prompt_text": reply.get("prompt_text")}
    delta: dict[str, Any] = {"content": message.get("content") or ""}
    if message.get("reasoning"):
        delta["reasoning"] = message["reasoning"]
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls) if isinstance(call, dict)]
    last = {**base, "choices": [{"index": choice.get("index", 0), "delta": delta,
                                 "logprobs": choice.get("logprobs"), "finish_reason": choice.get("finish_reason"),
                                 "stop_reason": choice.get("stop_reason"), "token_ids": choice.get("token_ids")}]}
    if usage is not None:
        first["usage"] = last["usage"] = usage
    return _events(first, last, base, reply, include_usage)


def completion_events(reply: dict[str, Any], include_usage: bool,
                      continuous_usage: bool = False) -> list[bytes] | None:
    """The SSE events of a completions stream carrying ``reply`` (a ``text_completion`` JSON answer): one chunk
    with the text and the finish reason, the usage chunk when asked for, ``[DONE]``; None when a chunk nests past
    what orjson writes."""
    base = {"id": reply.get("id"), "object": "text_completion", "created": reply.get("created"),
            "model": reply.get("model")}
    choice = _choice(reply)
    last = {**base, "choices": [{"index": choice.get("index", 0), "text": choice.get("text") or "",
                                 "logprobs": choice.get("logprobs"), "finish_reason": choice.get("finish_reason"),
                                 "stop_reason": choice.get("stop_reason"),
                                 "prompt_token_ids": choice.get("prompt_token_ids"),
                                 "token_ids": choice.get("token_ids")}]}
    if continuous_usage and reply.get("usage") is not None:
        last["usage"] = reply["usage"]
    return _events(None, last, base, reply, include_usage)


def _events(first: dict[str, Any] | None, last: dict[str, Any], base: dict[str, Any], reply: dict[str, Any],
            include_usage: bool) -> list[bytes] | None:
    chunks = [c for c in (first, last) if c is not None]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": reply.get("usage"),
                       "system_fingerprint": reply.get("system_fingerprint")})
    else:
        last["system_fingerprint"] = reply.get("system_fingerprint")
    written = [dumps_or_none(c) for c in chunks]
    if any(w is None for w in written):
        return None
    return [sse.data_event(w) for w in written if w is not None] + [sse.DONE_EVENT]


async def send(req: ProxyRequest, ctx: RequestContext, out: Responder, reply: dict[str, Any],
               headers: list[tuple[bytes, bytes]]) -> None:
    """Send ``reply`` (the prefiller's JSON answer, finished ``stop``, in ``req``'s API) to the client as ``req``
    asked: JSON unchanged, or one SSE body (chat, completions); records the first/last token times and the
    output tokens (``completion_tokens`` / ``output_tokens``) on ``ctx``.  Raises :class:`UpstreamUnavailable`
    (502, nothing sent) for an answer nested past what orjson writes (254 levels)."""
    now = time.monotonic()
    ctx.timeline.first_token_at = ctx.timeline.last_token_at = now
    usage = reply.get("usage")
    key = "completion_tokens" if req.api in (Api.CHAT, Api.COMPLETIONS) else "output_tokens"
    if isinstance(usage, dict) and isinstance(usage.get(key), int):
        ctx.completion_tokens = usage[key]
    if not req.stream:
        body = dumps_or_none(reply)
    else:
        build = chat_events if req.api is Api.CHAT else completion_events
        events = build(reply, req.include_usage, req.continuous_usage)
        body = None if events is None else b"".join(events)
    if body is None:                        # orjson writes at most 254 levels; vLLM's answers nest a handful
        raise UpstreamUnavailable(f"prefiller {ctx.prefiller} answered JSON nested too deep to relay",
                                  endpoint=ctx.prefiller or "")
    if not req.stream:
        await out.json(200, body, headers)
        return
    await out.start(200, [*SSE_HEADERS, *headers])
    out.done_sent = True                    # the events end with [DONE] (a fan-out merge checks for it)
    await out.end(body)
