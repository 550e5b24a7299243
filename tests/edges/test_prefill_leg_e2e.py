"""The P→D legs through real processes (the ``openai`` client → pdproxy → simulated engines): what each engine
receives, and what the client gets when the prefill leg already finished the request (``docs/pd-protocol.md``)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import orjson
import pytest

from pdproxy.apis import kv_transfer
from tests.conftest import Fleet
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(30)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(proxy: ProxyThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0, timeout=20)


def legs(sims: Fleet) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return ([r for s in sims.prefillers for r in s.completions_received()],
            [r for s in sims.decoders for r in s.completions_received()])


def test_the_prefill_leg_asks_one_token_and_the_decoder_gets_the_clients_constraints(proxy: ProxyThread,
                                                                                      sims: Fleet) -> None:
    """Prefill: one token, ``min_tokens: 1`` (no first-token EOS), not streamed, the stub handle, no client
    handle; every field that shapes the prompt kept (tools...), output constraints relaxed (tool_choice auto, no
    structured outputs: pdproxy/apis/kv_transfer.py).
    Decode: the client's bytes with only the handle replaced, one member of each name."""
    sent = {"model": "sim-model", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 12, "min_tokens": 3,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "response_format": {"type": "json_object"}, "structured_outputs": {"json": {"type": "object"}},
            "logit_bias": {"5": -1.0}, "stream": True, "stream_options": {"include_usage": True},
            "cache_salt": "s3cr3t", "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "client"},
            "ec_transfer_params": {"remote_host": "client"}}
    raw = orjson.dumps(sent)
    r = httpx.post(proxy.url + "/v1/chat/completions", content=raw, timeout=20,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    (p,), (d,) = legs(sims)
    pb, db = p["body"], d["body"]
    assert (pb["max_tokens"], pb["min_tokens"], pb["stream"]) == (1, 1, False) and "stream_options" not in pb
    assert pb["kv_transfer_params"] == kv_transfer.PREFILL_STUB and "ec_transfer_params" not in pb
    for key in ("messages", "tools", "logit_bias", "cache_salt", "model"):     # what shapes the prompt
        assert pb[key] == sent[key] == db[key], key
    for key in ("tool_choice", "response_format", "structured_outputs"):        # what only steers sampling
        assert sent[key] == db[key], key
    assert pb["tool_choice"] == "auto" and not {"response_format", "structured_outputs"} & pb.keys()
    assert (db["max_tokens"], db["min_tokens"], db["stream"], db["stream_options"]) == (12, 3, True,
                                                                                        {"include_usage": True})
    assert db["kv_transfer_params"]["do_remote_prefill"] is True and db["kv_transfer_params"]["remote_host"] != "client"
    assert "ec_transfer_params" not in db
    # the bytes the decoder got: the client's, the two proxy-owned members cut out, one handle inserted
    cut = raw.replace(b',"kv_transfer_params":{"do_remote_prefill":true,"remote_host":"client"}', b"")
    cut = cut.replace(b',"ec_transfer_params":{"remote_host":"client"}', b"")
    assert d["raw_len"] == len(cut) + len(b',"kv_transfer_params":') + len(orjson.dumps(db["kv_transfer_params"]))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["chat", "completions"])
def test_a_prefill_that_stops_on_its_first_token_is_the_answer(proxy: ProxyThread, sims: Fleet, api: str,
                                                               stream: bool) -> None:
    """The prefiller ends the request itself (first-token EOS) and hands over no KV: the client gets that
    complete, empty answer — finish_reason "stop", usage — as JSON or as a well-formed stream; no decoder."""
    sims.prefillers[0].faults({"kind": "no_kv_params"})
    c = client(proxy)
    if api == "chat":
        kwargs: dict[str, Any] = {"model": "sim-model", "messages": MESSAGES, "max_tokens": 16}
        if stream:
            chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
            assert next(ch.choices[0].delta.role for ch in chunks if ch.choices) == "assistant"
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices] == [None, "stop"]
            usage = chunks[-1].usage
        else:
            reply = c.chat.completions.create(**kwargs)
            assert reply.choices[0].finish_reason == "stop"
            text, usage = reply.choices[0].message.content or "", reply.usage
    else:
        kwargs = {"model": "sim-model", "prompt": "The weather in Paris is", "max_tokens": 16}
        if stream:
            chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
            text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices] == ["stop"]
            usage = chunks[-1].usage
        else:
            comp = c.completions.create(**kwargs)
            assert comp.choices[0].finish_reason == "stop"
            text, usage = comp.choices[0].text, comp.usage
    assert len(text.split()) <= 1       # the prefiller's one token (vLLM shows nothing for an EOS; the sim a word)
    assert usage is not None and usage.completion_tokens == 1 and usage.prompt_tokens > 0
    prefills, decodes = legs(sims)
    assert len(prefills) == 1 and decodes == []


def test_a_stopped_prefill_cannot_answer_a_client_asking_more_tokens(proxy: ProxyThread, sims: Fleet) -> None:
    """With ``min_tokens`` above 1 the one-token answer is not one the client would accept: a decoder prefills
    the request itself (no handle in its body) and answers."""
    sims.prefillers[0].faults({"kind": "no_kv_params"})
    reply = client(proxy).completions.create(model="sim-model", prompt="The weather in Paris is", max_tokens=8,
                                             extra_body={"min_tokens": 4})
    assert reply.choices[0].finish_reason == "length" and reply.usage and reply.usage.completion_tokens == 8
    _, (d,) = legs(sims)
    assert "kv_transfer_params" not in d["body"] and d["body"]["min_tokens"] == 4


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 1}, {"echo": True, "logprobs": 1},
                                   {"use_beam_search": True}])
def test_requests_needing_the_prompts_logits_go_to_a_decoder_alone(proxy: ProxyThread, sims: Fleet,
                                                                   extra: dict[str, Any]) -> None:
    """vLLM computes prompt logprobs (and beam search) from the prompt on whichever engine runs the request, and
    ignores a KV handle for them: pdproxy sends no prefill leg and the decoder gets the client's body."""
    body = {"model": "sim-model", "prompt": "The weather in Paris is", "max_tokens": 4, **extra}
    httpx.post(proxy.url + "/v1/completions", json=body, timeout=20)
    prefills, (d,) = legs(sims)
    assert prefills == []
    assert "kv_transfer_params" not in d["body"] and all(d["body"][k] == v for k, v in extra.items())



@pytest.mark.parametrize("stream", [False, True])
def test_echo_without_generation_is_the_prompt_from_a_decoder_alone(proxy: ProxyThread, sims: Fleet,
                                                                    stream: bool) -> None:
    """``echo`` with ``max_tokens: 0`` is valid in vLLM 0.32 (run with ``max_tokens`` 1, the prompt echoed,
    ``completion/serving.py``): a decoder alone answers the prompt as the text (the simulator once refused it)."""
    prompt = "The weather in Paris is"
    c = client(proxy)
    if stream:
        chunks = list(c.completions.create(model="sim-model", prompt=prompt, max_tokens=0, echo=True, stream=True,
                                           stream_options={"include_usage": True}))
        assert [ch.choices[0].text for ch in chunks if ch.choices] == [prompt]
        finish, usage = chunks[-2].choices[0].finish_reason, chunks[-1].usage
    else:
        reply = c.completions.create(model="sim-model", prompt=prompt, max_tokens=0, echo=True)
        assert reply.choices[0].text == prompt
        finish, usage = reply.choices[0].finish_reason, reply.usage
    assert finish == "length" and usage is not None and usage.completion_tokens == 1
    prefills, (d,) = legs(sims)
    assert prefills == [] and (d["body"]["echo"], d["body"]["max_tokens"]) == (True, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_generation_is_the_prompt_then_the_decoders_tokens(proxy: ProxyThread, sims: Fleet,
                                                                     stream: bool) -> None:
    """``echo`` with ``max_tokens`` > 0 (no logprobs) goes prefiller → decoder; vLLM 0.32 answers the prompt
    followed by the generated text (``completion/serving.py``), so the decoder's answer the client gets starts
    with the prompt (the simulator once sent the generated text alone), and usage counts generated tokens only."""
    prompt = "The weather in Paris is"
    c = client(proxy)
    if stream:
        chunks = list(c.completions.create(model="sim-model", prompt=prompt, max_tokens=4, echo=True, stream=True,
                                           stream_options={"include_usage": True}))
        texts = [ch.choices[0].text for ch in chunks if ch.choices]
        assert texts[0].startswith(prompt)
        text, usage = "".join(texts), chunks[-1].usage
    else:
        reply = c.completions.create(model="sim-model", prompt=prompt, max_tokens=4, echo=True)
        text, usage = reply.choices[0].text, reply.usage
    assert text.startswith(prompt) and len(text) > len(prompt)
    assert usage is not None and usage.completion_tokens == 4
    (p,), (d,) = legs(sims)
    assert p["body"]["max_tokens"] == 1 and (d["body"]["echo"], d["body"]["max_tokens"]) == (True, 4)

OVER = 4096 + 1                      # the fleet's max_model_len + 1 (tests/conftest.py SIM_ARGS)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": OVER, "stream": True}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": OVER}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "The weather in Paris is", "max_tokens": OVER, "stream": True}, "max_tokens"),
    ("/v1/responses", {"input": "The weather in Paris?", "max_output_tokens": OVER, "stream": True},
     "max_output_tokens"),
])
def test_more_output_tokens_than_max_model_len_is_vllms_400_at_once(proxy: ProxyThread, sims: Fleet, path: str,
                                                                    body: dict[str, Any], param: str) -> None:
    """vLLM refuses ``max_tokens`` > ``max_model_len`` before any work (``renderers/params.py::TokenizeParams``):
    pdproxy answers that 400 in vLLM's words itself — no engine asked, so an engine that would accept it cannot
    make the client wait for a whole prefill-side generation (a new user's trial waited 30 s for a 504) — and the
    simulator refuses it the same way when asked directly."""
    r = httpx.post(proxy.url + path, json={"model": "sim-model", **body}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] == (
        f"{param}={OVER} cannot be greater than max_model_len=4096. Please request fewer output tokens. "
        f"(parameter={param}, value={OVER})")
    assert generation_requests(sims) == []
    direct = httpx.post(sims.prefillers[0].url + path, json={"model": "sim-model", **body}, timeout=10)
    assert direct.status_code == 400 and direct.json()["error"] == err


def test_more_output_tokens_than_max_model_len_in_the_anthropic_shape(proxy: ProxyThread, sims: Fleet) -> None:
    r = httpx.post(proxy.url + "/v1/messages", json={"model": "sim-model", "max_tokens": OVER, "stream": True,
                                                     "messages": MESSAGES}, timeout=10)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["message"].startswith(f"max_tokens={OVER} cannot be greater than max_model_len=4096.")
    assert generation_requests(sims) == []


def generation_requests(sims: Fleet) -> list[dict[str, Any]]:
    """What the engines received on the four generation routes."""
    routes = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
    return [x for s in sims.all for x in s.received() if x["path"] in routes]


def test_a_stream_the_engine_accepts_though_vllm_refuses_is_pdproxys_400_never_the_engines_fault(
        proxy: ProxyThread, sims: Fleet) -> None:
    """A body pdproxy finds invalid for vLLM goes to the prefiller as sent, for vLLM's own 400.  An engine more
    lenient (here the simulator, which takes ``include_usage: "maybe"``) accepts it and starts streaming: its status
    line is the verdict — pdproxy answers its own 400 and stops the engine's stream there (the connection closed,
    vLLM aborts).  Never a failure of the engine: more of them than the breaker's threshold (3), each tried on one
    prefiller once, and the next request is served (one client's bodies once opened the breaker for everyone)."""
    body = {"model": "sim-model", "messages": MESSAGES, "max_tokens": 2000, "stream": True,
            "stream_options": {"include_usage": "maybe"}}
    (prefiller,) = sims.prefillers
    before = prefiller.state()
    for _ in range(5):
        r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=20)
        err = r.json()["error"]
        assert (r.status_code, err["param"]) == (400, "body.stream_options.include_usage"), r.text  # vLLM's words
    p, d = legs(sims)
    assert len(p) == 5 and not d and all(x["body"]["stream_options"] == {"include_usage": "maybe"} for x in p)
    assert not [e for e, b in proxy.state.health.breakers.items() if b.state != "closed"]
    ok = client(proxy).chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=4)
    assert ok.choices[0].message.content
    after = prefiller.state()
    assert after["aborted"] - before["aborted"] == 5 and after["active_streams"] == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_an_integer_past_64_bits_is_refused_before_any_leg_would_carry_another_number(proxy: ProxyThread,
                                                                                     sims: Fleet, path: str) -> None:
    """orjson 3.13 reads ``123456789012345678901234567890`` as a float: the prefill leg (written again from the
    parsed body) would carry ``1.2345678901234568e+29`` where the decoder (the client's bytes) gets the integer —
    two prompts for one request, the case that kills a decoder (docs/pd-protocol.md).  pdproxy refuses such a body
    with a 400 in the route's shape; no engine is asked."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 0}}}
    tools = ([{"type": "function", "function": {"name": "f", "parameters": schema}}] if path != "/v1/messages"
             else [{"name": "f", "input_schema": schema}])
    body = orjson.dumps({"model": "sim-model", "max_tokens": 3, "messages": MESSAGES, "tools": tools})
    raw = body.replace(b'"maximum":0', b'"maximum":123456789012345678901234567890')
    r = httpx.post(proxy.url + path, content=raw, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "integers within 64 bits" in message and (r.json().get("type") == "error") is (path == "/v1/messages")
    assert generation_requests(sims) == []
    ok = httpx.post(proxy.url + path, content=body.replace(b'"maximum":0', b'"maximum":18446744073709551615'),
                    headers={"content-type": "application/json"}, timeout=10)
    assert ok.status_code == 200, ok.text
    (p,), (d,) = legs(sims) if path != "/v1/messages" else messages_legs(sims)
    assert b"18446744073709551615" in orjson.dumps(p["body"]) and b"18446744073709551615" in orjson.dumps(d["body"])


def messages_legs(sims: Fleet) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return ([r for s in sims.prefillers for r in s.received() if r["path"] == "/v1/messages"],
            [r for s in sims.decoders for r in s.received() if r["path"] == "/v1/messages"])
