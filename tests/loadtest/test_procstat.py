"""loadtest/procstat.py's scheduling figures: where a process tree's time went (its busiest thread on a CPU, its
threads waiting for one), read from the kernel's per-thread schedstat."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from loadtest.procstat import sched_figures, thread_schedstats

pytestmark = pytest.mark.timeout(30)


def test_sched_figures_take_the_busiest_thread_and_sum_the_waits() -> None:
    before = {1: (1_000_000_000, 5_000_000), 2: (0, 0), 3: (7, 7)}
    after = {1: (1_987_000_000, 25_000_000), 2: (300_000_000, 111_000_000), 4: (400_000_000, 80_000_000)}
    # thread 1 ran 0.987 s of 1 s; thread 4 started meanwhile (counted from 0); thread 3 ended (counts nothing)
    assert sched_figures(before, after, 1.0) == {"busiest_thread_cpu_frac": 0.987, "run_queue_wait_frac": 0.211}
    halved = sched_figures(before, after, 2.0)                       # the same over twice the wall time
    assert halved["busiest_thread_cpu_frac"] == pytest.approx(0.4935, abs=0.001)
    assert halved["run_queue_wait_frac"] == pytest.approx(0.1055, abs=0.001)


def test_a_reused_thread_id_counts_from_zero_and_no_schedstat_reads_as_none() -> None:
    before = {5: (9_000_000_000, 4_000_000_000)}      # a long-lived thread that ended; its id then reused
    after = {5: (200_000_000, 50_000_000)}
    assert sched_figures(before, after, 1.0) == {"busiest_thread_cpu_frac": 0.2, "run_queue_wait_frac": 0.05}
    assert sched_figures(before, {}, 1.0) == {"busiest_thread_cpu_frac": None, "run_queue_wait_frac": None}


def test_a_spinning_thread_is_read_as_the_busiest() -> None:
    if not os.path.exists(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/schedstat"):
        pytest.skip("this kernel keeps no per-thread schedstat")
    done, read = threading.Event(), threading.Event()
    spun: list[float] = []

    def spin() -> None:
        try:
            start = time.thread_time()
            while time.thread_time() - start < 0.2:   # 0.2 s of this thread's own CPU time, however long that takes
                pass
            spun.append(time.thread_time() - start)
            done.set()
        finally:
            read.wait(20)                            # alive until its stats are read

    before = thread_schedstats([os.getpid()])
    t0 = time.monotonic()
    worker = threading.Thread(target=spin, daemon=True)
    worker.start()
    try:
        assert done.wait(20)
        after = thread_schedstats([os.getpid()])
        wall = time.monotonic() - t0
    finally:
        read.set()
    worker.join(5)
    assert worker.native_id in after and worker.native_id not in before
    on_cpu_s = after[worker.native_id][0] / 1e9
    assert on_cpu_s == pytest.approx(spun[0], abs=0.05)
    busiest = sched_figures(before, after, wall)["busiest_thread_cpu_frac"]
    assert busiest is not None and busiest >= round(on_cpu_s / wall, 3) > 0.0
    assert thread_schedstats([2**22 + 12345]) == {}                     # a process that is gone: nothing


@pytest.mark.timeout(60)
def test_a_batch_run_reports_each_group_s_scheduling_figures() -> None:
    """``loadgen.run_batch`` reads every group's threads before the first request and when the last answer is in:
    an engine that served the run shows time on a CPU; a group whose process is gone shows None."""
    from loadtest import fleet
    from loadtest.loadgen import run_batch

    with fleet.fake_engine("sched-engine", None) as engine:
        fleet.configure_engine(engine.url, itl_s=0.0, ttft_s=0.0, prefill_s=0.0)   # type: ignore[attr-defined]
        spec = {"mode": "direct", "decode": engine.url, "prefill": engine.url,       # type: ignore[attr-defined]
                "max_tokens": 64, "arrival": {"kind": "closed_n", "concurrency": 8, "n": 400},
                "api": "completions", "cpu_pids": {"engine": [engine.pid], "gone": [2**22 + 12345]}}
        out = asyncio.run(run_batch(spec))
    window = out["windows"][0]
    assert window["errors"] == 0 and window["requests"] == 400
    engine_sched = window["sched"]["engine"]
    assert engine_sched["busiest_thread_cpu_frac"] is not None and engine_sched["busiest_thread_cpu_frac"] > 0.0
    assert engine_sched["busiest_thread_cpu_frac"] <= 1.0 and engine_sched["run_queue_wait_frac"] >= 0.0
    assert window["sched"]["gone"] == {"busiest_thread_cpu_frac": None, "run_queue_wait_frac": None}
