"""vLLM's request validation and error envelopes, as the simulator reproduces them.

Error envelope (``vllm/entrypoints/openai/engine/protocol.py::ErrorResponse``, reference §2.4):
``{"error": {"message", "type", "param", "code"}}``. Bodies as real vLLM 0.32 returned them (the captures in
``tests/real_vllm/captures/``; ``tests/real_vllm/test_sim_contract.py`` keeps the simulator to them):

* ``"BadRequestError"`` for ``ValueError``/``VLLMValidationError``; a validation error that names its field ends
  with ``(parameter=<field>)`` or ``(parameter=<field>, value=<v>)`` and sets ``param`` (``stream_options``,
  ``max_tokens``, ``input_tokens``). ``min_tokens`` errors have ``param: null``;
* ``"Bad Request"`` for pydantic request-model failures: ``"1 validation error:\n  {'type': 'int_parsing',
  'loc': 'body.max_tokens', 'msg': ..., 'input': ...}"`` with ``param`` = the dotted location;
* ``"NotFoundError"`` (404) for an unknown model: "The model `x` does not exist. Valid aliases: <served>.";
* ``"InternalServerError"`` (500) for a failed KV load.

Length rule (vLLM 0.32 as observed; its 0.26 rejection of prompt + max_tokens > max_model_len is gone, and
``SimConfig.max_tokens_overflow = "reject"`` brings it back for engines built on 0.26 such as vLLM-Ascend):

* ``prompt_tokens > max_model_len`` → 400 "... your prompt contains at least {L+1} input tokens, which
  exceeds this limit even without any output tokens ... (parameter=input_tokens, value={L+1})" (the tokenizer
  truncates at limit+1, hence "at least" and a value capped at L+1);
* otherwise ``max_tokens`` (chat: ``max_completion_tokens`` wins; absent = the server default) is *clamped* to
  ``max_model_len - prompt_tokens``: 2000 prompt tokens with ``max_tokens`` 100 under 2048 generate 48 tokens;
* so a prompt of exactly ``max_model_len`` tokens → 400 "max_tokens must be at least 1, got 0.
  (parameter=max_tokens, value=0)", ``param: "max_tokens"``. ``min_tokens`` is checked against the clamped value.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from pdproxy.sim.config import SimConfig
from pdproxy.tokens import Tokenizer, prompt_token_ids

Api = Literal["chat", "completions"]


class SimHTTPError(Exception):
    """An HTTP error answered in vLLM's envelope (``status_code``, ``error_type``, ``param``)."""

    def __init__(self, status_code: int, message: str, error_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.error_type = error_type
        self.param = param

    def body(self) -> bytes:
        """The JSON envelope bytes."""
        return error_body(self.message, self.error_type, self.status_code, self.param)


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` as bytes."""
    return orjson.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}})


def kv_load_failed_body() -> bytes:
    """The 500 body of a request whose KV pull failed (``kv_load_failure_policy="fail"``, reference §1.4)."""
    return error_body("Internal server error", "InternalServerError", 500)


@dataclass(slots=True)
class ParsedRequest:
    """A validated completion request: the body plus the fields the simulator acts on (tokens)."""

    api: Api
    body: dict[str, Any]
    base_id: str
    response_id: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    prompt_token_ids: list[int]
    max_tokens: int | None
    min_tokens: int
    kv_transfer_params: Any
    tools: list[dict[str, Any]] | None
    tool_choice: Any


def request_base_id(headers: Any, body: dict[str, Any]) -> str:
    """``X-Request-Id`` header, else the body's ``request_id``, else 16 random hex digits (``_base_request_id``)."""
    rid = headers.get("X-Request-Id") or body.get("request_id")
    return str(rid) if rid else secrets.token_hex(8)


def _validation(message: str) -> SimHTTPError:
    return SimHTTPError(400, message, "Bad Request")


def _pydantic_error(kind: str, key: str, msg: str, value: Any) -> SimHTTPError:
    """A FastAPI/pydantic request-model failure as vLLM 0.32 words it (``type: "Bad Request"``)."""
    detail = {"type": kind, "loc": f"body.{key}", "msg": msg, "input": value}
    return SimHTTPError(400, f"1 validation error:\n  {detail!r}", "Bad Request", f"body.{key}")


def _optional_int(body: dict[str, Any], key: str) -> int | None:
    """An integer field in pydantic's lax mode: ints, bools, integral floats and numeric strings are accepted."""
    value = body.get(key)
    if value is None or isinstance(value, int):
        return None if value is None else int(value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise _pydantic_error("int_from_float", key, "Input should be a valid integer, got a number with a "
                              "fractional part", value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise _pydantic_error("int_parsing", key, "Input should be a valid integer, unable to parse string "
                                  "as an integer", value) from None
    raise _pydantic_error("int_type", key, "Input should be a valid integer", value)


def parse_request(body: Any, api: Api, headers: Any, config: SimConfig, tokenizer: Tokenizer) -> ParsedRequest:
    """Validate a request like vLLM's OpenAI server. ``body`` is the decoded JSON, or the raw ``bytes`` when
    they may not be JSON. Raises :class:`SimHTTPError` (400/404) on bad input."""
    if isinstance(body, (bytes, bytearray)):
        try:
            body = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise _validation(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise _validation("Input should be a valid dictionary or object to extract fields from")
    key = "messages" if api == "chat" else "prompt"
    if body.get(key) is None:
        raise _pydantic_error("missing", key, "Field required", body)
    model = body.get("model")
    if model is not None and model != config.served_model_name:
        raise SimHTTPError(404, f"The model `{model}` does not exist. Valid aliases: {config.served_model_name}.",
                           "NotFoundError", "model")
    stream = bool(body.get("stream", False))
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise SimHTTPError(400, "Stream options can only be defined when `stream=True`. "
                                "(parameter=stream_options)", param="stream_options")
    max_tokens = _optional_int(body, "max_tokens")
    if api == "chat":
        max_completion = _optional_int(body, "max_completion_tokens")
        max_tokens = max_completion if max_completion is not None else max_tokens
    min_tokens = _optional_int(body, "min_tokens") or 0
    n = body.get("n", 1)
    if n not in (None, 1):
        raise SimHTTPError(400, "pdproxy sim serves one sequence per request: n must be 1.", param="n")
    tools = body.get("tools") if api == "chat" else None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise _pydantic_error("list_type", "tools", "Input should be a valid list of tool objects", tools)
    if stream_options is not None and not isinstance(stream_options, dict):
        raise _pydantic_error("model_type", "stream_options", "Input should be a valid dictionary or instance of "
                              "StreamOptions", stream_options)
    tool_choice = body.get("tool_choice")
    if tools and tool_choice in (None, "auto") and not config.enable_auto_tool_choice:
        raise SimHTTPError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                "to be set")
    try:
        ids = prompt_token_ids(tokenizer, body, api)
    except ValueError as exc:
        raise SimHTTPError(400, str(exc), param=key) from None
    max_tokens = check_length(len(ids), max_tokens, config.max_model_len, clamp=config.max_tokens_overflow == "clamp")
    if max_tokens is not None and max_tokens < 1:
        raise SimHTTPError(400, f"max_tokens must be at least 1, got {max_tokens}. "
                                f"(parameter=max_tokens, value={max_tokens})", param="max_tokens")
    if min_tokens < 0:
        raise SimHTTPError(400, f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if max_tokens is not None and min_tokens > max_tokens:
        raise SimHTTPError(400, f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    base = request_base_id(headers, body)
    if not tools or tool_choice == "none":
        tools = None
    options = stream_options if isinstance(stream_options, dict) else {}
    return ParsedRequest(
        api=api, body=body, base_id=base, response_id=("chatcmpl-" if api == "chat" else "cmpl-") + base,
        stream=stream, include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("continuous_usage_stats")), prompt_token_ids=ids,
        max_tokens=max_tokens, min_tokens=min_tokens, kv_transfer_params=body.get("kv_transfer_params"),
        tools=tools, tool_choice=tool_choice)


def check_length(prompt_tokens: int, max_tokens: int | None, max_model_len: int, clamp: bool = True) -> int | None:
    """Apply vLLM 0.32's length rule (module docstring): raise the over-length 400 (``param="input_tokens"``)
    for a prompt over ``max_model_len``, else return ``max_tokens`` clamped to the room left (tokens; the room
    itself when ``max_tokens`` is None and the prompt fills the context, so the caller's ``max_tokens`` check
    rejects it). None stays None while there is room (the server default applies).

    ``clamp=False`` is vLLM ≤ 0.26's rule instead (``renderers/params.py::_token_len_check``, reference §2.4): a
    given ``max_tokens`` with ``prompt + max_tokens > max_model_len`` gets the "you requested ... output tokens"
    400, and ``max_tokens`` is returned unchanged."""
    limit = max_model_len
    if prompt_tokens > limit:
        value = limit + 1
        raise SimHTTPError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your prompt contains at least "
            f"{value} input tokens, which exceeds this limit even without any output tokens. Please reduce the "
            f"length of the input prompt. (parameter=input_tokens, value={value})",
            param="input_tokens")
    room = limit - prompt_tokens
    if not clamp and max_tokens is not None and max_tokens > room:
        value = max(limit - max_tokens + 1, 1)
        raise SimHTTPError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested {max_tokens} output "
            f"tokens and your prompt contains at least {value} input tokens, for a total of at least "
            f"{value + max_tokens} tokens. Please reduce the length of the input prompt or the number of "
            f"requested output tokens. (parameter=input_tokens, value={value})",
            param="input_tokens")
    if max_tokens is None:
        return None if room > 0 else room
    return min(max_tokens, room)
