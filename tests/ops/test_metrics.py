"""``GET /metrics`` after known traffic: request counts, rejections, phase histograms, in-flight gauges, engine gauges.

Also ``X-Request-Id`` (honoured and returned) and the optional routing headers.
"""

from __future__ import annotations

import socket
from bisect import bisect_left

import httpx
import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from pdproxy.errors import BadRequest, NoEndpointAvailable, Overloaded, PromptTooLong, UpstreamHTTPError
from pdproxy.ops.metrics import PHASES, ProxyMetrics, _observe, rejection_of
from pdproxy.timeline import RequestContext, Timeline
from tests.conftest import Fleet
from tests.ops.promtext import Samples, scrape
from tests.support import ProxyThread, SimProcess, wait_until

pytestmark = pytest.mark.timeout(30)

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "Hello metrics"}], "max_tokens": 8}


def test_metrics_count_known_traffic(proxy: ProxyThread, sims: Fleet) -> None:
    for d in sims.decoders:  # ≥ 5 ms between token events, so each stream reaches the client in several writes
        d.faults({"kind": "slow", "factor": 2, "min_gap_s": 0.005})
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=20)
    for _ in range(2):
        chunks = list(client.chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None
    client.completions.create(model="sim-model", prompt="Hello there", max_tokens=4)
    bad = httpx.post(proxy.url + "/v1/chat/completions", json={**CHAT, "n": 99})  # pdproxy's own 400: over the fan-out bound
    assert bad.status_code == 400
    tokenized = httpx.post(proxy.url + "/tokenize", json={"model": "sim-model", "prompt": "Hello"})
    assert tokenized.status_code == 200                  # a call about the model: counted, never timed
    proxy.wait_idle()
    # a passthrough request (the /tokenize) is recorded just after it leaves in_flight (pdproxy/app/application.py,
    # handle_passthrough), so wait for the last one
    wait_until(lambda: scrape(proxy.url).total("pdproxy_requests_total") == 5, 5, what="every request recorded")
    assert scrape(proxy.url).value("pdproxy_requests_total", api="tokenize", status="200", outcome="ok") == 1
    for name in ("pdproxy_time_to_first_token_seconds_count", "pdproxy_e2e_request_latency_seconds_count",
                 *(f"{n}_count" for n, _, _ in PHASES.values())):
        assert scrape(proxy.url).find(name, api="tokenize") == [], name      # not even an empty series

    m = scrape(proxy.url)
    assert m.value("pdproxy_requests_total", api="chat", status="200", outcome="ok") == 2
    assert m.value("pdproxy_requests_total", api="completions", status="200", outcome="ok") == 1
    assert m.value("pdproxy_requests_total", api="chat", status="400", outcome="bad_request") == 1
    assert m.value("pdproxy_rejections_total", reason="bad_request", detail="n") == 1
    assert m.total("pdproxy_rejections_total") == 1
    assert m.value("pdproxy_time_to_first_token_seconds_count", api="chat") == 2
    assert m.value("pdproxy_time_to_first_token_seconds_count", api="completions") == 1
    # ITL: one observation per gap between the client writes of a stream (8 tokens ≥ 5 ms apart each)
    itl_count = m.value("pdproxy_inter_token_latency_seconds_count", api="chat")
    assert itl_count >= 2 * 6
    assert m.value("pdproxy_inter_token_latency_seconds_sum", api="chat") / itl_count >= 0.003
    assert m.value("pdproxy_inter_token_latency_seconds_count", api="completions") == 0  # not streamed
    # TPOT needs completion_tokens, read from the usage the decoders sent (stream and JSON alike)
    assert m.value("pdproxy_request_time_per_output_token_seconds_count", api="chat") == 2
    assert m.value("pdproxy_request_time_per_output_token_seconds_count", api="completions") == 0
    for name, _, _ in PHASES.values():  # the served requests went through every phase; the 400 through none
        assert m.value(f"{name}_count", api="chat") == 2, name
        assert m.value(f"{name}_count", api="completions") == 1, name
    assert m.value("pdproxy_e2e_request_latency_seconds_count", api="chat", outcome="ok") == 2
    assert m.value("pdproxy_e2e_request_latency_seconds_count", api="chat", outcome="bad_request") == 1
    ttft_sum = m.value("pdproxy_time_to_first_token_seconds_sum", api="chat")
    e2e_sum = m.value("pdproxy_e2e_request_latency_seconds_sum", api="chat", outcome="ok")
    assert 0 < ttft_sum <= e2e_sum
    assert m.total("pdproxy_requests_in_progress") == 0
    assert m.total("pdproxy_prefill_queue_depth") == 0
    # admission's counters (pdproxy/admission/admission.py AdmissionStats): each served prompt counted once
    assert m.total("pdproxy_prompt_counts_total") == 3
    # load back to zero, every endpoint healthy, breakers closed
    assert m.total("pdproxy_inflight_requests") == 0 and m.total("pdproxy_inflight_tokens") == 0
    urls = {s.url for s in sims.all}
    assert {lab["endpoint"] for lab, _ in m.find("pdproxy_endpoint_healthy")} == urls
    assert all(v == 1 for _, v in m.find("pdproxy_endpoint_healthy"))
    assert m.total("pdproxy_endpoint_breaker_state", state="closed") == 3
    assert m.total("pdproxy_endpoint_breaker_state", state="open") == 0
    # the engines' own gauges, re-exported per endpoint (sim: max_model_len 4096, pool 4 × 4096 tokens)
    for s in sims.all:
        role = s.role
        assert m.value("pdproxy_engine_up", endpoint=s.url, role=role) == 1
        assert m.value("pdproxy_engine_max_model_len", endpoint=s.url) == 4096
        assert m.value("pdproxy_engine_kv_pool_tokens", endpoint=s.url) == 4 * 4096
        assert m.value("pdproxy_engine_num_requests_running", endpoint=s.url) == 0
        assert {lab["reason"] for lab, _ in m.find("pdproxy_engine_num_requests_waiting_by_reason",
                                                    endpoint=s.url)} == {"capacity", "deferred"}


def test_an_engine_that_dies_is_down_in_its_gauges(sims: Fleet) -> None:
    """``pdproxy_engine_up`` goes to 0 once a probe of a stopped engine fails, and its last running / waiting /
    KV figures are no longer exported as its state (old code: up stayed 1 and the figures froze, so the alert
    ``pdproxy_engine_up == 0`` never fired)."""
    extra = SimProcess("decode", "--served-model-name", "sim-model", "--max-model-len", "4096").start()
    proxy = ProxyThread(prefill=[sims.prefillers[0].url], decode=[sims.decoders[0].url, extra.url],
                        health_interval_s=0.2).start()
    try:
        def up(url: str) -> float:
            return scrape(proxy.url).value("pdproxy_engine_up", endpoint=url, role="decode")

        wait_until(lambda: up(extra.url) == 1, 10, 0.05, "the extra decoder up")
        assert scrape(proxy.url).find("pdproxy_engine_num_requests_running", endpoint=extra.url)
        extra.stop()
        wait_until(lambda: up(extra.url) == 0, 10, 0.05, "the stopped decoder down")
        m = scrape(proxy.url)
        for name in ("pdproxy_engine_num_requests_running", "pdproxy_engine_num_requests_waiting",
                     "pdproxy_engine_kv_cache_usage_perc", "pdproxy_engine_num_requests_waiting_by_reason"):
            assert not m.find(name, endpoint=extra.url), name
        assert m.value("pdproxy_engine_max_model_len", endpoint=extra.url) == 4096      # what it declared
        assert up(sims.decoders[0].url) == 1
    finally:
        proxy.stop()
        extra.stop()


def _raw_request(port: int, body: dict[str, object]) -> socket.socket:
    payload = orjson.dumps(body)
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def test_inflight_gauges_during_a_request_and_after_disconnect(proxy: ProxyThread, sims: Fleet) -> None:
    sims.prefillers[0].faults({"kind": "hang", "on_request": 1})  # the prefill leg of the request under test
    sock = _raw_request(proxy.port, {**CHAT, "stream": True})
    try:
        def inflight() -> Samples | None:
            m = scrape(proxy.url)
            return m if m.total("pdproxy_inflight_requests", role="prefill") == 1 else None

        m = wait_until(inflight, 10, 0.05, "prefill lease visible in /metrics")
        assert m.total("pdproxy_inflight_tokens", role="prefill") > 0
        assert m.total("pdproxy_inflight_requests", role="decode") == 0
        assert m.value("pdproxy_requests_in_progress", api="chat") == 1
    finally:
        sock.close()
    proxy.wait_idle()
    m = wait_until(lambda: (s := scrape(proxy.url)).total("pdproxy_requests_in_progress") == 0 and s, 5, 0.05)
    assert m.value("pdproxy_requests_total", api="chat", status="0", outcome="client_disconnected") == 1
    assert m.total("pdproxy_inflight_requests") == 0 and m.total("pdproxy_inflight_tokens") == 0


def test_request_id_honoured_and_routing_headers(sims: Fleet) -> None:
    p = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                    expose_routing_headers=True).start()
    try:
        r = httpx.post(p.url + "/v1/completions", json={"model": "sim-model", "prompt": "hi", "max_tokens": 2},
                       headers={"X-Request-Id": "ops-req-1"}, timeout=10)
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "ops-req-1"
        assert r.headers["x-pdproxy-prefiller"] == sims.prefillers[0].url
        assert r.headers["x-pdproxy-decoder"] in {d.url for d in sims.decoders}
        (leg,) = sims.prefillers[0].completions_received()
        assert leg["headers"]["x-request-id"].startswith("ops-req-1-")  # recognisable, and unique per request
        r2 = httpx.post(p.url + "/v1/completions", json={"model": "sim-model", "prompt": "hi", "max_tokens": 2},
                        timeout=10)
        assert r2.headers["x-request-id"]  # generated when the client sent none
        p.wait_idle()
    finally:
        p.stop()


def test_rejection_reasons() -> None:
    too_long = PromptTooLong("x", limit_kind="kv_pool", prompt_tokens=5000, limit=4584)
    assert rejection_of(too_long) == ("too_long", "kv_pool")
    assert rejection_of(Overloaded("full")) == ("queue_full", "")
    assert rejection_of(NoEndpointAvailable("decode")) == ("no_endpoint", "decode")
    assert rejection_of(BadRequest("bad", param="n")) == ("bad_request", "n")
    assert rejection_of(UpstreamHTTPError(400, b"{}")) is None  # the engine's answer, not ours

    class Declared(Overloaded):
        rejection = ("deadline", "queue")

    assert rejection_of(Declared("late")) == ("deadline", "queue")


def test_observe_computes_ttft_itl_tpot_and_phases() -> None:
    metrics = ProxyMetrics(lambda: None)
    tl = Timeline(arrived_at=10.0, admitted_at=10.1, prefill_start_at=10.1, prefill_end_at=10.5,
                  decode_start_at=10.5, first_token_at=10.7, last_token_at=11.7, finished_at=11.7)
    ctx = RequestContext(request_id="r", client_request_id=None, api_label="chat", status=200, events=11,
                         completion_tokens=11, timeline=tl)
    gaps = metrics.started("chat")
    for gap in [0.1] * 9 + [0.3]:  # the relay counts each gap between client writes into its bucket
        gaps.counts[bisect_left(gaps.bounds, gap)] += 1
        gaps.total += gap
    ctx.gaps = gaps
    metrics.observe(ctx, None)
    m = Samples(metrics.render().decode())
    assert m.value("pdproxy_time_to_first_token_seconds_sum", api="chat") == pytest.approx(0.7)
    assert m.value("pdproxy_inter_token_latency_seconds_sum", api="chat") == pytest.approx(1.2)
    assert m.value("pdproxy_inter_token_latency_seconds_count", api="chat") == 10
    assert m.value("pdproxy_inter_token_latency_seconds_bucket", api="chat", le="0.1") == 9  # same as observe()
    assert m.value("pdproxy_inter_token_latency_seconds_bucket", api="chat", le="0.2") == 9
    assert m.value("pdproxy_inter_token_latency_seconds_bucket", api="chat", le="0.3") == 10
    assert m.value("pdproxy_request_time_per_output_token_seconds_sum", api="chat") == pytest.approx(0.1)
    assert m.value("pdproxy_prefill_time_seconds_sum", api="chat") == pytest.approx(0.4)
    assert m.value("pdproxy_decode_first_token_seconds_sum", api="chat") == pytest.approx(0.2)
    assert m.value("pdproxy_decode_time_seconds_sum", api="chat") == pytest.approx(1.0)
    assert m.value("pdproxy_e2e_request_latency_seconds_sum", api="chat", outcome="ok") == pytest.approx(1.7)
    assert m.value("pdproxy_requests_in_progress", api="chat") == 0
    # one registry per app: a second app does not share (or collide with) the first one's series
    other = Samples(ProxyMetrics(lambda: None).render().decode())
    assert other.value("pdproxy_requests_total", api="chat", status="200", outcome="ok") == 0


def test_observe_counts_an_engines_figures_only_when_they_are_counts() -> None:
    """An engine's usage is read as it comes: a negative ``completion_tokens`` or ``cached_tokens`` (a broken or
    hostile engine) counts nothing and takes nothing back; the rest of the request is recorded as usual."""
    metrics = ProxyMetrics(lambda: None)
    for completion, cached in ((5, 3), (-7, -2)):
        ctx = RequestContext(request_id="r", client_request_id=None, api_label="chat", status=200,
                             prefiller="http://p", prompt_tokens=10, completion_tokens=completion, prefix_mode="text",
                             predicted_cached_tokens=3, cached_tokens=cached,
                             timeline=Timeline(arrived_at=1.0, first_token_at=1.5, finished_at=2.0))
        ctx.gaps = metrics.started("chat")
        metrics.observe(ctx, None)
    m = Samples(metrics.render().decode())
    assert m.value("pdproxy_requests_total", api="chat", status="200", outcome="ok") == 2
    assert m.value("pdproxy_prompt_tokens_total", api="chat") == 20
    assert m.value("pdproxy_generation_tokens_total", api="chat") == 5
    assert m.value("pdproxy_time_to_first_token_seconds_count", api="chat") == 2
    assert m.value("pdproxy_prefix_predictions_total", source="text", outcome="exact") == 1
    assert m.value("pdproxy_prefix_predictions_total", source="text", outcome="unreported") == 1
    assert m.value("pdproxy_requests_in_progress", api="chat") == 0


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.005, 0.25, 1.0, 10.0]),
                       max_size=20))
def test_bisected_observe_stores_what_histogram_observe_stores(values: list[float]) -> None:
    """The request path's histogram observe (bucket by bisection) leaves the same samples as prometheus_client's
    own ``observe``, bucket bounds, infinities and NaN included."""
    reg = CollectorRegistry()
    bounds = (0.005, 0.05, 0.25, 1.0, 10.0)
    ours = Histogram("ours", "x", ("api",), buckets=bounds, registry=reg).labels("chat")
    theirs = Histogram("theirs", "x", ("api",), buckets=bounds, registry=reg).labels("chat")
    for v in values:
        _observe(ours, v)
        theirs.observe(v)

    def samples(name: str) -> list[tuple[str, dict[str, str], float]]:
        return [(x.name.removeprefix(name), x.labels, x.value) for m in reg.collect() if m.name == name
                for x in m.samples if not x.name.endswith("_created")]

    got, want = samples("ours"), samples("theirs")
    assert [(n, lab) for n, lab, _v in got] == [(n, lab) for n, lab, _v in want]
    assert [v for _n, _l, v in got] == pytest.approx([v for _n, _l, v in want], nan_ok=True)
