"""Over-length prompts end to end (real sim processes, the proxy on a real socket): an exact 400 before any engine
gets a completion, at the exact boundary (limit passes, limit + 1 is rejected), with the simulator's tokenizer (via
the engine's ``/tokenize`` and locally) and with a local tokenizer directory; the seed-000 KV pool case."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest

from pdproxy.tokens import load_tokenizer, sim_prompt
from tests.admission.conftest import Pair, exact_body

pytestmark = pytest.mark.timeout(60)

TOOLS = [{"type": "function", "function": {"name": f"tool_{i}", "description": sim_prompt(40, unique=True, seed=i),
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
         for i in range(8)]


def post(proxy_url: str, api: str, body: dict[str, Any]) -> httpx.Response:
    path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
    return httpx.post(proxy_url + path, json={"model": "sim-model", **body}, timeout=30)


def vllm_over(limit: int) -> dict[str, Any]:
    """vLLM 0.32's error object for any prompt over ``limit`` tokens (``tests/real_vllm/captures/length_*.json``)."""
    return {"message": f"This model's maximum context length is {limit} tokens. However, your prompt contains at "
                       f"least {limit + 1} input tokens, which exceeds this limit even without any output tokens. "
                       f"Please reduce the length of the input prompt. (parameter=input_tokens, value={limit + 1})",
            "type": "BadRequestError", "param": "input_tokens", "code": 400}


VLLM_FULL = {"message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
             "type": "BadRequestError", "param": "max_tokens", "code": 400}
"""vLLM 0.32's error object for a prompt of exactly max_model_len tokens (``length_prompt2048_max1.json``)."""


def assert_vllm_error(resp: httpx.Response, error: dict[str, Any]) -> None:
    assert resp.status_code == 400, resp.text
    assert resp.json() == {"error": error}


def assert_too_long(resp: httpx.Response, *phrases: str, param: str = "input_tokens") -> str:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param
    assert "maximum context length" in err["message"]
    for phrase in phrases:
        assert phrase in err["message"], (phrase, err["message"])
    return str(err["message"])


@pytest.mark.parametrize("source", ["engine", "sim"])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_exact_boundary_with_the_sim_tokenizer(pair_of: Any, source: str,
                                               api: Literal["chat", "completions"]) -> None:
    pair: Pair = pair_of("sim512")
    tok = load_tokenizer(None)
    proxy = pair.proxy(**({"tokenizer": "sim"} if source == "sim" else {}))
    try:
        # without max_tokens every leg must still generate one token (the prefill leg asks for max_tokens=1)
        ok = post(proxy.url, api, exact_body(tok, api, 511))
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] == 511                # the engine agrees: exactly the limit
        assert len(pair.completions()) == 2                              # prefill + decode legs
        pair.reset()
        # a prompt that fills the context leaves max_tokens 0: vLLM 0.32's own 400 (param max_tokens)
        assert_vllm_error(post(proxy.url, api, exact_body(tok, api, 512)), VLLM_FULL)
        assert pair.completions() == []                                  # no engine saw a rejected request
        assert_vllm_error(post(proxy.url, api, exact_body(tok, api, 600)), vllm_over(512))   # L+1 whatever the count
        assert pair.completions() == []
        # max_tokens beyond the room left: the engine clamps it (vLLM 0.32), so pdproxy's default admits it
        clamped = post(proxy.url, api, exact_body(tok, api, 413, extra={"max_tokens": 100}))
        assert clamped.status_code == 200, clamped.text
        assert clamped.json()["usage"]["completion_tokens"] == 99
        pair.reset()
        assert pair.completions() == []                                  # no engine saw a rejected request
        if source == "engine":                                          # a repeated prompt is not re-counted
            assert post(proxy.url, api, exact_body(tok, api, 512)).status_code == 400
            assert proxy.state.admission.snapshot()["engine_count_cache"]["hits"] == 1
        stats = proxy.state.admission.stats
        assert stats.counted_total.get(source if source == "engine" else "local", 0) >= 3
        assert stats.rejected_total == {"prefill:max_model_len": 2 + (source == "engine")}
        assert proxy.state.admission.queue.idle()
        proxy.wait_idle()
    finally:
        proxy.stop()


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_reject_mode_checks_prompt_plus_max_tokens_up_front(pair_of: Any,
                                                            api: Literal["chat", "completions"]) -> None:
    """``max_tokens_overflow=reject`` (engines that refuse rather than clamp, vLLM <= 0.26): the decoder's rule
    prompt + max_tokens <= max_model_len is checked before any engine is touched."""
    pair: Pair = pair_of("sim512")
    tok = load_tokenizer(None)
    proxy = pair.proxy(tokenizer="sim", max_tokens_overflow="reject")
    try:
        assert post(proxy.url, api, exact_body(tok, api, 412, extra={"max_tokens": 100})).status_code == 200
        pair.reset()
        assert_too_long(post(proxy.url, api, exact_body(tok, api, 413, extra={"max_tokens": 100})),
                        "you requested 100 output tokens", "413 input tokens", "total of 513 tokens")
        assert pair.completions() == []
        assert proxy.state.admission.stats.rejected_total == {"decode:max_model_len": 1}
        proxy.wait_idle()
    finally:
        proxy.stop()


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_exact_boundary_with_a_local_tokenizer_directory(pair_of: Any, tokenizer_dir: Path,
                                                          api: Literal["chat", "completions"]) -> None:
    pair: Pair = pair_of("hf")                                           # engines use the same tokenizer dir
    tok = load_tokenizer(str(tokenizer_dir))
    proxy = pair.proxy(tokenizer=str(tokenizer_dir), token_count="local")
    try:
        ok = post(proxy.url, api, exact_body(tok, api, 255, unit=" hello,", pad=" a"))
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["prompt_tokens"] == 255
        pair.reset()
        assert_vllm_error(post(proxy.url, api, exact_body(tok, api, 256, unit=" hello,", pad=" a")), VLLM_FULL)
        assert pair.completions() == []
        assert proxy.state.admission.stats.counted_total.get("local", 0) == 2
        assert proxy.state.admission.stats.counted_total.get("engine", 0) == 0
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_seed_000_kv_pool_is_named_and_a_small_request_right_after_succeeds(pair_of: Any) -> None:
    pair: Pair = pair_of("seed")
    proxy = pair.proxy()
    try:
        agent = {"messages": [{"role": "system", "content": sim_prompt(9000, unique=True, seed=1)},
                              {"role": "user", "content": " list the files"}],
                 "tools": TOOLS, "stream": True}
        rejected = post(proxy.url, "chat", agent)
        msg = assert_too_long(rejected, "133120", "KV cache pool", "4580 tokens",
                              "1146 blocks × 4 tokens less vLLM's null block")
        assert "at least" in msg                                         # decided by the word bound: no count
        hello = post(proxy.url, "completions", {"prompt": " hello there", "max_tokens": 2})
        assert hello.status_code == 200, hello.text
        assert hello.json()["usage"] == {**hello.json()["usage"], "prompt_tokens": 2, "completion_tokens": 2}
        bodies = [r["body"] for r in pair.completions()]
        assert len(bodies) == 2 and all(b["prompt"] == " hello there" for b in bodies)   # only the small one
        # the exact boundary at the pool: a decoder needs prompt + 1 token of KV
        assert_too_long(post(proxy.url, "completions", {"prompt": sim_prompt(4580), "max_tokens": 1}),
                        "at least 4580 input tokens", "at least 4581 tokens", "decode engine")
        stats = proxy.state.admission.stats
        assert stats.rejected_total == {"prefill:kv_pool": 1, "decode:kv_pool": 1}
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_200k_token_prompt_is_rejected_without_counting(pair_of: Any) -> None:
    pair: Pair = pair_of("sim512")
    proxy = pair.proxy()
    try:
        big = json.dumps({"model": "sim-model", "prompt": sim_prompt(200_000, unique=True), "max_tokens": 4})
        resp = httpx.post(proxy.url + "/v1/completions", content=big, timeout=30,
                          headers={"content-type": "application/json"})
        assert_vllm_error(resp, vllm_over(512))
        assert pair.completions() == []
        assert proxy.state.admission.stats.counted_total == {"bound": 1}   # no tokenizer, no /tokenize
        proxy.wait_idle()
    finally:
        proxy.stop()


@pytest.mark.parametrize("word_bound", [True, False])
def test_word_bound_at_exactly_max_model_len_counts_before_choosing_the_wording(
        pair_of: Any, tokenizer_dir: Path, word_bound: bool) -> None:
    """256 one-token words: the word bound says 256 = L, but the tokenizer adds BOS (257 tokens), so the client
    must get vLLM's "at least 257" body, not the max_tokens one for a prompt of exactly L."""
    pair: Pair = pair_of("hf")
    proxy = pair.proxy(tokenizer=str(tokenizer_dir), token_count="local", word_bound=word_bound)
    try:
        assert_vllm_error(post(proxy.url, "completions", {"prompt": " a" * 256, "max_tokens": 1}), vllm_over(256))
        assert_vllm_error(post(proxy.url, "completions", {"prompt": " a" * 255, "max_tokens": 1}), VLLM_FULL)
        assert pair.completions() == []
        stats = proxy.state.admission.stats
        assert stats.counted_total == {"local": 2}                        # counted, not decided by the bound
        assert stats.rejected_total == {"prefill:max_model_len": 2}
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_seed_000_an_answer_that_would_outgrow_the_decoders_pool_is_capped_there(pair_of: Any) -> None:
    """vLLM never lowers ``max_tokens`` to its KV pool: a request whose prompt and output together outgrow the whole
    pool preempts itself and waits forever (a 200 whose stream stops; vllm/v1/core/sched/scheduler.py,
    ``schedule``).  pdproxy caps the decode leg's limit at the pool less the prompt (``n`` choices are fanned out,
    a leg each): the answer ends there with ``length``; a limit that fits, or an absent one whose default fits, is
    forwarded untouched."""
    pair: Pair = pair_of("seed")                                         # pool 4,580 tokens (+ the null block), max_model_len 133,120
    proxy = pair.proxy()
    try:
        def ask(api: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
            pair.reset()
            resp = post(proxy.url, api, body)
            assert resp.status_code == 200, resp.text
            legs = [r["body"] for r in pair.decoder.completions_received()]
            assert len({leg["max_tokens"] for leg in legs}) == 1               # n > 1: one leg per choice, alike
            return resp.json(), legs[0]

        answer, leg = ask("completions", {"prompt": sim_prompt(4000), "max_tokens": 1000})
        assert leg["max_tokens"] == 580 and answer["usage"]["completion_tokens"] == 580
        assert answer["choices"][0]["finish_reason"] == "length"
        answer, leg = ask("completions", {"prompt": sim_prompt(4000), "max_tokens": 1000, "n": 2})
        assert leg["max_tokens"] == 580 and [c["finish_reason"] for c in answer["choices"]] == ["length"] * 2
        answer, leg = ask("completions", {"prompt": sim_prompt(4574)})     # vLLM's default 16 > the 6 left
        assert leg["max_tokens"] == 6 and answer["usage"]["completion_tokens"] == 6
        for low in (900, "900", 900.0):                                   # as vLLM's pydantic reads it, each 900
            answer, leg = ask("completions", {"prompt": sim_prompt(4000), "max_tokens": 1000, "min_tokens": low})
            assert leg["max_tokens"] == leg["min_tokens"] == 580          # vLLM refuses min_tokens > max_tokens
            assert answer["usage"]["completion_tokens"] == 580
        answer, leg = ask("completions", {"prompt": "x," * 1000, "max_tokens": 4000, "prompt_logprobs": 0})
        assert answer["usage"]["prompt_tokens"] == 2000                   # the decoder prefilled: no engine count,
        assert 2000 + leg["max_tokens"] <= 4580                             # admission's upper bound (not estimate)
        answer, leg = ask("completions", {"prompt": sim_prompt(4000), "max_tokens": 100})
        assert leg["max_tokens"] == 100 and answer["usage"]["completion_tokens"] == 100     # fits: untouched
        answer, leg = ask("chat", {"messages": [{"role": "user", "content": sim_prompt(4000)}]})   # no limit at all
        room = 4580 - answer["usage"]["prompt_tokens"]
        assert leg["max_tokens"] == room and answer["usage"]["completion_tokens"] == room
        answer, leg = ask("chat", {"messages": [{"role": "user", "content": sim_prompt(4000)}],
                                   "max_completion_tokens": 5000, "max_tokens": 3, "stream": False})
        assert leg["max_completion_tokens"] == room and leg["max_tokens"] == 3       # the limit vLLM applies
        assert answer["usage"]["completion_tokens"] == room
        proxy.wait_idle()
    finally:
        proxy.stop()


@pytest.mark.parametrize(("body", "largest"), [
    ({"prompt": "x," * 2000, "n": "4", "temperature": 1}, 4000),       # n as vLLM's pydantic reads it: 4
    ({"prompt": "x," * 2000, "n": 4.0, "temperature": 1}, 4000),
    ({"prompt": ["x," * 500] * 4}, 1000),                             # a prompt list: four engine requests
], ids=["n-string", "n-float", "prompt-list"])
def test_a_decoder_that_prefills_shares_its_pool_among_every_sequence(pair_of: Any, body: dict[str, Any],
                                                                      largest: int) -> None:
    """A request the decoder prefills itself (``prompt_logprobs``) is not fanned out: the decoder runs all its
    sequences, so the leg's output limit is the pool's room shared by all of them.  It was shared by ``n`` only
    when ``n`` was a JSON integer (``"n": "200"`` filled a decoder's whole pool: preemptions, every other request on
    it waiting), and a prompt list was sized as one token per prompt."""
    pair: Pair = pair_of("seed")                                         # pool 4,580 tokens (+ the null block)
    proxy = pair.proxy()
    try:
        resp = post(proxy.url, "completions", {**body, "max_tokens": 4000, "prompt_logprobs": 0})
        assert resp.status_code == 200, resp.text
        (leg,) = [r["body"] for r in pair.decoder.completions_received()]
        assert largest + 4 * leg["max_tokens"] <= 4580, leg["max_tokens"]
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_a_prompt_list_the_decoder_prefills_is_admitted_prompt_by_prompt(pair_of: Any) -> None:
    """Each prompt of a list sent whole to the decoder is an engine request of its own: one over the pool is the
    400 it is alone.  The list was sized as token ids (2 tokens here), admitted, and waited forever on the decoder
    (a prompt the pool cannot hold is never scheduled: docs/field-reports.md)."""
    pair: Pair = pair_of("seed")
    proxy = pair.proxy()
    try:
        alone = post(proxy.url, "completions", {"prompt": "x," * 2400, "max_tokens": 4, "prompt_logprobs": 0})
        listed = post(proxy.url, "completions", {"prompt": ["x,", "x," * 2400], "max_tokens": 4,
                                                 "prompt_logprobs": 0})
        assert alone.status_code == listed.status_code == 400, listed.text
        assert listed.json() == alone.json()
        assert pair.decoder.completions_received() == []
        admitted = proxy.state.admission.stats.admitted_total
        fits = post(proxy.url, "completions", {"prompt": ["x,", "x," * 1000], "max_tokens": 4, "prompt_logprobs": 0})
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 2, fits.text
        assert proxy.state.admission.stats.admitted_total == admitted + 1     # one request, however many prompts
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_reject_mode_refuses_an_output_limit_over_the_decoders_pool_up_front(pair_of: Any) -> None:
    pair: Pair = pair_of("seed")
    proxy = pair.proxy(max_tokens_overflow="reject")
    try:
        assert post(proxy.url, "completions", {"prompt": sim_prompt(4000), "max_tokens": 580}).status_code == 200
        pair.reset()
        assert_too_long(post(proxy.url, "completions", {"prompt": sim_prompt(4000), "max_tokens": 581}),
                        "you requested 581 output tokens", "4000 input tokens", "4580 tokens", "decode engine",
                        "or the number of requested output tokens")
        assert pair.completions() == []
        assert proxy.state.admission.stats.rejected_total == {"decode:kv_pool": 1}
        proxy.wait_idle()
    finally:
        proxy.stop()
