"""Prefix routing's text estimate never overrides an exact count (``PrefixRouter.hints``,
pdproxy/prefix/routing.py).  With engines that publish no KV events, prefix routing keys the rendered text and
estimates a prompt's tokens from its bytes at the engine's learnt tokens per byte — a ratio that differs several-fold
between texts (English words against runs of spaces, or CJK).  A prompt admission counted exactly with the engine's
``/tokenize`` must keep that count: sized by the estimate instead, a prompt that fits the prefiller's KV pool looked
bigger than the pool, and the prefill queue waited for room it would never find, then answered 503."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.admission.conftest import Pair

pytestmark = pytest.mark.timeout(60)


def chat(text: str) -> dict[str, Any]:
    return {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}


def test_an_exactly_counted_prompt_is_not_resized_by_the_text_estimate(pair_of: Any) -> None:
    pair: Pair = pair_of("seed")                       # a KV pool of 4,584 tokens (max_model_len 133,120)
    proxy = pair.proxy(prefill_queue_timeout_s=3.0)
    try:
        with httpx.Client(base_url=proxy.url, timeout=30) as client:
            words = " ".join(f"word{i}" for i in range(600))       # ~0.3 tokens per byte: the ratio learnt
            for _ in range(3):
                r = client.post("/v1/chat/completions", json=chat(words))
                assert r.status_code == 200, r.text
            assert proxy.state.prefix.tokens_per_byte.get("sim-model", 0) > 0.1
            spaces = " " * 40_000 + "hi"               # 40 KB at that ratio: ~12K tokens, far over the pool
            counted = httpx.post(pair.prefiller.url + "/tokenize", json=chat(spaces)).json()["count"]
            assert counted < 100                       # what the engine says it is
            r = client.post("/v1/chat/completions", json=chat(spaces))
            assert r.status_code == 200, r.text        # was: 503 after waiting 3 s in pdproxy's prefill queue
            assert r.json()["usage"]["prompt_tokens"] == counted
        proxy.wait_idle()
    finally:
        proxy.stop()
