"""vLLM's request validation and error envelopes, as the simulator reproduces them.

Error envelope (``vllm/entrypoints/serve/engine/protocol.py::ErrorResponse``):
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
* otherwise ``max_tokens`` (chat: ``max_completion_tokens`` wins, absent = to the end of the answer; completions:
  absent or null = 16, :data:`COMPLETION_DEFAULT_MAX_TOKENS`) is *clamped* to
  ``max_model_len - prompt_tokens``: 2000 prompt tokens with ``max_tokens`` 100 under 2048 generate 48 tokens;
* so a prompt of exactly ``max_model_len`` tokens → 400 "max_tokens must be at least 1, got 0.
  (parameter=max_tokens, value=0)", ``param: "max_tokens"``. ``min_tokens`` is checked against the clamped value.

Echo without generation: a completion with ``echo`` and ``max_tokens: 0`` is valid (vLLM's
``CompletionRequest.to_sampling_params`` runs it with ``max_tokens`` 1, ``completion/protocol.py``); the answer's
text is the prompt alone (``completion/serving.py``: ``if request.max_tokens == 0: output_text = prompt_text``),
while ``finish_reason`` ("length") and ``usage.completion_tokens`` (1) are those of the one token the engine ran.
``max_tokens: 0`` without ``echo`` stays the 400 above. With ``max_tokens`` > 0, ``echo`` prepends the prompt to
the generated text (``output_text = prompt_text + output.text``; streamed, with the first output chunk:
``delta_text = prompt_text + output.text``), ``usage.completion_tokens`` counting the generated tokens only.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import orjson

from pdproxy.sim.config import SimConfig
from pdproxy.sim.errors import SimHTTPError, error_body
from pdproxy.tokens import Tokenizer, prompt_token_ids

if TYPE_CHECKING:
    from pdproxy.sim.models import ModelRegistry
    from pdproxy.sim.validation import SamplingSpec, Structured

Api = Literal["chat", "completions", "responses", "messages", "generate"]
ToolMode = Literal["auto", "required", "named"]

COMPLETION_DEFAULT_MAX_TOKENS = 16
"""A completion's ``max_tokens`` when absent or null (vLLM ``CompletionRequest``, ``vllm/entrypoints/openai/
completion/protocol.py``: the field's default, and ``normalize_null_max_tokens``)."""

__all__ = ["Api", "ParsedRequest", "SimHTTPError", "check_length", "error_body", "kv_load_failed_body",
           "parse_request", "request_base_id"]


def kv_load_failed_body() -> bytes:
    """The 500 body of a request whose KV pull failed (``kv_load_failure_policy="fail"``, vLLM's default:
    ``vllm/config/kv_transfer.py``)."""
    return error_body("Internal server error", "InternalServerError", 500)


def _default_sampling() -> SamplingSpec:
    from pdproxy.sim.validation import SamplingSpec

    return SamplingSpec()


@dataclass(slots=True)
class ParsedRequest:
    """A validated generation request: the body plus the fields the simulator acts on (tokens).

    ``prompts`` holds every prompt (a completions list has several; ``prompt_token_ids`` is the first) and
    ``prompt_max_tokens`` each one's output limit after vLLM's clamp. ``echo_texts``: for a completion with
    ``echo``, each prompt's text, which comes before the generated text (module docstring); None otherwise.
    ``echo_only``: ``echo`` with ``max_tokens: 0`` (run with ``max_tokens`` 1): the prompt is the whole text. ``model`` is the served name the request
    selected (the base model or a LoRA adapter). ``tool_mode``/``tool_name``/``tool_schema``: the tool call the
    answer makes (None: plain text). ``content``: fixed content (JSON for a structured-output constraint).
    """

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
    sampling: SamplingSpec = field(default_factory=_default_sampling)
    prompts: list[list[int]] = field(default_factory=list)
    prompt_max_tokens: list[int | None] = field(default_factory=list)
    model: str = ""
    tool_mode: ToolMode | None = None
    tool_name: str | None = None
    tool_schema: Any = None
    structured: Structured | None = None
    return_token_ids: bool = False
    echo_texts: list[str] | None = None
    echo_only: bool = False

    def __post_init__(self) -> None:
        if not self.prompts:
            self.prompts = [self.prompt_token_ids]
            self.prompt_max_tokens = [self.max_tokens]


def request_base_id(headers: Any, body: dict[str, Any]) -> str:
    """``X-Request-Id`` header, else the body's ``request_id``, else 16 random hex digits (``_base_request_id``)."""
    rid = headers.get("X-Request-Id") or body.get("request_id")
    return str(rid) if rid else secrets.token_hex(8)


def decode_body(body: Any) -> dict[str, Any]:
    """The request object (``body``: decoded JSON, or raw bytes that may not be JSON). Raises the 400s vLLM
    gives for a body that is not JSON or not an object."""
    if isinstance(body, (bytes, bytearray)):
        try:
            body = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise SimHTTPError(400, f"JSON decode error: {exc}", "Bad Request") from None
    if not isinstance(body, dict):
        raise SimHTTPError(400, "Input should be a valid dictionary or object to extract fields from", "Bad Request")
    return body


def choose_tool(tools: list[dict[str, Any]], tool_choice: Any) -> dict[str, Any]:
    """The tool a tool-calling answer calls: ``tool_choice``'s named function, else the first tool."""
    if isinstance(tool_choice, dict):
        wanted = (tool_choice.get("function") or {}).get("name", tool_choice.get("name"))
        for tool in tools:
            if _function(tool).get("name") == wanted:
                return tool
    return tools[0]


def tool_plan(tools: list[dict[str, Any]] | None, choice: Any, config: SimConfig,
              ) -> tuple[ToolMode | None, str | None, Any]:
    """``(mode, name, parameters schema)`` of the tool call a chat answer makes, or raises vLLM's 400 when the
    engine's flags do not allow the ``tool_choice`` (``--enable-auto-tool-choice``, ``--tool-call-parser``)."""
    if not tools or choice == "none" or (choice is None and not tools):
        return None, None, None
    parser = config.tool_call_parser
    if choice is None or choice == "auto":
        if not config.enable_auto_tool_choice or not parser:
            raise SimHTTPError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                    "to be set")
        mode: ToolMode = "auto"
    elif choice == "required":
        if not parser:
            raise SimHTTPError(400, 'tool_choice="required" requires --tool-call-parser to be set')
        mode = "required"
    else:
        if not parser:
            name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else choice
            raise SimHTTPError(400, f'tool_choice=function "{name}" requires --tool-call-parser to be set')
        mode = "named"
    function = _function(choose_tool(tools, choice))
    return mode, str(function.get("name", "tool")), function.get("parameters")


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's function object (chat tools nest it under ``function``; Responses tools are flat)."""
    function = tool.get("function")
    return function if isinstance(function, dict) else tool


def completion_prompts(tokenizer: Tokenizer, prompt: Any) -> list[list[int]]:
    """The token ids of each prompt of a completions request (a string, token ids, or a list of either)."""
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        return [prompt_token_ids(tokenizer, {"prompt": p}, "completions") for p in prompt]
    return [prompt_token_ids(tokenizer, {"prompt": prompt}, "completions")]


def completion_prompt_texts(tokenizer: Tokenizer, prompt: Any, prompts: list[list[int]]) -> list[str]:
    """The text of each prompt of a completions request (``prompts``: their token ids, from
    :func:`completion_prompts`): a string prompt as sent, token ids decoded (vLLM's ``RequestOutput.prompt``)."""
    several = isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt)
    texts = []
    for item, ids in zip(prompt if several else [prompt], prompts, strict=True):
        while isinstance(item, list) and len(item) == 1 and isinstance(item[0], (str, list)):
            item = item[0]
        texts.append(item if isinstance(item, str) else tokenizer.decode(ids))
    return texts


def parse_request(body: Any, api: Api, headers: Any, config: SimConfig, tokenizer: Tokenizer,
                  models: ModelRegistry | None = None) -> ParsedRequest:
    """Validate a chat or completions request like vLLM's OpenAI server. ``body`` is the decoded JSON, or the raw
    ``bytes`` when they may not be JSON. Raises :class:`SimHTTPError` (400/404) on bad input.

    Order as in vLLM: field types (pydantic), the request model's validators, the model (404), the tool-choice
    flags, the prompt and the length rule, then ``SamplingParams``' range checks."""
    from pdproxy.sim import validation as v
    from pdproxy.sim.models import ModelRegistry

    body = decode_body(body)
    chat = api == "chat"
    key = "messages" if chat else "prompt"
    if chat and body.get("messages") is None:
        raise v.missing("messages", body)
    max_tokens = v.get_int(body, "max_tokens")
    if chat:
        max_completion = v.get_int(body, "max_completion_tokens")
        max_tokens = max_completion if max_completion is not None else max_tokens
    elif max_tokens is None:       # CompletionRequest.max_tokens: absent or null is 16 (normalize_null_max_tokens)
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
    stream = v.get_bool(body, "stream")
    echo = not chat and v.get_bool(body, "echo")
    echo_only = echo and max_tokens == 0   # run with max_tokens 1 (docstring)
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise v.pydantic_error("model_type", "stream_options", "Input should be a valid dictionary or instance of "
                               "StreamOptions", stream_options)
    tools = body.get("tools") if chat else None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise v.pydantic_error("list_type", "tools", "Input should be a valid list", tools)
    fields = v.read_sampling(body, api)  # type: ignore[arg-type]
    structured = v.structured_from_response_format(body.get("response_format"))
    if chat:
        v.check_chat_validators(body)
    else:
        v.check_completion_validators(body)
    if body.get("structured_outputs") is not None:
        structured = v.structured_from_params(body.get("structured_outputs")) or structured
    registry = models or ModelRegistry(config.served_model_name, config.max_model_len)
    model = registry.resolve(body.get("model"))
    tool_choice = body.get("tool_choice", "auto" if tools else None) if chat else None
    mode, tool_name, tool_schema = tool_plan(tools, tool_choice, config) if chat else (None, None, None)
    check_output_limit(max_tokens, config.max_model_len,
                       "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None
                       else "max_tokens")
    try:
        prompts = [prompt_token_ids(tokenizer, body, "chat")] if chat else completion_prompts(tokenizer, body["prompt"])
    except ValueError as exc:
        raise SimHTTPError(400, str(exc), param=key) from None
    if not all(prompts):                     # vllm/v1/engine/input_processor.py (a decoder-only model)
        raise v.vllm_error("The decoder prompt cannot be empty")
    clamp = config.max_tokens_overflow == "clamp"
    limits = [check_length(len(ids), max_tokens, config.max_model_len, clamp=clamp) for ids in prompts]
    if echo_only:
        limits = [1] * len(prompts)
    spec = fields.verify(limits[0] if limits[0] is not None else None)
    for limit in limits[1:]:
        fields.verify(limit)
    base = request_base_id(headers, body)
    options = stream_options if isinstance(stream_options, dict) else {}
    return ParsedRequest(
        api=api, body=body, base_id=base, response_id=("chatcmpl-" if chat else "cmpl-") + base,
        stream=stream, include_usage=bool(options.get("include_usage")),
        continuous_usage=bool(options.get("continuous_usage_stats")), prompt_token_ids=prompts[0],
        max_tokens=limits[0], min_tokens=spec.rules.min_tokens, kv_transfer_params=body.get("kv_transfer_params"),
        tools=tools if mode is not None else None, tool_choice=tool_choice, sampling=spec, prompts=prompts,
        prompt_max_tokens=limits, model=model, tool_mode=mode, tool_name=tool_name, tool_schema=tool_schema,
        structured=structured if mode is None else None, return_token_ids=v.get_bool(body, "return_token_ids"),
        echo_texts=completion_prompt_texts(tokenizer, body["prompt"], prompts) if echo else None,
        echo_only=echo_only)


def check_output_limit(max_tokens: int | None, max_model_len: int, param: str) -> None:
    """vLLM 0.32's first length check, before the prompt is even rendered (``renderers/params.py::
    TokenizeParams.__post_init__``): more output tokens than ``max_model_len`` is a 400 naming ``param``
    (``max_tokens``, ``max_completion_tokens``, ``max_output_tokens``) whatever the prompt — never clamped."""
    if max_tokens is not None and max_tokens > max_model_len:
        raise SimHTTPError(400, f"{param}={max_tokens} cannot be greater than max_model_len={max_model_len}. "
                                f"Please request fewer output tokens. (parameter={param}, value={max_tokens})",
                           param=param)


def check_length(prompt_tokens: int, max_tokens: int | None, max_model_len: int, clamp: bool = True) -> int | None:
    """Apply vLLM 0.32's length rule (module docstring): raise the over-length 400 (``param="input_tokens"``)
    for a prompt over ``max_model_len``, else return ``max_tokens`` clamped to the room left (tokens; the room
    itself when ``max_tokens`` is None and the prompt fills the context, so the caller's ``max_tokens`` check
    rejects it). None stays None while there is room (the server default applies).

    ``clamp=False`` is vLLM ≤ 0.26's rule instead (``renderers/params.py::_token_len_check``): a
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
