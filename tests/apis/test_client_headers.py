"""What of the client's own headers reaches the engines' legs (simulated engines on loopback): the Anthropic
clients' ``x-api-key`` as the bearer token when pdproxy passes the client's credential through, and the W3C trace
context when pdproxy's own tracing is off (pdproxy/http/engine_headers.py)."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.http.engine_headers import EngineHeaders, client_authorization
from tests.apis.support import legs
from tests.conftest import Fleet
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(60)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACESTATE = "vendor=opaque"
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "Hello there " * 20}], "max_tokens": 3}


def test_the_anthropic_clients_x_api_key_is_passed_through_as_the_bearer_token(proxy: ProxyThread,
                                                                               sims: Fleet) -> None:
    client = anthropic.Anthropic(base_url=proxy.url, api_key="sk-tenant", max_retries=0, timeout=20)
    assert client.messages.create(model="sim-model", max_tokens=2, messages=[
        {"role": "user", "content": "Hello"}]).usage.output_tokens == 2
    both = legs(sims.all, "/v1/messages")
    assert len(both) == 2                                                  # the prefill leg and the decode leg
    assert [leg["headers"].get("authorization") for leg in both] == ["Bearer sk-tenant"] * 2


def test_the_clients_own_authorization_wins_over_its_x_api_key() -> None:
    assert client_authorization("Bearer a", "b") == "Bearer a"
    assert client_authorization(None, "b") == "Bearer b"
    assert client_authorization(None, None) is None and client_authorization("", "") is None
    keyed = EngineHeaders(engine_api_key="engine")                          # pdproxy's engine key still wins
    endpoint = Endpoint("http://p:1", Role.PREFILL)
    assert keyed.leg(endpoint, "r", client_authorization(None, "b"))["Authorization"] == "Bearer engine"


@pytest.mark.parametrize("stream", [False, True])
def test_the_clients_trace_context_reaches_both_legs_with_tracing_off(proxy: ProxyThread, sims: Fleet,
                                                                       stream: bool) -> None:
    headers = {"traceparent": TRACEPARENT, "tracestate": TRACESTATE}
    r = httpx.post(proxy.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, headers=headers,
                   timeout=20)
    assert r.status_code == 200, r.text
    both = legs(sims.all, "/v1/chat/completions")
    assert len(both) == 2
    assert [(leg["headers"].get("traceparent"), leg["headers"].get("tracestate")) for leg in both] == [
        (TRACEPARENT, TRACESTATE)] * 2


@pytest.mark.parametrize(("traceparent", "tracestate", "kept"), [
    (TRACEPARENT, "v=" + "x" * 510, (True, True)),                          # 512 characters: W3C's floor
    (TRACEPARENT, "v=" + "x" * 9000, (True, False)),                        # kilobytes: the engine's header limit
    (TRACEPARENT, ",".join(f"k{i}=v" for i in range(33)), (True, False)),   # over 32 members
    (TRACEPARENT + "-" + "f" * 300, TRACESTATE, (False, True)),             # a "later version" of kilobytes
])
def test_trace_context_past_w3cs_bounds_is_not_handed_on(proxy: ProxyThread, sims: Fleet, traceparent: str,
                                                         tracestate: str, kept: tuple[bool, bool]) -> None:
    """A ``traceparent`` or ``tracestate`` outside W3C Trace Context's bounds stays at pdproxy (the other one
    goes on); the request is served — 9 KB of ``tracestate`` once made the engine refuse it (400)."""
    r = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=20,
                   headers={"traceparent": traceparent, "tracestate": tracestate})
    assert r.status_code == 200, r.text
    for leg in legs(sims.all, "/v1/chat/completions"):
        got = (leg["headers"].get("traceparent"), leg["headers"].get("tracestate"))
        assert got == (traceparent if kept[0] else None, tracestate if kept[1] else None)


def test_no_trace_context_is_made_up(proxy: ProxyThread, sims: Fleet) -> None:
    assert httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=20).status_code == 200
    assert all("traceparent" not in leg["headers"] for leg in legs(sims.all, "/v1/chat/completions"))


def test_a_passthrough_route_hands_on_the_trace_context(proxy: ProxyThread, sims: Fleet) -> None:
    r = httpx.post(proxy.url + "/inference/v1/generate", headers={"traceparent": TRACEPARENT}, timeout=20,
                   json={"model": "sim-model", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 200, r.text
    (leg,) = legs(sims.all, "/inference/v1/generate")
    assert leg["headers"].get("traceparent") == TRACEPARENT


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "application/json-seq", "application/json ; charset=utf-8"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"])
def test_a_generation_route_takes_application_json_only(proxy: ProxyThread, sims: Fleet, path: str,
                                                        content_type: str | None) -> None:
    """vLLM's ``validate_json_request``: any other media type (or none: ``curl -d`` sends a form's) is its 400,
    in the route's own error shape, before any engine sees the body."""
    body = {"model": "sim-model", "max_tokens": 2, "prompt": "hi", "input": "hi",
            "messages": [{"role": "user", "content": "hi"}]}
    if path == "/v1/completions":
        body.pop("messages")
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = httpx.post(proxy.url + path, content=httpx.Request("POST", "/", json=body).content, headers=headers,
                   timeout=20)
    assert r.status_code == 400, r.text
    if path == "/v1/messages":
        assert r.json()["type"] == "error" and "application/json" in r.json()["error"]["message"]
    else:
        assert r.json()["error"]["message"] == (
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed")
    assert not [leg for s in sims.all for leg in s.completions_received()]


def test_application_json_with_parameters_in_any_case_is_served(proxy: ProxyThread, sims: Fleet) -> None:
    r = httpx.post(proxy.url + "/v1/chat/completions", content=httpx.Request("POST", "/", json=CHAT).content,
                   headers={"Content-Type": "Application/JSON; charset=utf-8"}, timeout=20)
    assert r.status_code == 200, r.text


def test_an_engines_plain_text_refusal_on_a_passthrough_route_takes_the_json_envelope(proxy: ProxyThread) -> None:
    """An engine's error that is not vLLM's JSON — here its HTTP server's plain-text 400 for a client's
    ``Authorization`` over its 8,190-byte field limit — reaches the client in the API's envelope with the engine's
    status, not as the engine's text."""
    r = httpx.post(proxy.url + "/tokenize", json={"model": "sim-model", "prompt": "hi"}, timeout=20,
                   headers={"authorization": "Bearer " + "k" * 9000})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["message"].startswith("engine answered HTTP 400: ") and err["type"]
    ok = httpx.post(proxy.url + "/tokenize", json={"model": "sim-model", "prompt": "hi"}, timeout=20)
    assert ok.status_code == 200 and ok.json()["tokens"]
    r = httpx.post(proxy.url + "/v1/messages/count_tokens", timeout=20,              # Anthropic's envelope there
                   json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]},
                   headers={"authorization": "Bearer " + "k" * 9000})
    body = r.json()
    assert r.status_code == 400 and body["type"] == "error", r.text
    assert body["error"]["message"].startswith("engine answered HTTP 400: ")
