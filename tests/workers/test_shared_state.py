"""Two workers' views of one load board in one process (two mappings of the file, as two worker processes have):
the prefill budget, the KV-pool guard and the decoders' reservation are one for both; a grant re-checks under the
board's lock; a release in one worker wakes the other's waiters through its FIFO (not the poll); the order of
waiters holds across workers; a breaker opened in one is open in the other, its half-open trial is taken once; a
dead worker's row gives everything back.  One process hammering grants against another never overshoots."""

from __future__ import annotations

import asyncio
import multiprocessing
from collections.abc import Iterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.breaker import BreakerState
from pdproxy.engines.control import EngineClient, EngineInfo
from pdproxy.engines.health import HealthMonitor
from pdproxy.engines.limits import Limits
from pdproxy.errors import NoEndpointAvailable
from pdproxy.scheduling import PickRequest, Scheduler
from pdproxy.scheduling.queue import PrefillLedger, PrefillQueue
from pdproxy.workers.board import GRANT_EPOCH, INFLIGHT_TOKENS, LoadBoard, SharedEndpointPool
from pdproxy.workers.breaker import BoardBreaker
from pdproxy.workers.share import WorkerShare
from pdproxy.workers.wakeup import WakeChannels, create_fifos

pytestmark = pytest.mark.timeout(30)

P = Endpoint("http://p0:9100", Role.PREFILL)
P1 = Endpoint("http://p1:9100", Role.PREFILL)
D = Endpoint("http://d0:9100", Role.DECODE)
ENDPOINTS = [P, P1, D]
NEVER_POLL = 60.0  # the queues' safety-net poll: far beyond every wait here, so a grant seen came from a wake-up


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Worker:
    """One worker's components, as ProxyState.build wires them with a WorkerShare."""

    share: WorkerShare
    pool: SharedEndpointPool
    ledger: PrefillLedger
    health: HealthMonitor
    scheduler: Scheduler
    queue: PrefillQueue


def make_worker(board: LoadBoard, run_dir: Path, row: int, *, budget: int, p_blocks: int | None = None,
                decoder_kv: int | None = None, aging: float = 0.0, clock: Clock | None = None,
                prefillers: tuple[Endpoint, ...] = (P,)) -> Worker:
    share = WorkerShare(board, row, WakeChannels(run_dir, board.rows, row))
    pool = share.pool(ENDPOINTS)
    p_info = (EngineInfo(max_model_len=4096, kv_pool_tokens=p_blocks * 128, num_gpu_blocks=p_blocks, block_size=128)
              if p_blocks else EngineInfo(max_model_len=1_000_000))
    infos = {P: p_info, P1: p_info, D: EngineInfo(max_model_len=1_000_000, kv_pool_tokens=decoder_kv)}
    for e in ENDPOINTS:
        if e.role is Role.PREFILL and e not in prefillers:
            pool.load(e).draining = True                      # routing leaves it alone
    limits = Limits(pool, infos)
    health = HealthMonitor(pool, EngineClient(timeout_s=1.0), infos, interval_s=60, refresh_interval_s=60,
                           breaker_failures=1, breaker_open_s=2.0, clock=clock or Clock(),
                           make_breaker=share.make_breaker)
    ledger = PrefillLedger(pool, limits, budget_tokens=budget, counts=share.ledger_counts())
    scheduler = Scheduler.standard(pool, health=health, limits=limits, ledger=ledger)
    queue = PrefillQueue(ledger, scheduler, max_waiting=100, timeout_s=20, aging_tokens_per_s=aging,
                         busy_tokens=5000, poll_s=NEVER_POLL)
    share.connect(pool, ledger)
    return Worker(share, pool, ledger, health, scheduler, queue)


@pytest.fixture
def board_files(tmp_path: Path) -> Iterator[tuple[LoadBoard, LoadBoard, Path]]:
    path = tmp_path / "load.board"
    create_fifos(tmp_path, 2)
    with LoadBoard.create(path, ENDPOINTS, rows=2) as a, LoadBoard.attach(path, ENDPOINTS, rows=2) as b:
        yield a, b, tmp_path


async def until(cond: object, what: str = "") -> None:
    async with asyncio.timeout(10):
        while not cond():  # type: ignore[operator]
            await asyncio.sleep(0.002)


def listen(*workers: Worker) -> None:
    for w in workers:
        w.share.listen(w.queue.notify)


def close(*workers: Worker) -> None:
    for w in workers:
        w.share.close()


@pytest.mark.anyio
async def test_budget_is_one_for_both_workers_and_a_release_wakes_the_other(board_files) -> None:  # type: ignore[no-untyped-def]
    a, b, run_dir = board_files
    wa, wb = make_worker(a, run_dir, 0, budget=1000), make_worker(b, run_dir, 1, budget=1000)
    listen(wa, wb)
    try:
        async with AsyncExitStack() as stack:
            first = await stack.enter_async_context(wa.queue.slot(600, 601))
            assert wb.ledger.inflight_tokens(P) == 600 and not wb.ledger.has_room(P, 600)
            small = await stack.enter_async_context(wb.queue.slot(400, 401))   # 600 + 400 = the budget: fits
            assert wa.ledger.inflight_tokens(P) == 1000
            waiter = asyncio.ensure_future(stack.enter_async_context(wb.queue.slot(300, 301)))
            await until(lambda: b.waiting(1) == 1, "worker 1's waiter published")
            assert wb.queue.stats.granted_total == 1 and not waiter.done()
            first.prefill_done()                     # worker 0's release: only worker 1's FIFO can tell it
            third = await asyncio.wait_for(waiter, 5)   # far below the 60 s poll
            assert third.endpoint == P and wb.share.wake.received >= 1 and wa.share.wake.sent >= 1
            assert wa.ledger.inflight_tokens(P) == 700
            small.release()
            third.release()
        assert wa.ledger.inflight_tokens(P) == 0 and wa.ledger.idle() and wb.ledger.idle()
        assert a.waiting(0) == a.waiting(1) == 0
    finally:
        close(wa, wb)


@pytest.mark.anyio
async def test_a_grant_rechecks_the_room_under_the_lock(board_files) -> None:  # type: ignore[no-untyped-def]
    a, b, run_dir = board_files
    wa, wb = make_worker(a, run_dir, 0, budget=1000), make_worker(b, run_dir, 1, budget=1000)
    held = wa.ledger.hold(P, 500, 501)
    assert wa.ledger.has_room(P, 400) and wb.ledger.has_room(P, 400)   # both see room for 400 at one instant …
    won = wb.ledger.try_hold(P, 400, 401)        # … worker 1 publishes first
    assert won is not None
    assert wa.ledger.try_hold(P, 400, 401) is None   # worker 0's re-check sees it: 500 + 400 + 400 > 1000
    assert wa.ledger.inflight_tokens(P) == 900
    won.release()
    held.release()
    assert wa.ledger.idle() and wb.ledger.idle() and wa.ledger.inflight_tokens(P) == 0


@pytest.mark.anyio
async def test_kv_pool_and_decoder_reservation_are_one_for_both(board_files) -> None:  # type: ignore[no-untyped-def]
    a, b, run_dir = board_files
    wa = make_worker(a, run_dir, 0, budget=32768, p_blocks=19, decoder_kv=5000)
    wb = make_worker(b, run_dir, 1, budget=32768, p_blocks=19, decoder_kv=5000)
    slot = wa.ledger.hold(P, 2000, 2001)
    with wa.pool.lease(P, 2000):
        slot.handed_over()
        slot.prefill_done()                      # answered, KV pinned by worker 0's lease
        assert wb.ledger.kv_held_tokens(P) == 16 * 128
        assert not wb.ledger.has_room(P, 2000) and wb.ledger.has_room(P, 100)   # 16 + 16 blocks > 18 (19 less the null block); 16 + 1 fit
        assert wb.ledger.pending_decode == 2001 and not wb.ledger.decode_room(3000)   # 5000 − 2001 < 3000
        slot.decode_started()
    assert wb.ledger.has_room(P, 2000) and wb.ledger.decode_room(3000) and wa.ledger.idle()


@pytest.mark.anyio
async def test_waiters_keep_one_order_across_workers(board_files) -> None:  # type: ignore[no-untyped-def]
    """Worker 0's blocked 900-token prompt goes before worker 1's 950 when worker 1 frees the room, though worker 1's
    own re-check runs first and would take it; a smaller prompt on worker 1 still goes ahead of both (smallest
    first, everywhere)."""
    a, b, run_dir = board_files
    wa, wb = make_worker(a, run_dir, 0, budget=1000), make_worker(b, run_dir, 1, budget=1000)
    listen(wa, wb)
    order: list[str] = []
    try:
        async with AsyncExitStack() as stack:
            busy = await stack.enter_async_context(wb.queue.slot(500, 501))

            async def ask(w: Worker, name: str, tokens: int) -> None:
                async with w.queue.slot(tokens, tokens + 1) as s:
                    order.append(name)
                    s.prefill_done()

            big0 = asyncio.ensure_future(ask(wa, "w0:900", 900))
            await until(lambda: a.waiting(0) == 1)
            big1 = asyncio.ensure_future(ask(wb, "w1:950", 950))
            await until(lambda: a.waiting(1) == 1)
            await ask(wb, "w1:100", 100)                   # fits next to the 500 and is the smallest key
            assert order == ["w1:100"]
            busy.prefill_done()      # worker 1 frees room for one of them: worker 0's, whose key is smaller
            await asyncio.wait_for(asyncio.gather(big0, big1), 5)
            assert order == ["w1:100", "w0:900", "w1:950"]
    finally:
        close(wa, wb)


def test_breaker_opened_by_one_worker_is_open_for_both_and_admits_one_trial(board_files) -> None:  # type: ignore[no-untyped-def]
    a, b, run_dir = board_files
    clock = Clock()
    wa = make_worker(a, run_dir, 0, budget=0, clock=clock, prefillers=(P, P1))
    wb = make_worker(b, run_dir, 1, budget=0, clock=clock, prefillers=(P, P1))
    ba, bb = wa.health.breakers[P], wb.health.breakers[P]
    assert isinstance(ba, BoardBreaker) and isinstance(bb, BoardBreaker)
    wa.health.record_failure(P)                              # threshold 1: worker 0 opens it
    assert bb.state is BreakerState.OPEN and not wb.health.can_take(P)
    picks = {wb.scheduler.pick(Role.PREFILL, PickRequest(f"r{i}")) for i in range(20)}
    assert picks == {P1}                                     # worker 1 never tries the dead engine
    clock.now += 2.0                                         # the open period is over: one trial, in all
    assert wa.health.can_take(P) and wb.health.can_take(P)
    assert wb.health.on_pick(P)                              # worker 1 takes it …
    assert not wa.health.can_take(P) and not wa.health.on_pick(P)   # … so worker 0 may not
    only_p = PickRequest("x", model=None)
    wa.pool.load(P1).draining = True
    with pytest.raises(NoEndpointAvailable, match="circuit breaker"):
        wa.scheduler.pick(Role.PREFILL, only_p)               # 503: the one trial is out
    wb.health.record_neutral(P)                              # worker 1's trial ended without a verdict
    assert wa.scheduler.pick(Role.PREFILL, only_p) == P       # worker 0 takes the trial now
    wa.health.record_success(P)
    assert bb.state is BreakerState.CLOSED and bb.opened_total == 1 and wb.health.snapshot(P).breaker == "closed"


def test_a_dead_workers_row_gives_back_its_reservations_and_trials(board_files) -> None:  # type: ignore[no-untyped-def]
    a, b, run_dir = board_files
    clock = Clock()
    wa = make_worker(a, run_dir, 0, budget=1000, clock=clock)
    wb = make_worker(b, run_dir, 1, budget=1000, clock=clock)
    wb.ledger.hold(P, 900, 901)                              # worker 1 dies holding a slot …
    wb.health.record_failure(P)
    clock.now += 2.0
    assert wb.health.on_pick(P)                              # … and the half-open trial
    assert not wa.ledger.has_room(P, 200) and not wa.health.can_take(P)
    a.clear(1)                                               # what the supervisor does
    assert wa.ledger.has_room(P, 200) and wa.ledger.pending_decode == 0
    assert wa.health.can_take(P) and wa.health.on_pick(P)    # the trial is free again, still half-open
    assert wa.health.breakers[P].state is BreakerState.HALF_OPEN


def test_a_lost_trial_of_one_worker_frees_the_slot_for_every_worker(board_files) -> None:  # type: ignore[no-untyped-def]
    a, b, run_dir = board_files
    clock = Clock()
    wa = make_worker(a, run_dir, 0, budget=1000, clock=clock)
    wb = make_worker(b, run_dir, 1, budget=1000, clock=clock)
    wb.health.record_failure(P)
    clock.now += 2.0
    assert wb.health.on_pick(P)                              # worker 1's trial, never given a verdict
    trial_timeout_s = wa.health.breakers[P].trial_timeout_s
    clock.now += trial_timeout_s - 0.1
    assert not wa.health.can_take(P) and not wa.health.on_pick(P)
    clock.now += 0.1
    assert wa.health.can_take(P) and wa.health.on_pick(P)    # taken for lost: worker 0's trial now
    assert not wb.health.can_take(P)                         # one trial in all, still
    wb.health.record_neutral(P)                              # the lost trial's late end frees its own slot only
    assert not wb.health.can_take(P) and not wa.health.can_take(P)
    wa.health.record_success(P)
    assert wb.health.breakers[P].state is BreakerState.CLOSED


# --- two real processes granting at once ------------------------------------------------------------------------
BUDGET = 1000


def _hammer(path: str, run_dir: str, row: int, rounds: int, seed: int) -> int:
    """Grant and release random prompts ``rounds`` times (room read without the lock, then a grant that re-checks
    only if another grant happened since: the queue's way); after every attempt read the all-worker total and
    return the largest seen (it must never exceed BUDGET)."""
    import random

    rng = random.Random(seed)
    with LoadBoard.attach(Path(path), ENDPOINTS, 2) as board:
        w = make_worker(board, Path(run_dir), row, budget=BUDGET)
        held = []
        worst = 0
        for _ in range(rounds):
            if held and rng.random() < 0.5:
                held.pop(rng.randrange(len(held))).release()
                continue
            size = rng.randrange(50, 400)
            epoch = w.ledger.counts.epoch()           # as the queue does: the epoch, then the room, then the grant
            if not w.ledger.has_room(P, size):
                continue
            slot = w.ledger.try_hold(P, size, 1, epoch)
            if slot is not None:
                held.append(slot)
            worst = max(worst, w.ledger.inflight_tokens(P))
        for slot in held:
            slot.release()
        w.share.close()
        return worst


def test_two_processes_granting_at_once_never_overshoot(tmp_path: Path) -> None:
    path = tmp_path / "load.board"
    create_fifos(tmp_path, 2)
    with LoadBoard.create(path, ENDPOINTS, rows=2) as board:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(2) as procs:
            results = procs.starmap(_hammer, [(str(path), str(tmp_path), r, 20_000, r) for r in range(2)])
        assert max(results) <= BUDGET and min(results) > BUDGET // 2    # busy, never over
        assert board.cells[GRANT_EPOCH] > 1000                          # and granting a lot
        assert board.cells[board.cell(0, 0, INFLIGHT_TOKENS)] == board.cells[board.cell(1, 0, INFLIGHT_TOKENS)] == 0
