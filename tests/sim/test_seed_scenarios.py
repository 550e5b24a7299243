"""Seed report scenarios over real sockets, and the simulator serving with a local tokenizer directory."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from pdproxy.sim.config import SimConfig
from pdproxy.sim.server import running_sim
from pdproxy.tokens import HFTokenizer, sim_prompt
from tests.sim.helpers import eventually, get_json, post

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]
SEED_000 = SimConfig(port=0, max_model_len=133120, block_size=4, num_gpu_blocks_override=1146)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def metric(text: str, name: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def test_seed_000_200_ok_but_nothing_happens(http: aiohttp.ClientSession) -> None:
    async with running_sim(SEED_000) as sim:
        base = sim.base_urls[0]
        agent = {"messages": [{"role": "user", "content": sim_prompt(10_000, unique=True)}], "stream": True}
        hello = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "stream": True}
        async with http.post(base + "/v1/chat/completions", json=agent) as big, \
                http.post(base + "/v1/chat/completions", json=hello) as small:
            assert big.status == small.status == 200  # SSE headers at once, as vLLM's StreamingResponse does

            async def stuck() -> str:
                async with http.get(base + "/metrics") as resp:
                    text = await resp.text()
                lab = '{engine="0",model_name="sim-model"'
                ok = (metric(text, f'vllm:num_requests_waiting_by_reason{lab},reason="capacity"}}') == 2.0
                      and metric(text, f"vllm:num_requests_running{lab}}}") == 0.0
                      and metric(text, f"vllm:kv_cache_usage_perc{lab}}}") == 0.0)
                return text if ok else ""

            text = await eventually(stuck, what="both requests waiting for capacity")
            assert 'num_gpu_blocks="1146"' in text and 'block_size="4"' in text
            # vLLM sends chat's role chunk with the first output, so a stuck request gets headers and nothing else
            assert small.content.total_bytes == 0 and big.content.total_bytes == 0
            state = await get_json(http, base + "/sim/state")
            assert state["finished"] == 0 and state["kv_blocks_used"] == 0


async def test_seed_000_with_an_8x_pool_both_complete(http: aiohttp.ClientSession) -> None:
    async with running_sim(SEED_000.replace(num_gpu_blocks_override=1146 * 8, prefill_tokens_per_s=100_000)) as sim:
        base = sim.base_urls[0]
        agent = {"messages": [{"role": "user", "content": sim_prompt(10_000, unique=True)}], "max_tokens": 4}
        hello = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        (s1, t1, _), (s2, t2, _) = [await post(http, base + "/v1/chat/completions", b) for b in (agent, hello)]
        assert (s1, s2) == (200, 200)
        assert json.loads(t1)["usage"]["prompt_tokens"] == 10_003 and json.loads(t2)["usage"]["completion_tokens"] == 2


async def test_repeated_filler_inflates_cached_tokens_unique_text_does_not(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, max_model_len=20_000)) as sim:
        url = sim.base_urls[0] + "/v1/completions"
        cached = {}
        for kind in ("filler", "unique"):
            for i in range(3):
                prompt = sim_prompt(8000, unique=kind == "unique", seed=i)
                _, text, _ = await post(http, url, {"prompt": prompt, "max_tokens": 1})
                cached[kind, i] = json.loads(text)["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached["filler", 1] >= 7984 and cached["filler", 2] >= 7984
        assert cached["unique", 0] == cached["unique", 1] == cached["unique", 2] == 0


async def test_sim_serves_with_a_local_tokenizer_directory(http: aiohttp.ClientSession, tmp_path: Path) -> None:
    from pdproxy.tools.tinymodel import write_tokenizer

    directory = write_tokenizer(tmp_path / "tok")
    tok = HFTokenizer(directory)
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    expected = len(tok.encode(tok.render_chat(messages)))
    async with running_sim(SimConfig(port=0, tokenizer=str(directory), max_model_len=expected + 4)) as sim:
        base = sim.base_urls[0]
        _, text, _ = await post(http, base + "/tokenize", {"messages": messages})
        assert json.loads(text)["count"] == expected
        status, text, _ = await post(http, base + "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
        assert status == 200 and json.loads(text)["usage"]["prompt_tokens"] == expected
        status, text, _ = await post(http, base + "/v1/chat/completions", {"messages": messages, "max_tokens": 5})
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 4  # clamped, as vLLM 0.32 does
        too_long = [{"role": "user", "content": "Hello there, how are you? " * 3}]
        status, text, _ = await post(http, base + "/v1/chat/completions", {"messages": too_long})
        assert status == 400 and "maximum context length" in json.loads(text)["error"]["message"]
