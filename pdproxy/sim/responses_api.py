"""``POST /v1/responses``: the OpenAI Responses API as vLLM 0.32 serves it (``vllm/entrypoints/openai/responses/
protocol.py``, ``serving.py``, ``api_router.py``; shapes as captured in ``tests/real_vllm/captures/apis/``).

Request: ``input`` (a string, or items: messages with ``input_text``/``output_text`` parts, ``function_call``,
``function_call_output``), ``instructions`` (a leading system message), ``max_output_tokens`` (the output limit;
absent = the room left in the context), ``text.format`` (``json_object`` / ``json_schema``), ``tools`` (function
tools) and ``tool_choice``, ``top_logprobs`` with ``include: ["message.output_text.logprobs"]``, the sampling fields
(``temperature``, ``top_p``, ``stop``, ``stop_token_ids``, ``ignore_eos``…), ``kv_transfer_params``. No ``n``, no
``min_tokens``. Without ``--tool-call-parser`` a ``tool_choice`` (even ``"required"``) is not enforced: the answer
is text, as real vLLM 0.32 answered (``tests/real_vllm/captures/apis/responses_tool_required_no_parser.json``). The response id is the body's ``request_id`` or ``resp_<16 hex>``: vLLM does not use
``X-Request-Id`` for it. The prompt is the chat template applied to the messages, encoded *with* the tokenizer's
special tokens (an HF template that writes BOS itself yields two BOS, as real vLLM 0.32 counted: 14 tokens for
``"Hi there"`` where Messages count 13).

JSON answer: a ``response`` object (``status`` ``completed``, or ``incomplete`` with ``incomplete_details.reason
"max_output_tokens"``), ``output`` = one ``message`` item with one ``output_text`` part (or one ``function_call``
item), ``usage`` = ``{input_tokens, input_tokens_details: {cached_tokens, cache_write_tokens, input_tokens_per_turn,
cached_tokens_per_turn}, output_tokens, output_tokens_details: {reasoning_tokens, tool_output_tokens,
output_tokens_per_turn, tool_output_tokens_per_turn}, total_tokens}``, top-level ``kv_transfer_params``.

Stream: ``event: <type>\\ndata: <json>\\n\\n`` events with a ``sequence_number``: ``response.created`` and
``response.in_progress`` at once (before the engine runs), then with the first token ``response.output_item.added``
+ ``response.content_part.added``, one ``response.output_text.delta`` per engine step, then
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done`` and
``response.completed`` (the whole response, ``usage`` and ``kv_transfer_params`` included). No ``data: [DONE]``.
A failed KV pull after the stream started cuts the connection without a terminator, as real vLLM 0.32 does (its
error event fails its own event validation).
"""

from __future__ import annotations

import secrets
import time
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

import orjson

from pdproxy.sim import validation as v
from pdproxy.sim.errors import SimHTTPError, error_body
from pdproxy.sim.generation import Seq, Usage
from pdproxy.sim.protocol import ParsedRequest, ToolMode, check_length, check_output_limit, decode_body
from pdproxy.tokens import MEDIA_PART_TOKENS, MEDIA_TOKEN_ID, HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from pdproxy.sim.config import SimConfig
    from pdproxy.sim.models import ModelRegistry

_TOOL_DEFAULTS: Final = MappingProxyType({"strict": None, "allowed_callers": None, "async": None,
                                          "defer_loading": None, "description": None, "output_schema": None})


def _text_of(content: Any) -> tuple[str, int]:
    """The text of an input item's ``content`` and its number of media parts."""
    if isinstance(content, str):
        return content, 0
    if not isinstance(content, list):
        return "", 0
    texts, media = [], 0
    for part in content:
        if not isinstance(part, dict):
            continue
        if part.get("type") in ("input_text", "output_text", "text"):
            texts.append(str(part.get("text", "")))
        elif part.get("type") in ("input_image", "input_file", "input_audio"):
            media += 1
    return "\n".join(texts), media


_MESSAGE_ROLES = ("user", "assistant", "system", "developer")


def chat_messages(body: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """The chat messages a Responses request renders (``instructions`` first) and its media part count.
    Raises pydantic's 400 for an ``input`` that is neither a string nor a list, and for a message item whose role
    is not a message role or whose content is neither a string nor a list of parts."""
    messages: list[dict[str, Any]] = []
    media = 0
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    items = body["input"]
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages, 0
    if not isinstance(items, list):
        raise v.pydantic_error("string_type", "input", "Input should be a valid string", items)
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "function_call":
            messages.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": item.get("call_id", ""), "type": "function",
                "function": {"name": item.get("name", ""), "arguments": item.get("arguments", "")}}]})
        elif kind == "function_call_output":      # vLLM: the output is the tool message's content, parts kept
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                             "content": _text_of(output)[0] if isinstance(output, list) else str(output)})
        elif kind == "message" or "role" in item:
            role, content = item.get("role", "user"), item.get("content")
            if role not in _MESSAGE_ROLES:    # openai's EasyInputMessageParam / ResponseInputItem message roles
                raise v.pydantic_error("literal_error", f"input.{i}.role",
                                       "Input should be 'user', 'assistant', 'system' or 'developer'", role)
            if not isinstance(content, str | list):
                raise v.pydantic_error("string_type", f"input.{i}.content", "Input should be a valid string",
                                       content)
            text, parts = _text_of(content)
            media += parts
            messages.append({"role": role, "content": text})
    return messages, media


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses function tools as the chat template sees them."""
    return [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                              "parameters": t.get("parameters")}}
            for t in tools if isinstance(t, dict) and t.get("type", "function") == "function"]


def prompt_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               media: int) -> list[int]:
    """The prompt: the chat template applied, encoded with special tokens (HF tokenizers)."""
    text = tokenizer.render_chat(messages, tools=tools or None)
    ids = tokenizer.encode(text, add_special_tokens=True) if isinstance(tokenizer, HFTokenizer) else tokenizer.encode(
        text)
    return ids + [MEDIA_TOKEN_ID] * (media * MEDIA_PART_TOKENS) if media else ids


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> Any:
    """``ResponsesRequest.check_tool_usage``: the effective ``tool_choice`` (``"none"`` without tools)."""
    choice = body.get("tool_choice", "auto")
    named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
    if not tools:
        if choice in ("auto", "none"):
            return "none"
        if choice == "required":
            raise v.vllm_error("Tool choice 'required' must be specified with 'tools' parameter.", "tool_choice")
        if named:
            raise v.vllm_error("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
        return choice
    if named and not any(t.get("name") == choice.get("name") for t in tools if isinstance(t, dict)):
        raise v.vllm_error("Tool choice 'function' not found in 'tools' parameter.", "tool_choice")
    return choice


def parse_responses(raw: Any, headers: Any, config: SimConfig, tokenizer: Tokenizer,
                    models: ModelRegistry) -> ParsedRequest:
    """Validate a Responses request (the module docstring); raises :class:`SimHTTPError`."""
    body = decode_body(raw)
    if "input" not in body:  # vLLM's validators have set tool_choice by then
        raise v.missing("input", {**body, "tool_choice": body.get("tool_choice")})
    max_output = v.get_int(body, "max_output_tokens")
    stream = v.get_bool(body, "stream")
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise v.pydantic_error("list_type", "tools", "Input should be a valid list", tools)
    fields = v.read_sampling(body, "responses")
    if body.get("prompt") is not None:
        raise v.vllm_error("prompt template is not supported", "prompt")
    choice = _tool_choice(body, tools)
    text_cfg = body.get("text")
    fmt = text_cfg.get("format") if isinstance(text_cfg, dict) else None
    structured = None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        structured = v.Structured("json_object")
    elif isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        structured = v.Structured("json", fmt.get("schema") if isinstance(fmt.get("schema"), dict) else {})
    if body.get("structured_outputs") is not None:
        if structured is not None:
            raise v.vllm_error("Cannot specify both structured_outputs and text.format", "structured_outputs")
        structured = v.structured_from_params(body["structured_outputs"])
    model = models.resolve(body.get("model"))
    if body.get("previous_response_id") is not None:
        raise SimHTTPError(404, f"Response with id '{body['previous_response_id']}' not found.",
                           "invalid_request_error", "response_id")
    check_output_limit(max_output, config.max_model_len, "max_output_tokens")
    messages, media = chat_messages(body)
    ids = prompt_ids(tokenizer, messages, chat_tools(tools), media)
    limit = check_length(len(ids), max_output, config.max_model_len,
                         clamp=config.max_tokens_overflow == "clamp")
    effective = limit if limit is not None else config.max_model_len - len(ids)
    spec = fields.verify(effective)
    mode: ToolMode | None = None
    name, schema = None, None
    function_tools = [t for t in tools if isinstance(t, dict) and t.get("type", "function") == "function"]
    if function_tools and choice != "none" and config.tool_call_parser and (
            choice != "auto" or config.enable_auto_tool_choice):
        mode = "named" if isinstance(choice, dict) else "required" if choice == "required" else "auto"
        wanted = choice.get("name") if isinstance(choice, dict) else None
        tool = next((t for t in function_tools if t.get("name") == wanted), function_tools[0])
        name, schema = str(tool.get("name", "tool")), tool.get("parameters")
    rid = str(body.get("request_id") or f"resp_{secrets.token_hex(8)}")
    return ParsedRequest(
        api="responses", body=body, base_id=rid, response_id=rid, stream=stream, include_usage=False,
        continuous_usage=False, prompt_token_ids=ids, max_tokens=effective, min_tokens=0,
        kv_transfer_params=body.get("kv_transfer_params"), tools=function_tools or None, tool_choice=choice,
        sampling=spec, model=model, tool_mode=mode, tool_name=name, tool_schema=schema,
        structured=structured if mode is None else None)


class ResponsesWriter:
    """The JSON body and SSE events of one Responses request (see the module docstring)."""

    done = b""
    include_usage = False
    continuous_usage = False
    abort_on_failure = True

    def __init__(self, req: ParsedRequest, model: str, created: int) -> None:
        self.req = req
        self.model = model
        self.created = created
        self.sequence = 0
        self.item_id = (f"fc_{secrets.token_hex(8)}" if req.tool_mode else f"msg_{secrets.token_hex(8)}")
        self.call_id = f"chatcmpl-tool-{secrets.token_hex(8)}"

    # ---- the response object ------------------------------------------------------------------------------
    def _tools(self) -> list[dict[str, Any]]:
        out = []
        for tool in self.req.body.get("tools") or []:
            if isinstance(tool, dict):
                out.append({"name": tool.get("name"), "parameters": tool.get("parameters"), **_TOOL_DEFAULTS,
                            "type": tool.get("type", "function"),
                            **{k: tool[k] for k in _TOOL_DEFAULTS if k in tool}})
        return out

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                 kv_params: dict[str, Any] | None, incomplete: bool = False) -> dict[str, Any]:
        """The ``response`` object (``ResponsesResponse.from_request``)."""
        body, spec = self.req.body, self.req.sampling
        choice = self.req.tool_choice
        if isinstance(choice, dict):
            choice = {"name": choice.get("name"), "type": choice.get("type", "function")}
        return {
            "id": self.req.response_id, "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata"), "model": self.model,
            "object": "response", "output": output, "parallel_tool_calls": body.get("parallel_tool_calls", True)
            if body.get("parallel_tool_calls") is not None else True,
            "temperature": spec.temperature, "tool_choice": choice, "tools": self._tools(),
            "top_p": float(v.get_float(body, "top_p") or 1.0), "background": bool(body.get("background", False)),
            "max_output_tokens": self.req.max_tokens, "max_tool_calls": body.get("max_tool_calls"),
            "previous_response_id": None, "prompt": None, "reasoning": body.get("reasoning"),
            "service_tier": body.get("service_tier", "auto"), "status": status, "text": body.get("text"),
            "top_logprobs": spec.logprobs, "truncation": body.get("truncation") or "disabled", "usage": usage,
            "user": body.get("user"), "presence_penalty": float(v.get_float(body, "presence_penalty") or 0.0),
            "frequency_penalty": float(v.get_float(body, "frequency_penalty") or 0.0),
            "kv_transfer_params": kv_params, "ec_transfer_params": None, "input_messages": None,
            "output_messages": None}

    @staticmethod
    def usage(figures: Usage) -> dict[str, Any]:
        """``ResponseUsage`` (cached tokens in ``input_tokens_details.cached_tokens``)."""
        return {"input_tokens": figures.prompt,
                "input_tokens_details": {"cached_tokens": max(figures.cached, 0), "cache_write_tokens": figures.created,
                                         "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
                "output_tokens": figures.completion,
                "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                          "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
                "total_tokens": figures.total}

    def _logprobs(self, seq: Seq, start: int, end: int) -> list[dict[str, Any]]:
        top = self.req.sampling.logprobs
        if top is None:
            return []
        out = []
        for i in range(start, end):
            token, lp, alts = seq.plan.logprobs(i, max(top, 1))
            out.append({"token": token, "bytes": list(token.encode()), "logprob": lp,
                        "top_logprobs": [{"token": t, "bytes": list(t.encode()), "logprob": x}
                                         for t, x in alts[:top]] if top else []})
        return out

    def _item(self, seq: Seq, done: bool) -> dict[str, Any]:
        text = seq.plan.text(0, seq.sent) if done else ""
        if self.req.tool_mode:
            return {"arguments": text, "call_id": self.call_id, "name": self.req.tool_name, "type": "function_call",
                    "id": self.item_id, "async": None, "caller": None, "namespace": None,
                    "status": "completed" if done else "in_progress"}
        content = [{"annotations": [], "text": text, "type": "output_text",
                    "logprobs": (self._logprobs(seq, 0, seq.sent) or None) if self.req.sampling.logprobs is not None
                    else None}] if done else []
        return {"id": self.item_id, "content": content, "role": "assistant",
                "status": "completed" if done else "in_progress", "type": "message", "phase": None}

    # ---- streaming ----------------------------------------------------------------------------------------
    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        data = {**payload, "sequence_number": self.sequence, "type": kind}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def head(self) -> list[bytes]:
        """``response.created`` and ``response.in_progress``, sent before the engine runs."""
        initial = self.response("in_progress", [], None, None)
        return [self._event("response.created", {"response": initial}),
                self._event("response.in_progress", {"response": initial})]

    def opening(self, seq: Seq) -> list[bytes]:
        """``response.output_item.added`` (+ ``response.content_part.added`` for text), with the first token."""
        seq.started = True
        events = [self._event("response.output_item.added", {"item": self._item(seq, False), "output_index": 0})]
        if self.req.tool_mode is None:
            events.append(self._event("response.content_part.added", {
                "content_index": 0, "item_id": self.item_id, "output_index": 0,
                "part": {"annotations": [], "text": "", "type": "output_text", "logprobs": []}}))
        return events

    def output(self, seq: Seq, start: int, end: int, finish: str | None, stop_reason: Any,
               usage: Usage | None, last: bool) -> list[bytes]:
        """Item/part openers with the first token, then deltas; the done events with the last one."""
        tool = self.req.tool_mode is not None
        events: list[bytes] = [] if seq.started else self.opening(seq)
        text = seq.plan.text(start, end)
        if text:
            if tool:
                events.append(self._event("response.function_call_arguments.delta", {
                    "delta": text, "item_id": self.item_id, "output_index": 0}))
            else:
                events.append(self._event("response.output_text.delta", {
                    "content_index": 0, "delta": text, "item_id": self.item_id,
                    "logprobs": self._logprobs(seq, start, end), "output_index": 0}))
        if finish is not None:
            seq.sent = end
            full = seq.plan.text(0, end)
            if tool:
                events.append(self._event("response.function_call_arguments.done", {
                    "arguments": full, "item_id": self.item_id, "output_index": 0, "name": self.req.tool_name}))
            else:
                events.append(self._event("response.output_text.done", {
                    "content_index": 0, "item_id": self.item_id, "logprobs": self._logprobs(seq, 0, end),
                    "output_index": 0, "text": full}))
                events.append(self._event("response.content_part.done", {
                    "content_index": 0, "item_id": self.item_id, "output_index": 0,
                    "part": {"annotations": [], "text": full, "type": "output_text", "logprobs": None}}))
            events.append(self._event("response.output_item.done", {"item": self._item(seq, True),
                                                                    "output_index": 0}))
        return events

    def tail(self, seqs: list[Seq], usage: Usage, kv_params: dict[str, Any] | None) -> list[bytes]:
        """``response.completed``: the whole response, ``usage`` and ``kv_transfer_params`` included."""
        return [self._event("response.completed", {"response": self._final(seqs, usage, kv_params)})]

    def failure(self) -> list[bytes]:
        """Nothing: the connection is cut (``abort_on_failure``)."""
        return []

    @staticmethod
    def failure_body() -> tuple[int, bytes]:
        """The 500 of a non-streaming request whose KV pull failed."""
        return 500, error_body("Internal server error", "InternalServerError", 500)

    # ---- JSON ---------------------------------------------------------------------------------------------
    def _final(self, seqs: list[Seq], usage: Usage, kv_params: dict[str, Any] | None) -> dict[str, Any]:
        seq = seqs[0]
        incomplete = seq.finish == "length"
        return self.response("incomplete" if incomplete else "completed", [self._item(seq, True)],
                             self.usage(usage), kv_params, incomplete)

    def body(self, seqs: list[Seq], usage: Usage, kv_params: dict[str, Any] | None) -> bytes:
        """The ``response`` object as the JSON answer."""
        return orjson.dumps(self._final(seqs, usage, kv_params))


def new_writer(parsed: ParsedRequest) -> ResponsesWriter:
    """The writer of a parsed Responses request."""
    return ResponsesWriter(parsed, parsed.model, int(time.time()))
