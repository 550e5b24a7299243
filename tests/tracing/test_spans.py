"""Unit tests of pdproxy/ops/tracing.py and pdproxy/ops/tracing_otel.py with the SDK's in-memory exporter: the hooks nest
into one trace under the client's ``traceparent``, the current span reaches the engine-leg headers, attributes
come from the request context, errors are recorded (status, ``error.type``, exception event), the client's
sampled flag is honoured; tracing off is one shared no-op and does not import OpenTelemetry."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pdproxy.apis.request import Api, parse_request
from pdproxy.endpoints import Endpoint, Role
from pdproxy.errors import DecodeFailed, PromptTooLong, UpstreamUnavailable
from pdproxy.http.engine_headers import EngineHeaders
from pdproxy.ops.tracing import NO_SPAN, NO_TRACING, Attr, Tracing, tracing_from_settings
from pdproxy.settings import PROTOCOL_ENV, Settings, traces_protocol
from pdproxy.timeline import RequestContext

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
PREFILLER = Endpoint("http://10.0.0.5:9100", Role.PREFILL)
DECODER = Endpoint("http://10.0.0.6:9200", Role.DECODE, dp_rank=1, internal_dp=True)
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "stream": True}


@pytest.fixture
def traced() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    return tracing_from_settings(Settings(), exporter=exporter), exporter


def context(traceparent: str | None = f"00-{TRACE}-{CLIENT_SPAN}-01") -> RequestContext:
    headers = [(b"content-type", b"application/json")]
    if traceparent:
        headers += [(b"traceparent", traceparent.encode()), (b"tracestate", b"vendor=1")]
    return RequestContext(request_id="rid-1", client_request_id=None, api_label="chat", client_headers=headers)


def spans(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


def hexid(n: int, width: int) -> str:
    return format(n, f"0{width}x")


def test_off_is_one_shared_no_op_and_sends_no_trace_headers() -> None:
    tracing = tracing_from_settings(Settings())
    assert tracing is NO_TRACING and not tracing.enabled and tracing.propagate is None
    ctx = context()
    req = parse_request(orjson.dumps(BODY), Api.CHAT)
    assert {id(h) for h in (tracing.request(req, ctx), tracing.admission(ctx), tracing.queue_wait(ctx),
                            tracing.prefill(ctx, PREFILLER), tracing.decode(ctx, DECODER))} == {id(NO_SPAN)}
    with tracing.request(req, ctx):
        headers = EngineHeaders.from_settings(Settings(), tracing.propagate).leg(DECODER, "rid-1")
    assert "traceparent" not in headers and "tracestate" not in headers


def test_off_never_imports_the_sdk_or_an_exporter() -> None:
    # (FastAPI itself imports the opentelemetry *API* when it is installed: only the SDK side is pdproxy's.)
    code = ("import sys; import pdproxy.app.application, pdproxy.app.state, pdproxy.pd.director; from pdproxy.settings import Settings;"
            "from pdproxy.app.state import ProxyState; st = ProxyState.build(Settings(prefill=['http://a:1'], "
            "decode=['http://b:2'])); assert not st.tracing.enabled;"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter', "
            "'grpc', 'pdproxy.ops.tracing_otel'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_hooks_nest_under_the_clients_span_and_the_legs_carry_their_own(
        traced: tuple[Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = traced
    headers = EngineHeaders(propagate=tracing.propagate)
    ctx, req = context(), parse_request(orjson.dumps(BODY), Api.CHAT)
    with tracing.request(req, ctx):
        with tracing.admission(ctx):
            ctx.prompt_tokens = 12
        with tracing.queue_wait(ctx):
            pass
        with tracing.prefill(ctx, PREFILLER):
            prefill_headers = headers.leg(PREFILLER, ctx.request_id)
            ctx.cached_tokens, ctx.engine_prompt_tokens = 8, 15     # the prefiller's usage
        with tracing.decode(ctx, DECODER):
            decode_headers = headers.leg(DECODER, ctx.request_id)
            ctx.status, ctx.completion_tokens = 200, 7
            ctx.timeline.decode_start_at = ctx.timeline.first_token_at = ctx.timeline.arrived_at + 0.01
    got = spans(exporter)
    assert set(got) == {"chat m", "admission", "queue_wait", "prefill", "decode"}
    root = got["chat m"]
    assert root.kind is SpanKind.SERVER and root.parent is not None
    assert (hexid(root.parent.span_id, 16), root.parent.is_remote) == (CLIENT_SPAN, True)
    assert {hexid(s.context.trace_id, 32) for s in got.values()} == {TRACE}
    for name in ("admission", "queue_wait", "prefill", "decode"):
        parent = got[name].parent
        assert parent is not None and parent.span_id == root.context.span_id, name
    assert got["prefill"].kind is got["decode"].kind is SpanKind.CLIENT
    # each leg's traceparent names its own span, with the client's tracestate passed on
    for leg, hdrs in (("prefill", prefill_headers), ("decode", decode_headers)):
        assert hdrs["traceparent"] == f"00-{TRACE}-{hexid(got[leg].context.span_id, 16)}-01"
        assert hdrs["tracestate"] == "vendor=1"
    assert decode_headers["X-data-parallel-rank"] == "1"          # the leg's other headers are untouched
    a = {name: dict(s.attributes or {}) for name, s in got.items()}
    assert a["chat m"] | {Attr.E2E: 0} == {
        Attr.OPERATION: "chat", Attr.REQUEST_MODEL: "m", Attr.REQUEST_MAX_TOKENS: 7, Attr.HTTP_METHOD: "POST",
        Attr.HTTP_ROUTE: "/v1/chat/completions", Attr.STREAM: True, Attr.REQUEST_ID: "rid-1",
        Attr.INPUT_TOKENS: 15, Attr.PROMPT_TOKENS: 15, Attr.ADMITTED_TOKENS: 12, Attr.CACHED_TOKENS: 8,
        Attr.OUTPUT_TOKENS: 7,
        Attr.COMPLETION_TOKENS: 7, Attr.DISAGGREGATED: True, Attr.HTTP_STATUS: 200,
        Attr.TTFT: pytest.approx(0.01), Attr.E2E: 0}
    assert a["admission"] == {Attr.ADMITTED_TOKENS: 12, Attr.DISAGGREGATED: True}
    assert a["prefill"] == {Attr.ROLE: "prefill", Attr.ENDPOINT: PREFILLER.name, Attr.SERVER_ADDRESS: "10.0.0.5",
                            Attr.SERVER_PORT: 9100, Attr.REQUEST_ID: "rid-1", Attr.INPUT_TOKENS: 15,
                            Attr.CACHED_TOKENS: 8}
    assert a["decode"] == {Attr.ROLE: "decode", Attr.ENDPOINT: "http://10.0.0.6:9200#dp1", Attr.DP_RANK: 1,
                           Attr.SERVER_ADDRESS: "10.0.0.6", Attr.SERVER_PORT: 9200, Attr.REQUEST_ID: "rid-1",
                           Attr.INPUT_TOKENS: 15, Attr.HTTP_STATUS: 200, Attr.OUTPUT_TOKENS: 7}
    assert [e.name for e in got["decode"].events] == ["first_token"]
    assert all(s.status.status_code is StatusCode.UNSET for s in got.values())
    assert root.start_time is not None and root.end_time is not None
    assert all(root.start_time <= (s.start_time or 0) <= (s.end_time or 0) <= root.end_time for s in got.values())


def test_errors_are_recorded_with_status_type_and_exception_event(
        traced: tuple[Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = traced
    ctx, req = context(traceparent=None), parse_request(orjson.dumps(BODY), Api.CHAT)
    err = UpstreamUnavailable("decoder http://10.0.0.6:9200 refused", endpoint=DECODER.name)
    with pytest.raises(DecodeFailed), tracing.request(req, ctx), tracing.decode(ctx, DECODER):
        raise DecodeFailed(err, DECODER, kv_intact=True)     # the decode leg wraps the engine's error
    got = spans(exporter)
    assert got["chat m"].parent is None                       # no client context: a new trace
    for name in ("decode", "chat m"):
        s = got[name]
        assert s.status.status_code is StatusCode.ERROR and s.status.description == err.message
        assert (s.attributes or {})[Attr.ERROR_TYPE] == "UpstreamUnavailable"
        assert (s.attributes or {})[Attr.HTTP_STATUS] == 502
        (event,) = s.events
        assert event.name == "exception" and (event.attributes or {})["exception.type"].endswith(
            "UpstreamUnavailable")
        assert (event.attributes or {})["exception.message"] == err.message
    assert Attr.OUTPUT_TOKENS not in (got["decode"].attributes or {})

    exporter.clear()
    with pytest.raises(PromptTooLong), tracing.request(req, context()), tracing.admission(ctx):
        raise PromptTooLong("This model's maximum context length is 4096 tokens", limit_kind="max_model_len",
                            prompt_tokens=5000, limit=4096)
    got = spans(exporter)
    assert (got["admission"].attributes or {})[Attr.HTTP_STATUS] == 400
    assert got["admission"].status.status_code is StatusCode.ERROR


def test_a_clients_megabytes_of_model_name_are_cut_in_the_span(traced: tuple[Tracing, InMemorySpanExporter]) -> None:
    """The client's ``model`` names the SERVER span and its ``gen_ai.request.model``, and the 404 quoting it is the
    span's status and exception event: each is cut (timeline.clip), so one request's span stays kilobytes however
    long the name (seen: a 3 MB name made a 15 MB OTLP export, over a collector's 4 MB message limit)."""
    from pdproxy.errors import ModelNotFound
    from pdproxy.timeline import MODEL_SHOWN_MAX, TEXT_SHOWN_MAX

    tracing, exporter = traced
    model = "M" * 3_000_000
    req = parse_request(orjson.dumps({**BODY, "model": model}), Api.CHAT)
    err = ModelNotFound(model, "prefill", [])
    with pytest.raises(ModelNotFound), tracing.request(req, context(traceparent=None)):
        raise err
    (span,) = exporter.get_finished_spans()
    attrs = span.attributes or {}
    assert span.name.startswith("chat " + "M" * MODEL_SHOWN_MAX) and len(span.name) < MODEL_SHOWN_MAX + 40
    assert str(attrs[Attr.REQUEST_MODEL]).startswith("M" * MODEL_SHOWN_MAX)
    assert len(str(attrs[Attr.REQUEST_MODEL])) < MODEL_SHOWN_MAX + 40
    assert len(span.status.description or "") < TEXT_SHOWN_MAX + 40
    assert span.status.description.startswith("The model `MMM")  # type: ignore[union-attr]
    (event,) = span.events
    assert all(len(str(v)) <= TEXT_SHOWN_MAX for v in (event.attributes or {}).values())
    assert len(span.to_json()) < 20_000


def test_a_client_tracestate_past_w3cs_size_is_not_taken_into_the_trace(
        traced: tuple[Tracing, InMemorySpanExporter]) -> None:
    """With tracing on, the client's trace context is extracted within the same W3C sizes as it is forwarded with
    tracing off (pdproxy/http/engine_headers.py ``forwardable``): an 8 KB ``tracestate`` (the propagator's own
    limit) is left at pdproxy, never sent on either leg; the client's ``traceparent`` still parents the trace."""
    tracing, _ = traced
    big = ",".join(f"k{i}=" + "v" * 240 for i in range(32))           # 32 members, ~7.9 KB: W3C's size is 512
    headers = [(b"traceparent", f"00-{TRACE}-{CLIENT_SPAN}-01".encode()), (b"tracestate", big.encode())]
    ctx = RequestContext(request_id="rid-1", client_request_id=None, api_label="chat", client_headers=headers)
    with tracing.request(req := parse_request(orjson.dumps(BODY), Api.CHAT), ctx), tracing.prefill(ctx, PREFILLER):
        leg = EngineHeaders(propagate=tracing.propagate).leg(PREFILLER, ctx.request_id)
    assert req.model == "m" and "tracestate" not in leg and leg["traceparent"].split("-")[1] == TRACE


def test_cancellation_and_a_failed_stream_are_errors_without_an_exception_leaving(
        traced: tuple[Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = traced
    req = parse_request(orjson.dumps(BODY), Api.CHAT)
    ctx = context()
    with pytest.raises(asyncio.CancelledError), tracing.request(req, ctx), tracing.queue_wait(ctx):
        raise asyncio.CancelledError
    got = spans(exporter)
    assert {(got[n].attributes or {})[Attr.ERROR_TYPE] for n in ("chat m", "queue_wait")} == {"cancelled"}
    assert got["queue_wait"].status.status_code is StatusCode.ERROR and not got["queue_wait"].events

    exporter.clear()
    ctx = context()
    with tracing.request(req, ctx), tracing.decode(ctx, DECODER):
        ctx.status, ctx.outcome = 200, "upstream_error"   # the relay sent an SSE error event mid-stream
    got = spans(exporter)
    for name in ("chat m", "decode"):
        assert got[name].status.status_code is StatusCode.ERROR
        assert (got[name].attributes or {})[Attr.OUTCOME] == "upstream_error"


def test_a_client_that_does_not_sample_is_honoured_and_told_to_the_engines(
        traced: tuple[Tracing, InMemorySpanExporter]) -> None:
    tracing, exporter = traced
    ctx, req = context(traceparent=f"00-{TRACE}-{CLIENT_SPAN}-00"), parse_request(orjson.dumps(BODY), Api.CHAT)
    with tracing.request(req, ctx):
        assert tracing.prefill(ctx, PREFILLER) is NO_SPAN                  # no children of an unsampled request
        with tracing.prefill(ctx, PREFILLER):
            headers = EngineHeaders(propagate=tracing.propagate).leg(PREFILLER, "rid-1")
    assert exporter.get_finished_spans() == ()
    assert headers["traceparent"].startswith(f"00-{TRACE}-") and headers["traceparent"].endswith("-00")
    assert headers["traceparent"] != f"00-{TRACE}-{CLIENT_SPAN}-00"         # the request span's own id


def test_protocol_is_chosen_as_vllm_chooses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PROTOCOL_ENV, raising=False)
    assert traces_protocol(None) == "grpc"                                     # vLLM 0.32's default
    monkeypatch.setenv(PROTOCOL_ENV, "http/protobuf")
    assert traces_protocol(None) == "http/protobuf"
    assert traces_protocol("grpc") == "grpc"                                   # the setting wins
    monkeypatch.setenv(PROTOCOL_ENV, "http/json")
    with pytest.raises(ValueError, match=r"http/json.*OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        traces_protocol(None)
    with pytest.raises(ValueError, match=r"http/json.*OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        Settings(otlp_traces_endpoint="http://127.0.0.1:4317")               # at start, not at the first request
    assert Settings().otlp_traces_endpoint is None                            # tracing off reads no OTEL_* variable


def test_the_setting_says_what_to_install_when_opentelemetry_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import pdproxy.settings

    monkeypatch.setattr(pdproxy.settings, "otel_missing", lambda: ["opentelemetry.sdk"])
    with pytest.raises(ValueError, match=r"otlp_traces_endpoint[\s\S]*pip install 'pdproxy\[tracing\]'"):
        Settings(otlp_traces_endpoint="http://127.0.0.1:4317")
    assert Settings().otlp_traces_endpoint is None                             # off needs nothing
