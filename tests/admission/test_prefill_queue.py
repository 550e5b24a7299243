"""The prefill queue on its own (no sockets): budget, small-before-large, aging, 429, deadline, decoder capacity,
cancellation.  Orderings and counters only."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineInfo
from pdproxy.engines.limits import Limits
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import NoEndpointAvailable, Overloaded, QueueTimeout
from pdproxy.scheduling import Scheduler
from pdproxy.scheduling.queue import PrefillLedger, PrefillQueue, PrefillSlot

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]

P = Endpoint("http://p", Role.PREFILL)
D = Endpoint("http://d", Role.DECODE)


def make_queue(*, budget: int = 10_000, kv: int | None = None, aging: float = 0.0, max_waiting: int = 100,
               timeout_s: float = 5.0, p_blocks: int | None = None, block_size: int = 128) -> PrefillQueue:
    p_info = (EngineInfo(max_model_len=2048, kv_pool_tokens=p_blocks * block_size, num_gpu_blocks=p_blocks,
                         block_size=block_size) if p_blocks else EngineInfo(max_model_len=1_000_000))
    infos = {P: p_info, D: EngineInfo(max_model_len=1_000_000, kv_pool_tokens=kv)}
    pool = EndpointPool(list(infos))
    limits = Limits(pool, infos)
    ledger = PrefillLedger(pool, limits, budget_tokens=budget)
    return PrefillQueue(ledger, Scheduler.standard(pool, ledger=ledger),
                        max_waiting=max_waiting, timeout_s=timeout_s, aging_tokens_per_s=aging, busy_tokens=5000)


async def until(cond: object, what: str = "") -> None:
    async with asyncio.timeout(5):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.005)


async def hold(queue: PrefillQueue, tokens: int, order: list[int], release: asyncio.Event) -> None:
    async with queue.slot(tokens, tokens + 1) as slot:
        order.append(tokens)
        await release.wait()
        slot.prefill_done()


async def test_small_prompts_go_ahead_of_large_ones_and_everything_is_released() -> None:
    q = make_queue(budget=10_000)
    order: list[int] = []
    gates = {n: asyncio.Event() for n in (20_000, 30_000, 500, 800)}
    async with asyncio.TaskGroup() as tg:
        tg.create_task(hold(q, 20_000, order, gates[20_000]))       # alone on an idle prefiller, over budget
        await until(lambda: order == [20_000])
        tg.create_task(hold(q, 30_000, order, gates[30_000]))
        await until(lambda: q.depth == 1)
        tg.create_task(hold(q, 800, order, gates[800]))
        tg.create_task(hold(q, 500, order, gates[500]))
        await until(lambda: q.depth == 3)
        assert q.congested()
        gates[20_000].set()
        await until(lambda: len(order) == 3)
        assert order == [20_000, 500, 800]                            # both small ones fit the budget together
        gates[500].set()
        gates[800].set()
        await until(lambda: len(order) == 4)
        gates[30_000].set()
    assert order == [20_000, 500, 800, 30_000]
    assert q.idle() and q.depth == 0
    assert q.stats.granted_total == 4 and q.stats.waited_total == 3


async def test_aging_lets_a_waiting_large_prompt_go_first() -> None:
    q = make_queue(budget=1_000, aging=1e9)                          # one second of waiting outweighs any size
    order: list[int] = []
    first, large, small = asyncio.Event(), asyncio.Event(), asyncio.Event()
    large.set()
    small.set()
    async with asyncio.TaskGroup() as tg:
        tg.create_task(hold(q, 900, order, first))
        await until(lambda: order == [900])
        tg.create_task(hold(q, 50_000, order, large))
        await until(lambda: q.depth == 1)
        await asyncio.sleep(0.01)                                    # the large one is older by ≥ 10 ms
        tg.create_task(hold(q, 10, order, small))
        await until(lambda: q.depth == 2)
        first.set()
    assert order == [900, 50_000, 10]


async def test_full_queue_answers_429_and_deadline_503() -> None:
    q = make_queue(budget=100, max_waiting=1, timeout_s=0.2)
    async with AsyncExitStack() as stack:
        await stack.enter_async_context(q.slot(1000, 1001))          # takes the prefiller
        waiter = asyncio.ensure_future(stack.enter_async_context(q.slot(50, 51)))
        await until(lambda: q.depth == 1)
        with pytest.raises(Overloaded) as full:
            await stack.enter_async_context(q.slot(60, 61))
        assert full.value.status_code == 429 and "retry-after" in full.value.headers
        with pytest.raises(QueueTimeout) as late:
            await waiter
        assert late.value.status_code == 503 and "retry-after" in late.value.headers
    assert q.idle() and q.stats.rejected_full_total == 1 and q.stats.timed_out_total == 1


async def test_prefills_wait_for_decoder_kv_and_go_once_it_frees() -> None:
    q = make_queue(kv=3000)
    async with AsyncExitStack() as stack:
        s1: PrefillSlot = await stack.enter_async_context(q.slot(2000, 2001))
        s1.prefill_done()                                            # prefilled, not yet on a decoder
        waiter = asyncio.ensure_future(stack.enter_async_context(q.slot(1500, 1501)))
        await until(lambda: q.depth == 1)
        assert not waiter.done()                                     # 2001 reserved + 1501 > 3000
        s1.decode_started()                                          # decode lease holds it from now on (none here)
        s2 = await waiter
        assert s2.endpoint == P
    assert q.idle()


async def test_cancelled_waiter_leaves_no_trace_and_unfit_prompt_fails_fast() -> None:
    q = make_queue(budget=100)
    async with q.slot(1000, 1001):
        waiter = asyncio.ensure_future(q.slot(50, 51).__aenter__())
        await until(lambda: q.depth == 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert q.depth == 0
    assert q.idle()
    with pytest.raises(NoEndpointAvailable):
        async with q.slot(10, 11, exclude=[P]):                     # the only prefiller failed already
            pass



async def test_prompts_pinned_on_the_prefiller_stay_within_its_kv_pool() -> None:
    """19 blocks × 128, one of them vLLM's null block: 2,304 tokens for requests.  A prefilled 2,000-token prompt
    stays pinned (its pool lease is held until the decoder's first event, as the director does) after the
    prefiller answered, so a second one waits for the lease — not just for the answer — while small prompts that
    fit still go."""
    q = make_queue(budget=32_768, p_blocks=19)
    order: list[int] = []
    first_event = asyncio.Event()

    async def request(tokens: int, decoded: asyncio.Event | None = None) -> None:
        async with q.slot(tokens, tokens + 1) as slot:
            with q.ledger.pool.lease(slot.endpoint, tokens):                 # the director's prefill lease
                order.append(tokens)
                slot.prefill_done()                                  # the prefiller answered: KV now pinned
                if decoded is not None:
                    await decoded.wait()                             # until the decoder's first event

    async with asyncio.TaskGroup() as tg:
        tg.create_task(request(2000, first_event))
        await until(lambda: order == [2000])
        assert q.ledger.inflight_tokens(P) == 0 and q.ledger.kv_held_tokens(P) == 16 * 128   # whole blocks
        tg.create_task(request(2001))
        await until(lambda: q.depth == 1)
        tg.create_task(request(3))                                   # 1 block: fits next to the pinned 16
        await until(lambda: order == [2000, 3])
        assert q.depth == 1 and order == [2000, 3]                   # the second long one still waits
        first_event.set()
        await until(lambda: len(order) == 3)
    assert order == [2000, 3, 2001]
    assert q.idle() and q.ledger.pool.idle() and q.ledger.kv_held_tokens(P) == 0
    assert q.stats.waited_total == 2 and q.stats.granted_total == 3


async def test_a_prompt_pinned_in_all_but_one_block_leaves_that_block_to_a_small_prompt() -> None:
    """18 blocks × 128, one of them vLLM's null block: 17 for requests (the real-vLLM KV-pressure engine's pool).
    A pinned 1,998-token prompt holds 16 blocks — counted as 16 (2,048 tokens), not as its tokens plus a block's
    pad (2,125, which left no room for a one-block prompt) — so a 3-token prompt takes the 17th block while a
    2-block one waits for the lease."""
    q = make_queue(budget=32_768, p_blocks=18)
    order: list[int] = []
    first_event = asyncio.Event()

    async def request(tokens: int, decoded: asyncio.Event | None = None) -> None:
        async with q.slot(tokens, tokens + 1) as slot:
            with q.ledger.pool.lease(slot.endpoint, tokens):
                order.append(tokens)
                slot.prefill_done()
                if decoded is not None:
                    await decoded.wait()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(request(1998, first_event))
        await until(lambda: order == [1998])
        assert q.ledger.kv_held_tokens(P) == 16 * 128
        tg.create_task(request(130))                                 # 2 blocks: 16 + 2 > 17
        await until(lambda: q.depth == 1)
        tg.create_task(request(3))                                   # 1 block: 16 + 1 = 17
        await until(lambda: order == [1998, 3])
        assert q.depth == 1
        first_event.set()
        await until(lambda: len(order) == 3)
    assert order == [1998, 3, 130]
    assert q.idle() and q.ledger.kv_held_tokens(P) == 0


async def test_kv_pool_is_the_budget_when_smaller_and_an_idle_prefiller_takes_any_prompt() -> None:
    q = make_queue(budget=32_768, p_blocks=18)
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(q.slot(2200, 2201))     # 18 blocks: alone on the idle prefiller
        waiter = asyncio.ensure_future(stack.enter_async_context(q.slot(10, 11)))
        await until(lambda: q.depth == 1)                            # 2,200 in flight + 1 block > 2,304
        a.prefill_done()                                             # no lease taken: the answer frees it
        assert (await waiter).endpoint == P
    assert q.idle()


async def test_congested_filters_only_while_a_long_prefill_is_in_flight() -> None:
    """``congested`` is asked on every request: with no long prefill anywhere it answers False without running
    the filters; with one in flight on the only prefiller it filters and says True; after it ends, False again
    without filtering."""
    q = make_queue(budget=100_000)
    eligible = q.scheduler.eligible
    calls: list[Role] = []

    def counted(role: Role, *args: object, **kwargs: object) -> list[Endpoint]:
        calls.append(role)
        return eligible(role, *args, **kwargs)  # type: ignore[arg-type]

    q.scheduler.eligible = counted  # type: ignore[method-assign]
    assert not q.congested() and calls == []
    async with q.slot(20_000, 20_001) as slot:                       # 20,000 uncached tokens >= busy_tokens
        assert q.congested() and calls == [Role.PREFILL]
        slot.prefill_done()
    assert not q.ledger.any_long_prefills
    assert not q.congested() and calls == [Role.PREFILL]
