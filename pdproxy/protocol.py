"""The OpenAI-compatible wire view (vLLM's name for it): parse and validate a client body, patch usage.

Request bodies stay dicts plus a small typed view (:class:`ProxyRequest`); the raw bytes are kept so that the
decode leg can forward them unchanged (see ``kv_transfer.decode_body_bytes``).  Validation mirrors vLLM's
(``entrypoints/openai/completion/protocol.py`` and ``chat_completion/protocol.py``) for what would otherwise
fail only after a prefill has been spent: the decoder gets the original body, the prefiller a rewritten one.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from pdproxy.errors import BadRequest


class Api(enum.StrEnum):
    """Which OpenAI endpoint a request came in on (value = the path on the engines)."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"

    @property
    def label(self) -> str:
        """Short name for logs and metrics: ``"chat"`` or ``"completions"``."""
        return "chat" if self is Api.CHAT else "completions"


@dataclass(slots=True)
class ProxyRequest:
    """A validated client request.

    ``body``: the parsed JSON object (never mutated); ``raw``: its bytes as received; ``max_output_tokens``:
    ``max_completion_tokens`` or ``max_tokens`` (chat gives the former precedence,
    ``chat_completion/protocol.py::build_tok_params``), None when the client left it to the engine;
    ``prompt_tokens``: filled in by admission (tokens), None until counted.
    """

    api: Api
    body: dict[str, Any]
    raw: bytes
    stream: bool
    include_usage: bool
    model: str | None
    max_output_tokens: int | None
    prompt_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_param(self) -> str:
        """The request field holding the prompt (``"messages"`` or ``"prompt"``), used as an error's ``param``."""
        return "messages" if self.api is Api.CHAT else "prompt"


def _positive_int(body: dict[str, Any], key: str, minimum: int = 1) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{key}' must be an integer", param=key)
    if value < minimum:
        raise BadRequest(f"'{key}' must be at least {minimum}, got {value}", param=key)
    return value


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _is_single_prompt(prompt: Any) -> bool:
    """True for a str, a flat list of token ids, or a one-element list of either (vLLM: one sequence)."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return True
    return isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or _is_token_ids(prompt[0]))


def parse_request(raw: bytes, api: Api) -> ProxyRequest:
    """Parse and validate a client body.

    Raises :class:`BadRequest` (HTTP 400, vLLM envelope) for: bad JSON, a non-object, missing ``messages`` /
    ``prompt``, ``max_tokens`` / ``max_completion_tokens`` < 1, ``n`` > 1 or a list of prompts (one
    ``kv_transfer_params`` handle covers one sequence, reference §1.2), ``echo`` / ``prompt_logprobs`` (the
    decoder never ran the prompt), ``stream_options`` without ``stream`` and ``min_tokens > max_tokens``
    (vLLM's own 400s, which the decoder would otherwise give only after the prefill).
    """
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", param="body") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")

    if api is Api.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' is required and must be a non-empty list", param="messages")
        if not all(isinstance(m, dict) for m in messages):
            raise BadRequest("each entry of 'messages' must be an object", param="messages")
    else:
        if "prompt" not in body or body["prompt"] is None or body["prompt"] == "":
            raise BadRequest("'prompt' is required", param="prompt")
        if not _is_single_prompt(body["prompt"]):
            raise BadRequest(
                "a list of several prompts cannot be served through PD disaggregation as one request "
                "(one kv_transfer_params handle covers one sequence); send one prompt per request",
                param="prompt")

    max_tokens = _positive_int(body, "max_tokens")
    max_completion_tokens = _positive_int(body, "max_completion_tokens")
    n = _positive_int(body, "n")
    if n is not None and n > 1:
        raise BadRequest("n > 1 cannot be served through PD disaggregation (one kv_transfer_params handle per "
                         "sequence); send n separate requests", param="n")
    if body.get("echo"):
        raise BadRequest("'echo' is not supported through PD disaggregation: the decoder never runs the prompt",
                         param="echo")
    if body.get("prompt_logprobs") is not None:
        raise BadRequest("'prompt_logprobs' is not supported through PD disaggregation: the decoder never runs "
                         "the prompt", param="prompt_logprobs")

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object such as {\"include_usage\": true}",
                         param="stream_options")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise BadRequest("'tools' must be a list of tool objects", param="tools")
    if stream_options and not stream:
        # vLLM's wording, completion/protocol.py::validate_stream_options
        raise BadRequest("Stream options can only be defined when `stream=True`.", param="stream_options")
    include_usage = bool(stream_options.get("include_usage")) if isinstance(stream_options, dict) else False

    max_output = max_completion_tokens if max_completion_tokens is not None else max_tokens
    min_tokens = _positive_int(body, "min_tokens", minimum=0)
    if min_tokens is not None and max_output is not None and min_tokens > max_output:
        raise BadRequest(f"min_tokens ({min_tokens}) must be less than or equal to max_tokens ({max_output})",
                         param="min_tokens")
    model = body.get("model")
    return ProxyRequest(api=api, body=body, raw=raw, stream=stream, include_usage=include_usage,
                        model=model if isinstance(model, str) else None, max_output_tokens=max_output)


_COMPLETION_TOKENS_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


def completion_tokens_in(data: bytes) -> int | None:
    """The last ``usage.completion_tokens`` figure in a JSON document or a block of SSE events, without parsing
    (one regex scan; callers check ``b'"completion_tokens"' in data`` first).  None when absent."""
    found = _COMPLETION_TOKENS_RE.findall(data)
    return int(found[-1]) if found else None


def patch_usage(obj: dict[str, Any], cached_tokens: int | None) -> bool:
    """Set ``usage.prompt_tokens_details.cached_tokens`` to the prefiller's value in a response or chunk dict.

    Returns True if ``obj`` had a usage object (and was changed in place).  ``cached_tokens=None`` leaves the
    decoder's figure alone.
    """
    usage = obj.get("usage")
    if not isinstance(usage, dict) or cached_tokens is None:
        return False
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = {}
        usage["prompt_tokens_details"] = details
    details["cached_tokens"] = cached_tokens
    return True


def patch_usage_bytes(data: bytes, cached_tokens: int | None) -> bytes:
    """:func:`patch_usage` on a JSON document's bytes; returns ``data`` unchanged when there is nothing to do."""
    if cached_tokens is None or b'"usage"' not in data:
        return data
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    if not isinstance(obj, dict) or not patch_usage(obj, cached_tokens):
        return data
    return orjson.dumps(obj)
