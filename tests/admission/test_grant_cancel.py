"""A prefill-queue waiter granted its slot and cancelled before it resumes gives the slot back.

The grant happens synchronously inside the release of the slot ahead (:meth:`PrefillQueue.notify`); the waiter's
task only learns of it when it next runs.  If the client leaves in between (its task cancelled), the granted slot
must be released by the waiter itself: its prefill budget and its decoder reservation back to zero, and the next
request placed at once, without waiting in the queue (pdproxy/scheduling/queue.py, ``PrefillQueue._wait``)."""

from __future__ import annotations

import asyncio

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


def make_queue(budget: int) -> PrefillQueue:
    infos = {P: EngineInfo(max_model_len=1_000_000), D: EngineInfo(max_model_len=1_000_000)}
    pool = EndpointPool(list(infos))
    ledger = PrefillLedger(pool, Limits(pool, infos), budget_tokens=budget)
    return PrefillQueue(ledger, Scheduler.standard(pool, ledger=ledger), max_waiting=10, timeout_s=5.0,
                        aging_tokens_per_s=0.0, busy_tokens=5000)


async def until(cond: object, what: str = "") -> None:
    async with asyncio.timeout(5):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0)


async def test_a_waiter_granted_while_being_cancelled_gives_its_slot_back() -> None:
    q = make_queue(budget=100)
    ahead = q.slot(1000, 1001)                           # alone on the idle prefiller, over the budget
    first = await ahead.__aenter__()
    waiter = asyncio.ensure_future(q.slot(60, 61).__aenter__())
    await until(lambda: q.depth == 1, "the second request waiting")
    granted_before = q.stats.granted_total

    first.release()                                      # the prefill ahead ends: the waiter is granted now ...
    assert q.stats.granted_total == granted_before + 1, "the waiter was not granted inside the release"
    assert q.ledger.inflight_tokens(P) == 60 and q.ledger.pending_decode == 61
    waiter.cancel()                                      # ... and its client leaves before its task resumes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await ahead.__aexit__(None, None, None)

    assert q.depth == 0
    assert q.ledger.inflight_tokens(P) == 0, "the cancelled waiter's prefill budget is still held"
    assert q.ledger.pending_decode == 0, "the cancelled waiter's decoder reservation is still held"
    assert q.ledger.idle() and q.idle()

    # the next request fits the budget only if the cancelled grant was given back: placed at once, no wait
    waited = q.stats.waited_total
    async with asyncio.timeout(1):
        async with q.slot(60, 61) as slot:
            assert slot.endpoint == P
    assert q.stats.waited_total == waited and q.stats.timed_out_total == 0
    assert q.idle()


async def test_a_waiter_granted_while_being_cancelled_gives_back_the_half_open_trial_its_grant_took() -> None:
    """The grant's pick takes a half-open breaker's one trial (:meth:`Scheduler.try_pick`); a waiter cancelled
    before it resumes released its slot but not that trial, so the breaker stayed half-open with its trial "in
    flight" and refused every later request (no probe re-admits a half-open breaker): a lone prefiller was out
    until pdproxy restarted (found reading the cancel path beside the prefill leg's own trial leak)."""
    from pdproxy.engines.breaker import BreakerState
    from pdproxy.engines.health import HealthMonitor

    now = [0.0]
    infos = {P: EngineInfo(max_model_len=1_000_000), D: EngineInfo(max_model_len=1_000_000)}
    pool = EndpointPool(list(infos))
    health = HealthMonitor(pool, None, infos, interval_s=30, refresh_interval_s=30,  # type: ignore[arg-type]
                           breaker_open_s=1.0, clock=lambda: now[0])
    ledger = PrefillLedger(pool, Limits(pool, infos), budget_tokens=100)
    q = PrefillQueue(ledger, Scheduler.standard(pool, health=health, ledger=ledger), max_waiting=10, timeout_s=5.0,
                     aging_tokens_per_s=0.0, busy_tokens=5000)
    ahead = q.slot(1000, 1001)
    first = await ahead.__aenter__()
    waiter = asyncio.ensure_future(q.slot(60, 61).__aenter__())
    await until(lambda: q.depth == 1, "the second request waiting")

    breaker = health.breaker(P)
    breaker.record_failure(hard=True)                    # the prefiller failed meanwhile: open ...
    now[0] += 2.0                                        # ... and its open period over: a trial may go
    first.release()                                      # the waiter is granted (its pick takes the trial) ...
    assert breaker.state is BreakerState.HALF_OPEN and not breaker.can_take()
    waiter.cancel()                                      # ... and its client leaves before its task resumes
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await ahead.__aexit__(None, None, None)
    assert breaker.can_take(), "the cancelled grant's trial was never given back"
