"""The OpenAI-compatible wire view (vLLM's name for it): parse and validate a client body, patch usage.

Request bodies stay dicts plus a small typed view (:class:`ProxyRequest`); the raw bytes are kept so that the
decode leg can forward them unchanged (see ``kv_transfer.decode_body_bytes``).  Validation mirrors vLLM's
(``entrypoints/openai/completion/protocol.py`` and ``chat_completion/protocol.py``) for what would otherwise
fail only after a prefill has been spent: the decoder gets the original body, the prefiller a rewritten one.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, Any, Final

import orjson
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from pdproxy.apis import fields as api_requests
from pdproxy.compiled import compiled_or
from pdproxy.errors import BadRequest, dumps_or_none
from pdproxy.settings import FAN_OUT_CEILING, MAX_JSON_DEPTH, MAX_JSON_ITEMS


class Api(enum.StrEnum):
    """Which generation API a request came in on (value = the path on the engines).  All four go through the
    same P→D path; :mod:`pdproxy.apis.kv_transfer` holds what each needs on its legs."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    MESSAGES = "/v1/messages"

    @property
    def label(self) -> str:
        """Short name for logs and metrics: ``"chat"``, ``"completions"``, ``"responses"`` or ``"messages"``."""
        return _LABELS[self]


# Dicts, read-only by their type: looked up for every request (a mapping proxy's lookup is ~2× slower).
_LABELS: Final[Mapping[Api, str]] = {Api.CHAT: "chat", Api.COMPLETIONS: "completions", Api.RESPONSES: "responses",
                                     Api.MESSAGES: "messages"}
_PROMPT_PARAMS: Final[Mapping[Api, str]] = {Api.CHAT: "messages", Api.COMPLETIONS: "prompt", Api.RESPONSES: "input",
                                            Api.MESSAGES: "messages"}


@dataclass(slots=True)
class ProxyRequest:
    """A client request, read with vLLM's own field types (see :func:`parse_request`).

    ``body``: the parsed JSON object (never mutated); ``raw``: its bytes as received; ``stream``,
    ``include_usage``, ``continuous_usage``: as vLLM reads them (``"stream": "true"`` is a stream);
    ``max_output_tokens``: ``max_completion_tokens`` or ``max_tokens`` (chat gives the former precedence,
    ``chat_completion/protocol.py::build_tok_params``; completions default to 16), None when the engine decides;
    ``min_tokens``: the client's (vLLM's default 0); ``decoder_prefills``: the request needs the prompt's logits
    or runs beam search, which a decoder computes from the prompt itself whatever KV it is handed, so no prefill
    leg is sent; ``engine_judges``: a field the prefill leg would rewrite is invalid for vLLM, so the prefill leg
    carries the client's values and the prefiller answers vLLM's own 400 (``kv_transfer.prefill_body``);
    ``fault``: what pdproxy found (vLLM's wording), answered by pdproxy itself should an engine accept the request
    after all; ``prompt_tokens``: filled in by admission (tokens), None until counted, and replaced by the prefix
    lookup's count in the engine's tokens where its rules allow (``PrefixRouter.hints``, :mod:`pdproxy.prefix.routing`);
    ``prompt_tokens_upper`` / ``prompt_tokens_lower``: admission's bounds on them (tokens; the upper one is what
    the engines' limits are checked against; the lower one 0 when unknown), ``prompt_tokens_exact``: admission
    counted them exactly (token ids, a tokenizer, the engine's ``/tokenize``: the prefix lookup never replaces
    them then), ``prompt_tokens_estimated``: admission only estimated them (nothing counted them, and the upper
    "bound" is that estimate); ``seed``: the client's ``seed`` as vLLM reads it (``"5"`` and ``5.0`` are 5);
    ``prefix_lookup``: the prefix lookup of this prompt, written and read only by :mod:`pdproxy.prefix.routing`
    (its ``PrefixLookup``; ``object`` here because ``apis/`` sits below ``prefix/``); ``n``: choices per prompt
    and ``prompts``: prompts of a completion prompt list (their product is the number of sequences,
    :mod:`pdproxy.pd.fanout`).  Responses and Messages requests (:mod:`pdproxy.apis.fields`) have
    ``max_output_tokens`` = their ``max_output_tokens`` / ``max_tokens``.
    """

    api: Api
    body: dict[str, Any]
    raw: bytes
    stream: bool
    include_usage: bool
    model: str | None
    max_output_tokens: int | None
    prompt_tokens: int | None = None
    prompt_tokens_upper: int | None = None
    prompt_tokens_lower: int = 0
    prompt_tokens_exact: bool = False
    prompt_tokens_estimated: bool = False
    prefix_lookup: object | None = None
    min_tokens: int | None = None
    continuous_usage: bool = False
    decoder_prefills: bool = False
    engine_judges: bool = False
    fault: BadRequest | None = None
    n: int = 1
    prompts: int = 1
    seed: int | None = None
    _count_view: tuple[dict[str, Any], bool, bool] | None = field(default=None, repr=False, compare=False)

    @property
    def prompt_param(self) -> str:
        """The request field holding the prompt (``"messages"``, ``"prompt"`` or ``"input"``), used as an error's
        ``param``."""
        return _PROMPT_PARAMS[self.api]

    def size_from(self, parent: ProxyRequest, extra: int) -> None:
        """Size this request — a body pdproxy built from ``parent``'s, its prompt ``parent``'s plus ``extra``
        tokens (a recompute or text continuation leg) — as ``parent`` plus ``extra``: count, bounds, exactness."""
        self.prompt_tokens = (parent.prompt_tokens or 0) + extra
        self.prompt_tokens_lower = parent.prompt_tokens_lower + extra
        self.prompt_tokens_upper = None if parent.prompt_tokens_upper is None else parent.prompt_tokens_upper + extra
        self.prompt_tokens_exact = parent.prompt_tokens_exact
        self.prompt_tokens_estimated = parent.prompt_tokens_estimated

    def size_exactly(self, tokens: int) -> None:
        """Size this request at exactly ``tokens`` (a token-id prompt pdproxy built)."""
        self.prompt_tokens = self.prompt_tokens_lower = self.prompt_tokens_upper = tokens
        self.prompt_tokens_exact = True
        self.prompt_tokens_estimated = False

    @property
    def sequences(self) -> int:
        """How many sequences the request asks for: ``n`` × prompts (1 for one prompt and ``n`` 1)."""
        return self.n * self.prompts

    def count_view(self) -> tuple[dict[str, Any], bool, bool]:
        """``(body, chat, add_special_tokens)`` to count the prompt with: the client's body for chat and
        completions; for Responses and Messages the chat they render (:mod:`pdproxy.apis.fields`), Responses
        encoded with the tokenizer's special tokens."""
        view = self._count_view
        if view is None:
            if self.api is Api.RESPONSES:
                view = (api_requests.responses_chat(self.body), True, True)
            elif self.api is Api.MESSAGES:
                view = (api_requests.messages_chat(self.body), True, False)
            else:
                view = (self.body, self.api is Api.CHAT, False)
            self._count_view = view
        return view


# ------------------------------------------------------------------------------------------ vLLM's field types
# The fields pdproxy reads or rewrites, typed as vLLM 0.32 types them (``chat_completion/protocol.py::
# ChatCompletionRequest``, ``completion/protocol.py::CompletionRequest``, ``generate/base/protocol.py``), in
# vLLM's field order, validated as FastAPI validates vLLM's models (pydantic's lax mode: ``"5"`` and ``True``
# are integers, ``"no"`` is a boolean).  Every other field reaches the prefiller unchanged, which judges it.
_NonNegative = Annotated[int, Field(ge=0)]
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
"""vLLM's bounds of ``seed`` (``_INT64_MIN`` / ``_INT64_MAX`` in ``chat_completion/protocol.py``)."""


class _Object(BaseModel):
    """Any JSON object (vLLM validates its members; pdproxy only needs an object here)."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(BaseModel):
    """vLLM's ``StreamOptions`` (``generate/base/protocol.py``)."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Shape(BaseModel):
    """What pdproxy must be able to read to route and count a request as vLLM would (a body failing it is
    judged by an engine)."""

    model_config = ConfigDict(extra="ignore")
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None


class _ChatShape(_Shape):
    messages: list[dict[str, Any]]
    tools: list[_Object] | None = None


class _CompletionShape(_Shape):
    prompt: list[_NonNegative] | list[list[_NonNegative]] | str | list[str] | None = None


class _Leg(BaseModel):
    """The fields the prefill leg rewrites or the routing reads (vLLM's types and defaults)."""

    model_config = ConfigDict(extra="ignore")
    max_tokens: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    use_beam_search: bool = False
    min_tokens: int = 0
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)


class _ChatLeg(_Leg):
    max_completion_tokens: int | None = None
    n: int | None = 1
    echo: bool = False


class _CompletionLeg(_Leg):
    echo: bool | None = False
    max_tokens: int | None = 16
    n: int = 1


_INTERNAL_LOC = frozenset({"function-wrap", "function-after", "function-before", "function-plain",
                           "json-or-python", "lax-or-strict", "chain", "default", "nullable", "tagged-union",
                           "union", "call", "arguments", "is-instance", "is-subclass", "callable", "str", "int",
                           "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset",
                           "complex", "none", "nonetype"})
_BRACKETED = re.compile(r"[\[\]{}()]")


def _clean_loc(loc: tuple[Any, ...]) -> str:
    """A pydantic ``loc`` as vLLM prints it: dotted, without pydantic's internal union/wrapper segments
    (``serve/exception_handling/handlers/validation.py::clean_loc_for_param``)."""
    parts = [str(p) for p in loc if not (_BRACKETED.search(str(p)) or str(p).lower() in _INTERNAL_LOC)]
    return ".".join(parts) if parts else ".".join(str(p) for p in loc)


def _summary(value: Any) -> Any:
    """An error's ``input`` as vLLM reports it: long strings cut, containers described, the rest ``str()``."""
    if isinstance(value, str):
        return value[:200] + "...[truncated]" if len(value) > 200 else value
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def _validation_error(exc: ValidationError) -> BadRequest:
    """vLLM's 400 for a request that fails its pydantic model (its FastAPI handler,
    ``serve/exception_handling/handlers/validation.py``): ``N validation error(s):`` then one line per error (at
    most 10), ``type`` "Bad Request", ``param`` the first error's field."""
    errors = exc.errors(include_url=False)
    rendered = []
    for err in errors[:10]:
        shown = dict(err)
        shown["loc"] = _clean_loc(("body", *err["loc"]))
        if "input" in shown:
            shown["input"] = _summary(shown["input"])
        text = str(shown)
        rendered.append(text[:1000] + "...[truncated]" if len(text) > 1000 else text)
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {line}\n" for line in rendered)
    if len(errors) > 10:
        message += f"  ...and {len(errors) - 10} more {label}\n"
    param = _clean_loc(("body", *errors[0]["loc"])) if errors else None
    return BadRequest(message.rstrip(), param=param, error_type="Bad Request")


def _vllm_error(message: str, parameter: str | None = None, value: Any = None) -> BadRequest:
    """vLLM's 400 for a ``VLLMValidationError`` (``vllm/exceptions.py``): ``message (parameter=…, value=…)``."""
    extras = ([f"parameter={parameter}"] if parameter is not None else []) + (
        [f"value={value}"] if value is not None else [])
    return BadRequest(f"{message} ({', '.join(extras)})" if extras else message, param=parameter)


def require_json(content_type: str | None) -> None:
    """vLLM's check of a generation route's ``Content-Type`` (``serve/utils/api_utils.py::validate_json_request``,
    run before the body is read): its media type, lower-cased and cut at the first ``;``, must be exactly
    ``application/json``.  Raises :class:`BadRequest` with vLLM's words (a 400, no ``param``) otherwise."""
    if (content_type or "").lower().split(";", 1)[0] != "application/json":
        raise BadRequest("1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
                         param=None, error_type="Bad Request")


def over_max_model_len(req: ProxyRequest, max_model_len: int) -> BadRequest:
    """vLLM's 400 for asking more output tokens than ``max_model_len`` (``renderers/params.py::TokenizeParams``)."""
    if req.api is Api.RESPONSES:
        name = "max_output_tokens"
    elif req.api is Api.CHAT and req.body.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"
    else:
        name = "max_tokens"
    value = req.max_output_tokens
    return _vllm_error(f"{name}={value} cannot be greater than max_model_len={max_model_len}. Please request "
                       "fewer output tokens.", name, value)


_INT: frozenset[type] = frozenset({int})
_STR: frozenset[type] = frozenset({str})
_LIST: frozenset[type] = frozenset({list})
_DICT: frozenset[type] = frozenset({dict})


def _is_token_ids(value: Any) -> bool:
    """A list of integers (not booleans), checked in C (the set of its members' types)."""
    return type(value) is list and set(map(type, value)) <= _INT


def _token_ids_ok(value: Any) -> bool:
    """A list of token ids as ``list[_NonNegative]`` accepts it without coercion: integers ≥ 0."""
    return _is_token_ids(value) and (not value or min(value) >= 0)


def _shape_problem(body: dict[str, Any], chat: bool) -> str | None:
    """None when the fields :class:`_ChatShape` / :class:`_CompletionShape` read plainly have shapes the model
    accepts (each list's member types as a set, the least token id: C speed), else the first field that may not
    (the model then says, :func:`_shape_fault`)."""
    for key in ("kv_transfer_params", "ec_transfer_params"):
        value = body.get(key)
        if value is not None and type(value) is not dict:
            return key
    if chat:
        messages, tools = body.get("messages"), body.get("tools")
        if type(messages) is not list or not set(map(type, messages)) <= _DICT:
            return "messages"
        if tools is not None and (type(tools) is not list or not set(map(type, tools)) <= _DICT):
            return "tools"
        return None
    prompt = body.get("prompt")
    if prompt is None or type(prompt) is str:
        return None
    if type(prompt) is list:
        kinds = set(map(type, prompt))
        if kinds <= _INT and (not prompt or min(prompt) >= 0):
            return None
        if kinds == _STR or (kinds == _LIST and all(map(_token_ids_ok, prompt))):
            return None
    return "prompt"


SHAPE_MODEL_ITEMS = 10_000
"""The most list members a body failing :func:`_shape_problem` may hold and still be given to pydantic for
vLLM's words: the model costs 1–6 µs a member (a 150,000-tool chat: 0.85 s of the event loop, a 480,000-prompt
list 1.4 s)."""
_SHAPE_WORDS: Final = MappingProxyType({
    "kv_transfer_params": "'kv_transfer_params' must be an object",
    "ec_transfer_params": "'ec_transfer_params' must be an object",
    "messages": "'messages' must be a list of message objects",
    "tools": "'tools' must be a list of tool objects",
    "prompt": "'prompt' must be a string, a list of token ids (integers ≥ 0), a list of strings or a list of "
              "token-id lists"})


def _members(value: Any) -> int:
    return len(value) if type(value) is list else 0


def _shape_fault(body: dict[str, Any], chat: bool) -> BadRequest | None:
    """The 400 of a body whose fields :class:`_ChatShape` / :class:`_CompletionShape` refuse, or None.  Most bodies
    pass :func:`_shape_problem` and never meet pydantic; one that fails it is given to the model for vLLM's own
    words when its lists hold at most :data:`SHAPE_MODEL_ITEMS` members, else gets pdproxy's (the engine that
    judges it still answers in vLLM's)."""
    problem = _shape_problem(body, chat)
    if problem is None:
        return None
    if chat:
        size = _members(body.get("messages")) + _members(body.get("tools"))
    else:
        prompt = body.get("prompt")
        size = _members(prompt)
        if isinstance(prompt, list) and size <= SHAPE_MODEL_ITEMS:
            size += sum(len(p) for p in prompt if type(p) is list)
    if size > SHAPE_MODEL_ITEMS:
        return BadRequest(_SHAPE_WORDS[problem], param=problem)
    try:
        (_ChatShape if chat else _CompletionShape).model_validate(body, from_attributes=True)
    except ValidationError as exc:
        return _validation_error(exc)
    return None


def _prompt_count(prompt: Any) -> int:
    """How many sequences a (validated) completions ``prompt`` asks for: a list of strings or of token-id lists
    is one each; anything else valid is one — a string, or a flat list of token ids, which pydantic's lax mode
    also reads from floats, booleans and digit strings beside integers (``[1.0, 2.0]``, ``["5", 6]``)."""
    return len(prompt) if type(prompt) is list and _several_prompts(prompt) else 1


def _several_prompts(prompt: list[Any]) -> bool:
    """A non-empty list whose members are all strings or all lists (C speed: the set of their types)."""
    kinds = set(map(type, prompt))
    return kinds in (_STR, _LIST)


def prompt_list(prompt: Any) -> list[Any] | None:
    """The prompts of a completion ``prompt`` (vLLM: a string, a list of token ids, a list of strings, a list of
    token-id lists), or None when it is none of these."""
    if isinstance(prompt, str) or (_is_token_ids(prompt) and prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        return list(prompt)
    return None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_LAX_FLOAT: TypeAdapter[float] = TypeAdapter(float)
"""``temperature`` as vLLM's request models type it (``float | None``, validated in pydantic's lax mode)."""


def _greedy(temperature: Any) -> bool:
    """True when vLLM samples greedily at ``temperature`` (``vllm/sampling_params.py::SamplingParams.__post_init__``):
    exactly 0 once read in pydantic's lax mode (``"0"`` and ``false`` are 0.0).  A temperature in ``(0, 1e-2)`` is
    raised to ``_MAX_TEMP`` (1e-2) before the check, a negative one is vLLM's own 400, and null is the model's
    default (the engine knows it): none of them is greedy here."""
    if temperature is None:
        return False
    try:
        return _LAX_FLOAT.validate_python(temperature) == 0.0
    except ValidationError:               # not a number: the engine's own 400 says so
        return False


# ------------------------------------------------------------------------------------------ JSON limits
_ORJSON_DEPTH = 1024
"""orjson's own nesting limit: deeper input is refused with "depth limit exceeded" (never a recursion)."""


NESTS_WITHIN: Final[Callable[[bytes, int], bool] | None] = compiled_or("pdproxy.apis._jsonscan", "nests_within", None)
"""``nests_within(raw, limit)`` of the compiled ``pdproxy/apis/_jsonscan.c``: no bracket of ``raw`` outside its
strings is deeper than ``limit`` levels — a JSON body's nesting depth exactly, in one C pass (memchr across
strings: ~5 µs for a 300 KB chat, ~10 µs for a 70 KB agent body of 400 brackets); None when not built or
``PDPROXY_NO_EXTENSIONS`` is set (:func:`load_json` then bounds depth with :func:`_brackets_at_most` and a padded
parse)."""


_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_NINETEEN_DIGITS = b"0" * 19


def py_wide_integer(raw: bytes) -> bool:
    """Whether ``raw`` holds, outside its strings, an integer literal outside [-2**63, 2**64 - 1] (the Python twin
    of ``wide_integer`` in ``pdproxy/apis/_jsonscan.c``): False at once when no 19 digits stand in a row anywhere
    (a translated copy searched: ~0.1 ms for 250 KB), else Python's ``json`` reads ``raw`` and looks at each integer
    (bytes it refuses: False, the parser's to judge)."""
    if _NINETEEN_DIGITS not in raw.translate(_DIGITS_AS_ZERO):
        return False
    wide = False

    def integer(text: str) -> int:
        nonlocal wide
        value = int(text)
        if not _INT64_MIN <= value <= _UINT64_MAX:
            wide = True
        return value

    try:
        json.loads(raw, parse_int=integer)
    except (ValueError, RecursionError):
        return False
    return wide


WIDE_INTEGER: Final[Callable[[bytes], bool]] = compiled_or("pdproxy.apis._jsonscan", "wide_integer", py_wide_integer)
"""``wide_integer(raw)``: whether a body holds an integer outside 64 bits (:func:`load_json` refuses it); the compiled
one in ``pdproxy/apis/_jsonscan.c`` (one pass, memchr across strings), else :func:`py_wide_integer`."""


def wide_integer_refused() -> BadRequest:
    """The 400 of a body holding an integer outside [-2**63, 2**64 - 1]: orjson 3.13 reads such an integer as a
    float (earlier releases refused it), so a leg pdproxy writes again would carry another number than the client
    sent — while Python's ``json``, which vLLM reads bodies with, keeps it exact."""
    return BadRequest("pdproxy reads request bodies as strict JSON (RFC 8259) with integers within 64 bits "
                      f"({_INT64_MIN} to {_UINT64_MAX}); write a larger number as a float or a string",
                      param="body")


def _brackets_at_most(raw: bytes, limit: int) -> bool:
    """True when ``raw`` holds at most ``limit`` opening brackets (``[`` and ``{`` together, in strings too): then
    no value in it can nest deeper than ``limit``.  Found with ``bytes.find`` (memchr: ~3 µs per 300 KB, where
    ``bytes.count`` of one byte takes ~90 µs) and at most ``limit + 1`` steps of Python."""
    seen = 0
    for opener in (b"[", b"{"):
        at = raw.find(opener)
        while at >= 0:
            seen += 1
            if seen > limit:
                return False
            at = raw.find(opener, at + 1)
    return True


def too_deep(limit: int) -> BadRequest:
    """vLLM's 400 for a body it cannot decode (``json_invalid``, as its FastAPI handler words a JSON decode error),
    naming the nesting limit (setting ``max_json_depth``)."""
    err = {"type": "json_invalid", "loc": "body", "msg": "JSON decode error", "input": "<dict of 0 items>",
           "ctx": {"error": f"nesting deeper than {limit} levels (pdproxy's max_json_depth)"}}
    return BadRequest.validation(err)


_FIND_STEPS = 1_000
""":func:`json_items` finds this many of one byte with ``bytes.find`` (memchr: nothing between them is touched
twice), then counts the rest with ``bytes.count`` a chunk at a time."""
_COUNT_CHUNK = 1 << 20


def json_items(raw: bytes, limit: int) -> int:
    """The ``{``, ``[`` and ``,`` bytes in ``raw`` (in strings too, so an upper bound on the arrays, objects and
    elements it parses to, less one per container), counted only until the count passes ``limit``: bounded work
    whatever the body (~1 ms per MB of ``bytes.count`` where those bytes are dense, memchr's speed elsewhere)."""
    n = 0
    for byte in (b"{", b"[", b","):
        at = raw.find(byte)
        steps = 0
        while at >= 0 and steps < _FIND_STEPS:
            steps += 1
            at = raw.find(byte, at + 1)
        n += steps
        if at >= 0:                           # dense: count the rest (from ``at``, not yet counted) in C
            for start in range(at, len(raw), _COUNT_CHUNK):
                n += raw.count(byte, start, start + _COUNT_CHUNK)
                if n > limit:
                    return n
        if n > limit:
            return n
    return n


def too_many_items(limit: int) -> BadRequest:
    """The 400 for a body of more than ``limit`` JSON items (setting ``max_json_items``), in vLLM's
    ``json_invalid`` words as :func:`too_deep`."""
    err = {"type": "json_invalid", "loc": "body", "msg": "JSON decode error", "input": "<dict of 0 items>",
           "ctx": {"error": f"more than {limit} arrays, objects and elements (pdproxy's max_json_items)"}}
    return BadRequest.validation(err)


def load_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH, max_items: int | None = MAX_JSON_ITEMS) -> Any:
    """``raw`` parsed as strict JSON (orjson), any top-level value, nested at most ``max_depth`` (< 1024) deep
    (``[[1]]`` is 2 deep).  The one parser of client bodies: every route reads them through it.

    Cost: one orjson parse and, with the compiled check built (:data:`NESTS_WITHIN`, ``pdproxy/apis/_jsonscan.c``),
    one C pass over ``raw`` that finds its depth: a deeper body is refused before it is parsed.  Without it: a body
    holding at most ``max_depth`` opening brackets cannot nest deeper (:func:`_brackets_at_most`: ~1 µs for a
    500-byte chat, ~6 µs for a 290 KB one-message chat whose parse takes ~140 µs, ~37 µs for a 50 KB agent body of
    200 brackets); any other is parsed inside ``1024 - max_depth`` array levels of padding, so that orjson's own
    depth limit (1024) refuses exactly the bodies deeper than ``max_depth``, and the value is unwrapped (each
    padding level must hold one element, or ``raw`` was not one JSON value): one copy of ``raw`` and ~90–200 µs of
    padding and unwrapping (a 270 KB chat of 1,200 messages: ~310 µs against orjson's ~220 µs; a 72 KB agent body
    of 36 tools: ~195 µs against ~81 µs).  A body both deeper than ``max_depth`` and otherwise not JSON is refused
    as too deep by the compiled check, and by the Python path may be refused for its other fault: a 400 either way.
    Nothing recurses on the input: orjson stops at its limit, the error fallback (:func:`_body_error`) catches
    Python's ``RecursionError``.  A body longer than ``1.5 × max_items`` bytes (the shortest item, ``{},``, is
    1.5 bytes a piece) is first checked to hold at most ``max_items`` items (:func:`json_items`), before anything
    is parsed; None: no such check (a body pdproxy built itself from one already checked).  A body that parsed is
    then scanned for integers outside 64 bits (:data:`WIDE_INTEGER`: ~5 µs for a 300 KB chat in C), which it may not
    hold (:func:`wide_integer_refused`).
    Raises :class:`BadRequest` (vLLM's 400 envelope) for a body that is not JSON, nests too deep, holds too many
    items or an integer outside 64 bits."""
    if max_items is not None and len(raw) * 2 > max_items * 3 and json_items(raw, max_items) > max_items:
        raise too_many_items(max_items)
    if NESTS_WITHIN is not None and not NESTS_WITHIN(raw, max_depth):
        raise too_deep(max_depth)
    if NESTS_WITHIN is not None or _brackets_at_most(raw, max_depth):     # depth known to be within the limit
        try:
            value = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _body_error(raw, max_depth, str(exc)) from None
    else:
        pad = _ORJSON_DEPTH - max_depth
        try:
            value = orjson.loads(b"".join((b"[" * pad, raw, b"]" * pad)))
        except orjson.JSONDecodeError as exc:
            raise _body_error(raw, max_depth, str(exc)) from None
        for _ in range(pad):
            if type(value) is not list or len(value) != 1:   # e.g. "1, 2": not one value
                raise _body_error(raw, max_depth)
            value = value[0]
    if WIDE_INTEGER(raw):
        raise wide_integer_refused()
    return value


def _body_error(raw: bytes, max_depth: int = MAX_JSON_DEPTH, orjson_error: str = "") -> BadRequest:
    """vLLM's 400 for a body that is not JSON, or not one object (its FastAPI handler: ``json_invalid`` at the
    character position Python's ``json`` reports, ``missing`` for an empty body, ``model_attributes_type``);
    ``orjson_error``: what orjson said of it (its depth limit is answered as :func:`too_deep`)."""
    if "depth limit exceeded" in orjson_error:
        return too_deep(max_depth)
    if not raw.strip(b" \t\r\n"):
        err: dict[str, Any] = {"type": "missing", "loc": "body", "msg": "Field required", "input": "None"}
    else:
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as exc:
            err = {"type": "json_invalid", "loc": f"body.{exc.pos}", "msg": "JSON decode error",
                   "input": "<dict of 0 items>", "ctx": {"error": exc.msg}}
        except RecursionError:        # Python's json nests in C recursion: deep input that orjson refused earlier
            return too_deep(max_depth)
        except ValueError as exc:     # bytes that are not UTF-8/16/32 text
            err = {"type": "json_invalid", "loc": "body", "msg": "JSON decode error", "input": "<dict of 0 items>",
                   "ctx": {"error": str(exc)}}
        else:
            if isinstance(value, dict):   # JSON that Python reads but orjson does not (NaN, lone surrogates...)
                return BadRequest("pdproxy reads request bodies as strict JSON (RFC 8259): no NaN or Infinity, "
                                  "no lone surrogates, integers within 64 bits", param="body")
            err = {"type": "model_attributes_type", "loc": "body",
                   "msg": "Input should be a valid dictionary or object to extract fields from",
                   "input": _summary(value)}
    return BadRequest.validation(err)


def load_json_object(raw: bytes, max_depth: int = MAX_JSON_DEPTH,
                     max_items: int | None = MAX_JSON_ITEMS) -> dict[str, Any]:
    """:func:`load_json` of a body that must be one JSON object (every vLLM route's body); raises
    :class:`BadRequest` otherwise (vLLM's ``model_attributes_type`` 400)."""
    body = load_json(raw, max_depth, max_items)
    if not isinstance(body, dict):
        raise _body_error(raw, max_depth)
    return body


def parse_request(raw: bytes, api: Api, max_depth: int = MAX_JSON_DEPTH,
                  max_items: int | None = MAX_JSON_ITEMS) -> ProxyRequest:
    """Read a client body with vLLM's types and meaning.

    pdproxy answers a 400 itself only for a body that is not one JSON object (vLLM's own envelope for it); ``n`` > 1
    and a list of several prompts are read as that many sequences (``ProxyRequest.n`` / ``prompts``: one P/D pair
    each, :mod:`pdproxy.pd.fanout`); Responses and Messages bodies are read by :mod:`pdproxy.apis.fields`.
    Everything else reaches an engine, which judges it with vLLM's own rules and order of checks: a valid request as the legs need it; a
    request pdproxy finds invalid (its field types read as vLLM's models type them, its cross-field rules) with
    the client's own values on the prefill leg (:attr:`ProxyRequest.engine_judges`), so the client gets exactly
    vLLM's 400 before any KV is computed.  ``max_depth`` / ``max_items``: the body's limits (settings
    ``max_json_depth``, ``max_json_items``,
    :func:`load_json`).  Raises :class:`BadRequest` (HTTP 400, vLLM's envelope).
    """
    body = load_json_object(raw, max_depth, max_items)
    if api is Api.RESPONSES:
        stream_r, model_r, limit = api_requests.responses_fields(body)
        return ProxyRequest(api=api, body=body, raw=raw, stream=stream_r, include_usage=False, model=model_r,
                            max_output_tokens=limit)
    if api is Api.MESSAGES:
        stream_m, model_m, required = api_requests.messages_fields(body)
        thinking = api_requests.messages_fault(body, required)
        return ProxyRequest(api=api, body=body, raw=raw, stream=stream_m, include_usage=False, model=model_m,
                            max_output_tokens=None if thinking else required, engine_judges=thinking is not None,
                            fault=thinking)
    chat = api is Api.CHAT
    prompts = 1
    faults: list[BadRequest] = []
    if not chat:                                          # completion/protocol.py::validate_prompt_and_...
        prompt, embeds = body.get("prompt"), body.get("prompt_embeds")
        if (prompt is None or prompt == "") and (embeds is None or embeds == []):
            faults.append(_vllm_error("Either prompt or prompt_embeds must be provided and non-empty.", "prompt"))
    if not chat:                                          # pdproxy's own ceiling, before a member is read
        prompt = body.get("prompt")
        if type(prompt) is list and len(prompt) > FAN_OUT_CEILING and _several_prompts(prompt):
            raise BadRequest(f"{len(prompt)} prompts ask for as many sequences; pdproxy serves at most "
                             f"{FAN_OUT_CEILING} per request (one prefill/decode pair each; setting "
                             "fan_out_max_sequences)", param="prompt")
    shape = _shape_fault(body, chat)
    if shape is not None:
        faults.append(shape)
    elif not chat:
        prompts = _prompt_count(body.get("prompt"))
    leg: _Leg
    try:
        leg = (_ChatLeg if chat else _CompletionLeg).model_validate(body, from_attributes=True)
    except ValidationError as exc:
        faults.append(_validation_error(exc))
        leg = (_ChatLeg if chat else _CompletionLeg)()
    if body.get("stream_options") and not body.get("stream"):     # validate_stream_options, on the raw values
        faults.append(_vllm_error("Stream options can only be defined when `stream=True`.", "stream_options"))
    n_field: int | None = getattr(leg, "n", 1)
    n = 1 if n_field is None else n_field                 # chat's n: null is 1 (to_sampling_params)
    if isinstance(leg, _ChatLeg):
        max_output = leg.max_completion_tokens if leg.max_completion_tokens is not None else leg.max_tokens
    else:                                                 # completion/protocol.py::normalize_null_max_tokens
        max_output = 16 if leg.max_tokens is None else leg.max_tokens
    echo_only = not chat and bool(leg.echo) and max_output == 0 and not leg.use_beam_search
    if echo_only:         # echo without generation: vLLM runs it with max_tokens 1 (to_sampling_params)
        max_output = 1
    if leg.use_beam_search:     # BeamSearchParams: none of SamplingParams' checks (its decoder judges beam_width)
        if max_output is not None and max_output < 0:    # accepted; no beam step runs (beam_search/online.py:
            max_output = 0                               # range(max_tokens)): 0 tokens, never a negative count
    elif n < 1:                 # SamplingParams._verify_args, in its order (a prompt list must not fan out past it)
        faults.append(_vllm_error(f"n must be at least 1, got {n}."))
    elif max_output is not None and max_output < 1:
        faults.append(_vllm_error(f"max_tokens must be at least 1, got {max_output}.", "max_tokens", max_output))
    elif leg.min_tokens < 0:
        faults.append(_vllm_error(f"min_tokens must be greater than or equal to 0, got {leg.min_tokens}."))
    elif max_output is not None and leg.min_tokens > max_output:
        faults.append(_vllm_error(f"min_tokens must be less than or equal to max_tokens={max_output}, got "
                                  f"{leg.min_tokens}."))
    if n > 1 and not leg.use_beam_search and _greedy(body.get("temperature")):   # after _verify_args, as vLLM
        faults.append(_vllm_error(f"n must be 1 when using greedy sampling, got {n}."))
    judges = bool(faults)
    options = leg.stream_options
    stream = bool(leg.stream)
    logits = (echo_only or _number(body.get("prompt_logprobs")) or (chat and leg.echo is True)
              or (not chat and bool(leg.echo) and _number(body.get("logprobs"))))
    model = body.get("model")
    return ProxyRequest(
        api=api, body=body, raw=raw, stream=stream, include_usage=bool(stream and options and options.include_usage),
        model=model if isinstance(model, str) else None, max_output_tokens=None if judges else max_output,
        min_tokens=leg.min_tokens, continuous_usage=bool(stream and options and options.continuous_usage_stats),
        decoder_prefills=not judges and bool(logits or leg.use_beam_search), engine_judges=judges,
        fault=faults[0] if faults else None, n=max(n, 1), prompts=max(prompts, 1), seed=leg.seed)


_COMPLETION_TOKENS_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,15})(?!\d)')
"""At most 15 digits, as pdproxy/apis/streams.py's figures: a longer one is no count and is not read."""


def completion_tokens_in(data: bytes) -> int | None:
    """The last ``usage.completion_tokens`` figure in a JSON document or a block of SSE events, without parsing.
    None when absent.  Searched from the end (``rfind``, then the figure matched in place): usage is the last
    chunk before ``[DONE]``, so a block of a whole answer costs a few bytes' search, not a scan of its events
    (``bytes.find`` of a key ending in ``"`` crawls through JSON, where ``"`` is everywhere)."""
    end = len(data)
    match = _COMPLETION_TOKENS_RE.match
    while (at := data.rfind(b'"completion_tokens"', 0, end)) >= 0:
        found = match(data, at)
        if found is not None:
            return int(found[1])
        end = at
    return None


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
    """:func:`patch_usage` on a JSON document's bytes; returns ``data`` unchanged when there is nothing to do, or
    when the patched document cannot be written (nested deeper than orjson writes)."""
    if cached_tokens is None or b'"usage"' not in data:
        return data
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    if not isinstance(obj, dict) or not patch_usage(obj, cached_tokens):
        return data
    return dumps_or_none(obj) or data       # nested past what orjson writes: relayed as it came
