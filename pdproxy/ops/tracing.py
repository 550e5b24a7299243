"""OpenTelemetry traces of the request path, off by default and then free.

With ``otlp_traces_endpoint`` set (vLLM's ``--otlp-traces-endpoint``), every completion request is one span with
children for each step (:mod:`pdproxy.ops.tracing_otel` builds them with the OpenTelemetry SDK):

- ``chat {model}`` / ``text_completion {model}`` (SERVER, the GenAI semantic-convention name
  ``{gen_ai.operation.name} {gen_ai.request.model}``): from arrival to the end of the response.  Its parent is the
  client's W3C ``traceparent`` (and ``tracestate``) when one came with the request;
- ``admission`` (INTERNAL): counting the prompt and checking the engines' limits;
- ``queue_wait`` (INTERNAL): waiting in pdproxy's prefill queue for a prefill slot (one per prefill attempt);
- ``prefill`` (CLIENT): the prefill leg's POST to one prefiller (one per attempt: a failed attempt is an error
  span, the next prefiller gets its own);
- ``decode`` (CLIENT): the decode leg, from the request sent to a decoder to the end of the relayed answer (one per
  decoder tried).

A request whose span is not sampled (the client's ``traceparent`` says so, or ``OTEL_TRACES_SAMPLER``) gets no
children; its legs carry its context, unsampled.

The ``prefill`` and ``decode`` spans are the current span while their leg's headers are built, so each engine leg
carries its span as ``traceparent``/``tracestate`` (:class:`~pdproxy.http.engine_headers.EngineHeaders`); a vLLM engine
started with ``--otlp-traces-endpoint`` then records its own ``llm_request`` span as their child in the same trace
(``vllm/v1/engine/output_processor.py``, ``do_tracing``; vLLM reads the two headers in
``vllm/entrypoints/serve/engine/serving.py``, ``_get_trace_headers``).  Attribute names: :class:`Attr`.

Off (the default): :data:`NO_TRACING`, whose hooks return one shared no-op context manager and whose
``propagate`` is None; OpenTelemetry is not imported at all, so pdproxy runs without the ``tracing`` extra.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Final

from pdproxy import settings as settings_module

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from pdproxy.apis.request import ProxyRequest
    from pdproxy.endpoints import Endpoint
    from pdproxy.settings import Settings
    from pdproxy.timeline import RequestContext



class Attr:
    """Span attribute names.  OpenTelemetry's GenAI and HTTP semantic conventions where they have one; vLLM's own
    names (``vllm/tracing/utils.py``, ``SpanAttributes``) where vLLM has one — on the request span vLLM's older
    token names are set next to the GenAI ones, so that it and vLLM's ``llm_request`` spans can be queried alike;
    ``pdproxy.*`` for what neither has.  Durations are seconds, token counts tokens; the prompt tokens are the
    prefiller's ``usage.prompt_tokens`` (the engine's count), admission's own figure is ``ADMITTED_TOKENS``."""

    OPERATION: Final = "gen_ai.operation.name"               # "chat" | "text_completion"
    REQUEST_MODEL: Final = "gen_ai.request.model"
    REQUEST_MAX_TOKENS: Final = "gen_ai.request.max_tokens"  # GenAI and vLLM
    REQUEST_ID: Final = "gen_ai.request.id"                  # vLLM: the id the engines get as X-Request-Id
    INPUT_TOKENS: Final = "gen_ai.usage.input_tokens"        # GenAI: the prefiller's count (its usage)
    OUTPUT_TOKENS: Final = "gen_ai.usage.output_tokens"      # GenAI
    CACHED_TOKENS: Final = "gen_ai.usage.cache_read.input_tokens"  # GenAI: the prefiller's prefix-cache hit
    PROMPT_TOKENS: Final = "gen_ai.usage.prompt_tokens"      # vLLM
    COMPLETION_TOKENS: Final = "gen_ai.usage.completion_tokens"  # vLLM
    TTFT: Final = "gen_ai.latency.time_to_first_token"       # vLLM (seconds, as the client sees it)
    E2E: Final = "gen_ai.latency.e2e"                        # vLLM (seconds)
    HTTP_METHOD: Final = "http.request.method"
    HTTP_ROUTE: Final = "http.route"
    HTTP_STATUS: Final = "http.response.status_code"
    SERVER_ADDRESS: Final = "server.address"                 # the engine of a leg
    SERVER_PORT: Final = "server.port"
    ERROR_TYPE: Final = "error.type"                         # the error's class name, or "cancelled"
    ENDPOINT: Final = "pdproxy.endpoint"                     # the engine's name in pdproxy (URL, "#dpN" for a rank)
    ROLE: Final = "pdproxy.role"                             # "prefill" | "decode"
    DP_RANK: Final = "pdproxy.dp_rank"                       # the DP rank the leg was pinned to (internal DP)
    STREAM: Final = "pdproxy.stream"
    DISAGGREGATED: Final = "pdproxy.disaggregated"           # False: the decoder prefilled the prompt itself
    ADMITTED_TOKENS: Final = "pdproxy.admission.prompt_tokens"  # what admission judged by: exact when it had to
    #                                                        count, else an estimate under the byte bound
    PREFILLER: Final = "pdproxy.prefiller"                   # on the request span: the endpoints finally used
    DECODER: Final = "pdproxy.decoder"
    OUTCOME: Final = "pdproxy.outcome"                       # the relay's verdict when it is not "ok"


class NoSpan:
    """The no-op context manager every hook of :class:`Tracing` returns when tracing is off (one shared
    instance, :data:`NO_SPAN`: entering and leaving it costs two method calls)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


NO_SPAN: Final = NoSpan()

SpanScope = AbstractContextManager[None]
"""What a hook returns: a context manager around one step (entering starts the span as the current one, leaving
ends it; an exception leaving it is recorded on it and passed on)."""


class Tracing:
    """The tracing hooks of the request path.  This base class is tracing off: every hook returns
    :data:`NO_SPAN`, :attr:`propagate` is None.  :class:`pdproxy.ops.tracing_otel.OtelTracing` is tracing on.

    ``propagate``: None, or a function that adds the current trace context to a dict of engine-leg headers
    (``traceparent``, ``tracestate``).
    """

    __slots__ = ()
    enabled: bool = False
    propagate: Callable[[dict[str, str]], None] | None = None

    def request(self, req: ProxyRequest, ctx: RequestContext) -> SpanScope:
        """The request's span (the parent of every other), around ``Director.serve``."""
        return NO_SPAN

    def admission(self, ctx: RequestContext) -> SpanScope:
        """Around admission (prompt counted, limits checked, path chosen)."""
        return NO_SPAN

    def queue_wait(self, ctx: RequestContext) -> SpanScope:
        """Around the wait for a prefill slot."""
        return NO_SPAN

    def prefill(self, ctx: RequestContext, endpoint: Endpoint) -> SpanScope:
        """Around one prefill attempt on ``endpoint`` (its engine call is made inside)."""
        return NO_SPAN

    def decode(self, ctx: RequestContext, endpoint: Endpoint) -> SpanScope:
        """Around one decode attempt on ``endpoint``: the engine call and the relay of its answer."""
        return NO_SPAN

    def shutdown(self) -> None:
        """Export what is still buffered and stop (blocking for a bounded time)."""
        return None


NO_TRACING: Final = Tracing()
"""Tracing off (stateless, shared)."""


def tracing_from_settings(settings: Settings, *, exporter: SpanExporter | None = None) -> Tracing:
    """:data:`NO_TRACING` unless ``settings.otlp_traces_endpoint`` is set (or an ``exporter`` is given: unit tests
    pass the SDK's in-memory exporter); otherwise an :class:`~pdproxy.ops.tracing_otel.OtelTracing` exporting to that
    endpoint.  Raises ``ValueError`` when the OpenTelemetry packages are missing."""
    if not settings.otlp_traces_endpoint and exporter is None:
        return NO_TRACING
    missing = settings_module.otel_missing()
    if missing:
        raise ValueError(f"otlp_traces_endpoint needs the OpenTelemetry packages {', '.join(missing)}; "
                         f"{settings_module.INSTALL_HINT}")
    from pdproxy.ops.tracing_otel import OtelTracing

    return OtelTracing.from_settings(settings, exporter=exporter)
