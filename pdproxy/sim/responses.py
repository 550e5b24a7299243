"""Response bodies and SSE events shaped like vLLM's OpenAI server (reference §2.3).

* Completion chunk: ``{"id","object":"text_completion","created","model","choices":[{"index":0,"text",
  "logprobs":null,"finish_reason","stop_reason","prompt_token_ids":null,"token_ids":null}]}``.
* Chat: first chunk ``delta {"role":"assistant","content":""}``, then ``delta.content`` (or
  ``delta.tool_calls``) chunks. The chunk carrying the last token has ``finish_reason`` and ``stop_reason``.
* Usage chunk (only with ``stream_options.include_usage``): ``choices: []`` plus ``usage`` with
  ``prompt_tokens_details.cached_tokens``; then ``data: [DONE]``.

Exact shapes are vLLM 0.32's as captured (``tests/real_vllm/captures/``, checked by
``tests/real_vllm/test_sim_contract.py``): compact JSON events (``{"id":...}``); chat's role chunk carries
top-level ``prompt_token_ids``/``prompt_text`` (null); every chat choice chunk has ``token_ids: null``; the
last JSON event of a stream (the usage chunk, else the finishing chunk) carries ``system_fingerprint``
(``"vllm-<version>-<8 hex>"``); usage in a stream drops null details (``{"cached_tokens": 0}``, chat adds
``"created_cache_tokens": 0``) while a JSON body keeps them and adds ``completion_tokens_details: null``;
JSON bodies carry ``routed_experts``, ``ec_transfer_params`` and ``metrics`` as null. The mid-stream error
event alone is written by ``json.dumps`` (``{"error": {"message": ...}}``, with spaces).

Generated text: output token ``i`` is the word ``_WORDS[(offset + i) % len]``. Each word is exactly one
SimTokenizer token, so ``completion_tokens`` agrees with a re-tokenization. Some words are multi-byte
UTF-8 (``" naïve"``, ``" 世界"``), so relays must handle characters split across reads.

Tool calls (``tools`` given, ``tool_choice`` not ``"none"``): the called function is the named one in
``tool_choice``, else the first tool. Its ``arguments`` JSON is built from the schema's required properties
and streamed in 4-character pieces, one piece per output token. ``finish_reason`` is ``"tool_calls"``.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import orjson

from pdproxy.sim.protocol import ParsedRequest

_WORDS = (" Hello", " from", " the", " simulated", " engine", " naïve", " token", " stream", " 世界", " café",
          " prefill", " decode", " block", " cache", " step", " done")
_EXAMPLE_BY_TYPE: Mapping[str, Any] = MappingProxyType({"string": "sim", "integer": 1, "number": 1.5,
                                                        "boolean": True, "array": (), "object": None, "null": None})
DONE = b"data: [DONE]\n\n"


def tool_call_arguments(tool: dict[str, Any]) -> str:
    """A JSON string of arguments satisfying the tool schema's required properties (example values)."""
    params = (tool.get("function") or {}).get("parameters") or {}
    props = params.get("properties") or {}
    required = params.get("required") or list(props)
    args: dict[str, Any] = {}
    for name in required:
        spec = props.get(name) or {}
        if spec.get("enum"):
            args[name] = spec["enum"][0]
        else:
            kind = spec.get("type", "string")
            value = _EXAMPLE_BY_TYPE.get(kind if isinstance(kind, str) else "string", "sim")
            args[name] = [] if kind == "array" else {} if kind == "object" else value
    return orjson.dumps(args).decode()


def choose_tool(tools: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any]:
    """The tool a tool-calling answer calls: ``tool_choice``'s named function, else the first tool."""
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name")
        for tool in tools:
            if (tool.get("function") or {}).get("name") == wanted:
                return tool
    return tools[0]


class ResponseWriter:
    """Builds the bytes of one request's answer (SSE events or the JSON body). Token counts are tokens.

    ``fingerprint`` is the ``system_fingerprint`` value (``"vllm-<version>-<8 hex>"``).
    """

    def __init__(self, req: ParsedRequest, model: str, created: int, word_offset: int,
                 fingerprint: str | None = None) -> None:
        self.req = req
        self.model = model
        self.created = created
        self.offset = word_offset
        self.fingerprint = fingerprint
        self.tool_name: str | None = None
        self.tool_pieces: list[str] = []
        self.tool_id = f"chatcmpl-tool-{secrets.token_hex(16)}"
        if req.tools:
            tool = choose_tool(req.tools, req.tool_choice)
            self.tool_name = str((tool.get("function") or {}).get("name", "tool"))
            args = tool_call_arguments(tool)
            self.tool_pieces = [args[i:i + 4] for i in range(0, len(args), 4)] or [""]
        self._head = {"id": req.response_id,
                      "object": "chat.completion.chunk" if req.api == "chat" else "text_completion",
                      "created": created, "model": model}

    @property
    def natural_length(self) -> int | None:
        """Output tokens after which the answer ends by itself ("stop"), or None for plain text."""
        return len(self.tool_pieces) if self.tool_name else None

    def text(self, start: int, end: int) -> str:
        """The text of output tokens ``[start, end)``."""
        if self.tool_name:
            return "".join(self.tool_pieces[start:end])
        words, off = _WORDS, self.offset
        return "".join(words[(off + i) % len(words)] for i in range(start, end))

    def public_finish_reason(self, finish_reason: str | None) -> str | None:
        """``stop`` becomes ``tool_calls`` for a tool-calling answer."""
        if finish_reason == "stop" and self.tool_name:
            return "tool_calls"
        return finish_reason

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
              stream: bool = False) -> dict[str, Any]:
        """OpenAI/vLLM usage with ``prompt_tokens_details.cached_tokens`` (JSON-body form, or the stream form
        without null details when ``stream``)."""
        details: dict[str, Any] = {"cached_tokens": max(cached_tokens, 0),
                                   "created_cache_tokens": 0 if self.req.api == "chat" else None,
                                   "multimodal_tokens": None}
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                                 "completion_tokens": completion_tokens}
        if stream:
            usage["prompt_tokens_details"] = {k: v for k, v in details.items() if v is not None}
        else:
            usage["prompt_tokens_details"] = details
            usage["completion_tokens_details"] = None
        return usage

    # ---- streaming ----------------------------------------------------------------------------------------
    def role_event(self) -> bytes:
        """Chat's first chunk (``delta.role``), sent with the first output; completions have none (b"")."""
        if self.req.api != "chat":
            return b""
        return self._event({**self._head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}],
                            "prompt_token_ids": None, "prompt_text": None})

    def token_event(self, start: int, end: int, finish_reason: str | None = None, stop_reason: Any = None,
                    usage: dict[str, Any] | None = None, last: bool = False) -> bytes:
        """One SSE event carrying output tokens ``[start, end)`` (vLLM merges tokens when the client lags).
        ``last``: no usage chunk follows, so this event carries ``system_fingerprint``."""
        finish = self.public_finish_reason(finish_reason)
        text = self.text(start, end)
        if self.req.api == "chat":
            if self.tool_name:
                call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
                if start == 0:
                    call = {"id": self.tool_id, "type": "function", "index": 0,
                            "function": {"name": self.tool_name, "arguments": text}}
                delta: dict[str, Any] = {"tool_calls": [call]} if end > start or start == 0 else {}
            else:
                delta = {"content": text} if end > start else {}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = stop_reason
            choice["token_ids"] = None
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                      "stop_reason": stop_reason, "prompt_token_ids": None, "token_ids": None}
        chunk: dict[str, Any] = {**self._head, "choices": [choice]}
        if usage is not None:
            chunk["usage"] = usage
        if last:
            chunk["system_fingerprint"] = self.fingerprint
        return self._event(chunk)

    def usage_event(self, usage: dict[str, Any]) -> bytes:
        """The final ``choices: []`` usage chunk (it carries ``system_fingerprint``)."""
        return self._event({**self._head, "choices": [], "usage": usage, "system_fingerprint": self.fingerprint})

    @staticmethod
    def error_event(message: str, error_type: str, code: int) -> bytes:
        """A mid-stream error chunk ``data: {"error": {...}}`` (vLLM sends ``data: [DONE]`` after it). vLLM writes
        this one with ``json.dumps``, so it has spaces after ``:`` and ``,`` unlike the other events."""
        body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    @staticmethod
    def _event(obj: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    # ---- non-streaming --------------------------------------------------------------------------------------
    def json_body(self, completion_tokens: int, finish_reason: str | None, stop_reason: Any,
                  usage: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> bytes:
        """The full JSON response, with vLLM's top-level ``kv_transfer_params`` (null unless pinned)."""
        finish = self.public_finish_reason(finish_reason)
        text = self.text(0, completion_tokens)
        if self.req.api == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                       "audio": None, "function_call": None}
            if self.tool_name:
                message["content"] = None
                message["tool_calls"] = [{"id": self.tool_id, "type": "function",
                                          "function": {"name": self.tool_name, "arguments": text}}]
            message["reasoning"] = None
            body: dict[str, Any] = {
                "id": self.req.response_id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish,
                             "stop_reason": stop_reason, "token_ids": None, "routed_experts": None}],
                "service_tier": None, "system_fingerprint": self.fingerprint, "usage": usage,
                "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
                "kv_transfer_params": kv_transfer_params, "ec_transfer_params": None, "metrics": None}
        else:
            body = {
                "id": self.req.response_id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                             "stop_reason": stop_reason, "token_ids": None, "prompt_logprobs": None,
                             "prompt_token_ids": None, "routed_experts": None}],
                "service_tier": None, "system_fingerprint": self.fingerprint, "usage": usage,
                "kv_transfer_params": kv_transfer_params, "ec_transfer_params": None, "metrics": None}
        return orjson.dumps(body)
