"""What ``pdproxy serve --workers N`` costs: the shared prefill ledger and breakers per request, and events per
CPU-second per worker with 2 workers against 1.

Run: ``python -m loadtest.workers_bench [--part sharing|serve ...] [--out FILE]``.  Prints one JSON document.

- ``sharing`` (one process, no sockets): the per-request sequence of the state the workers share — the prefill
  queue's grant (scheduler pick with the breaker and room filters, the ledger's re-check and reservation inside the
  board's ``flock``), the prefill lease and its release, the slot's two releases (each telling the release
  listeners, which read the other workers' ``waiting`` cells), the decoder pick and lease, the breakers'
  ``record_success`` — timed over many iterations with the per-process components (``single``), with the
  board-backed ones and an idle second worker (``shared``), and with a second worker that has a waiter, so every
  release also writes a wake-up byte into its FIFO (``shared_waking``).  The uncontended ``flock`` pair alone is
  timed too.  Figures are µs per request (median of ``--repeats`` runs), and the differences against ``single``.
- ``wake`` (two processes on one board): the time from worker 0 giving back prefill budget to worker 1's waiting
  request being granted, with the FIFO wake-up (:mod:`pdproxy.workers.wakeup`) and with the queue's poll alone (p50/p99).
- ``serve`` (processes, unpinned, the whole process tree's CPU over each window): ``pdproxy serve --workers 1``
  and ``--workers 2`` in front of two ``loadtest.fake_engine`` engines, closed loops from ``loadtest.loadgen``:
  paced streams (an event every 20 ms), full-speed streams and 1-token PD requests; reports events (or requests) per CPU-second of the whole proxy tree, per
  worker process (each worker's own CPU), and each worker's share of the CPU.  On a 2-core machine the engines and
  the generator share the cores with the workers: this shows the cost per event of the multi-worker mode, not
  scaling.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest import fleet, procstat, report


# --- sharing: the per-request sequence in one process ---------------------------------------------------------
def _components(kind: str, run_dir: Path) -> tuple[Callable[[], Any], Callable[[], None]]:
    """A ``one_request`` coroutine factory for the ``kind`` of state, and a cleanup."""
    from pdproxy.endpoints import Endpoint, Role
    from pdproxy.engines.control import EngineClient, EngineInfo
    from pdproxy.engines.health import HealthMonitor
    from pdproxy.engines.limits import Limits
    from pdproxy.engines.pool import EndpointPool
    from pdproxy.scheduling import PickRequest, Scheduler
    from pdproxy.scheduling.queue import PrefillLedger, PrefillQueue
    from pdproxy.workers.board import WAITING, LoadBoard
    from pdproxy.workers.share import WorkerShare
    from pdproxy.workers.wakeup import WakeChannels, create_fifos

    endpoints = [Endpoint("http://p0:1", Role.PREFILL), Endpoint("http://d0:1", Role.DECODE),
                 Endpoint("http://d1:1", Role.DECODE)]
    infos = {e: EngineInfo(max_model_len=131072, kv_pool_tokens=200_000, num_gpu_blocks=12500, block_size=16)
             for e in endpoints}
    closers: list[Callable[[], None]] = []
    share = None
    wake_fd: int | None = None
    if kind == "single":
        pool: EndpointPool = EndpointPool(endpoints)
    elif kind == "board_pool":                                   # the load board's pool alone (leases shared)
        board = LoadBoard.create(run_dir / "load.board", endpoints, 2)
        closers.append(board.close)
        pool = board.pool(endpoints, 0)
    else:
        create_fifos(run_dir, 2)
        board = LoadBoard.create(run_dir / "load.board", endpoints, 2)
        closers.append(board.close)
        share = WorkerShare(board, 0, WakeChannels(run_dir, 2, 0))
        closers.insert(0, share.close)
        pool = share.pool(endpoints)
        if kind == "shared_waking":
            board.cells[board.row_cell(1, WAITING)] = 1            # the other worker has a waiter …
            wake_fd = os.open(run_dir / "wake.1", os.O_RDWR | os.O_NONBLOCK)   # … and its end of its FIFO
            closers.insert(0, lambda: os.close(wake_fd))           # type: ignore[arg-type]

    def drain() -> None:                                         # what the woken worker's loop would read
        if wake_fd is not None:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_fd, 1 << 16)
    limits = Limits(pool, infos)
    health = HealthMonitor(pool, EngineClient(timeout_s=1.0), infos, interval_s=60, refresh_interval_s=60,
                           make_breaker=share.make_breaker if share is not None else None)
    ledger = PrefillLedger(pool, limits, budget_tokens=32768,
                           counts=share.ledger_counts() if share is not None else None)
    scheduler = Scheduler.standard(pool, health=health, infos=infos, limits=limits, ledger=ledger)
    queue = PrefillQueue(ledger, scheduler, max_waiting=100, timeout_s=10, aging_tokens_per_s=8192,
                         busy_tokens=8192)
    if share is not None:
        share.connect(pool, ledger)
    tokens = 1000

    async def one_request(i: int) -> None:
        pick = PickRequest(request_id=f"r{i}", prompt_tokens=tokens, max_output_tokens=16)
        async with queue.slot(tokens, tokens + 1, request=pick) as slot:
            with pool.lease(slot.endpoint, tokens) as prefill_lease:
                slot.handed_over()
                slot.prefill_done()
                health.record_success(slot.endpoint)
                decoder = scheduler.pick(Role.DECODE, pick)
                with pool.lease(decoder, tokens + 16):
                    slot.decode_started()
                    prefill_lease.release()
                health.record_success(decoder)

    def cleanup() -> None:
        for close in closers:
            close()

    async def run(n: int) -> float:
        for i in range(200):
            await one_request(i)
        drain()
        t0 = time.thread_time()                                  # this thread's CPU: robust to a busy machine
        for i in range(n):
            await one_request(i)
            if i % 1000 == 999:
                drain()
        return (time.thread_time() - t0) / n * 1e6

    return run, cleanup


def flock_pair_us(n: int = 200_000) -> float:
    """µs per uncontended ``flock(LOCK_EX)`` + ``flock(LOCK_UN)`` on a file in /dev/shm (or /tmp)."""
    import fcntl

    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.NamedTemporaryFile(dir=base) as f:
        fd = f.fileno()
        t0 = time.perf_counter()
        for _ in range(n):
            fcntl.flock(fd, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_UN)
        return (time.perf_counter() - t0) / n * 1e6


def sharing(iterations: int, repeats: int) -> dict[str, Any]:
    """µs per request of the shared state's per-request sequence (see module docstring)."""
    out: dict[str, Any] = {"iterations": iterations, "repeats": repeats, "clock": "thread CPU time"}
    kinds = ("single", "board_pool", "shared", "shared_waking")
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(repeats):                                      # round robin: load changes hit every kind
        for kind in kinds:
            with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
                run, cleanup = _components(kind, Path(d))
                try:
                    runs[kind].append(asyncio.run(run(iterations)))
                finally:
                    cleanup()
    for kind in kinds:
        out[f"{kind}_us_per_request"] = round(statistics.median(runs[kind]), 2)
        out[f"{kind}_runs"] = [round(r, 2) for r in runs[kind]]
    out["shared_extra_us_per_request"] = round(out["shared_us_per_request"] - out["single_us_per_request"], 2)
    out["ledger_and_breakers_extra_us_per_request"] = round(out["shared_us_per_request"]
                                                            - out["board_pool_us_per_request"], 2)
    out["waking_extra_us_per_request"] = round(out["shared_waking_us_per_request"]
                                               - out["shared_us_per_request"], 2)
    out["flock_pair_us"] = round(flock_pair_us(), 3)
    return out


# --- wake: another worker's release to this worker's grant, across processes -----------------------------------
def _wake_endpoints() -> list[Any]:
    from pdproxy.endpoints import Endpoint, Role

    return [Endpoint("http://p0:1", Role.PREFILL), Endpoint("http://d0:1", Role.DECODE)]


def _ledger(share: Any) -> Any:
    from pdproxy.engines.control import EngineInfo
    from pdproxy.engines.limits import Limits
    from pdproxy.scheduling.queue import PrefillLedger

    pool = share.pool(_wake_endpoints())
    infos = {e: EngineInfo(max_model_len=131072) for e in _wake_endpoints()}
    return PrefillLedger(pool, Limits(pool, infos), budget_tokens=1000, counts=share.ledger_counts())


def _waiter_process(run_dir: str, rounds: int, listen: bool, conn: Any) -> None:
    """Worker 1: each round, ask for a 600-token slot (it waits: worker 0 holds 600 of 1,000), send back the
    monotonic time of the grant, give the slot back."""
    from pdproxy.scheduling import Scheduler
    from pdproxy.scheduling.queue import PrefillQueue
    from pdproxy.workers.board import LoadBoard
    from pdproxy.workers.share import WorkerShare
    from pdproxy.workers.wakeup import WakeChannels

    async def main() -> None:
        with LoadBoard.attach(Path(run_dir) / "load.board", _wake_endpoints(), 2) as board:
            share = WorkerShare(board, 1, WakeChannels(Path(run_dir), 2, 1))
            ledger = _ledger(share)
            queue = PrefillQueue(ledger, Scheduler.standard(ledger.pool, ledger=ledger), max_waiting=10,
                                 timeout_s=30, aging_tokens_per_s=0, busy_tokens=8192)
            share.connect(ledger.pool, ledger)
            if listen:
                share.listen(queue.notify)
            loop = asyncio.get_running_loop()
            for _ in range(rounds):
                await loop.run_in_executor(None, conn.recv)              # worker 0 holds its slot now
                async with queue.slot(600, 601):
                    conn.send(time.monotonic())
            share.close()

    asyncio.run(main())


def wake(rounds: int) -> dict[str, Any]:
    """Latency from worker 0's release to worker 1's grant (separate processes, one machine), with the FIFO
    wake-up and with the queue's poll alone; plus the CPU of one wake-up write."""
    import multiprocessing

    from pdproxy.workers.board import WAITING, LoadBoard
    from pdproxy.workers.share import WorkerShare
    from pdproxy.workers.wakeup import WakeChannels, create_fifos

    out: dict[str, Any] = {"rounds": rounds}
    ctx = multiprocessing.get_context("spawn")
    for mode, listen, n in (("fifo", True, rounds), ("poll_only", False, max(8, rounds // 25))):
        with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
            create_fifos(Path(d), 2)
            with LoadBoard.create(Path(d) / "load.board", _wake_endpoints(), 2) as board:
                share = WorkerShare(board, 0, WakeChannels(Path(d), 2, 0))
                ledger = _ledger(share)
                share.connect(ledger.pool, ledger)
                mine, theirs = ctx.Pipe()
                child = ctx.Process(target=_waiter_process, args=(d, n, listen, theirs))
                child.start()
                lat = []
                waiting = board.row_cell(1, WAITING)
                for _ in range(n):
                    slot = ledger.hold(_wake_endpoints()[0], 600, 601)
                    mine.send(True)
                    while board.cells[waiting] == 0:                    # worker 1's waiter is published
                        time.sleep(0.0002)
                    t0 = time.monotonic()
                    slot.release()                                      # tells worker 1 through its FIFO
                    lat.append(mine.recv() - t0)
                child.join(30)
                share.close()
        lat.sort()
        out[mode] = {"rounds": n, "p50_ms": round(lat[len(lat) // 2] * 1e3, 3),
                     "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3, 3),
                     "max_ms": round(lat[-1] * 1e3, 3)}
    return out


# --- serve: real processes -----------------------------------------------------------------------------------
PDPROXY = ("{python} -m pdproxy serve --host 127.0.0.1 --port {port} --prefill {prefill} --decode {decode} "
           "--log-level warning --no-request-log")


def SCENARIOS(streams: int, tokens: int) -> tuple[tuple[str, int, int, float], ...]:
    """``(name, events per stream, concurrent streams, engine inter-token seconds)`` of the ``serve`` part."""
    return (("paced", tokens, 2 * streams, 0.02),      # decode's real shape: one event per step per sequence
            ("full_speed", tokens, streams, 0.0),
            ("pd_requests", 1, streams, 0.0))          # 1-token streams: per-request cost


def _worker_pids(root: int) -> list[int]:
    """The spawned worker processes of a ``--workers N`` supervisor (its children running ``spawn_main``)."""
    out = []
    for pid in procstat.children_map().get(root, []):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
    return sorted(out)


def _all_ready(url: str, workers: int) -> bool:
    try:
        body = httpx.get(url + "/debug/load", timeout=2).json()
    except (httpx.HTTPError, ValueError):
        return False
    rows = body.get("workers")
    if workers == 1:
        return True
    if rows is not None:
        return len(rows) == workers and all(r["ready"] for r in rows)
    try:                                 # a pdproxy without /debug/load rows: every worker's gauge is exported
        text = httpx.get(url + "/metrics", timeout=2).text
    except httpx.HTTPError:
        return False
    return text.count("pdproxy_worker_inflight_requests{") == workers


def serve(window_s: float, windows: int, warmup_s: float, streams: int, tokens: int) -> dict[str, Any]:
    """Full-speed streams and 1-token PD requests through ``--workers 1`` and ``--workers 2`` (unpinned)."""
    out: dict[str, Any] = {"machine": procstat.describe_machine(), "window_s": window_s, "windows": windows,
                           "warmup_s": warmup_s, "streams": streams, "tokens_per_stream": tokens}
    prefiller, decoder = fleet.fake_engine("wb-prefill", None), fleet.fake_engine("wb-decode", None)
    with prefiller, decoder:
        for workers in (1, 2):
            child = fleet.proxy_child(f"wb-w{workers}", PDPROXY + f" --workers {workers}",
                                      prefiller.url, decoder.url, None)   # type: ignore[attr-defined]
            with child:
                deadline = time.monotonic() + 30
                while not _all_ready(child.url, workers):               # type: ignore[attr-defined]
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{workers} workers not ready: {child.log_tail()}")
                    time.sleep(0.1)
                wpids = _worker_pids(child.pid) if workers > 1 else [child.pid]
                cpu_pids: dict[str, list[int]] = {"proxy": [child.pid],
                                                  "engines": [prefiller.pid, decoder.pid]}
                for k, pid in enumerate(wpids):
                    cpu_pids[f"w{k}"] = [pid]
                for scenario, n_tokens, concurrency, itl_s in SCENARIOS(streams, tokens):
                    for url in (prefiller.url, decoder.url):   # type: ignore[attr-defined]
                        fleet.configure_engine(url, itl_s=itl_s, ttft_s=0.0, prefill_s=0.0)
                    spec = {"mode": "proxy", "target": child.url,              # type: ignore[attr-defined]
                            "prefill": prefiller.url, "decode": decoder.url,   # type: ignore[attr-defined]
                            "max_tokens": n_tokens, "arrival": {"kind": "closed", "concurrency": concurrency},
                            "stall_gap_s": 5.0, "warmup_s": warmup_s, "windows": windows, "window_s": window_s,
                            "cpu_pids": cpu_pids}
                    ws = fleet.run_loadgen(spec, None, 120 + warmup_s + 2 * windows * window_s)["windows"]
                    s = report.summarize(ws, "proxy")
                    per_worker = [statistics.median(w["cpu_s"][f"w{k}"] for w in ws) for k in range(len(wpids))]
                    worker_cpu = [statistics.median(sum(w["cpu_s"][f"w{k}"] for k in range(len(wpids)))
                                                    / w["wall_s"] for w in ws)]
                    unit = "requests" if scenario == "pd_requests" else "events"
                    per_s = s["events_per_s"] if unit == "events" else s["requests_per_s"]
                    tree = statistics.median(w["cpu_s"]["proxy"] / w["wall_s"] for w in ws)
                    out[f"workers_{workers}_{scenario}"] = {
                        f"{unit}_per_s": per_s, "errors": s["errors"], "stalls": s["stalls"],
                        f"{unit}_per_cpu_s_tree": round(per_s / tree) if tree else None,
                        f"{unit}_per_cpu_s_per_worker": round(per_s / worker_cpu[0]) if worker_cpu[0] else None,
                        "worker_cpu_share": [round(c / sum(per_worker), 3) for c in per_worker] if sum(per_worker)
                        else None,
                        "tree_cpu_frac": round(tree, 3), "workers_cpu_frac": round(worker_cpu[0], 3),
                        "proxy_us_per_event": s["proxy_us_per_event"],
                        "proxy_us_per_request": s["proxy_us_per_request"],
                        "others_cpu_frac": s["others_cpu_frac"], "loadgen_cpu_frac": s["loadgen_cpu_frac"]}
    for scenario, unit in (("paced", "events"), ("full_speed", "events"), ("pd_requests", "requests")):
        one = out[f"workers_1_{scenario}"][f"{unit}_per_cpu_s_per_worker"]
        two = out[f"workers_2_{scenario}"][f"{unit}_per_cpu_s_per_worker"]
        out[f"{scenario}_per_cpu_s_ratio_2_vs_1"] = round(two / one, 3) if one and two else None
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", nargs="+", choices=["sharing", "wake", "serve"], default=["sharing", "wake", "serve"])
    ap.add_argument("--wake-rounds", type=int, default=200)
    ap.add_argument("--iterations", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--window-s", type=float, default=5.0)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    result: dict[str, Any] = {}
    if "sharing" in args.part:
        result["sharing"] = sharing(args.iterations, args.repeats)
    if "wake" in args.part:
        result["wake"] = wake(args.wake_rounds)
    if "serve" in args.part:
        result["serve"] = serve(args.window_s, args.windows, args.warmup_s, args.streams, args.tokens)
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
