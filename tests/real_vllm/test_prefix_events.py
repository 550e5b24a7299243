"""Real vLLM 0.32's KV events drive pdproxy's prefix index, and the index's prediction of a request's cached
tokens equals what the prefiller then reports (``usage.prompt_tokens_details.cached_tokens``).

The prefiller of every real-stage configuration publishes (``tests/real_vllm/support.py::RealEngines.
kv_events_args``: ``--enable-prefix-caching --kv-events-config`` with a replay endpoint), so these tests start no
engine of their own: a chat conversation through pdproxy on the standard engines, and evictions on the 18-block
pool of the KV-pressure configuration.  Token ids come from the tiny model's own tokenizer (chat template
included), keys from :func:`pdproxy.prefix.index.block_keys` with the engine's block size from
``vllm:cache_config_info``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pdproxy.endpoints import KVEventSource
from pdproxy.engines.control import kv_pool_tokens, parse_cache_config
from pdproxy.prefix.index import block_keys
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


def held(proxy: ProxyThread, url: str, body: dict[str, Any]) -> int | None:
    """What pdproxy's index says ``url`` holds of ``body``'s prompt (``POST /debug/prefix``, answered on the
    proxy's own loop, which owns the index)."""
    r = httpx.post(proxy.url + "/debug/prefix", json=body, timeout=30)
    r.raise_for_status()
    return {e["name"]: e["cached_tokens"] for e in r.json()["endpoints"]}.get(url)


@pytest.mark.parametrize("ids", ["local", "engine"])
def test_pdproxy_predicts_the_cached_tokens_of_requests_it_routes(
        engines: Engines, prompts: Prompts, real_engines: Any, make_proxy: Any, tmp_path: Path, ids: str) -> None:
    """Through pdproxy with the prefiller's KV events: its prediction for the prefiller each turn went to (the
    request log's ``predicted_cached_tokens``, the prediction metrics) equals the prefiller's ``cached_tokens``.
    Token ids from the tiny model's tokenizer directory (``local``) or from the engine's ``/tokenize``."""
    url = engines.prefill_url
    log = tmp_path / "requests.log"
    tokenizer = {"tokenizer": str(real_engines.model_dir())} if ids == "local" else {}
    proxy: ProxyThread = make_proxy(engines, kv_events=[f"{url}={engines.prefill_kv_events}"],
                                    kv_events_replay=[f"{url}={engines.prefill_kv_replay}"],
                                    kv_events_topic=KV_EVENTS_TOPIC, request_log_path=str(log), **tokenizer)
    cache = proxy.state.prefix_cache
    wait_until(lambda: cache.is_precise(url), 20, 0.05, "pdproxy follows the prefiller's events")
    bs = block_size(url)
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="none", max_retries=0)
    seed = 9300 if ids == "local" else 9400
    messages: list[dict[str, Any]] = [{"role": "system", "content": prompts.unique(400, seed=seed)},
                                      {"role": "user", "content": prompts.unique(50, seed=seed + 1)}]
    turns = 3 if ids == "local" else 2
    for turn in range(turns):
        reply = client.chat.completions.create(model=engines.served_model, messages=messages, max_tokens=4)
        prompt_ids = prompt_token_ids(prompts.tok, {"messages": messages}, "chat")
        want = ((len(prompt_ids) - 1) // bs) * bs
        body = {"model": engines.served_model, "messages": messages}
        wait_until(lambda b=body, w=want: held(proxy, url, b) == w, 20, 0.1,
                   "the turn's BlockStored events in pdproxy's index")
        messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                     {"role": "user", "content": prompts.unique(120, seed=seed + 10 + turn)}]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    seen = [(x["prompt_tokens"], x["predicted_cached_tokens"], x["cached_tokens"], x["prefix_mode"]) for x in lines]
    assert len(seen) == turns and all(m == "precise" for *_, m in seen), seen
    assert all(p == c for _n, p, c, _m in seen), seen          # predicted = the prefiller's report, every turn
    assert all(c >= 3 * bs for _n, _p, c, _m in seen[1:]), seen  # and the later turns did hit their history
    metrics = httpx.get(proxy.url + "/metrics").text
    assert f'pdproxy_prefix_predictions_total{{outcome="exact",source="precise"}} {float(turns)}' in metrics


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
