"""pdproxy's spans through a real OTLP receiver (``loadtest/otlp_receiver.py``: OTLP/HTTP on aiohttp and OTLP/gRPC
on grpcio, decoding the ``opentelemetry-proto`` messages), in front of simulated engines that record the headers
they received (``/sim/received``).

Asserted: the span tree (request span → admission, queue_wait, prefill, decode), its attributes (endpoints, DP
rank, prompt / cached / completion tokens as the client's usage shows them), the client's ``traceparent`` as the
parent, both engine legs carrying a ``traceparent`` of the same trace naming their own span; retried legs as error
spans with exception events; a refusal at admission; tracing off sending no trace headers.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from loadtest.otlp_receiver import GrpcReceiver, HttpReceiver, ReceivedSpan, SpanStore, receivers
from pdproxy.ops.tracing_otel import SHUTDOWN_TIMEOUT_S
from pdproxy.tokens import sim_prompt
from tests.support import ProxyThread, SimProcess, free_port, running

EXPORTER_TIMEOUT_S = 12

pytestmark = pytest.mark.timeout(90)

ARGS = ("--served-model-name", "sim-model", "--max-model-len", "4096", "--prefill-tokens-per-s", "0",
        "--decode-tokens-per-s", "0")
LEGS = ("admission", "queue_wait", "prefill", "decode")


DP = ("--data-parallel-size", "2", "--dp-single-port")
Engines = tuple[SimProcess, SimProcess]


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    """A prefiller and a decoder, each serving two DP ranks on one port (internal DP: four endpoints)."""
    with running(SimProcess("prefill", *ARGS, *DP), SimProcess("decode", *ARGS, *DP)) as (p, d):
        yield p, d


@pytest.fixture(scope="module")
def otlp() -> Iterator[tuple[HttpReceiver, GrpcReceiver]]:
    with receivers() as (http, grpc_):
        assert grpc_ is not None
        yield http, grpc_


@pytest.fixture
def fresh(engines: Engines, otlp: tuple[HttpReceiver, GrpcReceiver]) -> tuple[Engines, SpanStore]:
    for sim in engines:
        sim.reset()
    otlp[0].store.clear()
    return engines, otlp[0].store


def proxy_for(engines: Engines, **settings: object) -> ProxyThread:
    p, d = engines
    return ProxyThread(prefill=[p.url], decode=[d.url], prefiller_dp_size=2, decoder_dp_size=2, **settings).start()


def finish(proxy: ProxyThread) -> None:
    """Idle counters, then stop: the provider's shutdown flushes every span still buffered."""
    try:
        proxy.wait_idle()
    finally:
        proxy.stop()


def legs_received(*sims: SimProcess) -> list[dict[str, str]]:
    """Headers of every completion leg the engines received, in arrival order per engine."""
    return [r["headers"] for s in sims for r in s.completions_received()]


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [s.name for s in spans])
    return found[0]


def traceparent(span: ReceivedSpan) -> str:
    """The W3C traceparent naming ``span``, sampled (the client's flags ``01`` are passed on)."""
    return f"00-{span.trace_id}-{span.span_id}-01"


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_streamed_request_is_one_trace_under_the_clients_span_and_both_legs_join_it(
        fresh: tuple[Engines, SpanStore],
        otlp: tuple[HttpReceiver, GrpcReceiver], transport: str) -> None:
    engines, store = fresh
    endpoint = otlp[0].endpoint if transport == "http" else otlp[1].endpoint
    protocol = "http/protobuf" if transport == "http" else "grpc"
    proxy = proxy_for(engines, otlp_traces_endpoint=endpoint, otlp_traces_protocol=protocol)
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=30,
                               default_headers={"traceparent": f"00-{trace_id}-{client_span}-01",
                                                "tracestate": "client=7"})
        chunks = list(client.chat.completions.create(
            model="sim-model", messages=[{"role": "user", "content": "hello there, how are you"}], max_tokens=5,
            stream=True, stream_options={"include_usage": True}))
    finally:
        finish(proxy)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 5
    spans = store.wait_for(lambda got: len([s for s in got if s.trace_id == trace_id]) >= 5)
    mine = [s for s in spans if s.trace_id == trace_id]
    assert {s.transport for s in mine} == {transport} and len(mine) == 5
    root = one(mine, "chat sim-model")
    assert (root.kind, root.parent_span_id) == ("SERVER", client_span)       # continues the client's trace
    assert root.resource["service.name"] == "pdproxy"
    for name in LEGS:
        assert one(mine, name).parent_span_id == root.span_id, name
    prefill, decode = one(mine, "prefill"), one(mine, "decode")
    assert (prefill.kind, decode.kind) == ("CLIENT", "CLIENT")
    assert all(s.status == "UNSET" for s in mine)

    # both legs carried their own span as traceparent (same trace id), and the client's tracestate
    (p_headers,) = legs_received(engines[0])
    (d_headers,) = legs_received(engines[1])
    assert p_headers["traceparent"] == traceparent(prefill)
    assert d_headers["traceparent"] == traceparent(decode)
    assert p_headers["tracestate"] == d_headers["tracestate"] == "client=7"
    assert p_headers["x-request-id"] == d_headers["x-request-id"] == root.attributes["gen_ai.request.id"]

    # attributes: endpoints and DP ranks as routed, tokens as the client's usage shows them
    for span, sim, headers in ((prefill, engines[0], p_headers), (decode, engines[1], d_headers)):
        rank = int(headers["x-data-parallel-rank"])
        assert span.attributes["pdproxy.endpoint"] == f"{sim.url}#dp{rank}"
        assert span.attributes["pdproxy.dp_rank"] == rank
        assert (span.attributes["server.address"], span.attributes["server.port"]) == ("127.0.0.1", sim.port)
    assert root.attributes["pdproxy.prefiller"] == prefill.attributes["pdproxy.endpoint"]
    assert root.attributes["pdproxy.decoder"] == decode.attributes["pdproxy.endpoint"]
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else None
    assert prefill.attributes["gen_ai.usage.cache_read.input_tokens"] == cached
    assert root.attributes["gen_ai.usage.cache_read.input_tokens"] == cached
    # GenAI's token names on every span, vLLM's too on the request span (as on vLLM's own llm_request spans)
    assert root.attributes["gen_ai.usage.output_tokens"] == root.attributes["gen_ai.usage.completion_tokens"] == 5
    assert decode.attributes["gen_ai.usage.output_tokens"] == 5
    assert root.attributes["gen_ai.usage.prompt_tokens"] == usage.prompt_tokens
    for s in (root, prefill, decode):       # the engine's own prompt count; admission's judgement apart
        assert s.attributes["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert one(mine, "admission").attributes["pdproxy.admission.prompt_tokens"] > 0
    assert root.attributes["gen_ai.request.model"] == "sim-model"
    assert root.attributes["gen_ai.operation.name"] == "chat"
    assert root.attributes["http.response.status_code"] == 200
    assert 0 < root.attributes["gen_ai.latency.time_to_first_token"] <= root.attributes["gen_ai.latency.e2e"]
    assert [e["name"] for e in decode.events] == ["first_token"]
    assert root.start_ns <= prefill.start_ns <= prefill.end_ns <= decode.start_ns <= decode.end_ns <= root.end_ns


def test_without_a_client_context_a_new_trace_is_started_and_grpc_is_the_default(
        fresh: tuple[Engines, SpanStore],
        otlp: tuple[HttpReceiver, GrpcReceiver], monkeypatch: pytest.MonkeyPatch) -> None:
    engines, store = fresh
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    proxy = proxy_for(engines, otlp_traces_endpoint=otlp[1].endpoint)     # protocol unset: grpc, as vLLM
    try:
        r = httpx.post(proxy.url + "/v1/completions", json={"model": "sim-model", "prompt": "once upon a time",
                                                            "max_tokens": 3}, timeout=30)
    finally:
        finish(proxy)
    assert r.status_code == 200, r.text
    spans = store.wait_for(lambda got: any(s.name == "text_completion sim-model" for s in got))
    root = one(spans, "text_completion sim-model")
    assert root.parent_span_id == "" and root.transport == "grpc"
    assert root.attributes["pdproxy.stream"] is False
    assert root.attributes["gen_ai.usage.completion_tokens"] == r.json()["usage"]["completion_tokens"] == 3
    parents = [h["traceparent"] for h in legs_received(*engines)]
    assert len(parents) == 2 and {p.split("-")[1] for p in parents} == {root.trace_id}


def test_a_refused_prefiller_and_a_failed_decoder_are_error_spans_next_to_the_ones_that_served(
        fresh: tuple[Engines, SpanStore],
        otlp: tuple[HttpReceiver, GrpcReceiver]) -> None:
    engines, store = fresh
    for sim in engines:   # the first leg on each engine (either DP rank) fails; the other rank serves the retry
        sim.faults({"kind": "status", "status": 503, "body": {"error": "busy"}, "times": 1})
    proxy = proxy_for(engines, otlp_traces_endpoint=otlp[0].endpoint, otlp_traces_protocol="http/protobuf",
                      retry_backoff_s=0.0)
    try:
        r = httpx.post(proxy.url + "/v1/chat/completions", json={
            "model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=30)
    finally:
        finish(proxy)
    assert r.status_code == 200, r.text
    spans = store.wait_for(lambda got: any(s.name == "chat sim-model" for s in got))
    root = one(spans, "chat sim-model")
    mine = [s for s in spans if s.trace_id == root.trace_id]
    # the decoder's 503 came after it may have read the KV handle: the prefill runs again for the new pair
    for leg, statuses in (("prefill", ["ERROR", "UNSET", "UNSET"]), ("decode", ["ERROR", "UNSET"])):
        tries = sorted((s for s in mine if s.name == leg), key=lambda s: s.start_ns)
        assert [s.status for s in tries] == statuses, leg
        failed = tries[0]
        assert failed.attributes["http.response.status_code"] == 503
        assert failed.attributes["error.type"] == "UpstreamHTTPError"
        assert [e["name"] for e in failed.events] == ["exception"]
        assert "503" in failed.events[0]["attributes"]["exception.message"]
        assert tries[0].attributes["pdproxy.dp_rank"] != tries[1].attributes["pdproxy.dp_rank"]
        assert all(s.parent_span_id == root.span_id for s in tries)
    assert root.status == "UNSET"
    # every attempt carried its own span: the engines saw five legs of one trace, five distinct parents
    parents = [h["traceparent"] for h in legs_received(*engines)]
    assert len(parents) == 5 and {p.split("-")[1] for p in parents} == {root.trace_id}
    assert sorted(p.split("-")[2] for p in parents) == sorted(s.span_id for s in mine
                                                              if s.name in ("prefill", "decode"))


def test_a_prompt_refused_at_admission_is_an_error_trace_that_reached_no_engine(
        fresh: tuple[Engines, SpanStore],
        otlp: tuple[HttpReceiver, GrpcReceiver]) -> None:
    engines, store = fresh
    proxy = proxy_for(engines, otlp_traces_endpoint=otlp[0].endpoint, otlp_traces_protocol="http/protobuf")
    try:
        r = httpx.post(proxy.url + "/v1/chat/completions", json={
            "model": "sim-model", "messages": [{"role": "user", "content": sim_prompt(5000, unique=True)}],
            "max_tokens": 2}, timeout=30)
    finally:
        finish(proxy)
    assert r.status_code == 400
    spans = store.wait_for(lambda got: any(s.name == "chat sim-model" for s in got))
    root, admission = one(spans, "chat sim-model"), one(spans, "admission")
    assert {s.name for s in spans} == {"chat sim-model", "admission"}
    for s in (root, admission):
        assert s.status == "ERROR" and s.attributes["error.type"] == "PromptTooLong"
        assert s.attributes["http.response.status_code"] == 400
        assert "maximum context length" in s.status_message
        assert [e["name"] for e in s.events] == ["exception"]
    assert legs_received(*engines) == []


def test_tracing_off_passes_the_clients_trace_headers_through(
        fresh: tuple[Engines, SpanStore]) -> None:
    """As Envoy and vllm-router do: the engines' spans join the client's trace; pdproxy records none."""
    engines, store = fresh
    proxy = proxy_for(engines)
    parent = f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"
    try:
        assert not proxy.state.tracing.enabled
        r = httpx.post(proxy.url + "/v1/chat/completions", json={
            "model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers={"traceparent": parent}, timeout=30)
    finally:
        finish(proxy)
    assert r.status_code == 200
    received = legs_received(*engines)
    assert len(received) == 2 and [h.get("traceparent") for h in received] == [parent, parent]
    assert not any("tracestate" in h for h in received)
    assert store.snapshot() == []


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_an_unreachable_collector_fails_no_request_and_holds_no_shutdown(
        fresh: tuple[Engines, SpanStore], monkeypatch: pytest.MonkeyPatch, protocol: str) -> None:
    engines, _ = fresh
    # the exporter alone would retry for 12 s: longer than pdproxy's bound on its shutdown flush
    # (pdproxy/ops/tracing_otel.py, SHUTDOWN_TIMEOUT_S), short enough to wait for its thread's end below
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", str(EXPORTER_TIMEOUT_S))
    endpoint = f"http://127.0.0.1:{free_port()}" + ("/v1/traces" if protocol == "http/protobuf" else "")
    proxy = proxy_for(engines, otlp_traces_endpoint=endpoint, otlp_traces_protocol=protocol)
    try:
        for stream in (False, True):
            r = httpx.post(proxy.url + "/v1/chat/completions", json={
                "model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "stream": stream}, timeout=30)
            assert r.status_code == 200
        proxy.wait_idle()
    finally:
        started = time.monotonic()
        proxy.stop()
    assert not proxy.thread.is_alive()
    assert time.monotonic() - started < SHUTDOWN_TIMEOUT_S + 4  # the flush is bounded, not the exporter's 12 s
    # the flush goes on in its daemon thread until the exporter gives up; it must end here, not in a later test of
    # this process (its export errors, logged with tracebacks, once raced a later test's ast.parse: CPython 3.11's
    # AST recursion-depth state is per interpreter, gh-106905)
    flushers = [t for t in threading.enumerate() if t.name == "pdproxy-tracing-shutdown"]
    for t in flushers:
        t.join(EXPORTER_TIMEOUT_S * 2)
    assert not any(t.is_alive() for t in flushers)
