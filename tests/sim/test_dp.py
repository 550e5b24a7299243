"""Data-parallel ranks: one port per rank (external DP) or one port fronting every rank (internal DP)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest

from pdproxy.sim.config import SimConfig
from pdproxy.sim.server import running_sim
from pdproxy.tokens import sim_prompt
from tests.sim.helpers import get_json, post, prefill

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_one_port_per_rank_and_header_routing(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, data_parallel_size=3, engine_id="e")) as sim:
        assert len(set(sim.ports)) == 3
        for k, base in enumerate(sim.base_urls):
            await post(http, base + "/v1/completions", {"prompt": "x", "max_tokens": 1})
            got = (await get_json(http, base + "/sim/received"))["requests"]
            assert [r["dp_rank"] for r in got] == [k]
        await post(http, sim.base_urls[0] + "/v1/completions", {"prompt": "x", "max_tokens": 1},
                   **{"X-data-parallel-rank": "2"})
        assert (await get_json(http, sim.base_urls[0] + "/sim/received"))["requests"][-1]["dp_rank"] == 2
        status, _, _ = await post(http, sim.base_urls[0] + "/v1/completions", {"prompt": "x"},
                                  **{"X-data-parallel-rank": "7"})
        assert status == 400
        state = await get_json(http, sim.base_urls[1] + "/sim/state")
        assert [r["finished"] for r in state["ranks"]] == [1, 1, 2] and state["finished"] == 1
        async with http.get(sim.base_urls[1] + "/metrics") as resp:
            text = await resp.text()
        assert 'engine="1"' in text and 'engine="0"' not in text


async def test_single_port_fronts_every_rank(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, data_parallel_size=2, dp_single_port=True)) as sim:
        assert len(sim.ports) == 1
        base = sim.base_urls[0]
        for rank in ("1", "0", "1"):
            await post(http, base + "/v1/completions", {"prompt": "x", "max_tokens": 1},
                       **{"X-data-parallel-rank": rank})
        assert [r["dp_rank"] for r in (await get_json(http, base + "/sim/received"))["requests"]] == [1, 0, 1]
        state = await get_json(http, base + "/sim/state")
        assert state["finished"] == 3 and [r["finished"] for r in state["ranks"]] == [1, 2]
        async with http.get(base + "/metrics") as resp:
            text = await resp.text()
        assert 'vllm:num_requests_running{engine="0"' in text and 'vllm:num_requests_running{engine="1"' in text


async def test_kv_pull_reaches_the_rank_named_in_remote_engine_id(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, role="prefill", data_parallel_size=2, engine_id="p")) as p, \
            running_sim(SimConfig(port=0, role="decode")) as d:
        params = (await prefill(http, p.base_urls[1], 64))["kv_transfer_params"]
        assert params["remote_engine_id"] == "p_dp1" and params["remote_port"] == p.ports[1]
        status, text, _ = await post(http, d.base_urls[0] + "/v1/completions",
                                     {"prompt": sim_prompt(64), "max_tokens": 2, "kv_transfer_params": params})
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 2
        async with http.get(d.base_urls[0] + "/metrics") as resp:   # the pull happened (vLLM 0.32's evidence)
            assert 'source="external_kv_transfer"} 64.0' in await resp.text()
        assert [r["pinned_requests"] for r in (await get_json(http, p.base_urls[0] + "/sim/state"))["ranks"]] == [0, 0]
