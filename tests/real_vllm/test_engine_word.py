"""On real vLLM 0.32: the engine's word overrides pdproxy's memory, salted prompts are keyed as vLLM keys them,
and the prefill leg's relaxed output constraints render the very prompt tokens of the client's request.

- blocks a small pool evicts (``BlockRemoved``): pdproxy's prediction for the prefiller drops as soon as its
  index has read the batch, although pdproxy prefilled that prompt there a moment before;
- ``POST /reset_prefix_cache`` (``AllBlocksCleared``; a ``VLLM_SERVER_DEV_MODE`` route, which scripts/real-vllm.sh
  turns on): the prediction is 0 as soon as the index has read the event;
- a chat with ``cache_salt``: the prefiller's ``BlockStored`` events carry the salt in the first block's extra
  keys, and pdproxy's keys for the same prompt with the same salt match them (another salt, or none, does not);
- the prefill leg with ``tool_choice`` relaxed to "auto" and structured outputs dropped renders the same
  ``prompt_token_ids`` (``return_token_ids``) as the client's constrained request.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from pdproxy.apis import kv_transfer
from pdproxy.apis.request import Api
from pdproxy.prefix.index import block_keys
from pdproxy.tokens import prompt_token_ids
from tests.real_vllm.support import KV_EVENTS_TOPIC, Engines, Prompts
from tests.real_vllm.test_prefix_events import block_size, held, predicted, subscriber
from tests.support import ProxyThread, wait_until

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(120)]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}


def prefilled_through_pdproxy(make_proxy: Any, e: Engines, prompts: Prompts, words: int,
                              seed: int) -> tuple[ProxyThread, dict[str, Any], int]:
    """pdproxy following ``e``'s prefiller's KV events, one prompt of ``words`` words prefilled through it, and its
    index holding that prompt's blocks: ``(proxy, the request body, the tokens held)``."""
    url = e.prefill_url
    proxy: ProxyThread = make_proxy(e, kv_events=[f"{url}={e.prefill_kv_events}"],
                                    kv_events_replay=[f"{url}={e.prefill_kv_replay}"],
                                    kv_events_topic=KV_EVENTS_TOPIC)
    wait_until(lambda: proxy.state.prefix_cache.is_precise(url), 20, 0.05, "pdproxy follows the prefiller's events")
    bs = block_size(url)
    body = {"model": e.served_model, "prompt": prompts.unique(words, seed=seed), "max_tokens": 1}
    r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    want = ((len(prompt_token_ids(prompts.tok, body, "completions")) - 1) // bs) * bs
    wait_until(lambda: held(proxy, url, body) == want, 20, 0.05, "the prefill's BlockStored events")
    return proxy, body, want


def test_evictions_end_pdproxys_credit_at_once(small_pool_engines: Engines, prompts: Prompts,
                                               make_proxy: Any) -> None:
    """The 18-block pool: a prompt pdproxy prefilled there, then a long one sent straight to the engine evicts
    most of it (``BlockRemoved``).  Once pdproxy's index has read that batch, its prediction for the first prompt
    is what the engine still holds — not the settling credit of pdproxy's own recent prefill."""
    e = small_pool_engines
    url = e.prefill_url
    proxy, first, want = prefilled_through_pdproxy(make_proxy, e, prompts, 600, 9501)
    cache = proxy.state.prefix_cache
    bs = block_size(url)
    long = {"model": e.served_model, "prompt": prompts.unique(1800, seed=9502), "max_tokens": 1}
    httpx.post(url + "/v1/completions", json=long, timeout=120).raise_for_status()   # straight to the engine
    long_ids = prompt_token_ids(prompts.tok, long, "completions")
    long_want = ((len(long_ids) - 1) // bs) * bs
    wait_until(lambda: cache.index.match(block_keys(long_ids, bs), [url])[url] == long_want, 20, 0.02,
               "the long prompt's batch read (its evictions with it)")
    assert cache.index.stats.removed_blocks > 0
    assert held(proxy, url, first) < want           # at once: only what the engine still holds
    proxy.wait_idle()


def test_a_cleared_prefix_cache_ends_pdproxys_credit_at_once(engines: Engines, prompts: Prompts,
                                                              make_proxy: Any) -> None:
    """A prompt pdproxy prefilled, then the engine's prefix cache reset (``AllBlocksCleared``, published with the
    engine's next step — ``vllm/v1/core/block_pool.py::reset_prefix_cache``): once pdproxy's index has counted the
    clear, its prediction for that prompt is 0 — not the settling credit of its own recent prefill, which would
    otherwise last seconds more.  (A restarted real engine is covered on the simulator only,
    tests/kv_events/test_engine_word.py: a real restart takes longer than the settling credit lasts, so it could
    not tell "at once" from "eventually".)"""
    e = engines
    url = e.prefill_url
    proxy, first, _want = prefilled_through_pdproxy(make_proxy, e, prompts, 300, 9551)
    cache = proxy.state.prefix_cache
    cleared = cache.index.stats.cleared

    def reset() -> bool:     # vLLM refuses ({"success": false}) while a block is held, e.g. until the decoder pulled
        r = httpx.post(url + "/reset_prefix_cache", timeout=60)
        assert r.status_code == 200, r.text
        return bool(r.json().get("success"))

    wait_until(reset, 30, 0.5, "the prefiller's prefix cache reset")
    # vLLM publishes the event with its next step's batch: one unrelated 1-token request straight to the engine
    tiny = {"model": e.served_model, "prompt": prompts.unique(20, seed=9552), "max_tokens": 1}
    httpx.post(url + "/v1/completions", json=tiny, timeout=60).raise_for_status()
    wait_until(lambda: cache.index.stats.cleared > cleared, 20, 0.02, "the AllBlocksCleared event read")
    assert held(proxy, url, first) == 0
    proxy.wait_idle()


def test_salted_prompts_match_their_own_salt(engines: Engines, prompts: Prompts) -> None:
    url = engines.prefill_url
    bs = block_size(url)
    messages = [{"role": "user", "content": prompts.unique(200, seed=9601)}]
    ids = prompt_token_ids(prompts.tok, {"messages": messages}, "chat")
    want = ((len(ids) - 1) // bs) * bs
    with subscriber(engines) as sub:
        wait_until(lambda: sub.call(lambda: sub.sub is not None and sub.sub.is_live(url)), 20, 0.05, "connected")
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": engines.served_model, "messages": messages, "max_tokens": 1, "cache_salt": "tenant-a"})
        assert r.status_code == 200, r.text

        def salted(salt: str | None) -> int:
            return int(sub.call(lambda: sub.index.match(block_keys(ids, bs, cache_salt=salt), [url])[url]))

        wait_until(lambda: salted("tenant-a") == want, 20, 0.05, "the salted prompt's blocks, keyed with its salt")
        assert salted("tenant-b") == 0 and salted(None) == 0 == predicted(sub, url, ids, bs)


CONSTRAINED: list[dict[str, Any]] = [
    {"tools": TOOLS, "tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_schema", "json_schema": SCHEMA}},
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"choice": ["yes", "no"]}},
]


@pytest.mark.parametrize("extra", CONSTRAINED, ids=["required", "named", "tools_json_schema", "json_object",
                                                    "structured_outputs"])
def test_the_relaxed_prefill_leg_renders_the_same_prompt_tokens(engines: Engines, prompts: Prompts,
                                                                extra: dict[str, Any]) -> None:
    """Both bodies straight to one engine without a KV handle, ``return_token_ids``: the prompt the prefill leg
    renders with the relaxation equals the one the client's constrained request renders."""
    body = {"model": engines.served_model, "messages": [{"role": "user", "content": prompts.unique(40, seed=9701)}],
            "max_tokens": 4, "temperature": 0, **extra}
    rendered = []
    for relax in (False, True):
        leg = kv_transfer.prefill_body(body, Api.CHAT, relax=relax)
        del leg[kv_transfer.KV_TRANSFER_PARAMS]
        leg["return_token_ids"] = True
        r = httpx.post(engines.decode_url + "/v1/chat/completions", json=leg, timeout=60)
        assert r.status_code == 200, r.text
        rendered.append(r.json()["prompt_token_ids"])
    relaxed = kv_transfer.prefill_body(body, Api.CHAT, relax=True)
    assert relaxed.get("tool_choice") in (None, "auto") and "response_format" not in relaxed
    assert rendered[0] == rendered[1] and len(rendered[0]) > 40
