"""vLLM 0.32's own spans join pdproxy's trace: both engines run with ``--otlp-traces-endpoint`` (gRPC, vLLM's
default protocol) pointing at the test's OTLP receiver, pdproxy exports to the same receiver over OTLP/HTTP, and
the client sends a W3C ``traceparent``.

Asserted on what the receiver got: pdproxy's request span is the child of the client's span; each engine's
``llm_request`` span (``vllm/v1/engine/output_processor.py``, ``do_tracing``) carries the client's trace id and
has pdproxy's ``prefill`` or ``decode`` span as its parent — the prefiller's request generated one token, the
decoder's the whole answer.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator

import openai
import pytest

from loadtest.otlp_receiver import GrpcReceiver, HttpReceiver, ReceivedSpan, receivers
from tests.real_vllm.support import EngineConfig, Engines, RealEngines
from tests.support import ProxyThread

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(120)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def otlp() -> Iterator[tuple[HttpReceiver, GrpcReceiver]]:
    with receivers() as (http, grpc_):
        assert grpc_ is not None
        yield http, grpc_


@pytest.fixture(scope="module")
def tracing_engines(real_engines: RealEngines, otlp: tuple[HttpReceiver, GrpcReceiver]) -> Engines:
    """Prefiller + decoder exporting their spans to the module's gRPC receiver."""
    args = f"--otlp-traces-endpoint {otlp[1].endpoint}"
    return real_engines.ensure(EngineConfig("tracing", prefill_args=args, decode_args=args))


def by_name(spans: list[ReceivedSpan], name: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.name == name]


@pytest.mark.parametrize("stream", [True, False])
def test_vllm_spans_carry_pdproxys_trace_and_hang_under_its_legs(
        tracing_engines: Engines, otlp: tuple[HttpReceiver, GrpcReceiver],
        make_proxy: Callable[..., ProxyThread], stream: bool) -> None:
    http, _ = otlp
    proxy = make_proxy(tracing_engines, otlp_traces_endpoint=http.endpoint, otlp_traces_protocol="http/protobuf")
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=60,
                           default_headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    messages = [{"role": "user", "content": "the quick brown fox"}]
    if stream:
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                     stream=True, stream_options={"include_usage": True}))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
    else:
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS)
        assert reply.usage is not None and reply.usage.completion_tokens == MAX_TOKENS

    def arrived(got: list[ReceivedSpan]) -> bool:   # both engines' spans and pdproxy's (batched: ≤ 5 s each)
        mine = [s for s in got if s.trace_id == trace_id]
        return len(by_name(mine, "llm_request")) >= 2 and len(by_name(mine, "chat tiny")) == 1

    spans = http.store.wait_for(arrived, timeout_s=60)
    mine = [s for s in spans if s.trace_id == trace_id]
    root = by_name(mine, "chat tiny")[0]
    assert root.parent_span_id == client_span and root.transport == "http"
    (prefill,) = by_name(mine, "prefill")
    (decode,) = by_name(mine, "decode")
    engine_spans = sorted(by_name(mine, "llm_request"), key=lambda s: s.attributes["gen_ai.usage.completion_tokens"])
    assert [s.transport for s in engine_spans] == ["grpc", "grpc"]           # vLLM's own exporter
    assert [s.kind for s in engine_spans] == ["SERVER", "SERVER"]
    p_span, d_span = engine_spans
    assert p_span.parent_span_id == prefill.span_id and p_span.attributes["gen_ai.usage.completion_tokens"] == 1
    assert d_span.parent_span_id == decode.span_id
    assert d_span.attributes["gen_ai.usage.completion_tokens"] == MAX_TOKENS
    prompt = root.attributes["gen_ai.usage.input_tokens"]              # the prefiller's usage.prompt_tokens
    assert p_span.attributes["gen_ai.usage.prompt_tokens"] == d_span.attributes["gen_ai.usage.prompt_tokens"]
    assert p_span.attributes["gen_ai.usage.prompt_tokens"] == prompt == prefill.attributes["gen_ai.usage.input_tokens"]
    # vLLM names the request by the X-Request-Id pdproxy sent both legs
    request_id = root.attributes["gen_ai.request.id"]
    assert {s.attributes["gen_ai.request.id"] for s in engine_spans} == {f"chatcmpl-{request_id}"}
    print(f"\nstream={stream} prompt tokens {prompt} (admission: {root.attributes['pdproxy.admission.prompt_tokens']})")
    for s in mine:
        print(f"  {s.transport:4} {s.name:14} {s.kind:8} span {s.span_id} parent {s.parent_span_id} {s.attributes}")
