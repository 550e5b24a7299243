"""Tracing on: the spans of :mod:`pdproxy.ops.tracing` made with the OpenTelemetry SDK and exported over OTLP.

Imported only when ``otlp_traces_endpoint`` is set (the ``tracing`` extra: ``opentelemetry-sdk`` and the OTLP
exporters).  The exporter is chosen the way ``vllm serve --otlp-traces-endpoint`` chooses it
(``vllm/tracing/otel.py``, ``get_span_exporter``): the protocol comes from ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
(``grpc``, the default, or ``http/protobuf``) — pdproxy's ``otlp_traces_protocol`` setting overrides it — and the
endpoint is used as given: ``host:4317`` or ``http://host:4317`` (plaintext) / ``https://host:4317`` (TLS) for
gRPC, the full URL with its path (``http://host:4318/v1/traces``) for OTLP/HTTP.  The URL's scheme thus decides
TLS, not the protocol.  Spans leave through a ``BatchSpanProcessor`` (a background thread; a full buffer drops
spans, never blocks a request).

The provider is this object's own (never OpenTelemetry's global one), so several proxies in one process (tests)
and ``--workers N`` processes each export their own spans.  Stopping flushes what is buffered for at most
``SHUTDOWN_TIMEOUT_S`` (an unreachable collector would otherwise hold the exit for the exporter's retries, 10 s
and more); what is not out by then is dropped.  The sampler is the SDK's default, configurable with
``OTEL_TRACES_SAMPLER``: parent-based, so a client's ``traceparent`` with the sampled flag off is honoured (and
passed on to the engines as such).  ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES`` name the service
(default ``service.name`` "pdproxy").
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from pdproxy import __version__
from pdproxy.apis.request import Api
from pdproxy.errors import DecodeFailed, ProxyError
from pdproxy.http.engine_headers import forwardable
from pdproxy.ops.logs import redact_url
from pdproxy.ops.tracing import NO_SPAN, Attr, Tracing
from pdproxy.settings import PROTOCOL_ENV, traces_protocol
from pdproxy.timeline import MODEL_SHOWN_MAX, TEXT_SHOWN_MAX, clip

if TYPE_CHECKING:
    from pdproxy.apis.request import ProxyRequest
    from pdproxy.endpoints import Endpoint
    from pdproxy.settings import Settings
    from pdproxy.timeline import RequestContext

log = logging.getLogger("pdproxy.tracing")

SHUTDOWN_TIMEOUT_S = 3.0

# GenAI gen_ai.operation.name values: Responses and Messages are chats.
_OPERATION: Final = MappingProxyType({Api.CHAT: "chat", Api.COMPLETIONS: "text_completion", Api.RESPONSES: "chat",
                                      Api.MESSAGES: "chat"})
_TRACE_HEADERS = (b"traceparent", b"tracestate")

EndHook = Callable[[Span, "RequestContext", bool, dict[str, Any]], None]
"""Puts a span's closing attributes, read from the request context, into the dict (None values are dropped);
``failed``: an exception is leaving the span."""


def span_exporter(endpoint: str, protocol: str) -> SpanExporter:
    """The OTLP span exporter for ``endpoint`` over ``protocol`` (see the module docstring)."""
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        if urlsplit(endpoint).path not in ("", "/"):
            log.warning("otlp_traces_endpoint %s has a path but the protocol is grpc (gRPC ignores it); for "
                        "OTLP/HTTP set %s=http/protobuf or otlp_traces_protocol", endpoint, PROTOCOL_ENV)
        return GrpcExporter(endpoint=endpoint, insecure=urlsplit(endpoint).scheme != "https")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=endpoint)


ATTRIBUTE_LENGTH_ENV = ("OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT", "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT")
"""The SDK's own settings of the longest attribute value: an operator's wins over pdproxy's default."""


def attribute_length_limit() -> int | None:
    """The tracer provider's longest attribute value: :data:`~pdproxy.timeline.TEXT_SHOWN_MAX` characters (client
    text in error messages, cut), or None — the SDK then reads the operator's :data:`ATTRIBUTE_LENGTH_ENV`."""
    return None if any(os.environ.get(name) for name in ATTRIBUTE_LENGTH_ENV) else TEXT_SHOWN_MAX


def _wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` mark as epoch nanoseconds (span timestamps are wall-clock)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def _record_error(span: Span, exc: BaseException, attrs: dict[str, Any]) -> None:
    """Error status, ``error.type`` (into ``attrs``) and an exception event for ``exc`` leaving the span (for a
    decoder's failure before its first event, the engine's error inside :class:`~pdproxy.pd.decode.DecodeFailed`)."""
    if isinstance(exc, DecodeFailed):
        exc = exc.error
    if isinstance(exc, asyncio.CancelledError):
        attrs[Attr.ERROR_TYPE] = "cancelled"
        span.set_status(Status(StatusCode.ERROR, "cancelled: the client disconnected, a deadline passed or pdproxy "
                                                 "is stopping"))
        return
    attrs[Attr.ERROR_TYPE] = exc.__class__.__name__
    if isinstance(exc, ProxyError):
        attrs[Attr.HTTP_STATUS] = exc.status_code
        message = exc.message
    else:
        message = f"{exc.__class__.__name__}: {exc}"
    span.record_exception(exc, escaped=True)      # its attributes cut by the provider's SpanLimits
    span.set_status(Status(StatusCode.ERROR, clip(message, TEXT_SHOWN_MAX)))


def _record_outcome(span: Span, ctx: RequestContext, attrs: dict[str, Any]) -> None:
    """A stream that failed after its first event ends without an exception: the relay sent the client an SSE
    error event and set ``ctx.outcome``.  That is an error of the span too."""
    if ctx.outcome != "ok":
        attrs[Attr.OUTCOME] = attrs[Attr.ERROR_TYPE] = ctx.outcome
        span.set_status(Status(StatusCode.ERROR, f"the response ended with outcome {ctx.outcome!r} (the client got "
                                                 "an error event mid-stream)"))


class OtelScope:
    """One step's span: current while the block runs, closed with ``end(span, ctx, failed)`` and any exception
    recorded (the exception is passed on).  Not reusable."""

    __slots__ = ("_ctx", "_end", "_span", "_token")

    def __init__(self, span: Span, ctx: RequestContext, end: EndHook | None) -> None:
        self._span = span
        self._ctx = ctx
        self._end = end
        self._token: object = None

    def __enter__(self) -> None:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        span = self._span
        try:
            if span.is_recording():
                attrs: dict[str, Any] = {}
                if self._end is not None:
                    self._end(span, self._ctx, exc is not None, attrs)
                if exc is not None:
                    _record_error(span, exc, attrs)
                span.set_attributes({k: v for k, v in attrs.items() if v is not None})  # one call: one lock
        except Exception:  # observability must never break a request
            log.exception("closing span %s failed", getattr(span, "name", "?"))
        finally:
            otel_context.detach(self._token)  # type: ignore[arg-type]
            span.end()


EXPORT_LOGGERS = ("opentelemetry.exporter.otlp.proto.grpc.exporter",
                  "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                  "opentelemetry.sdk._shared_internal", "opentelemetry.sdk.trace.export")
"""The SDK's loggers that report failed exports (a WARNING and an ERROR per batch while the collector is down)."""


class ExportLogLimit(logging.Filter):
    """Lets the SDK's export warnings and errors through at most once per ``interval_s`` seconds (the first one at
    once), the next one saying how many it held back: a collector that is down must not fill the log with a pair
    of lines every few seconds.  Records below WARNING pass."""

    def __init__(self, interval_s: float = 300.0) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.suppressed = 0
        self._last: float | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        now = time.monotonic()
        if self._last is not None and now - self._last < self.interval_s:
            self.suppressed += 1
            return False
        if self.suppressed:
            record.msg, record.args = f"{record.getMessage()} ({self.suppressed} more export messages held back in "\
                                      f"the last {self.interval_s:.0f} s)", ()
        self._last, self.suppressed = now, 0
        return True


class OtelTracing(Tracing):
    """Tracing on (see :mod:`pdproxy.ops.tracing`).  ``provider``: this proxy's own tracer provider; its spans are
    exported by the processors added to it (:meth:`from_settings`)."""

    __slots__ = ("_propagator", "_tracer", "export_log_limit", "propagate", "provider")
    enabled = True

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer("pdproxy", __version__)
        self._propagator = TraceContextTextMapPropagator()
        self.propagate: Callable[[dict[str, str]], None] | None = self._propagator.inject
        self.export_log_limit = ExportLogLimit()
        for name in EXPORT_LOGGERS:
            logging.getLogger(name).addFilter(self.export_log_limit)

    @classmethod
    def from_settings(cls, settings: Settings, *, exporter: SpanExporter | None = None) -> OtelTracing:
        """Export to ``settings.otlp_traces_endpoint`` (batched), or to ``exporter`` span by span (unit tests:
        the SDK's ``InMemorySpanExporter``).  Raises ``ValueError`` for an unsupported protocol."""
        name = os.environ.get("OTEL_SERVICE_NAME") or "pdproxy"
        resource = Resource.create({"service.name": name, "service.version": __version__,
                                    "process.pid": os.getpid()})
        provider = TracerProvider(resource=resource, shutdown_on_exit=False,   # stopped by the proxy's lifespan
                                  span_limits=SpanLimits(max_attribute_length=attribute_length_limit()))
        if exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        if settings.otlp_traces_endpoint:
            protocol = traces_protocol(settings.otlp_traces_protocol)
            provider.add_span_processor(BatchSpanProcessor(span_exporter(settings.otlp_traces_endpoint, protocol)))
            log.info("exporting traces to %s over OTLP %s", redact_url(settings.otlp_traces_endpoint), protocol)
        return cls(provider)

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Flush and stop the span processors, waiting at most ``timeout_s`` seconds (blocking; the flush goes on
        in a daemon thread that does not hold the process's exit)."""
        flusher = threading.Thread(target=self.provider.shutdown, name="pdproxy-tracing-shutdown", daemon=True)
        flusher.start()
        flusher.join(timeout_s)
        if flusher.is_alive():
            log.warning("traces not flushed within %.1f s (is the collector reachable?); the rest are dropped",
                        timeout_s)
        for name in EXPORT_LOGGERS:
            logging.getLogger(name).removeFilter(self.export_log_limit)

    # --- the hooks -----------------------------------------------------------------------------------------------
    def request(self, req: ProxyRequest, ctx: RequestContext) -> AbstractContextManager[None]:
        """The request's SERVER span, started at the request's arrival, child of the client's trace context."""
        carrier = {k.decode(): text for k, v in ctx.client_headers      # within W3C's sizes, as with tracing off
                   if k in _TRACE_HEADERS and forwardable(k, text := v.decode("latin-1"))}
        parent = self._propagator.extract(carrier) if carrier else otel_context.Context()
        operation = _OPERATION[req.api]
        attributes: dict[str, Any] = {Attr.OPERATION: operation, Attr.HTTP_METHOD: "POST",
                                      Attr.HTTP_ROUTE: req.api.value, Attr.STREAM: req.stream,
                                      Attr.REQUEST_ID: ctx.request_id}
        model = clip(req.model, MODEL_SHOWN_MAX)
        if model:
            attributes[Attr.REQUEST_MODEL] = model
        if req.max_output_tokens is not None:
            attributes[Attr.REQUEST_MAX_TOKENS] = req.max_output_tokens
        span = self._tracer.start_span(f"{operation} {model}" if model else operation, context=parent,
                                       kind=SpanKind.SERVER, attributes=attributes,
                                       start_time=_wall_ns(ctx.timeline.arrived_at))
        return OtelScope(span, ctx, _end_request)

    # The children of a request span that is not sampled are not made at all (NO_SPAN): the legs then carry the
    # request span's context, unsampled, which is all an engine needs to know.
    def admission(self, ctx: RequestContext) -> AbstractContextManager[None]:
        if not trace.get_current_span().is_recording():
            return NO_SPAN
        return OtelScope(self._tracer.start_span("admission"), ctx, _end_admission)

    def queue_wait(self, ctx: RequestContext) -> AbstractContextManager[None]:
        if not trace.get_current_span().is_recording():
            return NO_SPAN
        return OtelScope(self._tracer.start_span("queue_wait"), ctx, None)

    def prefill(self, ctx: RequestContext, endpoint: Endpoint) -> AbstractContextManager[None]:
        if not trace.get_current_span().is_recording():
            return NO_SPAN
        return OtelScope(self._leg("prefill", ctx, endpoint), ctx, _end_prefill)

    def decode(self, ctx: RequestContext, endpoint: Endpoint) -> AbstractContextManager[None]:
        if not trace.get_current_span().is_recording():
            return NO_SPAN
        return OtelScope(self._leg("decode", ctx, endpoint), ctx, _end_decode)

    def _leg(self, role: str, ctx: RequestContext, endpoint: Endpoint) -> Span:
        attributes: dict[str, Any] = {Attr.ROLE: role, Attr.ENDPOINT: endpoint.name,
                                      Attr.SERVER_ADDRESS: endpoint.host, Attr.SERVER_PORT: endpoint.port,
                                      Attr.REQUEST_ID: ctx.request_id}
        if endpoint.dp_rank is not None:
            attributes[Attr.DP_RANK] = endpoint.dp_rank
        return self._tracer.start_span(role, kind=SpanKind.CLIENT, attributes=attributes)


# --- closing attributes (read from the request context when the step ends) ----------------------------------------
def _end_request(span: Span, ctx: RequestContext, failed: bool, attrs: dict[str, Any]) -> None:
    t = ctx.timeline
    attrs.update({
        Attr.INPUT_TOKENS: ctx.engine_prompt_tokens, Attr.PROMPT_TOKENS: ctx.engine_prompt_tokens,
        Attr.ADMITTED_TOKENS: ctx.prompt_tokens, Attr.CACHED_TOKENS: ctx.cached_tokens,
        Attr.OUTPUT_TOKENS: ctx.completion_tokens, Attr.COMPLETION_TOKENS: ctx.completion_tokens,
        Attr.PREFILLER: ctx.prefiller, Attr.DECODER: ctx.decoder, Attr.DISAGGREGATED: ctx.disaggregated,
        Attr.HTTP_STATUS: ctx.status or None,
        Attr.TTFT: None if t.first_token_at is None else t.first_token_at - t.arrived_at,
        Attr.E2E: time.monotonic() - t.arrived_at})
    if not failed:
        _record_outcome(span, ctx, attrs)


def _end_admission(span: Span, ctx: RequestContext, failed: bool, attrs: dict[str, Any]) -> None:
    attrs[Attr.ADMITTED_TOKENS] = ctx.prompt_tokens
    if not failed:
        attrs[Attr.DISAGGREGATED] = ctx.disaggregated


def _end_prefill(span: Span, ctx: RequestContext, failed: bool, attrs: dict[str, Any]) -> None:
    if not failed:   # the prefiller's usage (prompt as the engine tokenized it, its prefix-cache hit)
        attrs[Attr.INPUT_TOKENS] = ctx.engine_prompt_tokens
        attrs[Attr.CACHED_TOKENS] = ctx.cached_tokens


def _end_decode(span: Span, ctx: RequestContext, failed: bool, attrs: dict[str, Any]) -> None:
    attrs[Attr.HTTP_STATUS] = ctx.status or None
    t = ctx.timeline
    if t.first_token_at is not None and t.decode_start_at is not None and t.first_token_at >= t.decode_start_at:
        span.add_event("first_token", timestamp=_wall_ns(t.first_token_at))
    if not failed:
        attrs[Attr.INPUT_TOKENS] = ctx.engine_prompt_tokens
        attrs[Attr.OUTPUT_TOKENS] = ctx.completion_tokens
        _record_outcome(span, ctx, attrs)
