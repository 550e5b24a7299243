"""Property: under any interleaving of pick / first event / release / failure / cancellation across
concurrent requests, the pool's load counters never go negative and return to zero.

Each simulated request follows the director's lease pattern (pdproxy/director.py): a prefill lease in the
request's exit stack, a decode lease, the prefill lease released early at the decoder's first event, failures
reported to the health monitor's breakers (so later picks change), and cancellation at any await point.
Hypothesis draws the requests' scripts and the order in which their steps run.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.endpoints import Endpoint, Role, expand
from pdproxy.errors import NoEndpointAvailable
from pdproxy.health import HealthMonitor
from pdproxy.pool import EndpointPool
from pdproxy.scheduling import PickRequest, Scheduler

ENDPOINTS = expand(["http://p0:1", "http://p1:1"], Role.PREFILL) + expand(["http://d0:1"], Role.DECODE, dp_size=2)
STEPS = ("picked_prefill", "prefilled", "picked_decode", "first_event", "streamed")


class Boom(Exception):
    pass


@dataclass
class Script:
    """One request: tokens, and where (if anywhere) it fails (a step name) or raises on its own."""

    tokens: int
    fail_at: str | None


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def check(pool: EndpointPool) -> None:
    for e in pool.endpoints():
        load = pool.load(e)
        assert load.requests >= 0 and load.tokens >= 0, (e.name, load)
        assert (load.requests == 0) == (load.tokens == 0) or load.tokens >= 0


async def request(pool: EndpointPool, sched: Scheduler, health: HealthMonitor, script: Script,
                  gate: asyncio.Queue[str]) -> str:
    def pick(role: Role, exclude: list[Endpoint]) -> Endpoint:
        return sched.pick(role, PickRequest(f"t{script.tokens}"), exclude)   # breaker filter + its trial slot

    async def step(name: str) -> None:
        assert await gate.get() == "go"
        if script.fail_at == name:
            raise Boom(name)

    async with AsyncExitStack() as stack:
        p = pick(Role.PREFILL, [])
        p_lease = stack.enter_context(pool.lease(p, script.tokens))
        try:
            await step("picked_prefill")
            await step("prefilled")
        except Boom:
            p_lease.release()
            health.record_failure(p)
            raise
        health.record_success(p)
        d = pick(Role.DECODE, [])
        with pool.lease(d, script.tokens * 2):
            try:
                await step("picked_decode")
                await step("first_event")
                p_lease.release()          # the director's early release at the decoder's first event
                p_lease.release()          # idempotent
                await step("streamed")
            except Boom:
                health.record_failure(d)
                raise
            health.record_success(d)
    return "ok"


scripts = st.lists(st.builds(Script, tokens=st.integers(1, 5000), fail_at=st.sampled_from((None, *STEPS))),
                   min_size=1, max_size=8)
actions = st.lists(st.tuples(st.sampled_from(("go", "cancel", "tick")), st.integers(0, 7)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(scripts=scripts, actions=actions)
@pytest.mark.timeout(60)
def test_load_counters_never_negative_and_return_to_zero(scripts: list[Script],
                                                         actions: list[tuple[str, int]]) -> None:
    async def main() -> None:
        clock = FakeClock()
        pool = EndpointPool(ENDPOINTS)
        health = HealthMonitor(pool, engines=None, infos={}, interval_s=1.0,  # type: ignore[arg-type]
                               refresh_interval_s=1.0, breaker_failures=2, breaker_open_s=1.0, clock=clock)
        sched = Scheduler.standard(pool, health=health)
        gates: list[asyncio.Queue[str]] = [asyncio.Queue() for _ in scripts]
        tasks: list[asyncio.Task[Any]] = [asyncio.create_task(request(pool, sched, health, s, g))
                                          for s, g in zip(scripts, gates, strict=True)]

        async def settle() -> None:
            for _ in range(5):
                await asyncio.sleep(0)
            check(pool)

        await settle()
        for kind, i in actions:
            i %= len(tasks)
            if kind == "go":
                gates[i].put_nowait("go")
            elif kind == "cancel":
                tasks[i].cancel()
            else:
                clock.now += 0.6  # breakers move towards half-open
            await settle()
        for g in gates:                      # let every survivor run to its end
            for _ in STEPS:
                g.put_nowait("go")
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for r in results:
            assert r == "ok" or isinstance(r, Boom | NoEndpointAvailable | asyncio.CancelledError), r
        check(pool)
        assert pool.idle(), pool.totals()
        for e in pool.endpoints():
            load = pool.load(e)
            assert load.leased_total == load.released_total
    asyncio.run(main())
