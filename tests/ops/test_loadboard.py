"""The shared load board: single-writer rows, summed views, and the scheduler reading the all-worker view."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.scheduling import PickRequest, Scheduler
from pdproxy.workers.board import LoadBoard

pytestmark = pytest.mark.timeout(10)

ENDPOINTS = [Endpoint("http://p0:9100", Role.PREFILL), Endpoint("http://d0:9100", Role.DECODE),
             Endpoint("http://d1:9100", Role.DECODE)]
P0, D0, D1 = ENDPOINTS


@pytest.fixture
def boards(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Two workers' mappings of one board file (what two processes see)."""
    path = tmp_path / "load.board"
    with LoadBoard.create(path, ENDPOINTS, rows=2) as a, LoadBoard.attach(path, ENDPOINTS, rows=2) as b:
        yield a, b


def test_rows_sum_across_mappings_and_release_to_zero(boards: tuple[LoadBoard, LoadBoard]) -> None:
    a, b = boards
    pa, pb = a.pool(ENDPOINTS, 0), b.pool(ENDPOINTS, 1)
    with pa.lease(D0, 100), pb.lease(D0, 40), pb.lease(P0, 7):
        assert (pa.load(D0).requests, pa.load(D0).tokens) == (2, 140)
        assert (pb.load(D0).requests, pb.load(D0).tokens) == (2, 140)  # same view from the other worker
        assert pa.load(P0).tokens == 7
        assert a.row_totals(0) == (1, 100) and a.row_totals(1) == (2, 47)
        assert pa.totals()["decode:http://d0:9100"] == (1, 100)  # what this worker itself holds
        assert not pa.idle() and not pb.idle()
    assert pa.idle() and pb.idle()
    assert pa.load(D0).requests == pa.load(D0).tokens == 0


def test_lease_released_early_and_on_error_counts_once(boards: tuple[LoadBoard, LoadBoard]) -> None:
    a, _ = boards
    pool = a.pool(ENDPOINTS, 0)
    with pytest.raises(RuntimeError), pool.lease(D1, 5) as lease:
        lease.release()  # the prefill lease is released at the decoder's first event, then the CM exits
        raise RuntimeError
    assert (pool.load(D1).requests, pool.load(D1).tokens) == (0, 0)


def test_health_flags_stay_per_worker_and_totals_are_read_only(boards: tuple[LoadBoard, LoadBoard]) -> None:
    a, b = boards
    pa, pb = a.pool(ENDPOINTS, 0), b.pool(ENDPOINTS, 1)
    pa.load(D1).healthy = False  # what health.py does after a failed probe
    assert pa.available(Role.DECODE) == [D0]
    assert pb.available(Role.DECODE) == [D0, D1]  # each worker probes for itself
    with pytest.raises(AttributeError):
        pa.load(D0).requests = 3  # type: ignore[misc]


def test_scheduler_sees_other_workers_leases(boards: tuple[LoadBoard, LoadBoard]) -> None:
    a, b = boards
    pa, pb = a.pool(ENDPOINTS, 0), b.pool(ENDPOINTS, 1)
    sched_a = Scheduler.standard(pa)
    with pb.lease(D0, 10), pb.lease(D0, 10):  # worker b holds two requests on d0
        picks = {sched_a.pick(Role.DECODE, PickRequest(f"r{i}")) for i in range(20)}
        assert picks == {D1}


def test_cleared_row_and_mismatched_settings(boards: tuple[LoadBoard, LoadBoard], tmp_path: Path) -> None:
    a, b = boards
    pb = b.pool(ENDPOINTS, 1)
    cm = pb.lease(D0, 50)
    cm.__enter__()  # a worker that dies holding a lease (its context manager never exits)
    pa = a.pool(ENDPOINTS, 0)
    assert pa.load(D0).requests == 1
    assert a.pool(ENDPOINTS, 1).load(D0).requests == 1  # mapping a row again does not reset it
    a.clear(1)  # the supervisor zeroes the dead worker's row
    assert pa.load(D0).requests == 0
    cm.__exit__(None, None, None)
    with pytest.raises(ValueError, match="other settings"):
        LoadBoard.attach(a.path, ENDPOINTS[:2], rows=2)
    with pytest.raises(ValueError):
        LoadBoard.attach(a.path, ENDPOINTS, rows=3)


def test_random_lease_traffic_sums_exactly(boards: tuple[LoadBoard, LoadBoard]) -> None:
    a, b = boards
    pools = [a.pool(ENDPOINTS, 0), b.pool(ENDPOINTS, 1)]
    rng = random.Random(7)
    held, keep = [], []
    expected = {e: [0, 0] for e in ENDPOINTS}
    for _ in range(500):
        if held and rng.random() < 0.45:
            lease = held.pop(rng.randrange(len(held)))
            lease.release()
            expected[lease.endpoint][0] -= 1
            expected[lease.endpoint][1] -= lease.tokens
        else:
            e, tokens = rng.choice(ENDPOINTS), rng.randrange(1, 5000)
            cm = rng.choice(pools).lease(e, tokens)
            keep.append(cm)  # a context manager dropped unexited would release its lease when collected
            held.append(cm.__enter__())
            expected[e][0] += 1
            expected[e][1] += tokens
        for e in ENDPOINTS:
            assert [pools[0].load(e).requests, pools[1].load(e).tokens] == expected[e]
