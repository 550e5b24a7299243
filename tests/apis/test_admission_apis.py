"""Admission counts the prompt of each API the way the engine renders it — Responses ``instructions`` + ``input``
(+ tools), Messages ``system`` + ``messages`` (+ tools) — so the over-length boundary is the engine's own: with a
local tokenizer and with the engine's ``/tokenize``, a prompt of ``max_model_len − 1`` tokens is served and one of
``max_model_len`` or more is a 400 in the API's error shape before any engine runs it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support import ProxyThread, SimProcess, running

pytestmark = pytest.mark.timeout(60)

MAX_MODEL_LEN = 96
ARGS = ("--served-model-name", "sim-model", "--max-model-len", str(MAX_MODEL_LEN), "--prefill-tokens-per-s", "0",
        "--decode-tokens-per-s", "0")
TOOLS_RESPONSES = [{"type": "function", "name": "get_weather", "description": "weather for a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
TOOLS_MESSAGES = [{"name": "get_weather", "description": "weather for a city",
                   "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SimProcess, SimProcess]]:
    with running(SimProcess("prefill", *ARGS), SimProcess("decode", *ARGS)) as sims:
        yield sims[0], sims[1]


def responses_body(words: int) -> dict[str, Any]:
    return {"model": "sim-model", "instructions": "Be brief.", "tools": TOOLS_RESPONSES,
            "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi " * words}]}]}


def messages_body(words: int) -> dict[str, Any]:
    return {"model": "sim-model", "system": [{"type": "text", "text": "Be brief."}], "tools": TOOLS_MESSAGES,
            "messages": [{"role": "user", "content": "hi " * words}]}


def engine_count(engine: SimProcess, api: str, body: dict[str, Any]) -> int:
    """The prompt's tokens as the engine renders them (its render / count_tokens routes)."""
    if api == "responses":
        return len(httpx.post(engine.url + "/v1/responses/render", json=body).json()["token_ids"])
    return int(httpx.post(engine.url + "/v1/messages/count_tokens", json=body).json()["input_tokens"])


def words_for(engine: SimProcess, api: str, tokens: int) -> int:
    """The word count whose prompt is exactly ``tokens`` tokens on the engine (one word is one token here; checked
    on prompts that fit, since the engine's render refuses the others)."""
    make = responses_body if api == "responses" else messages_body
    base = engine_count(engine, api, make(1))
    words = tokens - base + 1
    assert engine_count(engine, api, make(words - 8)) == tokens - 8
    return words


@pytest.mark.parametrize("counting", [{"tokenizer": "sim"}, {"token_count": "engine"}], ids=["local", "engine"])
@pytest.mark.parametrize("api", ["responses", "messages"])
def test_the_over_length_boundary_is_the_engines(pair: tuple[SimProcess, SimProcess], api: str,
                                                 counting: dict[str, str]) -> None:
    p, d = pair
    for s in pair:
        s.reset()
    proxy = ProxyThread(prefill=[p.url], decode=[d.url], chat_template_max_overhead_tokens=0, word_bound=False,
                        **counting).start()
    try:
        make = responses_body if api == "responses" else messages_body
        limit = {"max_output_tokens": 1} if api == "responses" else {"max_tokens": 1}
        fits = make(words_for(d, api, MAX_MODEL_LEN - 1))
        ok = httpx.post(f"{proxy.url}/v1/{api}", json={**fits, **limit}, timeout=20)
        assert ok.status_code == 200, ok.text
        for over, needle in ((0, "max_tokens must be at least 1, got 0."),
                             (1, f"maximum context length is {MAX_MODEL_LEN} tokens")):
            body = make(words_for(d, api, MAX_MODEL_LEN + over))
            r = httpx.post(f"{proxy.url}/v1/{api}", json={**body, **limit}, timeout=20)
            assert r.status_code == 400
            err = r.json()
            message = err["error"]["message"]
            assert needle in message
            if api == "messages":
                assert err["type"] == "error" and err["error"]["type"] == "BadRequestError"
            else:
                assert err["error"]["type"] == "BadRequestError"
        generation = [r for s in pair for r in s.received() if r["path"] == f"/v1/{api}"]
        assert len(generation) == 2                                  # only the one that fits: prefill + decode
        proxy.wait_idle()
    finally:
        proxy.stop()
