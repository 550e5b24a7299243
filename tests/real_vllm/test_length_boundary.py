"""Over-length at the boundary: pdproxy decides exactly as vLLM 0.32 does, and what it rejects reaches no engine.

The oracle is the real prefiller itself: each boundary body (prompts of ``max_model_len - 1``, ``max_model_len`` and
``max_model_len + 1`` tokens, counted with the served tokenizer and checked with the engine's ``/tokenize``) is
first sent straight to it. The same body through pdproxy (the ``openai`` client) must then get the same status and,
for a 400, the same error body; an accepted one the same usage. A rejected request must not have reached any
engine's completion routes (``http_requests_total`` of both engines unchanged). pdproxy counts with the local
tokenizer directory (``tokenizer=<model dir>``) or with the engine's ``/tokenize`` (``token_count="engine"``).

vLLM 0.32's rule (captures ``length_*.json``): a prompt over ``max_model_len`` → 400 "... at least L+1 input tokens
..." (``param: input_tokens``); otherwise ``max_tokens`` is clamped to the room left, so a prompt of exactly
``max_model_len`` → 400 "max_tokens must be at least 1, got 0." (``param: max_tokens``), and ``L - 1`` prompt
tokens with ``max_tokens`` 16 → 200 with one token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.real_vllm.support import Engines, Prompts, completion_requests, metric, scrape
from tests.support import ProxyThread

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(90)]

# (api, prompt tokens - max_model_len, max_tokens)
CASES = [("completions", -1, 16), ("completions", 0, 1), ("completions", 1, 1),
         ("chat", -1, None), ("chat", 0, None), ("chat", 1, None)]
CASE_IDS = [f"{api}-L{offset:+d}-max{max_tokens}" for api, offset, max_tokens in CASES]
MODES = ("local", "engine")
BODY_PARAMS = [c for c, (_, offset, _) in zip(CASE_IDS, CASES, strict=True) if offset >= 0]


def body_for(prompts: Prompts, engines: Engines, api: str, offset: int, max_tokens: int | None) -> dict[str, Any]:
    n = engines.max_model_len + offset
    body: dict[str, Any] = {"model": engines.served_model}
    if api == "chat":
        body["messages"] = prompts.chat(n)
    else:
        body["prompt"] = prompts.completion(n)
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


@pytest.fixture(scope="module")
def vllm_answers(engines: Engines, prompts: Prompts) -> dict[str, tuple[dict[str, Any], httpx.Response]]:
    """What the real prefiller answers to each boundary body sent straight to it (the oracle)."""
    out: dict[str, tuple[dict[str, Any], httpx.Response]] = {}
    with httpx.Client(base_url=engines.prefill_url, timeout=60) as engine:
        for case_id, (api, offset, max_tokens) in zip(CASE_IDS, CASES, strict=True):
            body = body_for(prompts, engines, api, offset, max_tokens)
            counted = engine.post("/tokenize", json={k: v for k, v in body.items() if k != "max_tokens"}).json()
            assert counted["count"] == engines.max_model_len + offset, "the engine counts like the local tokenizer"
            path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
            out[case_id] = (body, engine.post(path, json=body))
    return out


def via_pdproxy(proxy: ProxyThread, api: str, body: dict[str, Any]) -> tuple[int, Any]:
    """Send ``body`` with the openai client; (status, usage) or (status, the error object)."""
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    extra = {k: v for k, v in body.items() if k not in ("model", "prompt", "messages")}
    try:
        if api == "chat":
            reply: Any = client.chat.completions.create(model=body["model"], messages=body["messages"], **extra)
        else:
            reply = client.completions.create(model=body["model"], prompt=body["prompt"], **extra)
    except openai.APIStatusError as exc:
        return exc.status_code, exc.body
    return 200, reply.usage


def proxy_for(make_proxy: Callable[..., ProxyThread], engines: Engines, mode: str) -> ProxyThread:
    if mode == "local":
        return make_proxy(engines, tokenizer=str(engines.model_dir))
    return make_proxy(engines, token_count="engine")


@pytest.mark.parametrize("case_id", CASE_IDS)
@pytest.mark.parametrize("mode", MODES)
def test_boundary_decision_matches_vllm_and_rejections_reach_no_engine(
        engines: Engines, make_proxy: Callable[..., ProxyThread], vllm_answers: dict[str, Any], mode: str,
        case_id: str) -> None:
    body, vllm = vllm_answers[case_id]
    api = CASES[CASE_IDS.index(case_id)][0]
    proxy = proxy_for(make_proxy, engines, mode)
    before = completion_requests(engines.prefill_url), completion_requests(engines.decode_url)

    status, got = via_pdproxy(proxy, api, body)

    assert status == vllm.status_code, (got, vllm.text[:300])
    if status == 200:
        usage = vllm.json()["usage"]
        assert (got.prompt_tokens, got.completion_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    else:
        after = completion_requests(engines.prefill_url), completion_requests(engines.decode_url)
        assert after == before, "a request pdproxy rejected reached an engine"


@pytest.mark.parametrize("case_id", BODY_PARAMS)
@pytest.mark.parametrize("mode", MODES)
def test_boundary_error_body_is_vllms(engines: Engines, make_proxy: Callable[..., ProxyThread],
                                      vllm_answers: dict[str, Any], mode: str, case_id: str) -> None:
    body, vllm = vllm_answers[case_id]
    assert vllm.status_code == 400
    proxy = proxy_for(make_proxy, engines, mode)
    status, error = via_pdproxy(proxy, CASES[CASE_IDS.index(case_id)][0], body)
    assert (status, error) == (400, vllm.json()["error"])


def test_text_far_over_the_limit_is_refused_as_vllm_refuses_it_without_a_count(
        engines: Engines, make_proxy: Callable[..., ProxyThread]) -> None:
    """A chat whose only long text is an assistant tool call's arguments (no lower bound: a template may drop them)
    at 40 bytes a token of ``max_model_len``: the real engine refuses it before tokenizing — vLLM 0.32's own
    character check (``renderers/params.py::_text_len_check``: rendered text longer than ``max_model_len`` × its
    tokenizer's longest token, "your prompt contains N characters (more than M characters …)") — and pdproxy,
    counting with the engine, refuses it too, a 400 with vLLM's type and the "maximum context length" phrase
    clients look for, in token words (it renders nothing, so it cannot give the character figures), and asks no
    engine anything, ``/tokenize`` included (``engine_count_max_bytes_per_token``)."""
    arguments = '{"q": "' + " the" * (10 * engines.max_model_len) + '"}'
    body = {"model": engines.served_model, "max_tokens": 4, "messages": [
        {"role": "user", "content": "look it up"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                               "function": {"name": "lookup", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"}]}
    with httpx.Client(base_url=engines.prefill_url, timeout=60) as engine:
        vllm = engine.post("/v1/chat/completions", json=body)
    assert vllm.status_code == 400 and "characters (more than" in vllm.json()["error"]["message"], vllm.text[:300]
    proxy = make_proxy(engines, token_count="engine")
    handlers = ("/v1/completions", "/v1/chat/completions", "/tokenize")
    before = [metric(scrape(url), "http_requests_total", handler=h) for url in (engines.prefill_url,
                                                                                 engines.decode_url) for h in handlers]
    status, error = via_pdproxy(proxy, "chat", body)
    assert status == 400 and error["type"] == vllm.json()["error"]["type"] == "BadRequestError", error
    assert f"maximum context length is {engines.max_model_len} tokens" in error["message"]
    after = [metric(scrape(url), "http_requests_total", handler=h) for url in (engines.prefill_url,
                                                                                engines.decode_url) for h in handlers]
    assert after == before, "an engine was asked to count or serve the refused request"
