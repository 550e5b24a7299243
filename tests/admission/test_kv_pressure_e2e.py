"""KV pressure end to end on the simulator (``pdproxy sim --num-gpu-blocks-override 18 --block-size 128``, the
real-vLLM KV-pressure engine): pdproxy reads the prefiller's pool from ``vllm:cache_config_info`` and never has
more prompt tokens in flight or pinned on it than the pool holds, so of two long prompts sent at once the second
waits in pdproxy's queue — not inside the engine, where it would hold every small request behind it — while small
requests keep completing.

"Waited inside the engine" is read from the prefiller's ``vllm:request_queue_time_seconds`` histogram: without
pdproxy's KV budget the second long prompt waits there for the first one's pull (≥ 0.5 s, ``KV18_ARGS``); every
request that found its blocks free is scheduled at the engine's next step (milliseconds), far below the histogram's
first bucket (0.3 s)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from pdproxy.endpoints import Role
from pdproxy.tokens import sim_prompt
from tests.admission.conftest import Pair
from tests.real_vllm.support import metric, scrape
from tests.support import sampling, wait_until

pytestmark = pytest.mark.timeout(40)
LONG_TOKENS = 2000                       # 16 blocks of 128: two never fit in 18
QUEUE_TIME = "vllm:request_queue_time_seconds"


def queued(url: str) -> float:
    """Requests the engine scheduled so far."""
    return metric(scrape(url), QUEUE_TIME + "_count")


def test_second_long_prompt_waits_in_pdproxy_not_in_the_engine(pair_of: Any) -> None:
    pair: Pair = pair_of("kv18")
    proxy = pair.proxy(tokenizer="sim")
    try:
        prefiller = proxy.state.pool.endpoints(Role.PREFILL)[0]
        wait_until(lambda: proxy.state.infos[prefiller].kv_pool_tokens == 2304, 10, what="pool read from /metrics")
        load = proxy.state.pool.load(prefiller)

        def ask(prompt: str, max_tokens: int) -> dict[str, Any]:
            reply = httpx.post(proxy.url + "/v1/completions", timeout=30,
                               json={"model": "sim-model", "prompt": prompt, "max_tokens": max_tokens})
            assert reply.status_code == 200, reply.text
            return dict(reply.json()["usage"])

        longs = [sim_prompt(LONG_TOKENS, unique=True, seed=700 + i) for i in range(2)]
        count0, blocked0 = queued(pair.prefiller.url), pair.prefiller.state()["kv_capacity_waits"]
        with sampling(lambda: load.tokens) as held, ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(ask, p, 8) for p in longs]
            smalls = []
            while not all(f.done() for f in futures):
                smalls.append(ask(" hello there", 2))
            usages = [f.result() for f in futures]
        count = queued(pair.prefiller.url)

        assert [u["prompt_tokens"] for u in usages] == [LONG_TOKENS, LONG_TOKENS]
        assert smalls and all(u["completion_tokens"] == 2 for u in smalls)   # small requests kept completing
        assert max(held) <= 2304 - 127                  # 2,000 pinned (+ a small one's block) at most, never two
        assert count - count0 == 2 + len(smalls)
        assert pair.prefiller.state()["kv_capacity_waits"] == blocked0, "a request waited for KV inside the prefiller"
        q = proxy.state.admission.queue
        assert q.stats.waited_total >= 1 and q.stats.timed_out_total == 0    # the second long one waited here
        assert sorted(len(r["body"]["prompt"].split()) for r in pair.prefiller.completions_received()
                      if len(r["body"]["prompt"].split()) > 100) == [LONG_TOKENS, LONG_TOKENS]
        assert q.idle()
        proxy.wait_idle()
    finally:
        proxy.stop()
