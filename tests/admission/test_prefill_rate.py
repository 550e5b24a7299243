"""The prefill budget in seconds of a prefiller's measured rate (``pdproxy/scheduling/prefill_rate.py``): busy time
counted once however many prefills overlap, failures add time and no tokens, the sums halve past the window, and
the ledger's budget is the larger of the token budget and ``budget_s`` of the rate.  Clocks are explicit."""

from __future__ import annotations

import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineInfo
from pdproxy.engines.limits import Limits
from pdproxy.engines.pool import EndpointPool
from pdproxy.scheduling.prefill_rate import MIN_PREFILLS, WINDOW_S, PrefillRate
from pdproxy.scheduling.queue import PrefillLedger

pytestmark = pytest.mark.timeout(10)

P = Endpoint("http://p", Role.PREFILL)
D = Endpoint("http://d", Role.DECODE)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ledger(budget_tokens: int = 1000, budget_s: float = 0.5) -> tuple[PrefillLedger, Clock]:
    infos = {P: EngineInfo(max_model_len=1_000_000), D: EngineInfo(max_model_len=1_000_000)}
    pool = EndpointPool(list(infos))
    clock = Clock()
    return PrefillLedger(pool, Limits(pool, infos), budget_tokens=budget_tokens, budget_s=budget_s,
                         clock=clock), clock


def test_overlapping_prefills_count_their_busy_time_once() -> None:
    rate = PrefillRate()
    for i in range(MIN_PREFILLS):          # two at a time: [0, 1] and [0.5, 1.5] per pair = 1.5 s busy, 2,000 tokens
        t = 10.0 * i
        rate.started(t)
        rate.started(t + 0.5)
        rate.finished(1000, t + 1.0)
        rate.finished(1000, t + 1.5)
    assert rate.prefills == 2 * MIN_PREFILLS
    assert rate.tokens_per_s() == pytest.approx(2000 / 1.5)       # idle gaps between pairs are not busy time


def test_no_rate_before_enough_answers_and_failures_add_time_without_tokens() -> None:
    rate = PrefillRate()
    for i in range(MIN_PREFILLS - 1):
        rate.started(i)
        rate.finished(500, i + 0.25)
    assert rate.tokens_per_s() is None
    rate.started(10.0)
    rate.finished(None, 11.0)                                     # failed after 1 s: time, no tokens
    assert rate.tokens_per_s() is None and rate.prefills == MIN_PREFILLS - 1
    rate.started(20.0)
    rate.finished(500, 20.25)
    assert rate.tokens_per_s() == pytest.approx(MIN_PREFILLS * 500 / (MIN_PREFILLS * 0.25 + 1.0))


def test_the_sums_halve_past_the_window_so_the_rate_follows_recent_work() -> None:
    rate = PrefillRate()
    t = 0.0
    for _ in range(MIN_PREFILLS):                                 # fast: 10,000 tokens/s
        rate.started(t)
        rate.finished(10_000, t + 1.0)
        t += 2.0
    assert rate.tokens_per_s() == pytest.approx(10_000)
    for _ in range(int(4 * WINDOW_S)):                            # then slow: 100 tokens/s for 4 windows
        rate.started(t)
        rate.finished(100, t + 1.0)
        t += 2.0
    per_s = rate.tokens_per_s()
    assert per_s is not None and per_s < 1_000                   # the fast past weighs ≤ 1/16 of what it did


def test_the_budget_is_the_larger_of_the_tokens_and_budget_s_of_the_rate() -> None:
    led, clock = ledger(budget_tokens=1000, budget_s=0.5)
    assert led.budget(P) == 1000 and led.rate(P).tokens_per_s() is None
    for _ in range(MIN_PREFILLS):                                 # 4,000 tokens in 0.1 s each: 40,000 tokens/s
        slot = led.hold(P, 4000, 4001)
        clock.now += 0.1
        slot.prefilled(4000, 0)
        slot.release()
    assert led.rate(P).tokens_per_s() == pytest.approx(40_000)
    assert led.budget(P) == 20_000                                # 0.5 s of it
    first = led.hold(P, 4000, 4001)
    assert led.has_room(P, 16_000) and not led.has_room(P, 16_001)   # 4,000 in flight + 16,000 = the budget
    first.release()
    led.budget_s = 0.0
    assert led.budget(P) == 1000                                  # 0: the token budget alone
    led.budget_s, led.budget_tokens = 0.5, 0
    assert led.budget(P) == 0                                     # no token budget: no budget at all


def test_a_slow_prefiller_keeps_the_token_budget() -> None:
    led, clock = ledger(budget_tokens=1000, budget_s=0.5)
    for _ in range(MIN_PREFILLS):                                 # 600 tokens in 1 s each: 0.5 s of it = 300
        slot = led.hold(P, 600, 601)
        clock.now += 1.0
        slot.prefilled()
    assert led.rate(P).tokens_per_s() == pytest.approx(600)
    assert led.budget(P) == 1000


def test_the_engine_s_counts_are_what_is_credited_and_a_failure_credits_nothing() -> None:
    led, clock = ledger()
    slots = [led.hold(P, 10_000, 10_001, compute_tokens=4000) for _ in range(MIN_PREFILLS + 1)]
    clock.now += 1.0                                              # all five in flight together for 1 s
    slots[0].prefilled(9000, 8000)                                # the engine: 9,000 prompt tokens, 8,000 cached
    slots[1].prefilled(None, 1000)                                # no prompt count: pdproxy's 10,000
    slots[2].prefilled(9000, None)                                # no cache count: pdproxy's 6,000 predicted
    slots[3].prefilled()                                          # neither: pdproxy's 4,000
    slots[4].prefill_done()                                       # failed: nothing
    slots[4].prefilled(10_000, 0)                                 # already released: ignored
    rate = led.rate(P)
    assert rate.prefills == MIN_PREFILLS
    assert rate.tokens_per_s() == pytest.approx(1000 + 9000 + 3000 + 4000)
    assert led.inflight_tokens(P) == 0
