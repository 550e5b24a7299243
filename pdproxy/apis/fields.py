"""The OpenAI Responses and Anthropic Messages requests: what pdproxy checks itself, and their prompt as a chat.

Both APIs are chat completions underneath in vLLM 0.32 (docs/apis-through-pd.md):

- ``POST /v1/responses`` (``vllm/entrypoints/openai/responses/protocol.py::ResponsesRequest``): the prompt is the
  chat template applied to ``instructions`` (a leading system message) and ``input`` (a string = one user
  message, or a list of items: messages with ``input_text`` / ``output_text`` / ``input_image`` parts,
  ``function_call``, ``function_call_output``, reasoning), with ``tools`` rendered as chat tools
  (``responses/utils.py::construct_input_messages``, ``construct_chat_messages_with_tool_call``,
  ``construct_tool_dicts``), encoded *with* the tokenizer's special tokens; the output limit is
  ``max_output_tokens``;
- ``POST /v1/messages`` (``vllm/entrypoints/anthropic/protocol.py::AnthropicMessagesRequest``): ``system`` becomes a
  leading system message, ``messages`` keep their roles (``tool_use`` blocks become ``tool_calls``, a user's
  ``tool_result`` a ``tool`` message, images media parts), ``tools`` chat tools of their ``input_schema``
  (``anthropic/serving.py::to_chat_completion_request``); ``max_tokens`` is required and positive.

:func:`parse_responses` and :func:`parse_messages` check what would otherwise fail only after a prefill was spent
(the required fields and their types) and return a :class:`~pdproxy.apis.request.ProxyRequest`;
:func:`chat_view` gives the chat body admission counts (:mod:`pdproxy.admission.bounds`, :mod:`pdproxy.admission.count`).
Everything else is the engines' to judge: the prefill leg carries the client's fields and a 4xx from the prefiller
reaches the client as is.
"""

from __future__ import annotations

import json
from itertools import chain, repeat
from typing import Any

from pydantic import TypeAdapter, ValidationError

from pdproxy.errors import BadRequest

MESSAGE_ROLES = ("user", "assistant", "system")
"""Roles ``AnthropicMessage.role`` accepts (``anthropic/protocol.py``)."""

_MISSING = object()
_OBJECT = frozenset({dict})
_ROLE_SET = frozenset(MESSAGE_ROLES)
_CONTENT_KINDS = frozenset({str, list})
_TEXT_PARTS = ("input_text", "output_text", "text")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image")
_LAX_BOOL: TypeAdapter[bool | None] = TypeAdapter(bool | None)
_LAX_INT: TypeAdapter[int | None] = TypeAdapter(int | None)
"""vLLM's models type ``stream`` ``bool | None`` and the output limits ``int``, read by pydantic in lax mode:
``"stream": "true"`` (or ``1``, ``"yes"``) streams, ``"max_tokens": "3"`` (or ``3.0``) is 3 — the same here."""


def _stream(body: dict[str, Any]) -> bool:
    try:
        return bool(_LAX_BOOL.validate_python(body.get("stream", False)))
    except ValidationError:
        raise BadRequest("'stream' must be a boolean", param="stream") from None


def _model(body: dict[str, Any], required: bool) -> str | None:
    model = body.get("model")
    if model is None and required:
        raise BadRequest("'model' is required", param="model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    return model


def _int(body: dict[str, Any], key: str) -> int | None:
    try:
        return _LAX_INT.validate_python(body.get(key))
    except ValidationError:
        raise BadRequest(f"'{key}' must be an integer", param=key) from None


def _tools(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("'tools' must be a list of tool objects", param="tools")


def responses_fields(body: dict[str, Any]) -> tuple[bool, str | None, int | None]:
    """``(stream, model, max_output_tokens)`` of a Responses body.

    Raises :class:`BadRequest` for a missing ``input`` (vLLM: pydantic's 400), an ``input`` that is neither a
    string nor a list, ``max_output_tokens`` < 1 (vLLM's words: "max_tokens must be at least 1, got 0."),
    ``background: true`` (a background response answers at once and is fetched later from the engine's store:
    there is no decode leg to run), a non-boolean ``stream``, bad ``tools``, a client's ``request_id`` past an
    ``X-Request-Id``'s bounds (:func:`_responses_request_id`)."""
    if "input" not in body or body["input"] is None:
        raise BadRequest("'input' is required", param="input")
    if not isinstance(body["input"], str | list):
        raise BadRequest("'input' must be a string or a list of input items", param="input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string", param="instructions")
    limit = _int(body, "max_output_tokens")
    if limit is not None and limit < 1:
        raise BadRequest(f"max_tokens must be at least 1, got {limit}. (parameter=max_tokens, value={limit})",
                         param="max_tokens")
    if body.get("background"):
        raise BadRequest("'background' responses cannot be served through PD disaggregation: they answer at once "
                         "and are fetched later from one engine's response store", param="background")
    _tools(body)
    _responses_request_id(body)
    return _stream(body), _model(body, False), limit


RESPONSES_REQUEST_ID_MAX = 96
"""The longest ``request_id`` a Responses client may name (as an ``X-Request-Id`` is cut to:
:data:`pdproxy.timeline.CLIENT_REQUEST_ID_MAX`); vLLM's own are ``resp_`` and 32 hex digits."""


def _responses_request_id(body: dict[str, Any]) -> None:
    """A client's own Responses ``request_id`` (a string) is passed to both engines as their request id — vLLM
    names the response, its engine request and the KV transfer after it, and logs it — so it must be what an
    ``X-Request-Id`` becomes: at most :data:`RESPONSES_REQUEST_ID_MAX` visible ASCII characters.  Raises
    :class:`BadRequest` otherwise (a newline in it reached both engines' logs, 100 KB of it was their request id).
    A value of another type (not null) is vLLM's 400 (``ResponsesRequest.request_id`` is a ``str``; pydantic does
    not read a number as one), in its words: pdproxy would otherwise name the legs ``resp_<id>`` in its place."""
    rid = body.get("request_id")
    if rid is not None and not isinstance(rid, str):
        shown = f"<{type(rid).__name__} of {len(rid)} items>" if isinstance(rid, list | dict) else str(rid)[:200]
        err = {"type": "string_type", "loc": "body.request_id", "msg": "Input should be a valid string",
               "input": shown}
        raise BadRequest.validation(err)
    if isinstance(rid, str) and (not rid or len(rid) > RESPONSES_REQUEST_ID_MAX
                                 or not (rid.isascii() and rid.isprintable()) or " " in rid):
        raise BadRequest(f"'request_id' must be 1 to {RESPONSES_REQUEST_ID_MAX} visible ASCII characters (no "
                         "spaces or control characters): it names the request on both engines", param="request_id")


def _plain_messages(messages: list[Any]) -> bool:
    """True when every message is an object with a role of :data:`MESSAGE_ROLES` and a ``content`` that is a
    string or a list of blocks (objects), checked in C (sets of types and roles: ~50 ns a message, where the loop
    of :func:`_message_fault` took ~270 ns); False: that loop says which is not."""
    if not set(map(type, messages)) <= _OBJECT:
        return False
    try:
        if not set(map(dict.get, messages, repeat("role"))) <= _ROLE_SET:
            return False
    except TypeError:                                   # an unhashable role
        return False
    contents = list(map(dict.get, messages, repeat("content"), repeat(_MISSING)))
    kinds = set(map(type, contents))
    if not kinds <= _CONTENT_KINDS:
        return False
    if list in kinds:
        return set(map(type, chain.from_iterable([c for c in contents if type(c) is list]))) <= _OBJECT
    return True


def _message_fault(messages: list[Any]) -> None:
    """Raise :class:`BadRequest` for the first message :func:`messages_fields` refuses (none: return)."""
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages.{i} must be an object", param=f"messages.{i}")
        if message.get("role") not in MESSAGE_ROLES:
            raise BadRequest(f"messages.{i}.role must be 'user', 'assistant' or 'system', got "
                             f"{message.get('role')!r}", param=f"messages.{i}.role")
        content = message.get("content", _MISSING)
        if content is _MISSING:
            raise BadRequest(f"messages.{i}.content is required", param=f"messages.{i}.content")
        if not (isinstance(content, str) or (isinstance(content, list) and set(map(type, content)) <= _OBJECT)):
            raise BadRequest(f"messages.{i}.content must be a string or a list of content blocks",
                             param=f"messages.{i}.content")


def messages_fields(body: dict[str, Any]) -> tuple[bool, str | None, int]:
    """``(stream, model, max_tokens)`` of an Anthropic Messages body.

    Raises :class:`BadRequest` (sent in the Anthropic error shape on that route) for a missing ``model``,
    ``messages`` that are not a non-empty list of objects with a role in :data:`MESSAGE_ROLES` and a ``content``
    that is a string or a list of blocks (objects: ``AnthropicMessage.content``),
    a missing or non-positive ``max_tokens``, a ``system`` that is neither a string nor a list of blocks, a
    non-boolean ``stream``, bad ``tools``."""
    model = _model(body, True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' is required and must be a non-empty list", param="messages")
    if not _plain_messages(messages):
        _message_fault(messages)
    if body.get("max_tokens") is None:
        raise BadRequest("'max_tokens' is required", param="max_tokens")
    max_tokens = _int(body, "max_tokens")
    if max_tokens is None or max_tokens < 1:
        raise BadRequest("max_tokens must be positive", param="max_tokens")
    system = body.get("system")
    if system is not None and not isinstance(system, str | list):
        raise BadRequest("'system' must be a string or a list of content blocks", param="system")
    _tools(body)
    return _stream(body), model, max_tokens


def messages_fault(body: dict[str, Any], max_tokens: int) -> BadRequest | None:
    """vLLM's one cross-field rule of a Messages body that its prefill leg skips: ``thinking.budget_tokens`` must be
    less than ``max_tokens`` (``anthropic/protocol.py::validate_thinking_budget``, not run on a leg with
    ``do_remote_decode``).  Returns vLLM's 400 for a valid budget (an integer ≥ 1024, pydantic's lax reading) that is
    not, else None: the request then goes to the prefiller with the client's own values
    (``ProxyRequest.engine_judges``), which refuses it in vLLM's words and order before any KV is computed — not
    to a one-token prefill whose KV the decoder would refuse to read.  An invalid budget (< 1024, not an integer)
    is every leg's field error: the prefiller says so."""
    thinking = body.get("thinking")
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return None
    try:
        budget = _LAX_INT.validate_python(thinking.get("budget_tokens"))
    except ValidationError:
        return None
    if budget is None or budget < 1024 or budget < max_tokens:
        return None
    err = {"type": "value_error", "loc": "body", "msg": "Value error, thinking.budget_tokens must be less than "
           "max_tokens", "input": f"<dict of {len(body)} items>",
           "ctx": {"error": "thinking.budget_tokens must be less than max_tokens"}}
    return BadRequest.validation(err)


# ------------------------------------------------------------------------------------------------ chat views
def _parts_of(content: Any) -> Any:
    """A Responses / Anthropic content value as chat content: a string stays, parts become chat text parts and
    media parts (one image part each)."""
    if isinstance(content, str) or content is None:
        return content or ""
    if not isinstance(content, list):
        return ""
    parts: list[dict[str, Any]] = []
    for part in content:
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind in _TEXT_PARTS and part.get("text"):
            parts.append({"type": "text", "text": str(part["text"])})
        elif kind in _MEDIA_PARTS:
            parts.append({"type": "image_url", "image_url": {"url": ""}})
    if len(parts) == 1 and parts[0]["type"] == "text":
        return parts[0]["text"]
    return parts


def responses_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body a Responses request renders (module docstring), for counting."""
    messages: list[dict[str, Any]] = []
    if isinstance(body.get("instructions"), str) and body["instructions"]:
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
    elif isinstance(items, list):
        for item in items:
            if not isinstance(item, dict):
                continue
            kind = item.get("type", "message")
            if kind in ("function_call", "custom_tool_call"):
                call = {"id": item.get("call_id", ""), "type": "function",
                        "function": {"name": item.get("name", ""),
                                     "arguments": item.get("arguments", item.get("input", ""))}}
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind in ("function_call_output", "custom_tool_call_output"):   # vLLM passes ``output`` as the
                output = item.get("output", "")          # tool message's content: a list stays parts (an image)
                messages.append({"role": "tool", "tool_call_id": item.get("call_id", ""),
                                 "content": _parts_of(output) if isinstance(output, list) else str(output)})
            elif kind == "reasoning":
                continue
            elif "role" in item:
                messages.append({"role": str(item["role"]), "content": _parts_of(item.get("content"))})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                               "parameters": t.get("parameters")}}
             for t in body.get("tools") or [] if isinstance(t, dict) and t.get("type", "function") == "function"]
    if tools and body.get("tool_choice") != "none":
        chat["tools"] = tools
    if isinstance(body.get("chat_template_kwargs"), dict):
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    return chat


def _system_text(blocks: Any) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        return ""
    return "".join(str(b.get("text") or "") for b in blocks if isinstance(b, dict) and b.get("type") == "text"
                   and not str(b.get("text") or "").startswith("x-anthropic-billing-header"))


def messages_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body a Messages (or count_tokens) request renders (module docstring), for counting."""
    messages: list[dict[str, Any]] = []
    system = _system_text(body.get("system"))
    if system:
        messages.append({"role": "system", "content": system})
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        role, content = message.get("role"), message.get("content")
        if role == "system":
            text = _system_text(content)
            if text:
                messages.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            continue
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for block in content if isinstance(content, list) else []:
            if not isinstance(block, dict):
                continue
            kind = block.get("type")
            if kind == "text" and block.get("text"):
                parts.append({"type": "text", "text": str(block["text"])})
            elif kind == "image":
                parts.append({"type": "image_url", "image_url": {"url": ""}})
            elif kind == "tool_use":
                calls.append({"id": block.get("id") or "", "type": "function", "function": {
                    "name": block.get("name") or "", "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result":
                result = block.get("content")
                text = result if isinstance(result, str) else "\n".join(
                    str(b.get("text", "")) for b in (result if isinstance(result, list) else ())
                    if isinstance(b, dict) and b.get("type") == "text")
                if role == "user":
                    messages.append({"role": "tool", "tool_call_id": block.get("tool_use_id") or "",
                                     "content": text})
                else:
                    parts.append({"type": "text", "text": f"Tool result: {text}"})
        out: dict[str, Any] = {"role": role}
        if calls:
            out["tool_calls"] = calls
        if parts:
            out["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
        if role == "user" and "content" not in out:
            continue
        messages.append(out)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    tools = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description"),
                                               "parameters": t.get("input_schema")}}
             for t in body.get("tools") or [] if isinstance(t, dict)]
    if tools:
        chat["tools"] = tools
    if isinstance(body.get("chat_template_kwargs"), dict):
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    return chat
