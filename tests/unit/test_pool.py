"""Pool accounting and the scheduler: leases release exactly once on every exit path; picks follow load."""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.endpoints import Endpoint, Role, expand
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import NoEndpointAvailable
from pdproxy.scheduling import PickRequest, Scheduler

P = expand(["http://p0:1", "http://p1:1"], Role.PREFILL)
D = expand(["http://d0:1"], Role.DECODE, dp_size=4)


def test_lease_released_on_return_exception_and_early_release() -> None:
    pool = EndpointPool(P + D)
    with pool.lease(P[0], 100) as lease:
        assert pool.totals()[f"prefill:{P[0].name}"] == (1, 100)
        lease.release()
        lease.release()  # idempotent
    with pytest.raises(RuntimeError), pool.lease(P[1], 7):
        raise RuntimeError
    assert pool.idle()
    assert pool.load(P[0]).leased_total == pool.load(P[0]).released_total == 1


def test_an_endpoint_keys_dicts_by_value_with_its_name_and_hash_computed_once() -> None:
    """Equal fields = equal endpoints, whatever object: the same dict slot; ``name`` and the hash are computed at
    construction, also for a copy by ``dataclasses.replace``; a pickled endpoint, read in another process (another
    ``hash(str)`` salt), still finds its slot there."""
    a = Endpoint("http://h:1", Role.DECODE, 2, internal_dp=True)
    b = Endpoint("http://h:1", Role.DECODE, 2, internal_dp=True)
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1 and a.name == "http://h:1#dp2"
    c = dataclasses.replace(a, dp_rank=3)
    assert c.name == "http://h:1#dp3" and c != a and {a: 1}.get(c) is None
    assert Endpoint("http://h:1", Role.PREFILL).name == "http://h:1" != a
    assert "_hash" not in repr(a) and pickle.loads(pickle.dumps(a)) == a
    code = ("import pickle, sys; from pdproxy.endpoints import Endpoint, Role; e = pickle.loads(sys.stdin.buffer.read()); "
            "print({Endpoint('http://h:1', Role.DECODE, 2, internal_dp=True): 'found'}.get(e), e.name)")
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(a), capture_output=True, timeout=30,
                         env={**os.environ, "PYTHONHASHSEED": "random"}, check=True)
    assert out.stdout.decode().split() == ["found", "http://h:1#dp2"]


def test_internal_dp_expansion_sets_rank_header() -> None:
    assert [e.name for e in D] == [f"http://d0:1#dp{r}" for r in range(4)]
    assert D[2].extra_headers() == {"X-data-parallel-rank": "2"}
    assert P[0].extra_headers() == {}


def test_prefill_choice_follows_in_flight_tokens() -> None:
    pool = EndpointPool(P + D)
    sched = Scheduler.standard(pool)
    with pool.lease(P[0], 120_000):
        assert {sched.pick(Role.PREFILL, PickRequest(f"r{i}")) for i in range(20)} == {P[1]}


def test_power_of_two_avoids_the_busiest_and_breaks_ties_randomly() -> None:
    pool = EndpointPool(D)
    sched = Scheduler.standard(pool, picker="power_of_two", seed=3)
    leases = [pool.lease(D[0], 1) for _ in range(5)]
    for lease_cm in leases:
        lease_cm.__enter__()
    picks = [sched.pick(Role.DECODE, PickRequest()) for _ in range(200)]
    assert D[0] not in picks
    assert set(picks) == set(D[1:])  # ties among idle ranks spread at random
    for lease_cm in leases:
        lease_cm.__exit__(None, None, None)
    assert pool.idle()


def test_unhealthy_draining_and_excluded_endpoints_are_skipped() -> None:
    pool = EndpointPool(P + D)
    sched = Scheduler.standard(pool)
    pool.load(P[0]).healthy = False
    assert sched.pick(Role.PREFILL, PickRequest()) == P[1]
    pool.load(P[1]).draining = True
    with pytest.raises(NoEndpointAvailable) as e:
        sched.pick(Role.PREFILL, PickRequest())
    assert e.value.status_code == 503 and e.value.headers["retry-after"]
    with pytest.raises(NoEndpointAvailable):
        sched.pick(Role.DECODE, PickRequest(), exclude=D)


OPS = st.lists(st.tuples(st.sampled_from(["pick", "release", "fail", "cancel"]), st.integers(0, 50)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(0, 2**16))
def test_random_interleavings_never_go_negative_and_return_to_zero(ops: list[tuple[str, int]], seed: int) -> None:
    """Property: pick / release / fail / cancel in any order keep counters ≥ 0 and end at zero."""
    pool = EndpointPool(P + D)
    sched = Scheduler.standard(pool, picker="power_of_two", seed=seed)
    rng = random.Random(seed)
    open_leases: list[tuple[object, object]] = []
    for op, tokens in ops:
        if op == "pick":
            cm = pool.lease(sched.pick(rng.choice([Role.PREFILL, Role.DECODE]), PickRequest()), tokens)
            open_leases.append((cm, cm.__enter__()))
        elif open_leases:
            cm, lease = open_leases.pop(rng.randrange(len(open_leases)))
            if op == "release":
                lease.release()  # type: ignore[attr-defined]
                cm.__exit__(None, None, None)  # type: ignore[attr-defined]
            elif op == "fail":
                try:
                    cm.__exit__(RuntimeError, RuntimeError("x"), None)  # type: ignore[attr-defined]
                except RuntimeError:
                    pass
            else:  # cancel: early release twice, then exit
                lease.release()  # type: ignore[attr-defined]
                lease.release()  # type: ignore[attr-defined]
                cm.__exit__(None, None, None)  # type: ignore[attr-defined]
        for load in (pool.load(e) for e in pool.endpoints()):
            assert load.requests >= 0 and load.tokens >= 0
    for cm, _ in open_leases:
        cm.__exit__(None, None, None)  # type: ignore[attr-defined]
    assert pool.idle()


def test_a_failing_release_listener_never_breaks_a_release() -> None:
    pool = EndpointPool(P + D)
    calls: list[int] = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("listener bug")

    pool.add_release_listener(broken)
    with pool.lease(P[0], 10) as lease:
        lease.release()  # must not raise
    assert calls == [1] and pool.idle()
