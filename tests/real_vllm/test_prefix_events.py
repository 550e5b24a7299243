"""Real vLLM 0.32's KV events drive pdproxy's prefix index, and the index's prediction of a request's cached
tokens equals what the prefiller then reports (``usage.prompt_tokens_details.cached_tokens``).

The prefiller of every real-stage configuration publishes (``tests/real_vllm/support.py::RealEngines.
kv_events_args``: ``--enable-prefix-caching --kv-events-config`` with a replay endpoint), so these tests start no
engine of their own: a chat conversation through pdproxy on the standard engines, and evictions on the 18-block
pool of the KV-pressure configuration.  Token ids come from the tiny model's own tokenizer (chat template
included), keys from :func:`pdproxy.prefix_index.block_keys` with the engine's block size from
``vllm:cache_config_info``.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from pdproxy.engines import kv_pool_tokens, parse_cache_config
from pdproxy.kv_subscriber import KVEventSource
from pdproxy.prefix_index import block_keys
from pdproxy.tokens import prompt_token_ids
from tests.kv_events.support import SubscriberThread
from tests.real_vllm.support import KV_EVENTS_TOPIC, Engines, Prompts, scrape
from tests.support import ProxyThread, wait_until

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(120)]


def block_size(url: str) -> int:
    labels = parse_cache_config(scrape(url))
    assert labels is not None
    _pool, bs, _blocks = kv_pool_tokens(labels)
    assert bs
    return bs


def subscriber(e: Engines) -> SubscriberThread:
    return SubscriberThread(KVEventSource(e.prefill_url, e.prefill_kv_events, e.prefill_kv_replay,
                                          topic=KV_EVENTS_TOPIC))


def predicted(sub: SubscriberThread, url: str, ids: list[int], bs: int) -> int:
    return int(sub.call(lambda: sub.index.match(block_keys(ids, bs), [url])[url]))


def settled(sub: SubscriberThread, url: str, ids: list[int], bs: int) -> None:
    """Wait until the index holds every full block of a prompt the prefiller just computed."""
    want = ((len(ids) - 1) // bs) * bs
    wait_until(lambda: predicted(sub, url, ids, bs) == want, 20, 0.05, "the prefill's BlockStored events")


def test_predicted_cached_tokens_match_the_prefiller_on_a_conversation(
        engines: Engines, prompts: Prompts, make_proxy: Any) -> None:
    proxy: ProxyThread = make_proxy(engines)
    bs = block_size(engines.prefill_url)
    url = engines.prefill_url
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    system = prompts.unique(420, seed=9101)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": prompts.unique(60, seed=9102)}]
    with subscriber(engines) as sub:
        wait_until(lambda: sub.call(lambda: sub.sub is not None and sub.sub.is_live(url)), 20, 0.05, "connected")
        seen = []
        for turn in range(3):
            ids = prompt_token_ids(prompts.tok, {"messages": messages}, "chat")
            expect = predicted(sub, url, ids, bs)
            reply = client.chat.completions.create(model=engines.served_model, messages=messages, max_tokens=8)
            assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
            details = reply.usage.prompt_tokens_details
            actual = details.cached_tokens if details is not None else None
            seen.append((turn, len(ids), expect, actual))
            assert expect == actual, seen
            settled(sub, url, ids, bs)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": prompts.unique(150, seed=9110 + turn)}]
        assert all(s[2] >= 3 * bs for s in seen[1:]), seen   # turns 2 and 3 hit the history
        status = sub.call(lambda: sub.sub.status(url))
        assert status.decode_errors == 0 and status.bad_events == 0 and status.encoding == "map"


def test_index_follows_evictions_on_a_small_real_pool(small_pool_engines: Engines, prompts: Prompts) -> None:
    e = small_pool_engines
    bs = block_size(e.prefill_url)
    a = prompts.unique(600, seed=9201)
    b = prompts.unique(1800, seed=9202)                     # 15 of the 18 blocks: evicts most of a
    steps = [a, a + prompts.unique(300, seed=9203), b, a]
    with subscriber(e) as sub, httpx.Client(base_url=e.prefill_url, timeout=120) as client:
        wait_until(lambda: sub.call(lambda: sub.sub is not None and sub.sub.is_live(e.prefill_url)), 20, 0.05,
                   "connected")
        seen = []
        for text in steps:
            body = {"model": e.served_model, "prompt": text, "max_tokens": 1}
            ids = prompt_token_ids(prompts.tok, body, "completions")
            expect = predicted(sub, e.prefill_url, ids, bs)
            reply = client.post("/v1/completions", json=body)
            reply.raise_for_status()
            actual = reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            seen.append((len(ids), expect, actual))
            assert expect == actual, seen
            settled(sub, e.prefill_url, ids, bs)
        removed = sub.call(lambda: sub.index.stats.removed_blocks)
        assert removed > 0 and 0 < seen[3][2] < seen[1][2], seen   # evictions seen; a only partly left
