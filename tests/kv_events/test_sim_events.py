"""``pdproxy sim --kv-events-config`` processes on loopback feeding the subscriber: the index follows the
simulated engine's real prefix cache (stores, evictions on a small pool, resets, a restart), per DP rank, in
both encodings; its prediction equals the ``cached_tokens`` the engine then reports."""

from __future__ import annotations

import contextlib
import json
import socket
from typing import Any

import httpx
import pytest

from pdproxy.endpoints import Endpoint, KVEventSource, Role, build_sources
from pdproxy.prefix.index import block_keys
from tests.kv_events.support import subscribed, until
from tests.support import SimProcess, free_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]
BS = 16


def events_config(port: int, replay: int | None) -> str:
    cfg: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    if replay:
        cfg["replay_endpoint"] = f"tcp://*:{replay}"
    return json.dumps(cfg)


def free_run(n: int) -> int:
    """A port ``p`` with ``p … p + n - 1`` all free (DP rank k publishes on port + k)."""
    for _ in range(100):
        base = free_port()
        if base + n > 65535:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for p in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise AssertionError("no run of free ports")


def sim(*extra: str, blocks: int = 64, port: int | None = None, events: int | None = None,
        replay: int | None = None) -> tuple[SimProcess, int, int]:
    if events is None or replay is None:
        base = free_run(4)
        events, replay = base, base + 2
    proc = SimProcess("prefill", "--block-size", str(BS), "--num-gpu-blocks-override", str(blocks),
                      "--max-model-len", "1024", "--kv-events-config", events_config(events, replay), *extra,
                      port=port)
    return proc, events, replay


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 30000 + 1 for i in range(n)]


async def cached(client: httpx.AsyncClient, url: str, ids: list[int], rank: int | None = None) -> int:
    headers = {"X-data-parallel-rank": str(rank)} if rank is not None else {}
    reply = await client.post(url + "/v1/completions", json={"model": "sim-model", "prompt": ids, "max_tokens": 1},
                              headers=headers)
    reply.raise_for_status()
    return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_index_follows_evictions_on_a_small_pool() -> None:
    proc, events, replay = sim(blocks=24)                            # 384 tokens of KV
    try:
        proc.start()
        source = KVEventSource(proc.url, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")
        async with subscribed(source) as (sub, index), httpx.AsyncClient(timeout=30) as client:
            await until(lambda: sub.is_live(proc.url))
            prompts = [prompt(s, n) for s, n in ((1, 160), (2, 200), (1, 170), (3, 300), (1, 160), (2, 210),
                                                 (4, 100), (2, 200))]
            status = sub.status(proc.url)
            assert status is not None
            for checked, ids in enumerate(prompts):
                predicted = index.match(block_keys(ids, BS)).get(proc.url, 0)
                actual = await cached(client, proc.url, ids)
                assert predicted == actual, (checked, predicted, actual)
                published = (await client.get(proc.url + "/sim/state")).json()["kv_events_published"]
                await until(lambda n=published: status.last_seq == n - 1, what="the request's events")
            assert index.stats.removed_blocks > 0                    # the pool did evict, and the index followed
            assert index.entries(proc.url) <= 24
            state = proc.state()
            assert status.gaps == 0 and status.decode_errors == 0, state
    finally:
        proc.stop()


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_dp_ranks_kept_apart(encoding: str) -> None:
    proc, events, replay = sim("--data-parallel-size", "2", "--dp-single-port", "--kv-events-encoding", encoding)
    try:
        proc.start()
        endpoints = [Endpoint(proc.url, Role.PREFILL, dp_rank=r, internal_dp=True) for r in (0, 1)]
        sources = build_sources([f"{proc.url}=tcp://127.0.0.1:{events}"], [f"{proc.url}=tcp://127.0.0.1:{replay}"],
                                endpoints)
        assert [s.publisher for s in sources] == [f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{events + 1}"]
        r0, r1 = (e.name for e in endpoints)
        async with subscribed(*sources) as (sub, index), httpx.AsyncClient(timeout=30) as client:
            await until(lambda: sub.is_live(r0) and sub.is_live(r1), what=f"both ranks connected: {sub.statuses()}")
            a, b = prompt(10, 100), prompt(11, 100)
            assert await cached(client, proc.url, a, rank=0) == 0
            assert await cached(client, proc.url, b, rank=1) == 0
            await until(lambda: index.entries(r0) == 6 and index.entries(r1) == 6)
            assert index.match(block_keys(a, BS)) == {r0: 96, r1: 0}
            assert index.match(block_keys(b, BS)) == {r0: 0, r1: 96}
            assert await cached(client, proc.url, a, rank=1) == 0     # rank 1 never had a
            assert await cached(client, proc.url, a, rank=0) == 96
            for name in (r0, r1):
                st = sub.status(name)
                assert st is not None and st.rank_mismatches == 0 and st.encoding == encoding
    finally:
        proc.stop()


async def test_reset_prefix_cache_clears_the_engine() -> None:
    proc, events, replay = sim()
    try:
        proc.start()
        source = KVEventSource(proc.url, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")
        async with subscribed(source) as (sub, index), httpx.AsyncClient(timeout=30) as client:
            await until(lambda: sub.is_live(proc.url))
            ids = prompt(20, 120)
            await cached(client, proc.url, ids)
            await until(lambda: index.entries(proc.url) == 7)
            (await client.post(proc.url + "/reset_prefix_cache")).raise_for_status()
            await until(lambda: index.entries(proc.url) == 0, what="AllBlocksCleared applied")
            assert index.stats.cleared == 1
            assert index.match(block_keys(ids, BS))[proc.url] == 0 == await cached(client, proc.url, ids)
    finally:
        proc.stop()


async def test_engine_restart_forgets_what_the_old_process_held() -> None:
    first, events, replay = sim()
    source = KVEventSource(first.url, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}")
    a, b = prompt(30, 120), prompt(31, 120)
    second = None
    try:
        first.start()
        async with subscribed(source) as (sub, index), httpx.AsyncClient(timeout=30) as client:
            await until(lambda: sub.is_live(first.url), what="connected")
            await cached(client, first.url, a)
            await until(lambda: index.entries(first.url) == 7, what="a stored")
            first.stop()
            second, _e, _r = sim(port=first.port, events=events, replay=replay)
            second.start()
            status = sub.status(first.url)
            assert status is not None
            await cached(client, second.url, b)
            await until(lambda: index.match(block_keys(b, BS))[first.url] == 112, what="the new process's blocks")
            assert index.match(block_keys(a, BS))[first.url] == 0 == await cached(client, second.url, a)
            assert status.restarts + status.forgotten >= 1
    finally:
        first.stop()
        if second is not None:
            second.stop()
