"""The circuit breaker's state machine on a fake clock (no sleeps), and the health monitor's pick filter."""

from __future__ import annotations

import pytest

from pdproxy.endpoints import Endpoint, Role, expand
from pdproxy.engines.breaker import BreakerState, CircuitBreaker
from pdproxy.engines.control import EngineInfo
from pdproxy.engines.health import HealthMonitor
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import NoEndpointAvailable, UpstreamRefused, UpstreamUnavailable
from pdproxy.scheduling import PickRequest, Scheduler

pytestmark = pytest.mark.timeout(5)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock, **kw: float) -> CircuitBreaker:
    return CircuitBreaker(failure_threshold=int(kw.get("threshold", 3)), open_s=kw.get("open_s", 2.0),
                          max_open_s=kw.get("max_open_s", 16.0), clock=clock)


def test_opens_after_consecutive_failures_only() -> None:
    clock = Clock()
    b = breaker(clock)
    b.record_failure()
    b.record_failure()
    b.record_success()              # a success in between resets the count
    b.record_failure()
    b.record_failure()
    assert b.state is BreakerState.CLOSED and b.can_take()
    b.record_failure()
    assert b.state is BreakerState.OPEN and not b.can_take()
    assert b.seconds_until_retry() == pytest.approx(2.0)


def test_half_open_admits_one_trial_then_closes_on_success() -> None:
    clock = Clock()
    b = breaker(clock, threshold=1)
    b.record_failure()
    clock.now += 1.9
    assert not b.can_take()
    clock.now += 0.2
    assert b.can_take()
    b.on_pick()
    assert b.state is BreakerState.HALF_OPEN
    assert not b.can_take()         # one trial at a time
    b.record_success()
    assert b.state is BreakerState.CLOSED and b.can_take()


def test_failed_trial_reopens_with_doubling_wait_capped() -> None:
    clock = Clock()
    b = breaker(clock, threshold=1, open_s=2.0, max_open_s=5.0)
    b.record_failure()
    waits = []
    for _ in range(4):
        clock.now += b.seconds_until_retry()
        b.on_pick()
        b.record_failure()
        waits.append(b.seconds_until_retry())
    assert waits == [4.0, 5.0, 5.0, 5.0]
    clock.now += 5.0
    b.on_pick()
    b.record_success()
    assert b.state is BreakerState.CLOSED
    b.record_failure()              # after a recovery the open period starts over from open_s
    assert b.seconds_until_retry() == pytest.approx(2.0)


def test_neutral_end_of_a_trial_frees_the_slot() -> None:
    clock = Clock()
    b = breaker(clock, threshold=1)
    b.record_failure()
    clock.now += 2.0
    b.on_pick()
    assert not b.can_take()
    b.release_trial()               # e.g. the client left, or the engine answered 4xx
    assert b.can_take() and b.state is BreakerState.HALF_OPEN


def test_a_trial_with_no_verdict_in_trial_timeout_s_no_longer_holds_its_slot() -> None:
    clock = Clock()
    b = breaker(clock, threshold=1)
    b.record_failure()
    clock.now += 2.0
    assert b.on_pick()                       # the one trial, whose leg never gives its verdict (a defect)
    clock.now += b.trial_timeout_s - 0.1
    assert not b.can_take() and not b.on_pick()
    clock.now += 0.1
    assert b.can_take() and b.on_pick()      # taken for lost: a new trial, still half-open
    assert b.state is BreakerState.HALF_OPEN and not b.can_take()
    clock.now += b.trial_timeout_s / 2       # the new trial's own timeout runs from its start
    assert not b.can_take()
    b.release_trial()                        # the lost trial ends after all (its client left): its own slot only
    assert not b.can_take(), "the lost trial's end freed the new trial's slot"
    b.release_trial()                        # the new one ends without a verdict too: its slot is free
    assert b.can_take() and b.on_pick()
    b.record_success()
    assert b.state is BreakerState.CLOSED


def test_retry_after_holds_it_open_and_probe_success_readmits() -> None:
    clock = Clock()
    b = breaker(clock, threshold=3, open_s=2.0)
    b.record_failure(retry_after_s=7)
    assert b.state is BreakerState.OPEN
    clock.now += 3.0
    b.probe_ok()                    # the engine asked for 7 s: a probe does not override that
    assert not b.can_take()
    clock.now += 4.0
    assert b.can_take()
    c = breaker(clock, threshold=1, open_s=30.0)
    c.record_failure()
    assert not c.can_take()
    c.probe_ok()                    # /health answers again: trial traffic at once
    assert c.can_take()


def test_hard_failure_opens_at_once() -> None:
    b = breaker(Clock(), threshold=5)
    b.record_failure(hard=True)
    assert b.state is BreakerState.OPEN


def test_monitor_filters_open_endpoints_and_reports_retry_after() -> None:
    clock = Clock()
    eps = expand(["http://p0:1", "http://p1:1"], Role.PREFILL)
    pool = EndpointPool(eps)
    health = HealthMonitor(pool, engines=None, infos={}, interval_s=1.0, refresh_interval_s=1.0,  # type: ignore
                           breaker_failures=1, breaker_open_s=3.0, clock=clock)
    sched = Scheduler.standard(pool, health=health)
    health.record_failure(eps[0])
    assert {sched.pick(Role.PREFILL, PickRequest(f"r{i}")) for i in range(20)} == {eps[1]}
    health.record_failure(eps[1], retry_after_s=10)
    with pytest.raises(NoEndpointAvailable) as refused:
        sched.pick(Role.PREFILL, PickRequest())
    assert "circuit breaker" in refused.value.message and refused.value.headers["retry-after"] == "3"
    assert health.retry_after_s(eps) == 3
    assert health.snapshot(eps[1]).breaker == "open"


def lone_prefiller(clock: Clock, breaker_failures: int) -> tuple[HealthMonitor, Endpoint, CircuitBreaker,
                                                                  UpstreamUnavailable]:
    """A health monitor of one prefiller (breaker open 3 s), its breaker and an engine fault to record."""
    (ep,) = expand(["http://p0:1"], Role.PREFILL)
    health = HealthMonitor(EndpointPool([ep]), engines=None, infos={}, interval_s=1.0,  # type: ignore[arg-type]
                           refresh_interval_s=1.0, breaker_failures=breaker_failures, breaker_open_s=3.0, clock=clock)
    return health, ep, health.breaker(ep), UpstreamUnavailable("reset", endpoint=ep.name)


def test_a_requests_second_failure_is_no_strike_on_a_closed_breaker_but_fails_a_trial() -> None:
    """``record_error(..., again=True)`` (the same request failed on the engine before): no strike while the
    breaker is closed, so one request cannot open it; but an open or half-open breaker records it as ever — a
    failed trial re-opens it, and another request's trial slot is never freed by it."""
    clock = Clock()
    health, ep, b, err = lone_prefiller(clock, breaker_failures=3)
    assert health.record_error(ep, err) and b.consecutive_failures == 1
    for _ in range(5):
        assert health.record_error(ep, err, again=True)                # an engine fault, told to the caller
    assert b.consecutive_failures == 1 and b.state is BreakerState.CLOSED
    health.record_error(ep, err)
    health.record_error(ep, err)                                        # two more requests: open
    assert b.state is BreakerState.OPEN and b.opened_total == 1
    clock.now += 10
    assert health.on_pick(ep) and b.state is BreakerState.HALF_OPEN    # a retry takes the trial ...
    health.record_error(ep, err, again=True)                            # ... and fails: open again, wait doubled
    assert b.state is BreakerState.OPEN and b.opened_total == 2
    clock.now += 10
    assert health.on_pick(ep) and not b.can_take()                      # another request's trial in flight
    health.record_error(ep, err, again=True)                            # an older request failing there again
    assert b.state is BreakerState.OPEN and not b.can_take()            # no second trial let in beside it


def test_a_legs_verdict_is_given_once_and_neutral_when_it_leaves_without_one() -> None:
    """health.judging: the first verdict counts; leaving the block without one (a fault, a cancellation) gives
    the half-open trial back, and the exception passes on."""
    clock = Clock()
    health, ep, b, err = lone_prefiller(clock, breaker_failures=1)
    health.record_failure(ep)
    clock.now += 3.0
    assert health.on_pick(ep) and not b.can_take()                      # the trial taken by a pick
    with pytest.raises(RuntimeError), health.judging(ep):
        raise RuntimeError("a defect between the pick and the send")
    assert b.can_take() and b.state is BreakerState.HALF_OPEN           # given back on the way out
    assert health.on_pick(ep)
    with health.judging(ep) as verdict:
        verdict.neutral()                                               # a 4xx: no verdict, the trial back ...
        assert b.can_take()
        assert health.on_pick(ep)                                       # ... and another request takes it
        verdict.error(err)                                              # a second verdict of the first leg: ignored
        assert b.state is BreakerState.HALF_OPEN and not b.can_take()
    assert not b.can_take(), "the exit gave back the other request's trial"
    with health.judging(ep) as verdict:
        assert verdict.error(err)                                       # the other request's leg fails: open
    assert b.state is BreakerState.OPEN


class _Engines:
    """The monitor's engine client: ``/health`` answers unless the endpoint is in ``down``."""

    def __init__(self) -> None:
        self.down: set[str] = set()

    async def health(self, endpoint: Endpoint) -> bool:
        return endpoint.url not in self.down

    async def refresh(self, endpoint: Endpoint, info: EngineInfo) -> EngineInfo:
        info.reachable, info.refreshed_at = endpoint.url not in self.down, 0.0
        return info

    def health_failure(self, endpoint: Endpoint) -> str | None:
        return None


@pytest.mark.parametrize("failure", ["refused", "reset"])
@pytest.mark.anyio
async def test_a_good_probe_after_a_refused_connection_closes_the_breaker(failure: str) -> None:
    """Nothing listened (a refused connection: the engine never saw the request), now /health answers: the engine
    restarted and takes traffic again at once — not one trial request at a time, which left a lone prefiller's
    every other request refused while its trial (a long prefill) ran.  After a failure the engine did see (a reset
    mid-answer), a good probe only lets the one trial in early, as before."""
    clock, engines = Clock(), _Engines()
    eps = expand(["http://p0:1"], Role.PREFILL)
    health = HealthMonitor(EndpointPool(eps), engines=engines, infos={}, interval_s=1.0,  # type: ignore[arg-type]
                           refresh_interval_s=1.0, breaker_failures=1, breaker_open_s=3.0, clock=clock)
    sched = Scheduler.standard(health.pool, health=health)
    exc = (UpstreamRefused("prefill refused the connection", endpoint=eps[0].name) if failure == "refused"
           else UpstreamUnavailable("prefill closed the connection", endpoint=eps[0].name))
    engines.down.add(eps[0].url)
    assert health.record_error(eps[0], exc)
    assert health.snapshot(eps[0]).breaker == "open" and not await health.probe(eps[0])
    engines.down.clear()
    assert await health.probe(eps[0])
    if failure == "refused":
        assert health.snapshot(eps[0]).breaker == "closed"
        assert [sched.pick(Role.PREFILL, PickRequest(f"r{i}")) for i in range(3)] == [eps[0]] * 3   # all at once
    else:
        assert sched.pick(Role.PREFILL, PickRequest("trial")) == eps[0]
        assert health.snapshot(eps[0]).breaker == "half_open"
        with pytest.raises(NoEndpointAvailable) as refused:              # its one trial is in flight
            sched.pick(Role.PREFILL, PickRequest("next"))
        assert "half-open with its one trial request in flight" in refused.value.message
