"""Every other vLLM route a client uses, passed through to one engine serving the request's model.

PD disaggregation is for generation; these routes run whole on one engine (vLLM 0.32,
``docs/apis-through-pd.md`` "Routes by model kind"): tokenizing (``/tokenize``, ``/detokenize``,
``/v1/messages/count_tokens``), the scale-out render routes (exact prompt token ids) and tokens-in/tokens-out
``/inference/v1/generate``, the pooling routes (``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score``,
``/rerank``, …; a pooling model, ``--runner pooling``) and speech-to-text (``/v1/audio/transcriptions``, multipart).

**Which engine.**  The scheduler's decode profile first, then its prefill profile (:meth:`Scheduler.pick`: healthy,
not draining, breaker closed, serving ``model``, DP rank), so a pooling or audio engine is reached by naming its
model; a request for a model nobody serves is vLLM's 404 before any engine is contacted
(:meth:`~pdproxy.engines.models.ServedModels.require`; the Anthropic envelope on ``count_tokens``).  The model is
the JSON body's ``model``, or the ``model`` field of a multipart form.

**Failover**, before any byte reached the client: a refused / reset connection or a 502/503/504 tries the next
engine (breaker fed, ``Retry-After`` honoured); an engine that does not serve the route at all — FastAPI's 404
``{"detail": "Not Found"}``, what vLLM answers for a pooling route on a generate model and the reverse — tries the
next engine without counting against it, and when none serves it the client gets a 404 in the OpenAI envelope
naming the route.  When every engine tried failed, the client gets the last one's own 5xx answer as it sent it,
or — none answered (refused, reset, timed out, an empty 2xx) — the PD routes' 503 with ``Retry-After`` until a
breaker re-admits one (:meth:`~pdproxy.errors.EnginesFailed.after`).  Any other status (4xx, 500) is the engine's
answer, relayed as is; a 5xx among them counts
against the engine's breaker (:func:`pdproxy.errors.classify_status`: engine unwell).  An engine that breaks after
its first byte (a reset, a time-out mid-answer) is never retried; it counts against its breaker, and the client's
body ends as a PD route's broken stream does: an SSE stream with vLLM's error event and ``data: [DONE]``, any other
body cut before its end (tests/reliability/test_passthrough_cut.py).  One that sends no answer at all within
``decode_first_byte_timeout_s`` is the client's 504, neither judged nor retried: a long answer is not a hung engine
(:class:`_Unanswered`, tests/reliability/test_passthrough_long_answer.py).  A half-open breaker's one
trial ends with every attempt: judged, or given back when the attempt says nothing of the engine (a 4xx, the
client leaving) — tests/reliability/test_passthrough_trial.py.

**Generation** (``/inference/v1/generate``, whole on one engine: no prefill queue, no PD): its prompt is the body's
``token_ids``, counted exactly, so it meets the limits the PD routes' admission applies (README "admit"): it goes
only to an engine whose ``max_model_len`` and KV pool (less vLLM's null block) hold the prompt and one output token
(the scheduler's ``FitsLimits``), none such is vLLM's 400 "maximum context length" before any engine is contacted,
and on an engine whose pool is below what the prompt and its output limit need (``max_tokens``: null means the
room ``max_model_len`` leaves, absent 16) ``sampling_params.max_tokens`` is lowered to the pool's room, shared by ``n``
(:func:`generate_output_room`; the decode leg's ``output_room`` in pdproxy/pd/decode.py): a request outgrowing the
pool preempts itself and waits forever, holding every request queued behind it (vLLM-Ascend 0.23
in docs/field-reports.md; ``vllm/v1/core/sched/scheduler.py``, ``schedule``) — one such request froze the engine.

**Transport**: httpx (control-plane style), not the data-plane client of :mod:`pdproxy.http.upstream`: these routes are
not on the hot path, they need arbitrary bodies (multipart uploads) and content types, and their answers are
relayed chunk by chunk as the engine writes them (``/inference/v1/generate`` streams SSE).  Timeouts: connect
``connect_timeout_s``; each read (the headers included) ``decode_first_byte_timeout_s``.  Headers to the engine:
the client's ``Content-Type`` and ``Accept``, one ``X-Request-Id``, ``Authorization`` by the rule of
:mod:`pdproxy.http.engine_headers`, the DP-rank pin.

**The body** (:func:`engine_body`): a JSON body is read with the limits of every route (strict JSON,
``max_json_depth``, ``max_body_bytes``) and reaches the engine without the fields the proxy owns
(``kv_transfer_params``, ``ec_transfer_params``: a client must never make an engine pull KV from a host it names,
``docs/threat-model.md``); a multipart form is parsed in linear time and refused if it sets them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

import httpx
import orjson
from pydantic import TypeAdapter, ValidationError
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from pdproxy.apis.kv_transfer import PROXY_OWNED, client_handle_fault, decode_body_bytes
from pdproxy.apis.request import Api, load_json, load_json_object
from pdproxy.apis.streams import error_json
from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.health import HealthMonitor, Verdict
from pdproxy.engines.limits import EngineLimits, Limits
from pdproxy.engines.models import ServedModels
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import (
    ENGINE_TEXT_CHARS,
    Action,
    BadRequest,
    EnginesFailed,
    ModelNotFound,
    NotFound,
    ProxyError,
    UpstreamHTTPError,
    UpstreamUnavailable,
    classify_status,
    sse_error_event,
)
from pdproxy.http import sse
from pdproxy.http.engine_headers import TRACE_HEADERS, EngineHeaders, forwardable
from pdproxy.http.errors import httpx_error, httpx_errors
from pdproxy.pd.decode import routing_headers
from pdproxy.scheduling import PickRequest, Scheduler
from pdproxy.settings import MAX_JSON_ITEMS, Settings
from pdproxy.timeline import RequestContext

Send = Callable[[dict[str, Any]], Awaitable[None]]

ROUTES: Final[Mapping[str, str]] = {
    "/tokenize": "tokenize", "/detokenize": "detokenize",
    "/v1/messages/count_tokens": "count_tokens",
    "/v1/chat/completions/render": "render", "/v1/completions/render": "render",
    "/v1/messages/render": "render", "/v1/responses/render": "render",
    "/v1/chat/completions/derender": "render", "/v1/completions/derender": "render",
    "/inference/v1/generate": "generate",
    "/v1/embeddings": "embeddings", "/v2/embed": "embeddings", "/pooling": "pooling", "/classify": "classify",
    "/score": "score", "/v1/score": "score", "/rerank": "rerank", "/v1/rerank": "rerank", "/v2/rerank": "rerank",
    "/v1/audio/transcriptions": "audio", "/v1/audio/translations": "audio",
}
"""Passed-through path → its ``api`` label in metrics and logs."""

MODEL_CALLS = frozenset({"tokenize", "detokenize", "count_tokens", "render"})
"""Route labels of calls about the model that start no engine request (vLLM records no latency for them): counted
in ``pdproxy_requests_total``, left out of the latency histograms (``RequestContext.engine_request``)."""

POOLING_APIS = frozenset({"embeddings", "pooling", "classify", "score", "rerank"})
"""Route labels of the pooling routes, whose unknown-model 404 vLLM words without aliases and with ``param: null``."""

ANTHROPIC_ROUTES = frozenset({"/v1/messages/count_tokens"})
"""Routes whose own errors take the Anthropic envelope."""

_OFF_LOOP_BYTES = 1 << 20
"""Bodies larger than this (uploads: python-multipart reads ~7 ns a byte here) are parsed in a worker thread."""
_MODEL_FIELD_MAX = 1024
"""Bytes of a multipart ``model`` field kept (a model id; vLLM's are far shorter)."""
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                         b"proxy-authenticate", b"proxy-authorization", b"content-length", b"server", b"date",
                         b"x-request-id"})
"""Engine response headers not relayed (hop-by-hop, framing, and the ones pdproxy sets itself)."""
_DECODED = frozenset({b"content-encoding"})
"""Also dropped from an error answer relayed whole: its body was read decoded (:func:`_read_error_body`)."""
_REWRITTEN = frozenset({b"content-encoding", b"content-type"})
"""Also dropped from an error answer whose body pdproxy rewrote (its own JSON: ``application/json``)."""


def _route_not_found(data: bytes) -> bool:
    """True for FastAPI's 404 body ``{"detail": "Not Found"}``: the engine does not serve the route at all."""
    try:
        return bool(orjson.loads(data) == {"detail": "Not Found"})
    except orjson.JSONDecodeError:
        return False


class FormFields:
    """What pdproxy reads of a ``multipart/form-data`` body (speech-to-text uploads): the ``model`` field's value
    (its first :data:`_MODEL_FIELD_MAX` bytes; of the last ``model`` field, the one FastAPI's ``Form`` reads), the
    value of every ``vllm_xargs`` field (``xargs``: vLLM parses it as JSON into the request's
    ``SamplingParams.extra_args``, where the engine reads ``kv_transfer_params`` from) and the name of every field.  Parsed by python-multipart — the parser
    vLLM's own FastAPI server reads the form with — in one pass, in linear time whatever the body holds (its state
    machine never backtracks; a part's data is skipped with ``bytes.find`` for the boundary).  Raises
    :class:`BadRequest` for a body that is not a multipart form of the boundary its ``Content-Type`` names, a
    boundary python-multipart refuses (over 256 bytes), or a ``charset`` other than UTF-8 (vLLM's parser would read
    the field names in it, where pdproxy checks them as UTF-8)."""

    def __init__(self, body: bytes, content_type: str) -> None:
        self.names: list[str] = []
        self.model: str | None = None
        self.xargs: list[bytes] = []
        _, options = parse_options_header(content_type)
        boundary = options.get(b"boundary")
        if not boundary:
            raise BadRequest("multipart/form-data without a boundary parameter", param="body")
        charset = options.get(b"charset", b"utf-8").lower()
        if charset not in (b"utf-8", b"utf8", b"us-ascii"):   # vLLM's form parser would read the names in it
            raise BadRequest("multipart/form-data is read as UTF-8: a charset parameter other than utf-8 is not "
                             "served", param="body")
        self._header = b""
        self._disposition = b""
        self._value = b""
        self._xargs = bytearray()
        self._name: str | None = None
        try:
            parser = MultipartParser(boundary, {
                "on_part_begin": self._part_begin, "on_header_field": self._header_field,
                "on_header_value": self._header_value, "on_header_end": self._header_end,
                "on_part_data": self._part_data, "on_part_end": self._part_end})
            parser.write(body)
            parser.finalize()
        except FormParserError:                           # the parser's errors, a boundary it refuses included
            raise BadRequest("There was an error parsing the body: not a multipart/form-data body of the boundary "
                             "its Content-Type names", param="body") from None

    def _part_begin(self) -> None:
        self._name, self._value = None, b""
        self._xargs = bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:     # a header name may come in pieces
        if len(self._header) < 64:
            self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        if self._header.lower() == b"content-disposition" and len(self._disposition) < 4096:
            self._disposition += data[start:end]

    def _header_end(self) -> None:
        if self._header.lower() == b"content-disposition":
            _, params = parse_options_header(self._disposition)
            name = params.get(b"name")
            self._name = name.decode("utf-8", "replace") if name is not None else None
        self._header = self._disposition = b""

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name == "model" and len(self._value) < _MODEL_FIELD_MAX:
            self._value += data[start:min(end, start + _MODEL_FIELD_MAX - len(self._value))]
        elif self._name == "vllm_xargs":                  # whole: it is checked as vLLM reads it (engine_body)
            self._xargs += data[start:end]

    def _part_end(self) -> None:
        if self._name is not None:
            self.names.append(self._name)
            if self._name == "model":                     # the last one, as FastAPI's Form(...) reads it
                self.model = self._value.decode("utf-8", "replace").strip() or None
            elif self._name == "vllm_xargs":
                self.xargs.append(bytes(self._xargs))


ERROR_BODY_MAX_BYTES = 1 << 20
"""The most of a 404 or a failed-over 5xx answer's body read (what an ``UpstreamHTTPError`` keeps of any engine's)."""


async def _read_error_body(resp: httpx.Response, limit: int, timeout_s: float) -> tuple[bytes, bool]:
    """The start of an error answer's body: at most ``limit`` bytes (decoded as httpx decodes it), read within
    ``timeout_s`` seconds in all, and whether that was the whole body; the rest is never read (the caller closes
    the response).  vLLM sends an error's small JSON body at once; one that goes on (an engine
    or a gateway trickling bytes, or sending without end) is not read on — before, a 503 whose body never ended
    held the client's request for as long as the engine kept writing, every byte in memory."""
    data = bytearray()
    whole = False
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in resp.aiter_bytes():
                data += chunk
                if len(data) > limit:
                    break
            else:
                whole = True
    except TimeoutError:
        pass
    return bytes(data[:limit]), whole


GENERATE = "/inference/v1/generate"
"""The passthrough route that generates (tokens in, tokens out): admitted against the engines' limits."""


SAMPLING_DEFAULT_MAX_TOKENS = 16
"""``SamplingParams.max_tokens``' default (``vllm/sampling_params.py``): a generate body without it asks for 16."""
_LAX_INT: TypeAdapter[int | None] = TypeAdapter(int | None)
"""``SamplingParams``' ``n``, ``max_tokens`` and ``min_tokens`` as vLLM's ``GenerateRequest`` validates them (pydantic,
lax: ``"4000"`` and ``4000.0`` are 4000, ``true`` is 1, None stays None); raises ``ValidationError`` otherwise."""


def generate_prompt_tokens(obj: dict[str, Any]) -> int | None:
    """The prompt length (tokens) of a ``/inference/v1/generate`` body ``obj``: its ``token_ids`` list's length
    (``vllm/entrypoints/serve/scale_out/token_in_token_out/protocol.py``); None when it has none (the engine
    judges the body)."""
    ids = obj.get("token_ids")
    return len(ids) if type(ids) is list else None


def generate_output_room(obj: dict[str, Any], prompt: int, limits: EngineLimits) -> int | None:
    """The ``sampling_params.max_tokens`` (≥ 1) a generate body ``obj`` of ``prompt`` tokens must carry for its
    answer to fit an engine of ``limits``' KV pool (less vLLM's null block), shared by ``sampling_params.n`` (both
    read as vLLM reads them: ``"4000"`` is 4000); None when the limit the engine would apply fits — the client's
    ``max_tokens`` (absent: :data:`SAMPLING_DEFAULT_MAX_TOKENS`; null: the room ``max_model_len`` leaves) — or the
    pool is unknown."""
    params = obj.get("sampling_params")
    params = params if isinstance(params, dict) else {}
    try:                      # as vLLM's pydantic reads them (lax): "4000" and 4000.0 are 4000, true is 1
        n = _LAX_INT.validate_python(params.get("n"))
        asked = _LAX_INT.validate_python(params.get("max_tokens", SAMPLING_DEFAULT_MAX_TOKENS))  # null: the
    except ValidationError:   # room max_model_len leaves; not an integer at all: the engine judges (and refuses) it
        return None
    return limits.output_room(prompt, asked, n if n is not None and n > 1 else 1)


def with_generate_output_limit(obj: dict[str, Any], limit: int) -> bytes:
    """The generate body ``obj`` (parsed, without proxy-owned members) re-encoded with ``sampling_params.max_tokens``
    set to ``limit`` and a ``min_tokens`` above it lowered to it (vLLM refuses ``min_tokens`` over ``max_tokens``:
    ``vllm/sampling_params.py``)."""
    params = obj.get("sampling_params")
    params = dict(params) if isinstance(params, dict) else {}
    params["max_tokens"] = limit
    try:
        low = _LAX_INT.validate_python(params.get("min_tokens"))
    except ValidationError:
        low = None
    if low is not None and low > limit:
        params["min_tokens"] = limit
    return orjson.dumps({k: v for k, v in obj.items() if k not in PROXY_OWNED} | {"sampling_params": params})


def engine_body(body: bytes, content_type: str, max_depth: int,
                max_items: int = MAX_JSON_ITEMS) -> tuple[bytes, str | None]:
    """``(the body to send an engine, the model it names)`` for a passthrough request.

    A ``multipart/form-data`` body (:class:`FormFields`) is sent as it came; a form field a client may not set
    (:data:`~pdproxy.apis.kv_transfer.PROXY_OWNED`) is refused, and so is a ``vllm_xargs`` field (a JSON string
    vLLM's speech-to-text routes parse into ``SamplingParams.extra_args``) that sets one or that pdproxy cannot
    read as strict JSON.  Any other body is read as the JSON object every
    vLLM route takes (:func:`~pdproxy.apis.request.load_json_object`: strict JSON, ``max_depth`` levels and
    ``max_items`` items at most —
    a body vLLM might read but pdproxy cannot is refused rather than passed unread) and sent without the
    proxy-owned members (:func:`~pdproxy.apis.kv_transfer.decode_body_bytes`, byte-faithful otherwise), so no
    client names the engine-side memory or host an engine transfers KV with.  The model is the form's or the
    object's ``model`` (None when it names none: any engine may take it).  Raises :class:`BadRequest` (vLLM's 400
    envelope)."""
    if content_type.lower().startswith("multipart/form-data"):
        form = FormFields(body, content_type)
        owned = PROXY_OWNED.intersection(form.names)
        if owned:
            raise BadRequest(f"{min(owned)} is set by pdproxy, never by a client", param=min(owned))
        for raw in form.xargs:
            try:
                xargs = load_json(raw, max_depth, max_items)
            except BadRequest:
                raise BadRequest("Failed to parse vllm_xargs: pdproxy reads it as strict JSON (RFC 8259)",
                                 param="vllm_xargs") from None
            fault = client_handle_fault({"vllm_xargs": xargs})
            if fault is not None:
                raise BadRequest(f"{fault} is set by pdproxy, never by a client", param="vllm_xargs")
        return body, form.model
    obj = load_json_object(body, max_depth, max_items)
    return json_engine_body(body, obj)


def json_engine_body(body: bytes, obj: dict[str, Any]) -> tuple[bytes, str | None]:
    """:func:`engine_body` of a JSON ``body`` already parsed as ``obj``."""
    fault = client_handle_fault(obj)
    if fault is not None:
        raise BadRequest(f"{fault} is set by pdproxy, never by a client", param=fault.split(".")[0])
    model = obj.get("model")
    return decode_body_bytes(body, None, obj), model if isinstance(model, str) and model else None


class _Unanswered(Exception):
    """An engine took a passthrough request and sent no answer within ``decode_first_byte_timeout_s`` (``error``:
    the 504 the client gets).  vLLM answers a non-streamed request only once it is done, so a long answer the client
    asked for — a generate request of many output tokens, a large pooling batch, a long audio file — cannot be told
    from a hung engine here: it is no verdict on the engine's breaker, and no other engine is tried (it would take
    as long).  Judged as a failure, three such requests from any client opened the breaker of every engine of both
    roles (each was tried on every engine in turn): every request of every route was a 503.  A hung engine is still
    found by the PD legs' first-byte timeouts, a stream's silence and the health probes."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(error.message)
        self.error = error


class Passthrough:
    """Serves the :data:`ROUTES` (module docstring) on raw ASGI.  ``scheduler`` picks the engine, ``served`` knows
    which models exist, ``pool`` holds a lease on the engine while the call runs (its in-flight count),
    ``health`` hears each attempt's verdict, ``headers`` builds the engine headers, ``limits`` are the engines'
    limits a generate request is admitted against (module docstring; None: not checked).  :meth:`aclose` closes
    the httpx client (the app's lifespan does)."""

    def __init__(self, settings: Settings, *, scheduler: Scheduler, served: ServedModels, pool: EndpointPool,
                 health: HealthMonitor, headers: EngineHeaders, limits: Limits | None = None) -> None:
        self.settings = settings
        self.limits = limits
        self.scheduler = scheduler
        self.served = served
        self.pool = pool
        self.health = health
        self.headers = headers
        timeout = httpx.Timeout(settings.decode_first_byte_timeout_s, connect=settings.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024,
                                                                             max_keepalive_connections=64))

    async def aclose(self) -> None:
        """Close the engine connections."""
        await self.client.aclose()

    def _candidates(self, request: PickRequest, tried: list[Endpoint]) -> Endpoint | None:
        """The next engine to try: decoders first, then prefillers; None when every one was tried."""
        for role in (Role.DECODE, Role.PREFILL):
            try:
                return self.scheduler.pick(role, request, tried, capacity=False)
            except ProxyError:
                continue
        return None

    def _engine_headers(self, endpoint: Endpoint, ctx: RequestContext, client: dict[bytes, str]) -> dict[str, str]:
        headers = self.headers.leg(endpoint, ctx.request_id, ctx.authorization)
        for name in (b"content-type", b"accept", *TRACE_HEADERS):  # no pdproxy span here: the client's context
            value = client.get(name)
            if value is not None and forwardable(name, value):
                headers[name.decode().title()] = value
        return headers

    async def serve(self, path: str, body: bytes, client: dict[bytes, str], ctx: RequestContext, send: Send,
                    anthropic: bool = False) -> None:
        """Pass ``body`` (``POST path``, the client's ``client`` headers) to an engine and relay its answer to
        ``send``.  Raises :class:`ProxyError` while nothing was sent (404 for an unknown model or a route no engine
        serves, 503 when no engine can take it; when every engine tried failed, the last one's own 5xx answer, else
        :class:`~pdproxy.errors.EnginesFailed`: 503 with Retry-After)."""
        ctype = client.get(b"content-type", "")
        generate: dict[str, Any] | None = None          # a generate request's parsed body (module docstring)
        prompt: int | None = None
        if path == GENERATE and self.limits is not None and not ctype.lower().startswith("multipart/form-data"):
            read = (asyncio.to_thread(load_json_object, body, self.settings.max_json_depth,
                                      self.settings.max_json_items) if len(body) > _OFF_LOOP_BYTES else None)
            generate = (await read if read is not None else
                        load_json_object(body, self.settings.max_json_depth, self.settings.max_json_items))
            body, model = json_engine_body(body, generate)
            prompt = generate_prompt_tokens(generate)
        elif len(body) > _OFF_LOOP_BYTES:                # an upload: parsed (linear, pure Python) off the event loop
            body, model = await asyncio.to_thread(engine_body, body, ctype, self.settings.max_json_depth,
                                                  self.settings.max_json_items)
        else:
            body, model = engine_body(body, ctype, self.settings.max_json_depth, self.settings.max_json_items)
        ctx.model = model
        try:
            self.served.require(model)
        except ModelNotFound as exc:
            if ROUTES.get(path) in POOLING_APIS:
                raise exc.on_pooling_route() from None
            raise
        if prompt is not None and self.limits is not None:
            self._admit_generate(prompt, model)
        request = PickRequest(request_id=ctx.request_id, model=model, prompt_tokens=prompt, whole=prompt is not None)
        tried: list[Endpoint] = []
        last: ProxyError | None = None
        not_served = 0
        while (endpoint := self._candidates(request, tried)) is not None:
            tried.append(endpoint)
            if endpoint.role is Role.DECODE:                # the engine that served it (logs, routing header)
                ctx.prefiller, ctx.decoder, ctx.decoder_dp_rank = None, endpoint.name, endpoint.dp_rank
            else:
                ctx.prefiller, ctx.decoder = endpoint.name, None
            # from the pick on: an attempt that ends without a verdict (the client left, a defect, _Unanswered) is
            # neutral on exit, so a half-open trial the pick took is given back (engines/health.py Verdict)
            with self.pool.lease(endpoint, 0), self.health.judging(endpoint) as verdict:
                sent = body
                if generate is not None and prompt is not None and self.limits is not None:
                    room = generate_output_room(generate, prompt, self.limits.of(endpoint))
                    if room is not None:
                        sent = with_generate_output_limit(generate, room)
                try:
                    outcome = await self._attempt(endpoint, path, sent, client, ctx, send, verdict)
                except ProxyError as exc:
                    if not verdict.error(exc):
                        raise
                    last = exc
                    continue
                except _Unanswered as late:      # no verdict on the engine, and no other engine tried (_Unanswered)
                    raise late.error from None
            if outcome == "not_served":
                not_served += 1
                continue
            return
        if last is not None and not not_served:      # every engine tried failed: an engine's own 5xx as it sent it,
            # else (refused, reset, timed out) the PD path's 503 with Retry-After until a breaker re-admits one
            raise EnginesFailed.after(tried[-1].role, last, self.health.retry_after_s(tried))
        if not tried:                                    # the scheduler's reason (503, or 404 for the model)
            self.scheduler.pick(Role.DECODE, request, capacity=False)
        raise NotFound(f"no engine serves {path}" + (f" for model {model}" if model else "") +
                       f" ({not_served} answered 404 Not Found for that route)", param=None)

    def _admit_generate(self, prompt: int, model: str | None) -> None:
        """Raise vLLM's 400 "maximum context length" (:class:`~pdproxy.errors.PromptTooLong`) when no engine of
        either role serving ``model`` takes a generate prompt of ``prompt`` tokens and one output token."""
        assert self.limits is not None
        refusal = None
        for role in (Role.DECODE, Role.PREFILL):
            if not any(model is None or self.served.serves(e, model) for e in self.pool.endpoints(role)):
                continue                                  # no engine of this role serves it: no say
            found = self.limits.violation(prompt, None, roles=(role,), model=model, rule=Role.DECODE)
            if found is None:
                return
            refusal = refusal or found
        if refusal is not None:
            raise refusal.error(prompt, exact=True)

    async def _attempt(self, endpoint: Endpoint, path: str, body: bytes, client: dict[bytes, str],
                       ctx: RequestContext, send: Send, verdict: Verdict) -> str:
        """One engine: ``"done"`` when its answer was relayed, ``"not_served"`` when it does not serve the route
        (``verdict``: the attempt's verdict on the engine, given here unless it raises).
        Raises :class:`ProxyError` for a failure worth another engine, and :class:`UpstreamHTTPError` for an error
        answer that is not JSON, for the route to answer in its envelope (nothing was sent either way)."""
        who = f"{endpoint.role.value} {endpoint.name}"
        request = self.client.build_request("POST", endpoint.url + path, content=body,
                                            headers=self._engine_headers(endpoint, ctx, client))
        with httpx_errors(who, endpoint.name, f" on {path}"):
            try:
                resp = await self.client.send(request, stream=True)
            except httpx.ReadTimeout as exc:          # no answer yet: a long one, or a hung engine (_Unanswered)
                raise _Unanswered(httpx_error(exc, who, endpoint.name, f" on {path}")) from None
        async with contextlib.aclosing(resp):   # the engine's connection back to the pool, or closed
            retry = resp.status_code >= 500 and classify_status(resp.status_code).action is Action.FAIL_OVER
            if resp.status_code == 404 or retry:
                with httpx_errors(who, endpoint.name, f" on {path}"):
                    data, whole = await _read_error_body(resp, ERROR_BODY_MAX_BYTES,
                                                         self.settings.decode_first_byte_timeout_s)
                if resp.status_code == 404 and not whole:    # no vLLM 404: a broken engine's, tried elsewhere
                    raise UpstreamUnavailable(f"{who} answered 404 with a body that did not end within "
                                              f"{self.settings.decode_first_byte_timeout_s:g} s or "
                                              f"{ERROR_BODY_MAX_BYTES:,} bytes", endpoint=endpoint.name,
                                              public="the engine answered 404 with a body that did not end")
                if resp.status_code == 404 and _route_not_found(data):
                    verdict.neutral()
                    return "not_served"
                if retry:
                    raise UpstreamHTTPError(resp.status_code, data, endpoint=endpoint.name,
                                            content_type=resp.headers.get("content-type", "application/json"),
                                            retry_after=resp.headers.get("retry-after"))
                await self._relay_whole(resp.status_code, resp.headers, self._error_body(path, resp, data), ctx,
                                        send, path in ANTHROPIC_ROUTES)
                verdict.neutral()
                return "done"
            if resp.status_code >= 400 and "json" not in resp.headers.get("content-type", "").lower():
                # not vLLM's JSON error (its server's plain-text refusal of a head too large, a gateway's page):
                # raised, so the route answers it in its API's envelope (OpenAI's, or Anthropic's on
                # /v1/messages/count_tokens) with the start of the engine's text and its Retry-After
                with httpx_errors(who, endpoint.name, f" on {path}"):
                    data, _ = await _read_error_body(resp, ENGINE_TEXT_CHARS,
                                                     self.settings.decode_first_byte_timeout_s)
                raise UpstreamHTTPError(resp.status_code, data, endpoint=endpoint.name,
                                        retry_after=resp.headers.get("retry-after"))
            if resp.status_code >= 400 and path in ANTHROPIC_ROUTES:   # a JSON error, in Anthropic's envelope
                with httpx_errors(who, endpoint.name, f" on {path}"):
                    data, whole = await _read_error_body(resp, ERROR_BODY_MAX_BYTES,
                                                         self.settings.decode_first_byte_timeout_s)
                if not whole:      # an error answer cut short: the engine's failure, as a relayed body cut is
                    raise UpstreamUnavailable(f"{who} answered {resp.status_code} with a body that did not end within "
                                              f"{self.settings.decode_first_byte_timeout_s:g} s or "
                                              f"{ERROR_BODY_MAX_BYTES:,} bytes", endpoint=endpoint.name,
                                              public=f"the engine answered {resp.status_code} with a body that did "
                                                     "not end")
                await self._relay_whole(resp.status_code, resp.headers, self._error_body(path, resp, data), ctx,
                                        send, True)
                broken = False
            else:
                broken = await self._relay_stream(resp, endpoint, ctx, send, verdict)
        if broken:                          # cut mid-answer: already told to the breaker (_relay_stream)
            return "done"
        if resp.status_code < 400:
            verdict.success()
        elif resp.status_code < 500:        # the request's own fault: no verdict on the engine, its trial given back
            verdict.neutral()
        else:                               # a 5xx relayed as the answer: judged as the PD legs judge one
            verdict.error(UpstreamHTTPError(   # (pdproxy.errors.classify: Retry-After kept)
                resp.status_code, b"", endpoint=endpoint.name, retry_after=resp.headers.get("retry-after")))
        return "done"

    @staticmethod
    def _error_body(path: str, resp: httpx.Response, data: bytes) -> bytes:
        """An engine's JSON error body ``data`` as relayed on ``path``: as it came, except on the
        :data:`ANTHROPIC_ROUTES`, where one in vLLM's OpenAI envelope (its request validation errors, on every route)
        is put in Anthropic's (:func:`pdproxy.apis.streams.error_json`) — an Anthropic client reads ``error.type``.
        A body cut short (:func:`_read_error_body`) is no JSON: the envelope words the status and its start."""
        if path not in ANTHROPIC_ROUTES:
            return data
        return error_json(Api.MESSAGES, UpstreamHTTPError(resp.status_code, data,
                                                          content_type=resp.headers.get("content-type", "")))

    def _headers_out(self, headers: httpx.Headers, ctx: RequestContext) -> list[tuple[bytes, bytes]]:
        """The engine's response headers for the client (hop-by-hop ones dropped), plus ``x-pdproxy-decoder`` /
        ``x-pdproxy-prefiller`` naming the engine when ``expose_routing_headers`` is set."""
        out = [(k, v) for k, v in headers.raw if k.lower() not in _HOP_BY_HOP]
        if self.settings.expose_routing_headers:
            out.extend(routing_headers(ctx))
        return out

    @staticmethod
    def _who(ctx: RequestContext) -> str:
        return ctx.decoder or ctx.prefiller or ""

    async def _relay_whole(self, status: int, headers: httpx.Headers, data: bytes, ctx: RequestContext,
                           send: Send, rewritten: bool) -> None:
        """An engine's error answer ``data`` (read by :func:`_read_error_body`: decoded, so its
        ``content-encoding`` is dropped) relayed whole with ``status``; ``rewritten``: pdproxy's JSON in place of the
        engine's body (its ``content-type`` is then ``application/json``)."""
        ctx.status = status
        ctx.outcome = "upstream_rejected" if status < 500 else "upstream_error"
        ctx.timeline.first_token_at = ctx.timeline.last_token_at = time.monotonic()
        drop = _REWRITTEN if rewritten else _DECODED
        out = [(k, v) for k, v in self._headers_out(headers, ctx) if k.lower() not in drop]
        if rewritten:
            out.append((b"content-type", b"application/json"))
        await send({"type": "http.response.start", "status": status,
                    "headers": out + [(b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    async def _relay_stream(self, resp: httpx.Response, endpoint: Endpoint, ctx: RequestContext,
                            send: Send, verdict: Verdict) -> bool:
        """The engine's (``endpoint``'s) status, headers and body as they come (chunked).  Returns True when the
        engine broke after the first byte: that failure (``httpx_error``'s, "…; the response is incomplete") is
        told to its breaker (as a decoder lost mid-stream is, pdproxy/pd/decode.py), before the client's body
        ends; the status line is out, so that body ends the way a PD route's broken stream does — an SSE body
        cut between events gets vLLM's error event and ``data: [DONE]`` (:func:`pdproxy.errors.sse_error_event`),
        any other body (JSON, an SSE event half sent) is cut: the response is left unfinished, which pdproxy's
        server ends by closing the connection before the body's end (no last chunk), so no client reads it as
        whole.  A 2xx SSE body that ended without ever holding a ``data: [DONE]`` line (:class:`sse.DoneWatch`;
        comments after it are fine; a compressed body — a ``content-encoding`` — is not read, so not judged, and
        never gets an event appended) is broken the same way: vLLM's streaming routes
        here (``/inference/v1/generate``: ``scale_out/token_in_token_out/serving.py``; speech-to-text:
        ``speech_to_text/base/serving.py``) always end with it, errors included, so a stream ended before it is cut
        (an engine that died after a whole event) and must not read as a whole answer.  Raises
        :class:`UpstreamUnavailable` (502, another engine is tried) for a 2xx whose body ended
        empty: no client gets a 200 with an empty body (vLLM's routes always answer a JSON or SSE body)."""
        ctx.status = resp.status_code
        if resp.status_code >= 400:
            ctx.outcome = "upstream_rejected" if resp.status_code < 500 else "upstream_error"
        started = False
        tail = b""                                          # the body's last bytes relayed (an event boundary?)
        keep = sse.DONE_TAIL_BYTES
        encoded = resp.headers.get("content-encoding", "identity").strip().lower() not in ("", "identity")
        sse_body = not encoded and "text/event-stream" in resp.headers.get("content-type", "").lower()
        done = sse.DoneWatch()
        failure: ProxyError | None = None
        try:
            async for chunk in resp.aiter_raw():
                if not started:
                    ctx.timeline.first_token_at = time.monotonic()
                    await send({"type": "http.response.start", "status": resp.status_code,
                                "headers": self._headers_out(resp.headers, ctx)})
                    started = True
                if chunk:
                    ctx.events += 1
                    tail = chunk[-keep:] if len(chunk) >= keep else (tail + chunk)[-keep:]
                    if sse_body:
                        done.feed(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            if not started:
                raise httpx_error(exc, f"engine {self._who(ctx)}", self._who(ctx), " before its answer") from None
            if not done.seen:          # after its data: [DONE] the answer was whole: a connection ended untidily
                failure = httpx_error(exc, f"engine {self._who(ctx)}", self._who(ctx), " mid-answer")
                failure.note("; the response is incomplete")
        if failure is None and started and sse_body and 200 <= resp.status_code < 300 and not done.seen:
            end = "ended the stream without data: [DONE]; the response may be incomplete"
            failure = UpstreamUnavailable(f"engine {endpoint.name} {end}", endpoint=endpoint.name,
                                          public=f"the engine {end}")
        if failure is not None:
            ctx.outcome = "upstream_error"
            ctx.error = failure.message
            ctx.timeline.last_token_at = time.monotonic()
            verdict.error(failure)
            if sse_body and (tail.endswith(b"\n\n") or tail.endswith(b"\r\n\r\n")):
                await send({"type": "http.response.body", "body": sse_error_event(failure) + sse.DONE_EVENT})
            return True                                     # else unfinished: the server cuts the body
        if not started:
            if 200 <= resp.status_code < 300:   # an engine's success with nothing in it (it ended its stream at
                # once: a crash after the status line): never relayed as an empty 200, another engine is tried
                who = self._who(ctx)
                raise UpstreamUnavailable(f"engine {who} answered {resp.status_code} with an empty body",
                                          endpoint=who)
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": self._headers_out(resp.headers, ctx)})
        ctx.timeline.last_token_at = time.monotonic()
        await send({"type": "http.response.body", "body": b""})
        return False


class TrackedSend:
    """An ASGI ``send`` that remembers whether the response started and ended, and adds ``headers`` (the
    proxy's own, e.g. ``x-request-id``) to its status line."""

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        self.send = send
        self.headers = headers
        self.started = False
        self.ended = False

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            message = {**message, "headers": list(message.get("headers") or []) + self.headers}
        elif not message.get("more_body", False):
            self.ended = True
        await self.send(message)
