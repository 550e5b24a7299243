"""The main job end to end: the real ``openai`` client → pdproxy → simulated prefiller + decoders (processes).

Asserts what the engines received (bodies, headers) and what the client got; the ``proxy`` fixture asserts that
the per-endpoint load counters are back to zero after each test.
"""

from __future__ import annotations

import base64
from typing import Any

import httpx
import openai
import orjson
import pytest

from tests.conftest import Fleet
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(30)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather for a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}]


def client(proxy: ProxyThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=20)


def legs(sims: Fleet) -> tuple[dict[str, Any], dict[str, Any]]:
    """The one prefill request and the one decode request the engines received."""
    (p,) = [r for s in sims.prefillers for r in s.completions_received()]
    (d,) = [r for s in sims.decoders for r in s.completions_received()]
    return p, d


def assert_pd_contract(p: dict[str, Any], d: dict[str, Any], sent: dict[str, Any]) -> None:
    pb, db = p["body"], d["body"]
    assert pb["stream"] is False and pb["max_tokens"] == 1
    assert "stream_options" not in pb
    assert pb["kv_transfer_params"]["do_remote_decode"] is True
    assert pb["kv_transfer_params"]["remote_block_ids"] is None
    # the decoder got the client's body plus the prefiller's kv_transfer_params
    for key, value in sent.items():
        assert db[key] == value, key
    params = db["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert isinstance(params["remote_block_ids"], list) and isinstance(params["remote_block_ids"][0], list)
    # one engine-side request id on both legs, unique per request
    assert p["headers"]["x-request-id"] == d["headers"]["x-request-id"]
    assert p["headers"]["authorization"] == d["headers"]["authorization"] == "Bearer sk-client"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completion(proxy: ProxyThread, sims: Fleet, stream: bool) -> None:
    sent = {"model": "sim-model", "messages": [{"role": "user", "content": "Hello there, how are you?"}],
            "max_tokens": 12, "temperature": 0.7}
    c = client(proxy)
    if stream:
        chunks = list(c.chat.completions.create(**sent, stream=True, stream_options={"include_usage": True}))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert chunks[0].choices[0].delta.role == "assistant"
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        assert finish == ["length"]
        usage = chunks[-1].usage
        assert chunks[-1].choices == []
        sent = {**sent, "stream": True, "stream_options": {"include_usage": True}}
    else:
        resp = c.chat.completions.create(**sent)
        text = resp.choices[0].message.content or ""
        assert resp.choices[0].finish_reason == "length"
        usage = resp.usage
    assert text
    assert usage is not None and usage.completion_tokens == 12
    p, d = legs(sims)
    assert_pd_contract(p, d, sent)
    # cached_tokens is the prefiller's figure, not the decoder's (which pulled the whole prompt)
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("stream", [False, True])
def test_completions(proxy: ProxyThread, sims: Fleet, stream: bool) -> None:
    c = client(proxy)
    sent: dict[str, Any] = {"model": "sim-model", "prompt": "Once upon a time", "max_tokens": 7}
    if stream:
        chunks = list(c.completions.create(**sent, stream=True))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        sent["stream"] = True
    else:
        resp = c.completions.create(**sent)
        text = resp.choices[0].text
        assert resp.usage is not None and resp.usage.completion_tokens == 7
    assert text
    p, d = legs(sims)
    assert_pd_contract(p, d, sent)
    assert p["path"] == d["path"] == "/v1/completions"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls(proxy: ProxyThread, sims: Fleet, stream: bool) -> None:
    c = client(proxy)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    if stream:
        chunks = list(c.chat.completions.create(model="sim-model", messages=messages, tools=TOOLS, stream=True,
                                                max_tokens=64))
        calls = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
        assert calls and calls[0].function.name == "get_weather"
        args = "".join(tc.function.arguments or "" for tc in calls)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    else:
        resp = c.chat.completions.create(model="sim-model", messages=messages, tools=TOOLS, max_tokens=64)
        (call,) = resp.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather"
        args = call.function.arguments
        finish = [resp.choices[0].finish_reason]
    assert finish == ["tool_calls"]
    assert isinstance(orjson.loads(args), dict)
    p, d = legs(sims)
    assert p["body"]["tools"] == d["body"]["tools"] == TOOLS


def test_unknown_fields_numbers_and_large_images_reach_both_engines_unchanged(proxy: ProxyThread,
                                                                             sims: Fleet) -> None:
    image = base64.b64encode(bytes(range(256)) * 12_000).decode()  # ~4 MB of base64
    raw = (b'{"model":"sim-model","messages":[{"role":"user","content":[{"type":"text","text":"describe"},'
           b'{"type":"image_url","image_url":{"url":"data:image/png;base64,' + image.encode() + b'"}}]}],'
           b'"max_tokens":3,"temperature":0.10000000000000000555,"top_p":1.0,"min_p":1e-5,'
           b'"ignore_eos":true,"repetition_penalty":1.05,"chat_template_kwargs":{"enable_thinking":false},'
           b'"vllm_xargs":{"x":1}}')
    r = httpx.post(proxy.url + "/v1/chat/completions", content=raw, timeout=20,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    p, d = legs(sims)
    assert d["raw_len"] > len(raw)  # decoder got the client's bytes + kv_transfer_params
    for leg in (p, d):
        body = leg["body"]
        assert body["messages"][0]["content"][1]["image_url"]["url"].endswith(image[-64:])
        assert len(body["messages"][0]["content"][1]["image_url"]["url"]) == len(image) + 22
        assert body["ignore_eos"] is True and body["repetition_penalty"] == 1.05
        assert body["chat_template_kwargs"] == {"enable_thinking": False} and body["vllm_xargs"] == {"x": 1}
        assert body["min_p"] == 1e-5


def test_client_request_id_is_kept_recognisable_and_unique(proxy: ProxyThread, sims: Fleet) -> None:
    ids = []
    for _ in range(2):
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       headers={"X-Request-Id": "client-abc"}, timeout=10)
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "client-abc"
    for s in sims.all:
        ids += [rec["headers"]["x-request-id"] for rec in s.completions_received()]
    assert len(ids) == 4 and len(set(ids)) == 2  # same id on P and D, different per request
    assert all(i.startswith("client-abc-") for i in ids)


def test_decoder_400_reaches_streaming_client_as_400(proxy: ProxyThread, sims: Fleet) -> None:
    body = {"error": {"message": "decoder says no", "type": "BadRequestError", "param": None, "code": 400}}
    for d in sims.decoders:
        d.faults({"kind": "status", "status": 400, "body": body})
    with pytest.raises(openai.BadRequestError) as e:
        list(client(proxy).chat.completions.create(model="sim-model", stream=True, max_tokens=5,
                                                   messages=[{"role": "user", "content": "hi"}]))
    assert e.value.status_code == 400
    assert e.value.body == body["error"]  # the openai client unwraps the engine's {"error": {...}} envelope
    r = httpx.post(proxy.url + "/v1/chat/completions", timeout=10,
                   json={"stream": True, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json() == body  # not a 200 with an empty body


def test_prefiller_4xx_is_passed_through_and_decoder_untouched(proxy: ProxyThread, sims: Fleet) -> None:
    body = {"error": {"message": "bad sampling param", "type": "BadRequestError", "param": "top_k", "code": 400}}
    sims.prefillers[0].faults({"kind": "status", "status": 400, "body": body})
    r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
    assert r.status_code == 400 and r.json() == body
    assert all(not d.completions_received() for d in sims.decoders)


@pytest.mark.parametrize(("raw", "param"), [
    (b"{bad json", "body.1"),                                  # vLLM's FastAPI envelope: json_invalid at char 1
    (b"[1, 2]", "body"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 99}', "n"),  # over the fan-out bound
])
def test_malformed_bodies_get_400_without_reaching_an_engine(proxy: ProxyThread, sims: Fleet, raw: bytes,
                                                             param: str) -> None:
    r = httpx.post(proxy.url + "/v1/chat/completions", content=raw, timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["message"]
    assert all(not s.completions_received() for s in sims.all)


@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
                                 b'{"model": "sim-model"}',
                                 b'{"model": "sim-model", "messages": 5}',          # old code: pdproxy's 500
                                 b'{"model": "sim-model", "messages": [{"role": "user", "content": "x"}], '
                                 b'"tools": {"type": "function"}}'])
def test_an_invalid_request_reaches_the_prefiller_as_sent_and_its_400_the_client(proxy: ProxyThread, sims: Fleet,
                                                                                 raw: bytes) -> None:
    """pdproxy finds it invalid for vLLM: the prefiller judges the client's own body (vLLM's 400, in vLLM's
    order of checks; should an engine accept it after all, pdproxy answers vLLM's words itself) and no decoder
    is contacted."""
    r = httpx.post(proxy.url + "/v1/chat/completions", content=raw, timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    (leg,) = [x for s in sims.prefillers for x in s.completions_received()]
    assert leg["body"] == orjson.loads(raw)
    assert all(not d.completions_received() for d in sims.decoders)


def test_wrong_method_on_a_completion_route_is_405(proxy: ProxyThread) -> None:
    r = httpx.get(proxy.url + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == 405
    r = httpx.get(proxy.url + "/v1/messages")            # Anthropic's shape on its route
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json() == {"type": "error", "error": {"type": "MethodNotAllowed", "message": "Method Not Allowed"}}


@pytest.mark.parametrize(("method", "path", "allow"), [("POST", "/v1/models", "GET"), ("DELETE", "/health", "GET"),
                                                     ("PUT", "/debug/prefix", "GET, POST")])
def test_wrong_method_on_a_control_route_is_405_in_vllms_envelope(proxy: ProxyThread, method: str, path: str,
                                                                   allow: str) -> None:
    """The routes served through the ASGI app answer a wrong method as the completion routes do (old code:
    FastAPI's ``{"detail": "Method Not Allowed"}``), with one ``Allow`` header naming every method the path
    serves (Starlette's own, naming the first route's only, was sent beside it)."""
    r = httpx.request(method, proxy.url + path)
    assert r.status_code == 405 and r.headers.get_list("allow") == [allow]
    assert r.json() == {"error": {"message": "Method Not Allowed", "type": "MethodNotAllowed", "param": None,
                                  "code": 405}}


def test_a_trailing_slash_is_not_redirected_to_the_clients_host(proxy: ProxyThread) -> None:
    """Starlette redirects ``/v1/models/`` to ``http://<the client's Host>/v1/models``; a shared cache would keep
    that redirect for everyone.  pdproxy answers 404 instead (vLLM's routes have no trailing slash either)."""
    r = httpx.get(proxy.url + "/v1/models/", headers={"host": "evil.example"}, follow_redirects=False)
    assert r.status_code == 404 and "location" not in r.headers
    assert httpx.get(proxy.url + "/v1/models").status_code == 200


def test_models_health_version(proxy: ProxyThread) -> None:
    models = client(proxy).models.list()
    (card,) = models.data
    assert card.id == "sim-model"
    assert card.model_extra and card.model_extra["max_model_len"] == 4096
    assert httpx.get(proxy.url + "/health").status_code == 200
    assert httpx.get(proxy.url + "/version").json()["version"]


def test_prefiller_without_a_kv_connector_is_a_502(sims: Fleet) -> None:
    """A "prefiller" that caps the one-token leg without handing over KV (a plain engine: here a consumer-only
    sim) is a configuration error, said so without the engine's address."""
    d0, d1 = sims.decoders
    proxy = ProxyThread(prefill=[d1.url], decode=[d0.url]).start()
    try:
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 502
        message = r.json()["error"]["message"]
        assert "kv_transfer_params" in message and "127.0.0.1" not in message and d1.url not in message
        assert not d0.completions_received()
        proxy.wait_idle()
    finally:
        proxy.stop()


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_wrong_method_on_anthropics_count_tokens_is_405_in_anthropics_shape(proxy: ProxyThread, method: str) -> None:
    """``/v1/messages/count_tokens`` answers its own errors in Anthropic's envelope (pdproxy/app/passthrough.py's
    ``ANTHROPIC_ROUTES``); its 405 did not (old code: vLLM's OpenAI envelope), as ``/v1/messages``' does."""
    r = httpx.request(method, proxy.url + "/v1/messages/count_tokens")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json() == {"type": "error", "error": {"type": "MethodNotAllowed", "message": "Method Not Allowed"}}
    r = httpx.get(proxy.url + "/tokenize")                # an OpenAI passthrough route keeps vLLM's envelope
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["code"] == 405


def test_every_control_routes_405_allows_exactly_the_methods_it_serves(sims: Fleet) -> None:
    """A wrong method's ``Allow`` lists every method the path is served with (RFC 9110 §15.5.6): ``/admin/endpoints``
    serves GET, POST and DELETE (old code: ``Allow: GET, HEAD``, Starlette's first route for the path only)."""
    p = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                    admin_key="admin-secret", debug_routes="open").start()
    try:
        paths = p.app.control.openapi()["paths"]        # every route the control plane serves, with its methods
        served = {path: {m.upper() for m in ops} for path, ops in paths.items()}
        assert served["/admin/endpoints"] == {"GET", "POST", "DELETE"}
        for path, methods in served.items():
            wrong = next(m for m in ("PATCH", "PUT", "DELETE", "POST") if m not in methods)
            r = httpx.request(wrong, p.url + path, headers={"Authorization": "Bearer admin-secret"})
            assert r.status_code == 405, (path, wrong, r.status_code)
            assert set(r.headers["allow"].split(", ")) == methods, (path, r.headers["allow"])
            assert r.json()["error"]["type"] == "MethodNotAllowed"
    finally:
        p.stop()
