"""Every other vLLM route through pdproxy to one engine serving the request's model: tokenize, render, generate
(streamed as the engine streams), pooling routes on a pooling engine, a multipart transcription on a speech
engine; failover to the next engine; a route no engine serves; unknown routes and models as 404s in the OpenAI
envelope.  Engines are simulated processes on loopback; ``x-pdproxy-decoder`` / ``x-pdproxy-prefiller`` name the
engine that answered."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.apis.support import events
from tests.support import ProxyThread, SimProcess, running

pytestmark = pytest.mark.timeout(60)

FAST = ("--prefill-tokens-per-s", "0", "--decode-tokens-per-s", "0")


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, SimProcess]]:
    fleet = {"p": SimProcess("prefill", "--served-model-name", "gen", *FAST),
             "d": SimProcess("decode", "--served-model-name", "gen", *FAST),
             "emb": SimProcess("both", "--served-model-name", "emb", "--runner", "pooling", "--embedding-size", "8",
                               *FAST),
             "asr": SimProcess("both", "--served-model-name", "whisper", "--transcription", *FAST)}
    with running(*fleet.values()):
        yield fleet


@pytest.fixture
def proxy(engines: dict[str, SimProcess]) -> Iterator[ProxyThread]:
    for s in engines.values():
        s.reset()
    # the pooling and speech engines are listed as decoders: passthrough tries decoders first
    p = ProxyThread(prefill=[engines["p"].url], decode=[engines["d"].url, engines["emb"].url, engines["asr"].url],
                    expose_routing_headers=True).start()
    try:
        yield p
        p.wait_idle()
    finally:
        p.stop()


def served_by(r: httpx.Response) -> str | None:
    return r.headers.get("x-pdproxy-decoder") or r.headers.get("x-pdproxy-prefiller")


@pytest.mark.parametrize(("path", "body"), [
    ("/tokenize", {"model": "gen", "prompt": "Hello there world"}),
    ("/tokenize", {"model": "gen", "messages": [{"role": "user", "content": "Hello"}]}),
    ("/detokenize", {"model": "gen", "tokens": [1, 2, 3]}),
    ("/v1/completions/render", {"model": "gen", "prompt": "Hello there"}),
    ("/v1/chat/completions/render", {"model": "gen", "messages": [{"role": "user", "content": "Hello"}]}),
    ("/v1/messages/render", {"model": "gen", "max_tokens": 4, "messages": [{"role": "user", "content": "Hello"}]}),
    ("/v1/responses/render", {"model": "gen", "input": "Hello"}),
    ("/inference/v1/generate", {"model": "gen", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}}),
])
def test_generate_model_routes_reach_a_decoder_serving_the_model(proxy: ProxyThread,
                                                                 engines: dict[str, SimProcess], path: str,
                                                                 body: dict[str, object]) -> None:
    r = httpx.post(proxy.url + path, json=body, headers={"x-request-id": "client-7"}, timeout=20)
    direct = httpx.post(engines["d"].url + path, json=body, timeout=20)
    assert r.status_code == direct.status_code == 200
    assert served_by(r) == engines["d"].url and r.headers["x-request-id"] == "client-7"
    mine, theirs = r.json(), direct.json()
    for key in ("tokens", "count", "prompt", "token_ids"):               # the exact ids the engine gives
        if isinstance(mine, dict) and key in mine:
            assert mine[key] == theirs[key]
    if isinstance(mine, list):
        assert [m["token_ids"] for m in mine] == [t["token_ids"] for t in theirs]


def test_generate_streams_as_the_engine_streams(proxy: ProxyThread, engines: dict[str, SimProcess]) -> None:
    with httpx.stream("POST", proxy.url + "/inference/v1/generate", timeout=20,
                      json={"model": "gen", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4},
                            "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert "content-length" not in r.headers                       # relayed chunk by chunk
        text = "".join(r.iter_text())
    got = events(text)
    assert got[-1] == (None, "[DONE]")
    assert sum(len(data["choices"][0]["token_ids"]) for _, data in got[:-1]) == 4
    generated = [r for r in engines["d"].received() if r["path"] == "/inference/v1/generate"]
    assert len(generated) == 1 and generated[0]["body"]["stream"] is True


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/embeddings", {"model": "emb", "input": ["a cat", "a dog"]}),
    ("/v1/embeddings", {"input": "no model named: the engines that do not serve the route are skipped"}),
    ("/pooling", {"model": "emb", "input": "a cat"}),
    ("/score", {"model": "emb", "text_1": "a cat", "text_2": ["a dog", "a cat"]}),
    ("/rerank", {"model": "emb", "query": "a cat", "documents": ["a dog", "a cat"]}),
    ("/v1/rerank", {"model": "emb", "query": "a cat", "documents": ["a dog", "a cat"]}),
    ("/v2/rerank", {"model": "emb", "query": "a cat", "documents": ["a dog", "a cat"]}),
])
def test_pooling_routes_reach_the_pooling_engine(proxy: ProxyThread, engines: dict[str, SimProcess], path: str,
                                                 body: dict[str, object]) -> None:
    r = httpx.post(proxy.url + path, json=body, timeout=20)
    assert r.status_code == 200, r.text
    assert served_by(r) == engines["emb"].url
    direct = httpx.post(engines["emb"].url + path, json=body, timeout=20).json()
    mine = r.json()
    if "data" in mine and isinstance(mine["data"], list) and mine["data"] and "embedding" in mine["data"][0]:
        assert [d["embedding"] for d in mine["data"]] == [d["embedding"] for d in direct["data"]]
        assert len(mine["data"][0]["embedding"]) == 8


def test_a_route_no_engine_serves_is_an_openai_404(proxy: ProxyThread) -> None:
    r = httpx.post(proxy.url + "/classify", json={"model": "emb", "input": "a cat"})   # an embed model: no classify
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "NotFoundError" and "/classify" in r.json()["error"]["message"]


def test_a_multipart_transcription_reaches_the_speech_engine(proxy: ProxyThread,
                                                             engines: dict[str, SimProcess]) -> None:
    audio = b"RIFF\x24\x08\x00\x00WAVEfmt " + bytes(range(256)) * 64
    r = httpx.post(proxy.url + "/v1/audio/transcriptions", files={"file": ("clip.wav", audio, "audio/wav")},
                   data={"model": "whisper", "language": "en"}, timeout=20)
    assert r.status_code == 200, r.text
    assert served_by(r) == engines["asr"].url
    body = r.json()
    assert body["text"] and body["usage"]["type"] == "duration"


def test_a_failing_engine_is_replaced_by_the_next_one(proxy: ProxyThread, engines: dict[str, SimProcess]) -> None:
    engines["d"].faults({"kind": "status", "status": 503, "path": "/inference/v1/generate", "times": 1})
    r = httpx.post(proxy.url + "/inference/v1/generate", timeout=20,
                   json={"model": "gen", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2
    assert served_by(r) == engines["p"].url                            # the decoder said 503: the prefiller took it
    assert [len(s.received()) for s in (engines["d"], engines["p"])] == [1, 1]
    assert proxy.state.health.breaker(next(e for e in proxy.state.pool.endpoints()
                                           if e.url == engines["d"].url)).consecutive_failures == 1


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_success_with_an_empty_body_is_never_relayed(proxy: ProxyThread, engines: dict[str, SimProcess],
                                                               stream: bool) -> None:
    """A decoder that answers 200 and ends its body at once (a clean close before its first byte, or an empty
    200) is a failed attempt: the prefiller serves the request; with every engine doing so the client gets the
    PD path's 503 with Retry-After in the OpenAI envelope, naming the last failure, never a 200 with an empty
    body (which the engine's status line, relayed as the body began, once made)."""
    fault = ({"kind": "close_without_done", "events": 0} if stream else {"kind": "status", "status": 200, "body": ""})
    body = {"model": "gen", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}, "stream": stream}
    engines["d"].faults(dict(fault, path="/inference/v1/generate", times=1))
    r = httpx.post(proxy.url + "/inference/v1/generate", json=body, timeout=20)
    assert r.status_code == 200 and r.content.strip()
    assert served_by(r) == engines["p"].url
    for name in ("d", "p"):
        engines[name].faults(dict(fault, path="/inference/v1/generate", times=1))
    r = httpx.post(proxy.url + "/inference/v1/generate", json=body, timeout=20)
    message = r.json()["error"]["message"]
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert "retry later" in message and "with an empty body" in message


def test_engine_errors_are_relayed_honestly(proxy: ProxyThread) -> None:
    r = httpx.post(proxy.url + "/tokenize", json={"model": "gen"})       # neither prompt nor messages
    assert 400 <= r.status_code < 500 and r.json()                     # the engine's own 4xx, as it said it


def test_unknown_routes_and_models_are_openai_404s(proxy: ProxyThread) -> None:
    for method in ("GET", "POST"):
        r = httpx.request(method, proxy.url + "/v1/no-such-route", json={})
        assert r.status_code == 404
        assert r.json() == {"error": {"message": "Not Found", "type": "NotFoundError", "param": None, "code": 404}}
    r = httpx.post(proxy.url + "/v1/embeddings", json={"model": "nope", "input": "x"})
    # vLLM's pooling routes word it without aliases and with param null
    # (tests/real_vllm/captures/pooling/error_embeddings_unknown_model.json); pdproxy gave chat's words and "model"
    assert r.status_code == 404 and not served_by(r)
    assert r.json() == {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                                  "param": None, "code": 404}}
    r = httpx.post(proxy.url + "/tokenize", json={"model": "nope", "prompt": "x"})   # a generate-model route
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert r.json()["error"]["message"].startswith("The model `nope` does not exist. Valid aliases: ")
    r = httpx.get(proxy.url + "/tokenize")
    assert r.status_code == 405


def test_passthrough_requests_are_counted_per_route_and_model(proxy: ProxyThread) -> None:
    """Each series carries vLLM's ``model_name`` label: the request's model when an engine lists it, else ``""`` —
    several models behind one port keep their own series, and names a client makes up add none."""
    httpx.post(proxy.url + "/tokenize", json={"model": "gen", "prompt": "Hello"}).raise_for_status()
    httpx.post(proxy.url + "/v1/embeddings", json={"model": "emb", "input": "x"}).raise_for_status()
    httpx.post(proxy.url + "/v1/chat/completions", json={"model": "gen", "max_tokens": 3, "messages": [
        {"role": "user", "content": "Hello"}]}).raise_for_status()
    for n in range(3):
        r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": f"made-up-{n}", "max_tokens": 3,
                                                                 "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 404
    text = httpx.get(proxy.url + "/metrics").text
    assert 'pdproxy_requests_total{api="tokenize",model_name="gen",outcome="ok",status="200"} 1.0' in text
    assert 'pdproxy_requests_total{api="embeddings",model_name="emb",outcome="ok",status="200"} 1.0' in text
    assert 'pdproxy_requests_total{api="chat",model_name="gen",outcome="ok",status="200"} 1.0' in text
    assert 'pdproxy_time_to_first_token_seconds_count{api="chat",model_name="gen"} 1.0' in text
    assert 'pdproxy_generation_tokens_total{api="chat",model_name="gen"} 3.0' in text
    assert 'pdproxy_requests_total{api="chat",model_name="",outcome="model_not_found",status="404"} 3.0' in text
    assert "made-up" not in text


@pytest.mark.parametrize("model", [None, ""], ids=["absent", "empty"])
def test_a_generation_request_naming_no_model_runs_on_the_one_pd_model(proxy: ProxyThread,
                                                                       engines: dict[str, SimProcess],
                                                                       model: str | None) -> None:
    """A chat without ``model`` beside a pooling and a speech engine (decoders here, serving other models): its
    prefill and decode both run on ``gen``'s engines, the only model a prefiller and a decoder serve — the decode
    leg (with the prefiller's KV handle) once went to any decoder, the speech engine's included."""
    body: dict[str, object] = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3}
    if model is not None:
        body["model"] = model
    for _ in range(6):                     # round robin would have reached the other decoders by now
        r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=20)
        assert r.status_code == 200, r.text
        assert served_by(r) == engines["d"].url
    assert not engines["emb"].received() and not engines["asr"].received()
