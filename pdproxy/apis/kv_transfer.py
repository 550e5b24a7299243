"""The vLLM P→D contract — the only module that spells the ``kv_transfer_params`` wire fields.

Pull model (NixlConnector, vLLM-Ascend MooncakeConnector(V1)); the contract, where each rule comes from in
vLLM's and vLLM-Ascend's sources, and what real vLLM 0.32 did with every field on a 1-token prefill are written
up in ``docs/pd-protocol.md``.  In short:

1. prefill leg (:func:`prefill_body`): the client's body as a **new** dict with ``stream: false``,
   ``max_tokens: 1`` (``max_completion_tokens: 1`` only if the client set it), no ``stream_options``,
   ``min_tokens: 1`` (so neither a first-token EOS nor a stop token ends the leg before the prompt's KV is handed
   over; stop strings are not checked until more than ``min_tokens`` tokens exist), the fields the proxy owns
   (:data:`PROXY_OWNED`) dropped, and the ``kv_transfer_params`` stub :data:`PREFILL_STUB`.  Every field that
   shapes the prompt (messages, ``tools``, chat template arguments, truncation, ``cache_salt``…) is the client's:
   both legs must render the same tokens, or the decoder pulls KV computed for another prompt (vLLM 0.32's
   decoder engine dies on a shorter one).  Output constraints that only steer sampling are relaxed on this leg
   (:func:`relax_constraints`): a forced tool call (``tool_choice`` "required" / a named tool) becomes "auto",
   structured outputs (``response_format`` json_object / json_schema / structural_tag, ``structured_outputs``,
   ``guided_*``, Responses ``text.format``, Messages ``output_config.format``) are dropped — engines that must
   build a grammar for one token fail there (vLLM-Ascend answers 500 with GLM-5), and the decoder, which samples
   every output token itself, keeps them all;
2. the prefiller answers JSON with a top-level ``kv_transfer_params`` object, opaque to us: read by
   :func:`load_prefill_answer` as its bytes (a :class:`KVHandle`, never turned into Python objects: NIXL's handle
   of a 64K-token prompt holds ~4,000 block ids) and taken by :func:`extract_params`; an answer without one that
   finished ``stop`` is a complete answer to the request (:func:`ended_on_prefill`);
3. decode leg (:func:`decode_body_bytes`): the client's bytes, byte-faithful, with the proxy-owned members removed
   and the prefiller's handle added as ``kv_transfer_params``, byte for byte as the prefiller sent it — never a
   second member of the same name.

Both legs carry the same ``X-Request-Id``.

**Per API** (vLLM 0.32; what was seen on the real engines is in ``docs/apis-through-pd.md``, captures in
``tests/real_vllm/captures/apis/``).  Every generation route hands the request's ``kv_transfer_params`` to the
engine the same way (``SamplingParams.extra_args``, e.g. ``openai/responses/protocol.py::to_sampling_params``):

- ``/v1/chat/completions``, ``/v1/completions``: as above;
- ``/v1/responses`` (``openai/responses/protocol.py::ResponsesRequest``): the output limit is
  ``max_output_tokens`` (there is no ``max_tokens``, ``min_tokens`` or ``stream_options``), so the prefill leg
  sets ``max_output_tokens: 1``; the params come back at the top level of the JSON ``response`` object (a streamed
  leg would carry them only in its last event, ``response.completed``, after events sent before the engine ran);
  cached tokens are ``usage.input_tokens_details.cached_tokens``.  The engine ignores ``X-Request-Id`` and names
  the response (and its engine request, ``<id>_0-<suffix>``) after the body's ``request_id``
  (``responses/serving.py::create_responses``), so both legs carry the same ``request_id`` —
  ``resp_<pdproxy request id>`` unless the client set its own (:func:`responses_request_id`);
- ``/v1/messages`` (``anthropic/protocol.py::AnthropicMessagesRequest``, served as a chat completion by
  ``anthropic/serving.py::to_chat_completion_request``): the prefill leg sets ``max_tokens: 1`` and **must** be
  non-streaming — ``message_stream_converter`` builds its events from chat chunks, which never carry
  ``kv_transfer_params``, so a streamed prefill leg pins the KV and returns no handle; the params come back at the
  top level of the JSON message (the key is absent when null, ``api_router.py`` dumps with ``exclude_none``);
  cached tokens are ``usage.cache_read_input_tokens``, and ``usage.input_tokens`` is net of them
  (``anthropic/serving.py::_build_anthropic_usage``).  ``thinking.budget_tokens < max_tokens`` is not checked on
  a leg with ``do_remote_decode`` (``anthropic/protocol.py::validate_thinking_budget``), so ``max_tokens: 1`` is
  safe with thinking on (and a client's budget not below its ``max_tokens`` is judged by the prefiller on the
  client's own body: ``pdproxy/apis/fields.py::messages_fault``).  Neither API has ``min_tokens``; a first-token EOS still hands over the KV on vLLM 0.32
  (NIXL returns a handle for a stopped request too, ``nixl/pull_scheduler.py::request_finished``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import msgspec
import orjson

from pdproxy.apis.request import Api
from pdproxy.compiled import compiled_or
from pdproxy.errors import UpstreamHTTPError, error_status, error_type_for

KVTransferParams = dict[str, Any]
"""A connector handle as a dict: the prefill leg's stub (a copy of :data:`PREFILL_STUB`), :meth:`KVHandle.params`."""


@dataclass(frozen=True, slots=True)
class KVHandle:
    """The opaque connector handle a prefiller produced for a decoder: its ``kv_transfer_params`` object exactly
    as the prefiller sent it (``raw``: UTF-8 JSON object bytes, at least one member, syntax checked), forwarded
    to the decoder byte for byte (:func:`decode_body_bytes`, :func:`release_body`) without ever becoming Python
    objects.  The size is the prompt's: NixlConnector lists one block id per ``block_size`` tokens
    (``nixl/pull_scheduler.py::request_finished``), ~4,000 ids (~25 KB) for a 64K-token prompt, which cost
    ~90 µs to parse and ~30 µs to serialise again (``loadtest/request_cost_bench.py``)."""

    raw: bytes

    def params(self) -> KVTransferParams:
        """The handle parsed (for inspection: tools, tests; the request path never needs it)."""
        params = orjson.loads(self.raw)
        assert isinstance(params, dict)
        return params

    @classmethod
    def of(cls, params: KVTransferParams) -> KVHandle:
        """The handle of an already parsed ``params`` dict (a test's, or a tool's)."""
        return cls(orjson.dumps(params))


KV_TRANSFER_PARAMS = "kv_transfer_params"

PROXY_OWNED = frozenset({KV_TRANSFER_PARAMS, "ec_transfer_params"})
"""Body fields only the proxy may set on an engine leg (the P→D handle, and vLLM's encoder-cache handle of the
same kind): a client's value never reaches an engine."""

EXTRA_ARGS = (("vllm_xargs",), ("sampling_params", "extra_args"))
"""Where a client body hands vLLM extra sampling arguments: ``vllm_xargs`` (chat, completions: it *is* the
request's ``SamplingParams.extra_args``, ``chat_completion/protocol.py::to_sampling_params``, a top-level
``kv_transfer_params`` overwriting its key only when set) and ``sampling_params.extra_args``
(``/inference/v1/generate``, ``scale_out/token_in_token_out/protocol.py``) — the dict the engine reads a request's
``kv_transfer_params`` / ``ec_transfer_params`` from (``vllm/v1/request.py``)."""


def client_handle_fault(body: Mapping[str, Any]) -> str | None:
    """The dotted path of a proxy-owned field (:data:`PROXY_OWNED`) that ``body`` (a parsed client body) sets inside
    one of the :data:`EXTRA_ARGS` dicts, where :func:`decode_body_bytes` does not cut (it cuts top-level members
    only); None when it sets none.  Such a body is refused (400), never forwarded."""
    for path in EXTRA_ARGS:
        node: Any = body
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None   # parsed JSON: objects are dicts
        if isinstance(node, dict):
            for name in PROXY_OWNED:
                if name in node:
                    return ".".join((*path, name))
    return None


PREFILL_STUB: Final[MappingProxyType[str, Any]] = MappingProxyType({
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
})

# vLLM rejects these on a non-streaming request ("Stream options can only be defined when `stream=True`.").
_STREAM_ONLY = ("stream_options",)

# An answer that finished this way said everything the model had to say (EOS, a stop token or string, or a
# tool call that ended the turn); "length" is the prefill leg's own cap.
_COMPLETE_FINISH = frozenset({"stop", "tool_calls"})


_STRUCTURED_OUTPUTS = frozenset({"structured_outputs", "guided_json", "guided_regex", "guided_choice",
                                 "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
                                 "structural_tag"})
"""Chat and completions fields that constrain sampling to a grammar (vLLM's ``structured_outputs`` and its
older ``guided_*`` spellings): dropped on the prefill leg."""
_GRAMMAR_FORMATS = frozenset({"json_object", "json_schema", "structural_tag"})
"""``response_format`` / ``text.format`` types that make vLLM build a grammar (``text`` does not)."""


def relax_constraints(body: dict[str, Any], api: Api) -> bool:
    """Relax, in place, a prefill-leg ``body``'s output constraints, which do not shape the prompt on vLLM's own
    renderers (``vllm/renderers/online_renderer.py`` hands the chat template ``tools``, never ``tool_choice``):
    a forced tool call becomes ``tool_choice`` "auto" (``{"type": "auto"}`` on Messages) — only when ``tools``
    are sent (without them the client's value stays, for vLLM to judge); grammar-building formats are dropped.
    ``tools`` always stay (they are rendered into the prompt).  Returns True when something was relaxed.  Nested
    values are replaced, never mutated (a shallow copy of a client body may be passed).

    A model whose renderer puts ``tool_choice`` or ``response_format`` into the prompt (vLLM's
    ``vllm/renderers/kimi_k3.py``) needs the setting ``prefill_relax_constraints: false``; "auto" needs the engines'
    ``--enable-auto-tool-choice`` (vLLM refuses it without), which tool calling with vLLM has anyway."""
    before = len(body)
    changed = False
    if body.get("tools"):
        choice = body.get("tool_choice")
        if api is Api.MESSAGES:
            if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
                body["tool_choice"] = {k: v for k, v in choice.items() if k != "name"} | {"type": "auto"}
                changed = True
        elif choice == "required" or isinstance(choice, dict):
            body["tool_choice"] = "auto"
            changed = True
    if api is Api.MESSAGES:
        config = body.get("output_config")
        if isinstance(config, dict) and "format" in config:
            body["output_config"] = {k: v for k, v in config.items() if k != "format"}
            changed = True
        return changed
    if api is Api.RESPONSES:
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
        if isinstance(text, dict) and isinstance(fmt, dict) and fmt.get("type") in _GRAMMAR_FORMATS:
            body["text"] = {k: v for k, v in text.items() if k != "format"}
            changed = True
        return changed
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in _GRAMMAR_FORMATS:
        del body["response_format"]
    for key in _STRUCTURED_OUTPUTS.intersection(body):
        del body[key]
    return changed or len(body) != before


def has_relaxable_constraints(original: Mapping[str, Any], api: Api) -> bool:
    """Whether ``original`` (a parsed client body of ``api``) carries a constraint :func:`relax_constraints`
    relaxes — then a prefill answer that stopped on its own did not obey it and cannot stand for the request's
    answer.  Never mutates ``original``."""
    return relax_constraints(dict(original), api)


def _inert(value: Any) -> Any:
    """A client's proxy-owned value with nothing in it an engine could use: ``{}`` for an object, as many nulls
    for an array, a scalar as it is."""
    if isinstance(value, dict):
        return {}
    if isinstance(value, list):
        return [None] * len(value)
    return value


def prefill_body(original: Mapping[str, Any], api: Api = Api.CHAT, *, engine_judges: bool = False,
                 request_id: str | None = None, relax: bool = False) -> dict[str, Any]:
    """Return a new dict: the prefill-leg body for ``original`` (a parsed client body of ``api``; the one-token
    limit per API in the module docstring).  Never mutates it.  ``request_id``: pdproxy's id of the request, named
    in a Responses body (:func:`responses_request_id`).  ``relax``: relax the output constraints
    (:func:`relax_constraints`; the prefill leg passes the setting ``prefill_relax_constraints``, a release leg
    keeps the client's: its prompt is the same either way).

    ``engine_judges`` (``ProxyRequest.engine_judges``: pdproxy found the request invalid for vLLM): the client's
    body as sent — its own values, so the prefiller rejects it with vLLM's own 400 and in vLLM's own order of
    checks, before any KV is computed — except that a proxy-owned object becomes ``{}`` (vLLM ignores an empty
    handle, and the member count vLLM may quote stays the client's) and a proxy-owned array one of as many nulls
    (vLLM quotes it as ``<list of N items>`` either way); a scalar stays, for vLLM to refuse while validating:
    nothing a client sends there reaches an engine as a handle, whatever vLLM's validation accepts.
    """
    if engine_judges:       # a client's handle becomes inert, an invalid one keeps its type for vLLM's own refusal
        return {k: _inert(v) if k in PROXY_OWNED else v for k, v in original.items()}
    body = {k: v for k, v in original.items() if k not in PROXY_OWNED}
    body["stream"] = False
    if api is Api.RESPONSES:
        body["max_output_tokens"] = 1
        rid = responses_request_id(original, request_id)
        if rid is not None:
            body["request_id"] = rid
    elif api is Api.MESSAGES:
        body["max_tokens"] = 1
    else:
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        for key in _STREAM_ONLY:
            body.pop(key, None)
        body["min_tokens"] = 1
    if relax:
        relax_constraints(body, api)
    body[KV_TRANSFER_PARAMS] = PREFILL_STUB.copy()  # its dict's copy(), as fast as dict() of a dict
    return body


def responses_request_id(original: Mapping[str, Any], request_id: str | None) -> str | None:
    """The ``request_id`` both legs of a Responses request carry (the engine names the response after it): None
    when the client set its own (which then stays, on both legs) or when ``request_id`` is None, else
    ``resp_<request_id>``."""
    if request_id is None or isinstance(original.get("request_id"), str):
        return None
    return f"resp_{request_id}"


def engine_must_judge(max_output_tokens: int | None, max_model_len: int | None) -> bool:
    """True when vLLM refuses the client's output-token request before any work whatever the prompt: more than
    ``max_model_len`` (``renderers/params.py::TokenizeParams.__post_init__``).  The prefill leg then carries the
    client's values (``prefill_body(..., engine_judges=True)``) so the prefiller says so in vLLM's words, instead
    of computing KV for a request the decoder would refuse."""
    return max_output_tokens is not None and max_model_len is not None and max_output_tokens > max_model_len


def decode_body(original: Mapping[str, Any], params: KVHandle | None) -> dict[str, Any]:
    """Return a new dict: the client's body without proxy-owned fields, plus the prefiller's handle ``params``
    verbatim (an ``orjson.Fragment`` of its bytes; none when ``params`` is None: the decoder then prefills the
    prompt itself)."""
    body = {k: v for k, v in original.items() if k not in PROXY_OWNED}
    if params is not None:
        body[KV_TRANSFER_PARAMS] = orjson.Fragment(params.raw)
    return body


def release_body(original: dict[str, object], params: KVHandle, api: Api = Api.CHAT) -> bytes:
    """The release leg's body: the prefill overrides of ``api`` (``stream: false``, a one-token limit, no stream
    options, ``min_tokens: 1`` on chat and completions) with the prefiller's ``params`` as the decoder's
    ``kv_transfer_params`` — the leg that frees a prefiller's pinned KV no decoder will read
    (``pdproxy/pd/kv_release.py``; docs/pd-protocol.md)."""
    return orjson.dumps(decode_body(prefill_body(original, api), params))


def decode_body_bytes(raw: bytes, params: KVHandle | None,
                      parsed: Mapping[str, Any] | None = None) -> bytes:
    """The decode-leg body built from the client's raw JSON object bytes, byte-faithful outside what changes.

    ``parsed`` is ``raw`` already parsed (the request's body; parsed here when omitted).  When the client sent
    no proxy-owned member (the common case) ``raw`` is kept whole and ``params`` is inserted as the last member:
    one copy, no scan.  Otherwise the top-level members named in :data:`PROXY_OWNED` (every occurrence, however
    their names are escaped) are cut out with :func:`top_level_members` and the rest is kept byte for byte —
    numbers, key order, whitespace and multi-MB base64 images are never re-encoded, and the result never holds
    two members of one name that the proxy produced.  ``params=None`` (the decoder prefills) adds nothing.
    Raises ``ValueError`` if ``raw`` is not a JSON object.
    """
    if parsed is None:
        parsed = orjson.loads(raw)
    if type(parsed) is not dict and not isinstance(parsed, Mapping):   # a dict first: no ABC check per request
        raise ValueError("request body is not a JSON object")
    if PROXY_OWNED.isdisjoint(parsed.keys()):
        return raw if params is None else _append_member(raw, KV_TRANSFER_PARAMS, orjson.Fragment(params.raw))
    kept = _without_members(raw, PROXY_OWNED)
    return kept if params is None else _append_member(kept, KV_TRANSFER_PARAMS, orjson.Fragment(params.raw))


def decode_leg_body(api: Api, raw: bytes, original: Mapping[str, Any], params: KVHandle | None,
                    request_id: str | None = None) -> bytes:
    """The decode-leg body of a request of ``api``: :func:`decode_body_bytes` of the client's ``raw`` bytes
    (``original``: them parsed), and for Responses the ``request_id`` the prefill leg named
    (:func:`responses_request_id`), appended the same way."""
    body = decode_body_bytes(raw, params, original)
    if api is Api.RESPONSES:
        rid = responses_request_id(original, request_id)
        if rid is not None:
            body = _append_member(body, "request_id", rid)
    return body


def output_limit_key(api: Api, original: Mapping[str, Any]) -> str:
    """The member holding the output-token limit vLLM applies to a request of ``api`` (``original``: its body):
    Responses' ``max_output_tokens``; chat's ``max_completion_tokens`` when the client set it (it wins over
    ``max_tokens``: ``ChatCompletionRequest``), else ``max_tokens`` (chat, completions, Messages)."""
    if api is Api.RESPONSES:
        return "max_output_tokens"
    if api is Api.CHAT and original.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens"


def with_output_limit(body: bytes, api: Api, original: Mapping[str, Any], limit: int,
                      min_tokens: int | None) -> bytes:
    """``body`` (a leg's JSON object bytes for a request of ``api`` whose client body is ``original``) with its
    output-token limit (:func:`output_limit_key`) set to ``limit``, and its ``min_tokens`` (the request's, as vLLM
    reads it: ``ProxyRequest.min_tokens``, so ``"900"`` and ``900.0`` are 900; None: the API has none) lowered to
    it when above (vLLM refuses ``min_tokens`` over ``max_tokens``: ``vllm/sampling_params.py``): each member's
    every occurrence removed, the new one appended; every other byte kept.  Raises ``ValueError`` if ``body`` is
    not a JSON object."""
    key = output_limit_key(api, original)
    lower = min_tokens is not None and min_tokens > limit
    body = _without_members(body, frozenset((key, "min_tokens") if lower else (key,)))
    body = _append_member(body, key, limit)
    return _append_member(body, "min_tokens", limit) if lower else body


def _append_member(raw: bytes, key: str, value: Any) -> bytes:
    """``raw`` (a JSON object) with ``"key": value`` added before its closing brace: one copy of ``raw``
    (``value``: anything orjson serialises; an ``orjson.Fragment`` goes in as its bytes)."""
    end = raw.rfind(b"}")
    if end < 0 or raw[end + 1:].strip() or not raw.lstrip().startswith(b"{"):
        raise ValueError("request body is not a JSON object")
    head = end
    while head > 0 and raw[head - 1] in b" \t\r\n":
        head -= 1
    sep = b"" if raw[head - 1] == 0x7B else b","  # {
    return b"".join((memoryview(raw)[:head], sep, orjson.dumps(key), b":", orjson.dumps(value), b"}"))


# ------------------------------------------------------------------------------------------ top-level members
_WS = re.compile(rb"[ \t\n\r]*")
_STRUCTURAL = re.compile(rb'["\[\]{}]')
_SCALAR_END = re.compile(rb"[,}\] \t\n\r]")


def _skip_ws(raw: bytes, i: int) -> int:
    """Index of the first non-whitespace byte of ``raw`` at or after ``i``."""
    m = _WS.match(raw, i)
    return m.end() if m else i


def _string_end(raw: bytes, i: int) -> int:
    """Index just past the JSON string starting at ``raw[i] == '"'``."""
    j = i + 1
    while True:
        j = raw.find(b'"', j)
        if j < 0:
            raise ValueError("unterminated string in request body")
        k = j - 1
        while raw[k] == 0x5C:  # backslash
            k -= 1
        if (j - 1 - k) % 2 == 0:  # an even number of backslashes: the quote is not escaped
            return j + 1
        j += 1


def py_container_end(raw: bytes, i: int) -> int:
    """Index just past the object or array opening at ``raw[i]`` (valid JSON assumed: the body parsed): one regex
    step per bracket or string.  Raises ``ValueError`` when nothing closes it.  The Python twin of the compiled
    ``container_end`` (``pdproxy/apis/_jsonscan.c``: ~1 ns a byte where this costs ~0.8 µs a bracket)."""
    depth, j = 0, i
    while True:
        m = _STRUCTURAL.search(raw, j)
        if m is None:
            raise ValueError("unbalanced brackets in request body")
        j = m.start()
        ch = raw[j]
        if ch == 0x22:
            j = _string_end(raw, j)
            continue
        depth += 1 if ch in b"{[" else -1
        j += 1
        if depth == 0:
            return j


CONTAINER_END: Final[Callable[[bytes, int], int]] = compiled_or("pdproxy.apis._jsonscan", "container_end",
                                                                 py_container_end)
""":func:`py_container_end`, compiled when built and ``PDPROXY_NO_EXTENSIONS`` is not set (the same ends)."""


def _value_end(raw: bytes, i: int) -> int:
    """Index just past the JSON value starting at ``raw[i]`` (valid JSON assumed: the body parsed)."""
    c = raw[i]
    if c == 0x22:  # "
        return _string_end(raw, i)
    if c in b"{[":
        return CONTAINER_END(raw, i)
    m = _SCALAR_END.search(raw, i)
    return m.start() if m else len(raw)


def top_level_members(raw: bytes) -> list[tuple[str, int, int]]:
    """``(name, start, end)`` of every member of the JSON object ``raw``: ``raw[start:end]`` is ``"name": value``
    exactly as sent (``name`` decoded from its escapes).  Cost: one pass over the structural characters, with
    long strings skipped by ``bytes.find``.  Raises ``ValueError`` if ``raw`` is not a JSON object."""
    i = _skip_ws(raw, 0)
    if i >= len(raw) or raw[i] != 0x7B:  # {
        raise ValueError("request body is not a JSON object")
    members: list[tuple[str, int, int]] = []
    i = _skip_ws(raw, i + 1)
    while i < len(raw) and raw[i] != 0x7D:  # }
        if raw[i] == 0x2C:  # ,
            i = _skip_ws(raw, i + 1)
            continue
        key_end = _string_end(raw, i)
        name = orjson.loads(raw[i:key_end])
        j = _skip_ws(raw, key_end)
        if raw[j] != 0x3A:  # :
            raise ValueError("malformed member in request body")
        j = _skip_ws(raw, j + 1)
        end = _value_end(raw, j)
        members.append((name, i, end))
        i = _skip_ws(raw, end)
    return members


def _without_members(raw: bytes, names: frozenset[str]) -> bytes:
    """``raw`` with its top-level members named in ``names`` removed; every other byte kept (each kept member
    keeps the separator that followed it, the last kept one the object's original ending)."""
    members = top_level_members(raw)
    kept = [idx for idx, (name, _, _) in enumerate(members) if name not in names]
    if len(kept) == len(members):
        return raw
    view = memoryview(raw)                           # slices without copies; the join copies once
    first_start = members[0][1]
    last_end = members[-1][2]
    out: list[bytes | memoryview] = [view[:first_start]]
    for pos, idx in enumerate(kept):
        _, start, end = members[idx]
        out.append(view[start:end])
        if pos + 1 < len(kept):                      # its own separator (", " as sent) before the next kept one
            out.append(view[end:members[idx + 1][1]])
    out.append(view[last_end:] if kept else raw[last_end:].lstrip(b", \t\n\r"))
    return b"".join(out)


# ------------------------------------------------------------------------------------------ the prefill answer
_MEMBERS = msgspec.json.Decoder(dict[str, msgspec.Raw])
"""A JSON object's top-level members, each value as its bytes (syntax checked while skipped, nothing built)."""
_EMPTY_OBJECT = re.compile(rb"\{[ \t\n\r]*\}")


def load_prefill_answer(data: bytes) -> Any:
    """A prefiller's answer ``data`` parsed as ``orjson.loads`` parses it, except that a ``kv_transfer_params``
    object with members stays bytes: a :class:`KVHandle` in its place (the last member of that name, as orjson
    keeps).  Cost: one skim of ``data`` (msgspec, validating the JSON syntax without building objects), then
    an orjson parse of each other top-level member when the handle is most of ``data`` (~26 µs for a 64K-token
    prompt's answer, whose plain parse and handle cost ~87 µs), else of ``data`` whole (~3 µs for a 100-token
    prompt's 600 bytes).  Anything else (no handle, a null or non-object handle, not an object, invalid JSON or
    UTF-8) is ``orjson.loads(data)``, which raises ``orjson.JSONDecodeError`` for what it refuses.  Nesting past
    msgspec's recursion limit (~1,000 levels, fewer down a deep call stack) raises ``orjson.JSONDecodeError`` too:
    no decoder reads a handle that deep (Python's ``json`` stops near 1,000), and orjson, which reads up to 1,023
    levels, writes no more than 254 (:meth:`KVHandle.of` would raise ``TypeError``).

    The handle's numbers are checked for syntax, not range: a number past a double's range (``1e999``, an integer
    of 400 digits), which orjson refuses, reaches the decoder as the prefiller wrote it when the handle is most of
    the answer — the decoder's JSON reader judges it (a connector's handle holds block ids, ports and names)."""
    try:
        members = _MEMBERS.decode(data)
    except msgspec.DecodeError:
        return orjson.loads(data)
    except RecursionError:
        orjson.loads(data)                  # its own refusal first, for what it refuses anyway
        raise orjson.JSONDecodeError("prefill answer nested past msgspec's recursion limit", "", 0) from None
    value = members.get(KV_TRANSFER_PARAMS)
    if value is None:
        return orjson.loads(data)
    raw = bytes(value)
    if raw[:1] != b"{" or _EMPTY_OBJECT.fullmatch(raw):
        return orjson.loads(data)
    try:
        raw.decode("utf-8")        # msgspec skips strings unchecked; a decoder gets valid JSON or nothing
    except UnicodeDecodeError:
        return orjson.loads(data)
    if len(raw) * 2 < len(data):    # a small handle: one plain parse costs less than one per member
        answer = orjson.loads(data)
    else:
        answer = {key: orjson.loads(memoryview(v)) for key, v in members.items() if key != KV_TRANSFER_PARAMS}
    answer[KV_TRANSFER_PARAMS] = KVHandle(raw)
    return answer


def extract_params(prefill_response: Mapping[str, Any]) -> KVHandle | None:
    """The ``kv_transfer_params`` of a prefiller's JSON answer as a :class:`KVHandle`, or None when
    absent/null/empty/not an object.  ``prefill_response``: :func:`load_prefill_answer`'s (the handle already
    bytes) or any parsed answer (a dict handle is serialised once).

    vLLM 0.32's NIXL connector returns a handle for a request that finished length-capped or stopped
    (``nixl/pull_scheduler.py::request_finished``); older NIXL and vLLM-Ascend's Mooncake connector only for a
    length-capped one, and no connector at all means no handle.
    """
    params = prefill_response.get(KV_TRANSFER_PARAMS)
    if isinstance(params, KVHandle):
        return params
    return KVHandle.of(params) if isinstance(params, dict) and params else None


def error_answer(prefill_response: Mapping[str, Any], endpoint: str) -> UpstreamHTTPError | None:
    """The engine's error when a prefiller answered HTTP 200 with an error object instead of a completion, else
    None: vLLM's flat ``ErrorResponse`` (``{"object": "error", "message", "type", "param", "code"}``, what older
    vLLM and some gateways send with a 200) or its envelope ``{"error": {...}}`` — never a KV connector's missing
    handle.  The error is the one an error status would have given (:class:`~pdproxy.errors.UpstreamHTTPError`):
    its status :func:`pdproxy.errors.error_status` of the object's ``code`` (the rule a decoder's in-band error
    event follows, :func:`pdproxy.apis.chat.first_event_error`), its body vLLM's envelope with the engine's own
    words, its message (the log's) naming them."""
    if prefill_response.get("object") == "error":
        inner: Any = prefill_response
    else:
        inner = prefill_response.get("error")
        if not isinstance(inner, Mapping) or _has_handle(prefill_response):
            return None
    status = error_status(inner.get("code"))
    message = inner.get("message")
    said = message if isinstance(message, str) else ""
    kind = inner.get("type")
    param = inner.get("param")
    body = {"error": {"message": said, "type": kind if isinstance(kind, str) else error_type_for(status),
                      "param": param if isinstance(param, str) else None, "code": status}}
    err = UpstreamHTTPError(status, orjson.dumps(body), endpoint=endpoint)
    err.message = f"prefiller {endpoint} answered HTTP 200 with an error object (HTTP {status}): {said!r}"
    return err


def _has_handle(prefill_response: Mapping[str, Any]) -> bool:
    """Whether the answer carries a handle (:func:`extract_params` would not be None), without serialising one."""
    params = prefill_response.get(KV_TRANSFER_PARAMS)
    return isinstance(params, KVHandle) or (isinstance(params, dict) and bool(params))


# How Responses and Messages answers say why they ended, in chat's finish_reason names (vLLM 0.32's
# ``responses/serving.py`` sets ``status`` "incomplete" with ``incomplete_details.reason "max_output_tokens"`` for
# a length cap, "completed" otherwise; ``anthropic/serving.py`` maps stop → "end_turn" / "stop_sequence", tool
# calls → "tool_use", length → "max_tokens").
# A dict, read-only by its type: looked up for every Messages prefill answer (a mapping proxy's lookup is ~2× slower).
_MESSAGES_STOP: Final[Mapping[str, str]] = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls",
                                            "max_tokens": "length"}


def finish_reason(prefill_response: Mapping[str, Any], api: Api = Api.CHAT) -> str | None:
    """Why a prefiller's JSON answer ended, in chat's terms (``stop``, ``tool_calls``, ``length``…): chat and
    completions ``choices[0].finish_reason``; Responses ``status`` (``completed`` → ``stop``, ``incomplete`` →
    ``length``); Messages ``stop_reason`` (``end_turn``/``stop_sequence`` → ``stop``, ``tool_use`` →
    ``tool_calls``, ``max_tokens`` → ``length``). None when the answer does not say."""
    if api is Api.RESPONSES:
        status = prefill_response.get("status")
        return {"completed": "stop", "incomplete": "length"}.get(status) if isinstance(status, str) else None
    if api is Api.MESSAGES:
        reason = prefill_response.get("stop_reason")
        return _MESSAGES_STOP.get(reason) if isinstance(reason, str) else None
    choices = prefill_response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        value = choices[0].get("finish_reason")
        return value if isinstance(value, str) else None
    return None


def ended_on_prefill(prefill_response: Mapping[str, Any], api: Api = Api.CHAT) -> bool:
    """True when the prefiller finished the request itself (EOS, a stop token or string, a tool call that ended
    the turn: :func:`finish_reason` ``stop`` / ``tool_calls``) and handed over no KV: its answer is the complete
    answer, not a broken handoff.  An answer capped by the leg's one-token limit without a handle means the
    prefiller has no KV connector."""
    return not _has_handle(prefill_response) and finish_reason(prefill_response, api) in _COMPLETE_FINISH


def prefill_prompt_tokens(prefill_response: Mapping[str, Any], api: Api = Api.CHAT) -> int | None:
    """The prompt's tokens in the prefiller's usage, as the engine tokenized it (chat template included), which
    admission may only have estimated: ``usage.prompt_tokens`` (chat, completions), ``usage.input_tokens``
    (Responses), ``input_tokens`` + ``cache_read_input_tokens`` + ``cache_creation_input_tokens`` (Messages, whose
    ``input_tokens`` is net of the cache)."""
    usage = prefill_response.get("usage")
    if type(usage) is not dict and not isinstance(usage, Mapping):
        return None
    if api is Api.MESSAGES:
        parts = [usage.get(k) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")]
        nums = [p for p in parts if isinstance(p, int) and not isinstance(p, bool)]
        return sum(nums) if isinstance(parts[0], int) else None
    value = usage.get("input_tokens" if api is Api.RESPONSES else "prompt_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def prefill_cached_tokens(prefill_response: Mapping[str, Any], api: Api = Api.CHAT) -> int | None:
    """The prefiller's real prefix-cache hits in its answer: ``usage.prompt_tokens_details.cached_tokens`` (chat,
    completions), ``usage.input_tokens_details.cached_tokens`` (Responses), ``usage.cache_read_input_tokens``
    (Messages); None when absent.

    The decoder reports nearly the whole prompt as cached because it pulled it (vLLM ``v1/metrics/stats.py``
    counts local and external hits alike; 0 with NIXL on vLLM 0.32), so the client must see the prefiller's figure.
    """
    usage = prefill_response.get("usage") or {}
    if type(usage) is not dict and not isinstance(usage, Mapping):
        return None
    if api is Api.MESSAGES:
        value = usage.get("cache_read_input_tokens")
    else:
        details = usage.get("input_tokens_details" if api is Api.RESPONSES else "prompt_tokens_details") or {}
        value = details.get("cached_tokens") if type(details) is dict or isinstance(details, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
