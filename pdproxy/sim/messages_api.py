"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API as vLLM 0.32 serves it
(``vllm/entrypoints/anthropic/protocol.py``, ``serving.py``, ``api_router.py``; shapes as captured in
``tests/real_vllm/captures/apis/``).

vLLM turns a Messages request into a chat completion (``AnthropicServingMessages.to_chat_completion_request``):
``system`` becomes a leading system message, content blocks become chat content / ``tool_calls`` / tool
messages, ``max_tokens`` (required, > 0) becomes ``max_tokens`` *and* ``max_completion_tokens``,
``stop_sequences`` becomes ``stop``, ``tool_choice`` ``auto``/``any``/``tool``/``none`` becomes
``auto``/``required``/named/``none``, ``output_config.format`` becomes ``response_format``; a stream asks for
``include_usage`` and ``continuous_usage_stats``. So the prompt, the validation and the tool flags are chat's.

Errors: a body pydantic rejects (``max_tokens`` missing or ≤ 0, a role other than user/assistant/system) gets the
*OpenAI* envelope with ``type "Bad Request"`` (vLLM's global validation handler runs before the Anthropic
router); errors raised while serving (unknown model 404, ``temperature`` out of range, tool flags) get the
Anthropic envelope ``{"type": "error", "error": {"type", "message"}}``.

JSON answer (``exclude_none``): ``{id: "chatcmpl-<X-Request-Id>", type: "message", role: "assistant", content:
[{type: "text", text} | {type: "tool_use", id, name, input}], model, stop_reason: end_turn | max_tokens |
stop_sequence | tool_use, [stop_sequence], usage: {input_tokens, output_tokens, cache_creation_input_tokens,
cache_read_input_tokens}, [kv_transfer_params]}``. ``input_tokens`` excludes cached and cache-written tokens
(``prompt - cache_read - cache_creation``, ``_build_anthropic_usage``).

Stream (``event: <type>\\ndata: <json>\\n\\n``): ``message_start`` (with the first token; its usage is
``{input_tokens: prompt, output_tokens: 0}``), ``content_block_start``, ``content_block_delta`` (``text_delta`` /
``input_json_delta``) per engine step, ``content_block_stop``, ``message_delta`` (``stop_reason`` and the full
usage), ``message_stop``. No ``data: [DONE]``, and never ``kv_transfer_params``: a prefill leg must not stream.
"""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

import orjson

from pdproxy.sim import validation as v
from pdproxy.sim.errors import SimHTTPError
from pdproxy.sim.generation import Seq, Usage
from pdproxy.sim.protocol import ParsedRequest, check_length, check_output_limit, decode_body, tool_plan
from pdproxy.tokens import Tokenizer, prompt_token_ids

if TYPE_CHECKING:
    from pdproxy.sim.config import SimConfig
    from pdproxy.sim.models import ModelRegistry

_ROLES = ("user", "assistant", "system")
_FAILURE_MESSAGE = (
    "2 validation errors for ChatCompletionStreamResponse\nmodel\n  Field required [type=missing, input_value="
    "{'error': {'message': 'In...am': None, 'code': 500}}, input_type=dict]\n    For further information visit "
    "https://errors.pydantic.dev/2.14/v/missing\nchoices\n  Field required [type=missing, input_value={'error': "
    "{'message': 'In...am': None, 'code': 500}}, input_type=dict]\n    For further information visit "
    "https://errors.pydantic.dev/2.14/v/missing")


def _check_messages(body: dict[str, Any], key: str = "messages") -> list[dict[str, Any]]:
    messages = body.get(key)
    if messages is None:
        raise v.missing(key, body)
    if not isinstance(messages, list):
        raise v.pydantic_error("list_type", key, "Input should be a valid list", messages)
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise v.pydantic_error("model_type", f"{key}.{i}", "Input should be a valid dictionary or instance of "
                                   "AnthropicMessage", message)
        role = message.get("role")
        if role not in _ROLES:
            expected = "'user', 'assistant' or 'system'"
            if role is None:
                raise v.missing(f"{key}.{i}.role", message)
            raise v.pydantic_error("literal_error", f"{key}.{i}.role", f"Input should be {expected}", role,
                                   {"expected": expected})
        if "content" not in message:
            raise v.missing(f"{key}.{i}.content", message)
        _check_content(message["content"], f"{key}.{i}.content")
    return messages


def _check_tools(tools: Any) -> None:
    """``AnthropicTool``: ``name`` a string and ``input_schema`` an object (pydantic's first error only)."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise v.pydantic_error("list_type", "tools", "Input should be a valid list", tools)
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise v.pydantic_error("model_type", f"tools.{i}", "Input should be a valid dictionary or instance of "
                                   "AnthropicTool", tool)
        if not isinstance(tool.get("name"), str):
            raise v.missing(f"tools.{i}.name", tool) if "name" not in tool else v.pydantic_error(
                "string_type", f"tools.{i}.name", "Input should be a valid string", tool["name"])
        if not isinstance(tool.get("input_schema"), dict):
            raise v.missing(f"tools.{i}.input_schema", tool) if "input_schema" not in tool else v.pydantic_error(
                "dict_type", f"tools.{i}.input_schema", "Input should be a valid dictionary", tool["input_schema"])


BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking",
               "tool_addition", "tool_removal")
"""``AnthropicContentBlock.type``'s literal (vLLM 0.32 ``vllm/entrypoints/anthropic/protocol.py``)."""
_BLOCK_WORDS = ", ".join(f"'{t}'" for t in BLOCK_TYPES[:-1]) + f" or '{BLOCK_TYPES[-1]}'"
_MISSING: Any = object()


def _check_content(content: Any, loc: str) -> None:
    """``AnthropicMessage.content`` (``str | list[AnthropicContentBlock]``) and each block's ``content``
    (``str | list[dict] | None``), as pydantic refuses them (its first error only)."""
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise v.pydantic_error("string_type", f"{loc}.str", "Input should be a valid string", content)
    for j, block in enumerate(content):
        where = f"{loc}.list[AnthropicContentBlock].{j}"
        if not isinstance(block, dict):
            raise v.pydantic_error("model_type", where, "Input should be a valid dictionary or instance of "
                                   "AnthropicContentBlock", block)
        kind = block.get("type", _MISSING)
        if kind is _MISSING:
            raise v.missing(f"{where}.type", block)
        if not isinstance(kind, str) or kind not in BLOCK_TYPES:
            raise v.pydantic_error("literal_error", f"{where}.type", f"Input should be {_BLOCK_WORDS}", kind,
                                   {"expected": _BLOCK_WORDS})
        inner = block.get("content")
        if inner is not None and not isinstance(inner, str) and not (
                isinstance(inner, list) and all(isinstance(x, dict) for x in inner)):
            raise v.pydantic_error("string_type", f"{where}.content.str", "Input should be a valid string", inner)


def _blocks_text(blocks: Any) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        return ""
    return "".join(str(b.get("text", "")) for b in blocks if isinstance(b, dict) and b.get("type") == "text"
                   and not str(b.get("text", "")).startswith("x-anthropic-billing-header"))


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion body vLLM renders for a Messages (or count_tokens) request (see the module
    docstring)."""
    messages: list[dict[str, Any]] = []
    system = _blocks_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for message in body.get("messages") or []:
        role, content = message["role"], message.get("content")
        if role == "system":
            text = _blocks_text(content)
            if text:
                messages.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for block in content or []:
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "text" and block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image":
                parts.append({"type": "image_url", "image_url": {"url": "data:image/png;base64,"}})
            elif kind == "tool_use":
                calls.append({"id": block.get("id") or "call", "type": "function", "function": {
                    "name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and role == "user":
                messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                                 "content": _blocks_text(block.get("content"))})
        out: dict[str, Any] = {"role": role}
        if calls:
            out["tool_calls"] = calls
        if parts:
            out["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
        if role == "user" and "content" not in out:
            continue
        messages.append(out)
    chat: dict[str, Any] = {"messages": messages}
    tools = body.get("tools")
    if isinstance(tools, list) and tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.get("name"), "description": t.get("description"),
            "parameters": {"type": "object", **(t.get("input_schema") or {})}}} for t in tools if isinstance(t, dict)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = str(choice.get("type"))
        mapped: Any = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
        chat["tool_choice"] = mapped or {"type": "function", "function": {"name": choice.get("name")}}
    elif chat.get("tools"):
        chat["tool_choice"] = "auto"
    return chat


def count_prompt(tokenizer: Tokenizer, chat: dict[str, Any]) -> list[int]:
    """The prompt token ids of the converted chat request."""
    try:
        return prompt_token_ids(tokenizer, chat, "chat")
    except ValueError as exc:
        raise SimHTTPError(400, str(exc)) from None


def parse_messages(raw: Any, headers: Any, config: SimConfig, tokenizer: Tokenizer,
                   models: ModelRegistry) -> ParsedRequest:
    """Validate a Messages request (the module docstring); raises :class:`SimHTTPError`."""
    body = decode_body(raw)
    if body.get("model") is None:
        raise v.missing("model", body)
    _check_messages(body)
    if body.get("system") is not None:                     # str | list[AnthropicContentBlock] | None
        _check_content(body["system"], "system")
    _check_tools(body.get("tools"))
    if "max_tokens" not in body:
        raise v.missing("max_tokens", body)
    max_tokens = v.get_int(body, "max_tokens")
    if max_tokens is None or max_tokens <= 0:
        raise v.pydantic_error("value_error", "max_tokens", "Value error, max_tokens must be positive",
                               body.get("max_tokens"), {"error": ValueError("max_tokens must be positive")})
    thinking = body.get("thinking")
    remote_decode = isinstance(body.get("kv_transfer_params"), dict) and body["kv_transfer_params"].get(
        "do_remote_decode")
    if isinstance(thinking, dict) and thinking.get("type") == "enabled":     # AnthropicThinkingConfigEnabled
        where = "thinking.enabled.budget_tokens"
        budget = v.get_int(thinking, "budget_tokens", where)
        if budget is None:
            raise v.missing(where, thinking)
        if budget < 1024:                                                    # Field(ge=1024): every leg
            raise v.pydantic_error("greater_than_equal", where, "Input should be greater than or equal to 1024",
                                   thinking.get("budget_tokens"), {"ge": 1024})
    if isinstance(thinking, dict) and thinking.get("type") == "enabled" and not remote_decode:
        budget = v.get_int(thinking, "budget_tokens") or 0
        if budget >= max_tokens:
            raise SimHTTPError(400, "1 validation error:\n  " + repr({
                "type": "value_error", "loc": "body", "msg": "Value error, thinking.budget_tokens must be less than "
                "max_tokens", "input": v.summarize_input(body),
                "ctx": {"error": ValueError("thinking.budget_tokens must be less than max_tokens")}}),
                "Bad Request", "body")
    stream = v.get_bool(body, "stream")
    fields = v.read_sampling(body, "messages")
    model = models.resolve(body.get("model"))
    chat = chat_request(body)
    mode, name, schema = tool_plan(chat.get("tools"), chat.get("tool_choice"), config)
    structured = None
    output_config = body.get("output_config")
    fmt = output_config.get("format") if isinstance(output_config, dict) else None
    if isinstance(fmt, dict) and isinstance(fmt.get("schema"), dict):
        structured = v.Structured("json", fmt["schema"])
    check_output_limit(max_tokens, config.max_model_len, "max_tokens")
    ids = count_prompt(tokenizer, chat)
    limit = check_length(len(ids), max_tokens, config.max_model_len, clamp=config.max_tokens_overflow == "clamp")
    spec = fields.verify(limit)
    base = str(headers.get("X-Request-Id") or secrets.token_hex(8))
    return ParsedRequest(
        api="messages", body=body, base_id=base, response_id=f"chatcmpl-{base}", stream=stream,
        include_usage=stream, continuous_usage=stream, prompt_token_ids=ids, max_tokens=limit, min_tokens=0,
        kv_transfer_params=body.get("kv_transfer_params"), tools=chat.get("tools") if mode else None,
        tool_choice=chat.get("tool_choice"), sampling=spec, model=model, tool_mode=mode, tool_name=name,
        tool_schema=schema, structured=structured if mode is None else None)


def parse_count_tokens(raw: Any, tokenizer: Tokenizer, models: ModelRegistry) -> dict[str, Any]:
    """The ``/v1/messages/count_tokens`` answer ``{"input_tokens", "context_management":
    {"original_input_tokens"}}``; raises :class:`SimHTTPError`."""
    body = decode_body(raw)
    if body.get("model") is None:
        raise v.missing("model", body)
    _check_messages(body)
    models.resolve(body.get("model"))
    count = len(count_prompt(tokenizer, chat_request(body)))
    return {"input_tokens": count, "context_management": {"original_input_tokens": count}}


class MessagesWriter:
    """The JSON body and SSE events of one Messages request (see the module docstring)."""

    done = b""
    include_usage = True
    continuous_usage = False

    def __init__(self, req: ParsedRequest, model: str) -> None:
        self.req = req
        self.model = model
        self.tool_id = f"chatcmpl-tool-{secrets.token_hex(8)}"
        self._opened = False
        self._started = False

    @staticmethod
    def usage(figures: Usage) -> dict[str, Any]:
        """Anthropic usage: ``input_tokens`` net of cache reads and writes."""
        return {"input_tokens": max(figures.prompt - figures.cached - figures.created, 0),
                "output_tokens": figures.completion, "cache_creation_input_tokens": figures.created,
                "cache_read_input_tokens": max(figures.cached, 0)}

    def stop(self, seq: Seq) -> tuple[str | None, str | None]:
        """``(stop_reason, stop_sequence)`` (``_to_anthropic_stop_reason``)."""
        if seq.finish == "length":
            return "max_tokens", None
        if seq.finish not in ("stop", "tool_calls"):
            return None, None
        if self.req.tool_mode is not None:
            return "tool_use", None
        if isinstance(seq.reason, str) and seq.reason != "recomputed":
            return "stop_sequence", seq.reason
        return "end_turn", None

    @staticmethod
    def _event(kind: str, payload: dict[str, Any]) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def _start(self, prompt_tokens: int) -> bytes:
        self._started = True
        return self._event("message_start", {"type": "message_start", "message": {
            "id": self.req.response_id, "type": "message", "role": "assistant", "content": [], "model": self.model,
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})

    def opening(self, seq: Seq) -> list[bytes]:
        """``message_start``, with the first token."""
        seq.started = True
        return [self._start(len(seq.ereq.prompt_token_ids))]

    def head(self) -> list[bytes]:
        """Nothing: ``message_start`` goes with the first token."""
        return []

    def output(self, seq: Seq, start: int, end: int, finish: str | None, stop_reason: Any,
               usage: Usage | None, last: bool) -> list[bytes]:
        """``message_start`` + ``content_block_start`` with the first token, then deltas."""
        tool = self.req.tool_mode is not None
        events: list[bytes] = [] if seq.started else self.opening(seq)
        text = seq.plan.text(start, end)
        if (text or tool) and end > start and not self._opened:
            self._opened = True
            block: dict[str, Any] = ({"type": "tool_use", "id": self.tool_id, "name": self.req.tool_name,
                                      "input": {}} if tool else {"type": "text", "text": ""})
            events.append(self._event("content_block_start", {"type": "content_block_start",
                                                              "content_block": block, "index": 0}))
        if text:
            delta = ({"type": "input_json_delta", "partial_json": text} if tool
                     else {"type": "text_delta", "text": text})
            events.append(self._event("content_block_delta", {"type": "content_block_delta", "delta": delta,
                                                              "index": 0}))
        return events

    def tail(self, seqs: list[Seq], usage: Usage, kv_params: dict[str, Any] | None) -> list[bytes]:
        """``content_block_stop`` (when a block was opened), ``message_delta`` with the usage, ``message_stop``."""
        seq = seqs[0]
        reason, sequence = self.stop(seq)
        events = []
        if self._opened:
            events.append(self._event("content_block_stop", {"type": "content_block_stop", "index": 0}))
        events.append(self._event("message_delta", {"type": "message_delta", "delta": {
            "stop_reason": reason, "stop_sequence": sequence}, "usage": self.usage(usage)}))
        events.append(self._event("message_stop", {"type": "message_stop"}))
        return events

    def failure(self) -> list[bytes]:
        """A failed KV load mid-stream, as vLLM 0.32 streams it: ``message_start`` (its role chunk), then an
        ``error`` event whose message is the pydantic error of parsing the chat error chunk as a stream chunk;
        no ``message_stop`` (``tests/real_vllm/captures/apis/decode_bad_remote_messages_stream.json``)."""
        events = [] if self._started else [self._start(len(self.req.prompt_token_ids))]
        return [*events, self._event("error", {"type": "error", "error": {"type": "internal_error",
                                                                          "message": _FAILURE_MESSAGE}})]

    @staticmethod
    def failure_body() -> tuple[int, bytes]:
        """The 500 of a non-streaming request whose KV pull failed, in the Anthropic envelope."""
        return 500, SimHTTPError(500, "Internal server error", "InternalServerError").anthropic_body()

    def body(self, seqs: list[Seq], usage: Usage, kv_params: dict[str, Any] | None) -> bytes:
        """The message object (``messages_full_converter``, serialized without nulls)."""
        seq = seqs[0]
        text = seq.plan.text(0, seq.sent)
        content: list[dict[str, Any]] = []
        if self.req.tool_mode is not None:
            try:
                arguments = json.loads(text)
            except ValueError:
                arguments = {}
            content.append({"type": "tool_use", "id": self.tool_id, "name": self.req.tool_name,
                            "input": arguments if isinstance(arguments, dict) else {}})
        elif text:
            content.append({"type": "text", "text": text})
        if not content:
            content.append({"type": "text", "text": ""})
        reason, sequence = self.stop(seq)
        out: dict[str, Any] = {"id": self.req.response_id, "type": "message", "role": "assistant",
                               "content": content, "model": self.model}
        if reason is not None:
            out["stop_reason"] = reason
        if sequence is not None:
            out["stop_sequence"] = sequence
        out["usage"] = self.usage(usage)
        if kv_params is not None:
            out["kv_transfer_params"] = kv_params
        return orjson.dumps(out)
