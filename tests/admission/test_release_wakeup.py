"""A released pool lease wakes the prefill queue at once (not on its next poll): with the safety-net poll made an
hour long, the waiting request is granted inside ``Lease.release()`` itself — before any other task runs.
Orderings and counters only; no wall-clock thresholds."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineInfo
from pdproxy.engines.limits import Limits
from pdproxy.engines.pool import EndpointPool
from pdproxy.scheduling import Scheduler
from pdproxy.scheduling.queue import PrefillLedger, PrefillQueue

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]

P = Endpoint("http://p", Role.PREFILL)
D = Endpoint("http://d", Role.DECODE)
HOUR_S = 3600.0


def make_queue(*, p_blocks: int | None = None, decoder_kv: int | None = None) -> PrefillQueue:
    """One prefiller (``p_blocks`` × 128-token KV pool) and one decoder (``decoder_kv`` tokens), polling hourly."""
    p_info = (EngineInfo(max_model_len=4096, kv_pool_tokens=p_blocks * 128, num_gpu_blocks=p_blocks, block_size=128)
              if p_blocks else EngineInfo(max_model_len=1_000_000))
    infos = {P: p_info, D: EngineInfo(max_model_len=1_000_000, kv_pool_tokens=decoder_kv)}
    pool = EndpointPool(list(infos))
    limits = Limits(pool, infos)
    ledger = PrefillLedger(pool, limits, budget_tokens=32_768)
    return PrefillQueue(ledger, Scheduler.standard(pool, ledger=ledger), max_waiting=10,
                        timeout_s=HOUR_S, aging_tokens_per_s=0.0, busy_tokens=5000, poll_s=HOUR_S)


async def until(cond: object) -> None:
    async with asyncio.timeout(5):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.005)


async def test_releasing_a_prefill_lease_grants_the_waiting_long_prompt_at_once() -> None:
    """18 blocks × 128 = 2,304 tokens of prefiller KV: a prefilled 2,000-token prompt stays pinned by its prefill
    lease (held by the director until the decoder's first event); the next long prompt waits for that lease."""
    q = make_queue(p_blocks=18)
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(q.slot(2000, 2001))
        lease = stack.enter_context(q.ledger.pool.lease(first.endpoint, 2000))  # the director's prefill lease
        first.prefill_done()                                           # answered: budget free, KV still pinned
        first.decode_started()
        waiter = asyncio.ensure_future(stack.enter_async_context(q.slot(2001, 2002)))
        await until(lambda: q.depth == 1)
        assert q.stats.granted_total == 1 and not waiter.done()
        lease.release()                                                # the decoder's first event
        assert q.stats.granted_total == 2                              # granted inside release(), no await between
        second = await waiter
        assert second.endpoint == P and q.depth == 0
        lease.release()                                                # idempotent: no second wake-up, no grant
        assert q.stats.granted_total == 2
    assert q.idle() and q.ledger.pool.idle() and q.ledger.kv_held_tokens(P) == 0
    assert q.stats.waited_total == 1 and q.stats.timed_out_total == 0


async def test_releasing_a_decode_lease_grants_the_prefill_waiting_for_decoder_kv_at_once() -> None:
    q = make_queue(decoder_kv=3000)
    async with AsyncExitStack() as stack:
        decode = stack.enter_context(q.ledger.pool.lease(D, 2500))            # a running stream holds decoder KV
        waiter = asyncio.ensure_future(stack.enter_async_context(q.slot(1000, 1001)))
        await until(lambda: q.depth == 1)                              # 1,001 > 3,000 − 2,500
        assert q.stats.granted_total == 0
        decode.release()                                               # the stream ended
        assert q.stats.granted_total == 1
        assert (await waiter).endpoint == P
    assert q.idle() and q.ledger.pool.idle()


def test_pool_calls_release_listeners_once_per_lease_and_forgets_removed_ones() -> None:
    pool = EndpointPool([P, D])
    calls: list[int] = []

    def heard() -> None:
        calls.append(pool.load(P).tokens)                              # the load is given back before the call
    with pool.lease(P, 10) as early:
        pool.add_release_listener(heard)                               # leases already out hear it too
        early.release()
        assert calls == [0]
    assert calls == [0]                                                # the context manager's exit is a no-op
    pool.remove_release_listener(heard)
    pool.remove_release_listener(heard)                                # unknown: ignored
    with pool.lease(D, 5):
        pass
    assert calls == [0] and pool.idle()
