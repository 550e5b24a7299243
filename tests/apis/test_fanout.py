"""Fan-out: ``n > 1`` and completion prompt lists as one P/D pair per sequence, through the real ``openai`` client
to simulated engines, merged the way vLLM answers (choice indices, usage, one usage chunk and one ``[DONE]``), and
failing honestly with hostile engines: failover before a sequence's first event, an error event (never a short
list) after it, and every leg closed and every pinned KV block released when the client leaves."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from pdproxy.apis.request import Api, parse_request
from pdproxy.pd import fanout
from pdproxy.timeline import RequestContext
from tests.apis.support import events, legs, wait_engines_idle
from tests.conftest import SIM_ARGS, Fleet
from tests.support import ProxyThread, SimProcess, running, wait_until

pytestmark = pytest.mark.timeout(60)

PROMPT = "Tell me a long story about the sea and the ships that sail on it " * 6


def oai(proxy: ProxyThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=30)


def count(sim: SimProcess, **body: Any) -> int:
    """The engine's own count of a prompt (``/tokenize``)."""
    return int(httpx.post(sim.url + "/tokenize", json={"model": "sim-model", **body}).json()["count"])


def prefix_hits(sim: SimProcess) -> float:
    text = sim.client.get("/metrics").text
    found = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def decode_legs(sims: Fleet, path: str) -> list[dict[str, Any]]:
    """Decode legs (the release legs, ``max_tokens: 1`` JSON, left out)."""
    return [r for r in legs(sims.decoders, path) if r["body"].get("max_tokens") != 1]


# ------------------------------------------------------------------------------------------------- the merge
def test_chat_n3_json_is_three_pairs_merged_like_vllm(proxy: ProxyThread, sims: Fleet) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    hits_before = prefix_hits(sims.prefillers[0])
    resp = oai(proxy).chat.completions.create(model="sim-model", messages=messages, n=3, max_tokens=5, seed=7,
                                              temperature=0.8)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" and c.message.content for c in resp.choices)
    prompt = count(sims.decoders[0], messages=messages)
    assert resp.usage is not None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (prompt, 15)   # prompt once, outputs summed
    assert resp.usage.total_tokens == prompt + 15
    p, d = legs(sims.prefillers, "/v1/chat/completions"), decode_legs(sims, "/v1/chat/completions")
    assert len(p) == len(d) == 3
    assert all("n" not in leg["body"] for leg in p + d)
    assert sorted(leg["body"]["seed"] for leg in d) == [7, 8, 9]          # vLLM's child seeds: seed + k
    assert len({leg["headers"]["x-request-id"] for leg in d}) == 3
    # the siblings were prefilled after the first, on the prefiller that now held the prompt: cache hits
    full_blocks = prompt // 16 * 16
    assert prefix_hits(sims.prefillers[0]) - hits_before >= 2 * full_blocks
    assert resp.id.startswith("chatcmpl-") and resp.id.endswith(d[0]["headers"]["x-request-id"].rsplit("-", 1)[0])
    wait_engines_idle(sims)


@pytest.mark.parametrize(("seed", "child_seeds"), [
    ((1 << 63) - 1, [(1 << 63) - 1, -(1 << 63)]),      # the largest seed: the second child's wraps (same 64 bits)
    (-1, [-1, 0]),
    ("5", [5, 6]), (5.0, [5, 6]),                       # vLLM reads both as 5 (they were copied: equal samples)
])
def test_child_seeds_are_seed_plus_k_within_vllms_int64_bounds(proxy: ProxyThread, sims: Fleet, seed: object,
                                                              child_seeds: list[int]) -> None:
    r = httpx.post(proxy.url + "/v1/chat/completions", timeout=30, json={
        "model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2,
        "temperature": 1, "seed": seed})
    assert r.status_code == 200, r.text
    assert sorted(leg["body"]["seed"] for leg in decode_legs(sims, "/v1/chat/completions")) == sorted(child_seeds)
    wait_engines_idle(sims)


@pytest.mark.parametrize("seed", [1 << 63, 18446744073709551615])       # (JSON integers orjson reads as ints)
def test_a_seed_outside_int64_is_vllms_400_not_a_500(proxy: ProxyThread, sims: Fleet, seed: int) -> None:
    """vLLM bounds ``seed`` to int64 (a 400 ``less_than_equal`` / ``greater_than_equal``); with ``n`` > 1 the
    fan-out's ``seed + k`` made it a 500 (a 2**64 - 1 seed could not even be encoded)."""
    r = httpx.post(proxy.url + "/v1/chat/completions", timeout=30, json={
        "model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 2,
        "temperature": 1, "seed": seed})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "body.seed" and "than or equal to" in error["message"], error
    assert decode_legs(sims, "/v1/chat/completions") == []
    wait_engines_idle(sims)


def test_chat_n2_stream_interleaves_by_index_with_one_usage_chunk_and_one_done(proxy: ProxyThread,
                                                                              sims: Fleet) -> None:
    r = httpx.post(proxy.url + "/v1/chat/completions", timeout=30, json={
        "model": "sim-model", "messages": [{"role": "user", "content": PROMPT}], "n": 2, "max_tokens": 4,
        "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.text.count("data: [DONE]") == 1 and r.text.rstrip().endswith("[DONE]")
    got = [data for _, data in events(r.text) if data != "[DONE]"]
    chunks = [c for c in got if c["choices"]]
    usage = [c for c in got if c.get("usage") and not c["choices"]]
    assert len(usage) == 1 and got[-1] is usage[0]
    assert {c["id"] for c in got} == {got[0]["id"]} and len({c["created"] for c in got}) == 1
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert sum(1 for c in mine if c["delta"].get("role") == "assistant") == 1      # one role chunk per choice
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["length"]
        assert sum(1 for c in mine if c["delta"].get("content")) == 4
    prompt = count(sims.decoders[0], messages=[{"role": "user", "content": PROMPT}])
    assert usage[0]["usage"]["prompt_tokens"] == prompt and usage[0]["usage"]["completion_tokens"] == 8
    assert usage[0]["usage"]["total_tokens"] == prompt + 8


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_whose_prefiller_finished_one_sequence_ends_whole(proxy: ProxyThread, sims: Fleet,
                                                                   path: str) -> None:
    """One sequence's prefill stops on its first token (EOS or a stop string: the prefiller answers it whole and
    hands over no KV) while the other goes on to a decoder: the merged stream has both choices, one ``[DONE]``
    and no error event (it once ended in a 502 "sequence 0 ended without data: [DONE]")."""
    sims.prefillers[0].faults({"kind": "no_kv_params", "times": 1})
    body: dict[str, Any] = {"model": "sim-model", "max_tokens": 4, "stream": True}
    if path == "/v1/chat/completions":
        body.update(messages=[{"role": "user", "content": PROMPT}], n=2, temperature=1)
    else:
        body.update(prompt=[PROMPT, PROMPT + " again"])
    r = httpx.post(proxy.url + path, timeout=30, json=body)
    assert r.status_code == 200 and r.text.count("data: [DONE]") == 1 and r.text.rstrip().endswith("[DONE]")
    got = [data for _, data in events(r.text) if data != "[DONE]"]
    assert not [c for c in got if "error" in c], r.text
    finish = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in got
              if c.get("choices") and c["choices"][0]["finish_reason"]}
    assert sorted(finish.values()) == ["length", "stop"]
    assert len(decode_legs(sims, path)) == 1                     # the finished sequence took no decoder


def test_stream_without_include_usage_gets_no_usage_chunk(proxy: ProxyThread, sims: Fleet) -> None:
    chunks = list(oai(proxy).completions.create(model="sim-model", prompt="Hello there", n=2, max_tokens=3,
                                                stream=True))
    assert all(c.usage is None and c.choices for c in chunks)
    assert sorted({c.choices[0].index for c in chunks}) == [0, 1]
    assert all(leg["body"]["stream_options"] == {"include_usage": True}           # asked upstream, dropped
               for leg in decode_legs(sims, "/v1/completions"))


@pytest.mark.parametrize("prompt", [["one two three", "four five six seven"], [[11, 12, 13], [14, 15]]])
def test_completion_prompt_list_with_n2(proxy: ProxyThread, sims: Fleet, prompt: list[Any]) -> None:
    resp = oai(proxy).completions.create(model="sim-model", prompt=prompt, n=2, max_tokens=3)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]                  # prompt_index * n + k
    sizes = [len(p) if isinstance(p, list) else count(sims.decoders[0], prompt=p) for p in prompt]
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == sum(sizes) and resp.usage.completion_tokens == 12
    d = decode_legs(sims, "/v1/completions")
    assert sorted(str(leg["body"]["prompt"]) for leg in d) == sorted(str(p) for p in prompt for _ in range(2))
    assert len(legs(sims.prefillers, "/v1/completions")) == 4


@pytest.mark.parametrize("n", [0, "0", 0.0, -2])
def test_a_prompt_list_with_n_below_one_is_vllms_400_not_fanned_out(proxy: ProxyThread, sims: Fleet,
                                                                     n: object) -> None:
    """vLLM checks ``n`` first (``SamplingParams._verify_args``), so a list of prompts with ``n`` below 1 is its
    400, not fanned out (it once was: one sequence per prompt, ``n`` dropped, a 200).  The prefiller alone judges the
    client's own body; no decoder is asked."""
    body = {"model": "sim-model", "prompt": ["a b", "c d"], "n": n, "max_tokens": 2}
    r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
    value = int(float(n)) if isinstance(n, (str, float)) else n
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == f"n must be at least 1, got {value}."
    assert [leg["body"]["prompt"] for leg in legs(sims.prefillers, "/v1/completions")] == [["a b", "c d"]]
    assert [leg["body"]["n"] for leg in legs(sims.prefillers, "/v1/completions")] == [n]
    assert legs(sims.decoders, "/v1/completions") == []


def test_fan_out_bound_is_pdproxys_400_before_any_engine(sims: Fleet) -> None:
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                        fan_out_max_sequences=4).start()
    try:
        chat = {"model": "sim-model", "messages": [{"role": "user", "content": "Hi"}]}
        for body, param, needle in (({**chat, "n": 5}, "n", "at most 4"),
                                    ({"model": "sim-model", "prompt": ["a", "b", "c"], "n": 2}, "prompt", "6 ")):
            r = httpx.post(proxy.url + ("/v1/chat/completions" if "messages" in body else "/v1/completions"),
                           json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param and needle in r.text
        assert legs(sims.prefillers, "/v1/chat/completions") == legs(sims.prefillers, "/v1/completions") == []
        assert httpx.post(proxy.url + "/v1/chat/completions", json={**chat, "n": 4, "max_tokens": 2}).status_code == 200
        assert len(legs(sims.prefillers, "/v1/chat/completions")) == 4
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_fanned_out_bodies_are_bounded_together_as_one_body(sims: Fleet) -> None:
    """Each sequence is a body of its own for pdproxy and both engines to parse: ``n`` copies of a body within
    ``max_body_bytes`` / ``max_json_items`` may not pass those bounds together — a 400 before any engine is asked
    (old code: ``n: 16`` on a 62 MB body held the event loop 8.7 s, grew the proxy to 4 GB and sent the engines
    992 MB twice).  Within them the request is served; prompt lists count each prompt's body."""
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                        max_body_bytes=1 << 20, max_json_items=10_000).start()
    try:
        chat = {"model": "sim-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                "temperature": 0.7}
        big = {**chat, "x": "A" * 150_000}                         # 150 KB: 7 copies fit in 1 MiB, 8 do not
        many = {**chat, "x": [0] * 2_000}                           # 2,000 items: 5 copies fit in 10,000, 6 do not
        for body, needle in (({**big, "n": 8}, "max_body_bytes (1,048,576)"),
                             ({**many, "n": 6}, "max_json_items (10,000)")):
            r = httpx.post(proxy.url + "/v1/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "n" and needle in r.text, r.text
            assert "8 sequences" in r.text or "6 sequences" in r.text
        prompts = {"model": "sim-model", "prompt": ["a", "b", "c"], "n": 3, "max_tokens": 2,
                   "x": "A" * 120_000}                              # 9 sequences × 120 KB
        r = httpx.post(proxy.url + "/v1/completions", json=prompts)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert legs(sims.prefillers, "/v1/chat/completions") == legs(sims.prefillers, "/v1/completions") == []
        for body, n in (({**big, "n": 6}, 6), ({**many, "n": 4}, 4)):
            r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
            assert r.status_code == 200 and len(r.json()["choices"]) == n, r.text
        r = httpx.post(proxy.url + "/v1/completions", json={**prompts, "n": 1}, timeout=30)     # 3 × 120 KB
        assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
        proxy.wait_idle()
    finally:
        proxy.stop()


@pytest.mark.parametrize(("extra", "message"), [
    ({"temperature": 0}, "n must be 1 when using greedy sampling, got 2."),
    ({"temperature": "0"}, "n must be 1 when using greedy sampling, got 2."),      # lax, as vLLM reads it
    ({"temperature": False}, "n must be 1 when using greedy sampling, got 2."),
    ({"temperature": -1}, "temperature must be non-negative, got -1.0."),          # vLLM checks this first
    ({"temperature": 0, "top_p": 1.5}, "top_p must be in (0, 1], got 1.5."),       # and this
])
def test_greedy_n2_is_judged_by_the_prefiller_in_vllms_order(proxy: ProxyThread, sims: Fleet,
                                                             extra: dict[str, Any], message: str) -> None:
    """``n`` 2 with greedy sampling is vLLM's 400, but vLLM's other checks come before it
    (``SamplingParams.__post_init__``): the prefiller gets the client's own body and its answer is the client's;
    nothing fans out."""
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "Hi"}], "n": 2, "max_tokens": 2, **extra}
    r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(message)
    prefills = [leg["body"] for leg in legs(sims.prefillers, "/v1/chat/completions")]
    if extra.get("temperature") == -1:            # not greedy to pdproxy: fanned out, the first leg refused
        assert prefills and all(leg["temperature"] == -1 and "n" not in leg for leg in prefills)
    else:
        assert prefills == [body]
    assert legs(sims.decoders, "/v1/chat/completions") == []


@pytest.mark.parametrize("temperature", [1e-6, 0.5])
def test_a_tiny_temperature_is_not_greedy_and_fans_out(proxy: ProxyThread, sims: Fleet, temperature: float) -> None:
    """vLLM raises a temperature in (0, 1e-2) to 1e-2 before its greedy check: ``n`` 2 is two sampled sequences."""
    resp = oai(proxy).chat.completions.create(model="sim-model", messages=[{"role": "user", "content": "Hi"}], n=2,
                                              max_tokens=2, temperature=temperature)
    assert [c.index for c in resp.choices] == [0, 1]
    assert len(decode_legs(sims, "/v1/chat/completions")) == 2


# ------------------------------------------------------------------------------------------ hostile engines
@pytest.fixture(scope="module")
def slow() -> Iterator[Fleet]:
    """1 prefiller + 2 decoders that decode at 40 tokens/s, so sequences are mid-stream together."""
    args = (*SIM_ARGS[:4], "--prefill-tokens-per-s", "0", "--decode-tokens-per-s", "40")
    with running(SimProcess("prefill", *args), SimProcess("decode", *args), SimProcess("decode", *args)) as sims:
        yield Fleet(prefillers=list(sims[:1]), decoders=list(sims[1:]))


@pytest.fixture
def slow_proxy(slow: Fleet) -> Iterator[ProxyThread]:
    slow.reset()
    proxy = ProxyThread(prefill=[s.url for s in slow.prefillers], decode=[s.url for s in slow.decoders]).start()
    try:
        yield proxy
        proxy.wait_idle()
        wait_engines_idle(slow)
    finally:
        proxy.stop()


CHAT3 = {"model": "sim-model", "messages": [{"role": "user", "content": "Hello there"}], "n": 3, "max_tokens": 12,
         "stream": True, "stream_options": {"include_usage": True}}


def test_a_sequence_whose_decoder_fails_before_its_first_event_fails_over(slow_proxy: ProxyThread,
                                                                          slow: Fleet) -> None:
    for d in slow.decoders:
        d.faults({"kind": "status", "status": 503, "on_request": 1})
    r = httpx.post(slow_proxy.url + "/v1/chat/completions", json=CHAT3, timeout=30)
    assert r.status_code == 200 and "error" not in r.text and r.text.count("[DONE]") == 1
    got = [data for _, data in events(r.text) if data != "[DONE]"]
    finishes = sorted(c["choices"][0]["index"] for c in got if c["choices"] and c["choices"][0]["finish_reason"])
    assert finishes == [0, 1, 2]
    assert got[-1]["usage"]["completion_tokens"] == 36
    assert len(decode_legs(slow, "/v1/chat/completions")) >= 4            # 3 sequences + at least one failover


def test_a_sequence_failing_after_its_first_event_ends_the_stream_with_an_error(slow_proxy: ProxyThread,
                                                                                slow: Fleet) -> None:
    for d in slow.decoders:
        d.faults({"kind": "reset_after_events", "events": 4, "times": 1})
    r = httpx.post(slow_proxy.url + "/v1/chat/completions", json=CHAT3, timeout=30)
    assert r.status_code == 200
    tail = events(r.text)
    assert tail[-1] == (None, "[DONE]") and r.text.count("[DONE]") == 1
    assert "error" in tail[-2][1] and "incomplete" in tail[-2][1]["error"]["message"]   # the failure, then [DONE]
    got = [data for _, data in tail if data != "[DONE]" and "choices" in data]
    assert all(c["choices"] for c in got)                               # no usage chunk: the response failed
    finished = [c for c in got if c["choices"][0]["finish_reason"]]
    assert len(finished) < 3                                            # not every choice: the stream failed


def test_a_sequence_refused_by_its_decoder_fails_the_json_response(slow_proxy: ProxyThread, slow: Fleet) -> None:
    """3 sequences on 2 decoders: one decoder's second request gets an engine 400, which is the request's fault:
    the client gets that 400, not a list of the other choices."""
    body = {"error": {"message": "sim says no", "type": "BadRequestError", "param": None, "code": 400}}
    for d in slow.decoders:
        d.faults({"kind": "status", "status": 400, "body": body, "on_request": 2})
    r = httpx.post(slow_proxy.url + "/v1/chat/completions", json={**CHAT3, "stream": False, "stream_options": None},
                   timeout=30)
    assert r.status_code == 400 and r.json() == body


def test_the_client_leaving_mid_way_closes_every_leg_and_frees_every_pin(slow_proxy: ProxyThread,
                                                                        slow: Fleet) -> None:
    aborted_before = sum(int(d.state()["aborted"]) for d in slow.decoders)
    with httpx.Client(timeout=30) as client, client.stream("POST", slow_proxy.url + "/v1/chat/completions",
                                                           json={**CHAT3, "max_tokens": 200}) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 6:
                    break
    # every sequence's decode leg was closed (the engines aborted them), no KV stays pinned, counters are zero
    started = len(decode_legs(slow, "/v1/chat/completions"))
    assert started >= 2
    wait_until(lambda: sum(int(d.state()["aborted"]) for d in slow.decoders) - aborted_before >= started, 10,
               what=f"{started} aborted decode legs")
    wait_engines_idle(slow)
    slow_proxy.wait_idle()


def test_siblings_follow_their_prompts_prefiller_among_several(sims: Fleet) -> None:
    """With two prefillers, the siblings of n = 3 go to the prefiller that computed the prompt for the first
    sequence (its prefix cache), although its cost still counts the first sequence's pinned KV."""
    args = (*SIM_ARGS[:4], "--prefill-tokens-per-s", "0", "--decode-tokens-per-s", "0")
    with running(SimProcess("prefill", *args), SimProcess("prefill", *args)) as prefillers:
        proxy = ProxyThread(prefill=[p.url for p in prefillers], decode=[d.url for d in sims.decoders]).start()
        try:
            for round_ in range(4):
                messages = [{"role": "user", "content": f"round {round_}: " + PROMPT}]
                hits = [prefix_hits(p) for p in prefillers]
                resp = oai(proxy).chat.completions.create(model="sim-model", messages=messages, n=3, max_tokens=2)
                assert [c.index for c in resp.choices] == [0, 1, 2]
                legs_per = [len([r for r in p.received() if r["body"]["messages"] == messages]) for p in prefillers]
                assert sorted(legs_per) == [0, 3], legs_per                 # all three on one prefiller
                served = prefillers[legs_per.index(3)]
                full = count(sims.decoders[0], messages=messages) // 16 * 16
                assert prefix_hits(served) - hits[legs_per.index(3)] >= 2 * full   # the siblings hit its cache
            proxy.wait_idle()
        finally:
            proxy.stop()


def test_sequences_are_read_without_an_item_limit_their_request_already_passed() -> None:
    """``max_json_items`` set above the default: a 1.1M-id prompt with ``n: 2`` is read, and so are the
    sequences pdproxy builds from it (they were re-read with the default limit: a 400 naming a limit the
    client's operator had raised)."""
    raw = orjson.dumps({"model": "sim-model", "prompt": [1] * 1_100_000, "n": 2, "max_tokens": 2,
                        "temperature": 1})
    req = parse_request(raw, Api.COMPLETIONS, max_items=2_000_000)
    parent = RequestContext(request_id="r", client_request_id=None, api_label="completions")
    assert [len(s.req.body["prompt"]) for s in fanout.plan(req, parent)] == [1_100_000, 1_100_000]
