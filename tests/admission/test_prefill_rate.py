"""The prefill budget in seconds of a prefiller's measured rate (``pdproxy/scheduling/prefill_rate.py``): busy time
counted once however many prefills overlap, failures add time and no tokens, the sums halve past the window, and
the ledger's budget is the larger of the token budget and ``budget_s`` of the rate.  Clocks are explicit."""

from __future__ import annotations

import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineInfo
from pdproxy.engines.limits import Limits
from pdproxy.engines.pool import EndpointPool
from pdproxy.scheduling.prefill_rate import MIN_PREFILLS, STALE_S, WINDOW_S, PrefillRate, computed_tokens
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
    assert led.budget(P) == 1000 and led.measured_rate(P) is None
    assert P not in led._rates                                    # a read (the budget, /debug/load) creates no entry
    for _ in range(MIN_PREFILLS):                                 # 4,000 tokens in 0.1 s each: 40,000 tokens/s
        slot = led.hold(P, 4000, 4001)
        clock.now += 0.1
        slot.prefilled(4000, 0)
        slot.release()
    assert led.rate(P).tokens_per_s() == pytest.approx(40_000) == led.measured_rate(P)
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
        slot.prefilled(600, 0)
    assert led.rate(P).tokens_per_s() == pytest.approx(600)
    assert led.budget(P) == 1000


def test_only_answers_that_report_what_was_computed_are_credited() -> None:
    """A prompt the engine had cached is answered at once: without the engine's cached count (vLLM without
    ``--enable-prompt-tokens-details``) pdproxy cannot tell, so such answers add their time and no tokens."""
    led, clock = ledger()
    for _ in range(2 * MIN_PREFILLS):                             # 64K-token prompts, answered in 10 ms
        slot = led.hold(P, 64_000, 64_001)
        clock.now += 0.01
        slot.prefilled(64_000, None)
    assert led.rate(P).prefills == 0 and led.rate(P).tokens_per_s() is None
    assert led.budget(P) == 1000
    slots = [led.hold(P, 10_000, 10_001, compute_tokens=4000) for _ in range(MIN_PREFILLS + 2)]
    clock.now += 1.0                                              # six in flight together for 1 s
    slots[0].prefilled(9000, 8000)                                # 9,000 prompt tokens, 8,000 cached: 1,000
    slots[1].prefilled(50_000, 0)                                 # more than pdproxy's count: 10,000 at most
    slots[2].prefilled(9000, -10**9)                              # a negative cached count: 0 cached
    slots[3].prefilled(9000, 10**9)                               # more cached than the prompt: nothing computed
    slots[4].prefilled(None, 0)                                   # no prompt count: time only
    slots[5].prefill_done()                                       # failed: time only
    slots[5].prefilled(10_000, 0)                                 # already released: ignored
    rate = led.rate(P)
    assert rate.prefills == MIN_PREFILLS
    assert rate.tokens_per_s() == pytest.approx((1000 + 10_000 + 9000 + 0) / (2 * MIN_PREFILLS * 0.01 + 1.0))
    assert led.inflight_tokens(P) == 0


@pytest.mark.parametrize(("own", "prompt", "cached", "computed"), [
    (100, 100, 30, 70), (100, 120, 30, 70), (0, 120, 30, 90), (100, -5, 0, 0), (100, 100, 200, 0),
    (100, None, 0, None), (100, 100, None, None)])
def test_computed_tokens_clamps_the_engine_s_counts(own: int, prompt: int | None, cached: int | None,
                                                    computed: int | None) -> None:
    assert computed_tokens(own, prompt, cached) == computed


def test_a_failure_ends_its_busy_time_so_idle_time_never_counts() -> None:
    led, clock = ledger()
    failed = led.hold(P, 5000, 5001)
    clock.now += 1.0
    failed.release()                                              # failed after 1 s: busy 1 s, no tokens
    clock.now += 30.0                                             # idle (under STALE_S): not busy time
    for _ in range(MIN_PREFILLS):
        slot = led.hold(P, 5000, 5001)
        clock.now += 1.0
        slot.prefilled(5000, 0)
        clock.now += 1.0                                          # idle between prefills
    assert led.rate(P).tokens_per_s() == pytest.approx(MIN_PREFILLS * 5000 / (MIN_PREFILLS + 1.0))


def test_long_prefills_are_measured_without_bias_across_the_window() -> None:
    """Halving keeps the ratio: a prefiller at 10,000 tokens/s reads 10,000 whether its prefills last 0.3 s, 3 s
    or 60 s (each one longer than the window alone)."""
    for seconds in (0.3, 3.0, 60.0):
        rate = PrefillRate()
        t = 0.0
        for _ in range(3 * MIN_PREFILLS):
            rate.started(t)
            t += seconds
            rate.finished(int(10_000 * seconds), t)
        assert rate.tokens_per_s() == pytest.approx(10_000), seconds


def test_a_prefiller_idle_past_stale_s_is_measured_afresh() -> None:
    led, clock = ledger(budget_tokens=1000, budget_s=0.5)
    for _ in range(MIN_PREFILLS):                                 # fast: 40,000 tokens/s → budget 20,000
        slot = led.hold(P, 4000, 4001)
        clock.now += 0.1
        slot.prefilled(4000, 0)
    assert led.budget(P) == 20_000
    clock.now += STALE_S - 1
    assert led.budget(P) == 20_000
    clock.now += 2                                                # idle: the engine may have been restarted
    assert led.measured_rate(P) is None and led.budget(P) == 1000    # what operators see too (/debug/load)
    slot = led.hold(P, 4000, 4001)
    assert led.rate(P).tokens_per_s() is None and led.budget(P) == 1000
    clock.now += 4.0
    slot.prefilled(4000, 0)                                       # slow now: 1,000 tokens/s
    assert led.rate(P).prefills == 1
