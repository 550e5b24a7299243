"""vLLM 0.32's request validation for the sampling fields every generation API shares, and their error texts.

Two kinds of 400, as the real engine words them (captured in ``tests/real_vllm/captures/``):

* a field of the wrong JSON type fails FastAPI/pydantic request parsing:
  ``{"error": {"message": "1 validation error:\\n  {'type': 'float_parsing', 'loc': 'body.temperature', 'msg':
  ..., 'input': 'hot'}", "type": "Bad Request", "param": "body.temperature", "code": 400}}`` — the ``input``
  is summarized as ``vllm/entrypoints/serve/exception_handling/handlers/validation.py`` does (strings as is, up
  to 200 characters; containers as ``<dict of N items>``; other values as ``str(value)``). This shape is the
  OpenAI one on *every* route, ``/v1/messages`` included;
* a value the request models' validators or ``SamplingParams._verify_args`` reject
  (``vllm/entrypoints/openai/chat_completion/protocol.py``, ``vllm/entrypoints/openai/completion/protocol.py``,
  ``vllm/sampling_params.py``): ``type "BadRequestError"``, a message ending with ``(parameter=<p>, value=<v>)``
  when vLLM names the field, ``param`` set accordingly.

:func:`read_sampling` type-checks the sampling fields of a ``chat``, ``completions``, ``responses`` or ``messages``
body (before the model and the prompt are looked at, as pydantic does); :meth:`SamplingFields.verify` range-checks
them once the output limit is known (after the length rule, as ``SamplingParams`` does) and returns the
:class:`SamplingSpec` the simulator honours. Both raise :class:`SimHTTPError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pdproxy.sim.errors import SimHTTPError
from pdproxy.sim.outputs import StopRules

MAX_LOGPROBS = 20
"""vLLM's default ``--max-logprobs``."""
MAX_STOP_STRINGS = 4
"""vLLM's ``VLLM_MAX_STOP_STRINGS`` (``vllm/envs.py``)."""
MAX_N = 16384
"""vLLM's ``VLLM_MAX_N_SEQUENCES``."""
SAMPLING_EPS = 1e-5
_INPUT_CHARS = 200


@dataclass(frozen=True, slots=True)
class Structured:
    """A constraint on the output: ``json_object``, a JSON schema (``json``), ``choice`` or ``regex``."""

    kind: Literal["json_object", "json", "choice", "regex"]
    schema: Any = None
    choices: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """What the simulator honours of a request's sampling parameters. ``logprobs``: top entries per output
    token (None = not asked for). ``temperature`` is vLLM's effective value (1.0 when absent)."""

    n: int = 1
    temperature: float = 1.0
    logprobs: int | None = None
    rules: StopRules = field(default_factory=StopRules)
    structured: Structured | None = None
    seed: int | None = None


# ---- pydantic-shaped field errors -----------------------------------------------------------------------------
def summarize_input(value: Any) -> Any:
    """A validation error's ``input`` as vLLM 0.32 reports it (size-bounded)."""
    if isinstance(value, str):
        return value if len(value) <= _INPUT_CHARS else value[:_INPUT_CHARS] + "...[truncated]"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return str(value)


def pydantic_error(kind: str, loc: str, msg: str, value: Any, ctx: dict[str, Any] | None = None) -> SimHTTPError:
    """A FastAPI/pydantic request-model failure (``type "Bad Request"``, ``param`` = the dotted location)."""
    detail: dict[str, Any] = {"type": kind, "loc": f"body.{loc}", "msg": msg, "input": summarize_input(value)}
    if ctx is not None:
        detail["ctx"] = ctx
    return SimHTTPError(400, f"1 validation error:\n  {detail!r}", "Bad Request", f"body.{loc}")


def missing(loc: str, body: Any) -> SimHTTPError:
    """pydantic's ``missing`` error for a required field absent from ``body``."""
    return pydantic_error("missing", loc, "Field required", body)


def vllm_error(message: str, param: str | None = None, value: Any = None, status: int = 400) -> SimHTTPError:
    """A ``VLLMValidationError`` as its ``__str__`` words it: ``message (parameter=p, value=v)``."""
    extras = [f"parameter={param}"] if param is not None else []
    if value is not None:
        extras.append(f"value={value}")
    return SimHTTPError(status, f"{message} ({', '.join(extras)})" if extras else message, param=param)


def get_int(body: dict[str, Any], key: str, loc: str | None = None) -> int | None:
    """An integer field in pydantic's lax mode (ints, integral floats, numeric strings; not bools' strings)."""
    value = body.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    where = loc or key
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise pydantic_error("int_from_float", where, "Input should be a valid integer, got a number with a "
                             "fractional part", value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise pydantic_error("int_parsing", where, "Input should be a valid integer, unable to parse string "
                                 "as an integer", value) from None
    raise pydantic_error("int_type", where, "Input should be a valid integer", value)


def get_float(body: dict[str, Any], key: str) -> float | None:
    """A number field in pydantic's lax mode."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise pydantic_error("float_parsing", key, "Input should be a valid number, unable to parse string "
                                 "as a number", value) from None
    raise pydantic_error("float_type", key, "Input should be a valid number", value)


_TRUE: Final = frozenset({"true", "1", "yes", "on", "t", "y"})
_FALSE: Final = frozenset({"false", "0", "no", "off", "f", "n"})


def get_bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    """A boolean field in pydantic's lax mode (``true``/``false``, 0/1, their usual strings)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise pydantic_error("bool_parsing" if isinstance(value, str) else "bool_type", key,
                         "Input should be a valid boolean, unable to interpret input" if isinstance(value, str)
                         else "Input should be a valid boolean", value)


def get_stop(body: dict[str, Any], key: str = "stop") -> tuple[str, ...]:
    """``stop``: a string or a list of at most :data:`MAX_STOP_STRINGS` strings."""
    value = body.get(key)
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list):
        raise pydantic_error("list_type", key, "Input should be a valid list", value)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise pydantic_error("string_type", f"{key}.{i}", "Input should be a valid string", item)
    if len(value) > MAX_STOP_STRINGS:
        raise pydantic_error("too_long", key, f"List should have at most {MAX_STOP_STRINGS} items after "
                             f"validation, not {len(value)}", value,
                             {"field_type": "List", "max_length": MAX_STOP_STRINGS, "actual_length": len(value)})
    return tuple(value)


def get_int_list(body: dict[str, Any], key: str) -> tuple[int, ...]:
    """A list of integers (``stop_token_ids``)."""
    value = body.get(key)
    if value is None:
        return ()
    if not isinstance(value, list):
        raise pydantic_error("list_type", key, "Input should be a valid list", value)
    out = []
    for i, item in enumerate(value):
        parsed = get_int({"v": item}, "v", f"{key}.{i}")
        out.append(int(parsed) if parsed is not None else 0)
    return tuple(out)


# ---- structured outputs --------------------------------------------------------------------------------------
def structured_from_response_format(fmt: Any, param: str = "response_format") -> Structured | None:
    """``response_format`` (chat/completions) → a constraint; ``json_schema`` needs its ``json_schema`` object."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise pydantic_error("model_type", param, "Input should be a valid dictionary or instance of "
                             "ResponseFormat", fmt)
    kind = fmt.get("type")
    if kind == "json_object":
        return Structured("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if spec is None:
            raise vllm_error("When response_format type is 'json_schema', the 'json_schema' field must be "
                             "provided.", param)
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        return Structured("json", schema if isinstance(schema, dict) else {"type": "object"})
    if kind in ("text", "structural_tag"):
        return None
    raise pydantic_error("literal_error", f"{param}.type", "Input should be 'text', 'json_object' or "
                         "'json_schema'", kind, {"expected": "'text', 'json_object' or 'json_schema'"})


def structured_from_params(value: Any) -> Structured | None:
    """vLLM's ``structured_outputs`` object: one of ``json``, ``regex``, ``choice`` (or ``json_object``)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise pydantic_error("dataclass_type", "structured_outputs", "Input should be a dictionary or an "
                             "instance of StructuredOutputsParams", value)
    count = sum(value.get(k) is not None for k in ("json", "regex", "choice"))
    if count > 1:
        raise vllm_error("You can only use one kind of constraints for structured outputs ('json', 'regex' or "
                         "'choice').")
    if value.get("json") is not None:
        schema = value["json"]
        if isinstance(schema, str):
            import json

            try:
                schema = json.loads(schema)
            except ValueError:
                schema = {"type": "object"}
        return Structured("json", schema if isinstance(schema, dict) else {"type": "object"})
    if isinstance(value.get("choice"), list) and value["choice"]:
        return Structured("choice", choices=tuple(str(c) for c in value["choice"]))
    if value.get("regex") is not None:
        return Structured("regex", schema=str(value["regex"]))
    if value.get("json_object"):
        return Structured("json_object")
    return None


# ---- SamplingParams._verify_args ----------------------------------------------------------------------------
def verify_sampling(*, n: int, temperature: float, top_p: float, top_k: int, min_p: float,
                    presence_penalty: float, frequency_penalty: float, repetition_penalty: float,
                    max_tokens: int | None, min_tokens: int, logprobs: int | None, stop: tuple[str, ...]) -> None:
    """``vllm/sampling_params.py::SamplingParams._verify_args`` (its order and texts), the greedy-sampling check
    and the ``--max-logprobs`` limit (``_validate_logprobs``). Raises :class:`SimHTTPError`."""
    if n < 1:
        raise vllm_error(f"n must be at least 1, got {n}.")
    if n > MAX_N:
        raise vllm_error(f"n must be at most {MAX_N}, got {n}. To increase this limit, set the "
                         "VLLM_MAX_N_SEQUENCES environment variable.")
    if not -2.0 <= presence_penalty <= 2.0:
        raise vllm_error(f"presence_penalty must be in [-2, 2], got {presence_penalty}.")
    if not -2.0 <= frequency_penalty <= 2.0:
        raise vllm_error(f"frequency_penalty must be in [-2, 2], got {frequency_penalty}.")
    if not math.isfinite(repetition_penalty):
        raise vllm_error(f"repetition_penalty must be a finite number, got {repetition_penalty}.")
    if repetition_penalty <= 0.0:
        raise vllm_error(f"repetition_penalty must be greater than zero, got {repetition_penalty}.")
    if not math.isfinite(temperature):
        raise vllm_error(f"temperature must be a finite number, got {temperature}.", "temperature", temperature)
    if temperature < 0.0:
        raise vllm_error(f"temperature must be non-negative, got {temperature}.", "temperature", temperature)
    if temperature > 2.0:
        raise vllm_error(f"temperature must be in [0, 2], got {temperature}.", "temperature", temperature)
    if not 0.0 < top_p <= 1.0:
        raise vllm_error(f"top_p must be in (0, 1], got {top_p}.", "top_p", top_p)
    if top_k < -1:
        raise vllm_error(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    if not 0.0 <= min_p <= 1.0:
        raise vllm_error(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens is not None and max_tokens < 1:
        raise vllm_error(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens", max_tokens)
    if min_tokens < 0:
        raise vllm_error(f"min_tokens must be greater than or equal to 0, got {min_tokens}.")
    if max_tokens is not None and min_tokens > max_tokens:
        raise vllm_error(f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}.")
    if logprobs is not None and logprobs != -1 and logprobs < 0:
        raise vllm_error(f"logprobs must be non-negative or -1, got {logprobs}.", "logprobs", logprobs)
    if any(not s for s in stop):
        raise vllm_error("stop cannot contain an empty string.")
    if temperature == 0.0 and n > 1:      # vLLM raises a temperature in (0, 1e-2) to 1e-2 first: not greedy
        raise vllm_error(f"n must be 1 when using greedy sampling, got {n}.")
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise vllm_error(f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
                         f"{MAX_LOGPROBS}", "logprobs", logprobs)


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """The sampling fields of a request, type-checked (pydantic's pass) but not yet range-checked."""

    n: int
    temperature: float | None
    top_p: float | None
    top_k: int | None
    min_p: float | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    seed: int | None
    logprobs: int | None
    rules: StopRules

    def verify(self, max_tokens: int | None) -> SamplingSpec:
        """``SamplingParams._verify_args`` with the effective output limit ``max_tokens`` (tokens, after vLLM's
        clamp); returns what the simulator honours. Raises :class:`SimHTTPError`."""
        temperature = 1.0 if self.temperature is None else self.temperature
        verify_sampling(n=self.n, temperature=temperature, top_p=1.0 if self.top_p is None else self.top_p,
                        top_k=0 if self.top_k is None else self.top_k, min_p=self.min_p or 0.0,
                        presence_penalty=self.presence_penalty or 0.0,
                        frequency_penalty=self.frequency_penalty or 0.0,
                        repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                        max_tokens=max_tokens, min_tokens=self.rules.min_tokens, logprobs=self.logprobs,
                        stop=self.rules.stop)
        return SamplingSpec(n=self.n, temperature=temperature, logprobs=self.logprobs, rules=self.rules,
                            seed=self.seed)


def read_sampling(body: dict[str, Any], api: Literal["chat", "completions", "responses", "messages"]) -> SamplingFields:
    """Type-check the sampling fields of ``body`` (pydantic's pass; raises its ``Bad Request`` 400). Field names
    per API: ``messages`` bodies use ``stop_sequences``; ``responses`` bodies use ``top_logprobs`` with
    ``include: ["message.output_text.logprobs"]`` and have no ``n``/``min_tokens``."""
    n = 1
    if api in ("chat", "completions") and body.get("n") is not None:
        n = get_int(body, "n") or 0
    logprobs: int | None = None
    if api == "chat":
        top = get_int(body, "top_logprobs") or 0
        if get_bool(body, "logprobs"):
            logprobs = top
    elif api == "completions":
        logprobs = get_int(body, "logprobs")
    elif api == "responses":
        include = body.get("include") or []
        if isinstance(include, list) and "message.output_text.logprobs" in include:
            logprobs = get_int(body, "top_logprobs") or 0
    if api == "messages":
        rules = StopRules(stop=get_stop(body, "stop_sequences"))
    else:
        rules = StopRules(stop=get_stop(body), stop_token_ids=get_int_list(body, "stop_token_ids"),
                          include_stop_str_in_output=get_bool(body, "include_stop_str_in_output"),
                          min_tokens=(get_int(body, "min_tokens") or 0) if api != "responses" else 0,
                          ignore_eos=get_bool(body, "ignore_eos"))
    return SamplingFields(n=n, temperature=get_float(body, "temperature"), top_p=get_float(body, "top_p"),
                          top_k=get_int(body, "top_k"), min_p=get_float(body, "min_p"),
                          presence_penalty=get_float(body, "presence_penalty"),
                          frequency_penalty=get_float(body, "frequency_penalty"),
                          repetition_penalty=get_float(body, "repetition_penalty"), seed=get_int(body, "seed"),
                          logprobs=logprobs, rules=rules)


def check_chat_validators(body: dict[str, Any]) -> None:
    """The ``ChatCompletionRequest`` model validators the simulator reproduces (``response_format``,
    ``stream_options``, ``top_logprobs``, ``structured_outputs``, ``tools``/``tool_choice``, generation
    prompt)."""
    check_stream_options(body)
    top = body.get("top_logprobs")
    if top is not None:
        if not isinstance(top, (int, float)) or isinstance(top, bool):
            raise vllm_error("`top_logprobs` must be an integer.", "top_logprobs", top)
        if top < 0 and top != -1:
            raise vllm_error("`top_logprobs` must be a positive value or -1.", "top_logprobs", top)
        if (top == -1 or top > 0) and not body.get("logprobs"):
            raise vllm_error("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    tools = body.get("tools")
    if tools == []:
        raise vllm_error("`tools` must not be an empty array. Either provide at least one tool or omit the field "
                         "entirely.", "tools")
    choice = body.get("tool_choice", "auto" if tools else None)
    if choice is not None and choice != "none":
        if tools is None:
            raise vllm_error("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if isinstance(choice, dict):
            function = choice.get("function")
            if not isinstance(function, dict):
                raise vllm_error(f"Invalid value for `function`: `{function}` in `tool_choice`! Correct usage: "
                                 '`{"type": "function", "function": {"name": "my_function"}}`',
                                 "tool_choice.function")
            name = function.get("name")
            if not any(isinstance(t, dict) and (t.get("function") or {}).get("name") == name for t in tools):
                raise vllm_error("The tool specified in `tool_choice` does not match any of the specified `tools`",
                                 "tool_choice")
        elif choice not in ("auto", "required"):
            raise pydantic_error("literal_error", "tool_choice", "Input should be 'none', 'auto' or 'required'",
                                 choice, {"expected": "'none', 'auto' or 'required'"})
    if body.get("continue_final_message") and body.get("add_generation_prompt", True):
        raise vllm_error("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")


def check_completion_validators(body: dict[str, Any]) -> None:
    """The ``CompletionRequest`` model validators the simulator reproduces (``logprobs`` type and sign,
    ``stream_options``, a present non-empty ``prompt``)."""
    value = body.get("logprobs")
    if value is not None:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise vllm_error("`logprobs` must be an integer.", "logprobs", value)
        if value < 0 and value != -1:
            raise vllm_error("`logprobs` must be a positive value or -1.", "logprobs", value)
    check_stream_options(body)
    prompt = body.get("prompt")
    if prompt is None or prompt == "":
        raise vllm_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")


def check_stream_options(body: dict[str, Any]) -> None:
    """``stream_options`` (truthy) without ``stream`` is a 400."""
    if body.get("stream_options") and not body.get("stream"):
        raise vllm_error("Stream options can only be defined when `stream=True`.", "stream_options")
