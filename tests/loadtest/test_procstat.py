"""loadtest/procstat.py's scheduling figures: where a process tree's time went (its busiest thread on a CPU, its
threads waiting for one), read from the kernel's per-thread schedstat."""

from __future__ import annotations

import os
import threading
import time

import pytest

from loadtest.procstat import sched_figures, thread_schedstats

pytestmark = pytest.mark.timeout(30)


def test_sched_figures_take_the_busiest_thread_and_sum_the_waits() -> None:
    before = {1: (1_000_000_000, 5_000_000), 2: (0, 0), 3: (7, 7)}
    after = {1: (1_900_000_000, 25_000_000), 2: (300_000_000, 100_000_000), 4: (400_000_000, 80_000_000)}
    # thread 1 ran 0.9 s of 1 s; thread 4 started meanwhile (counted from 0); thread 3 ended (left out)
    assert sched_figures(before, after, 1.0) == {"busiest_thread_cpu_frac": 0.9, "run_queue_wait_frac": 0.2}


def test_a_spinning_thread_is_read_as_the_busiest() -> None:
    done, read = threading.Event(), threading.Event()
    spun: list[float] = []

    def spin() -> None:
        start = time.thread_time()
        while time.thread_time() - start < 0.2:     # 0.2 s of this thread's own CPU time, however long that takes
            pass
        spun.append(time.thread_time() - start)
        done.set()
        read.wait(20)                                   # alive until its stats are read

    before = thread_schedstats([os.getpid()])
    t0 = time.monotonic()
    worker = threading.Thread(target=spin)
    worker.start()
    assert done.wait(20)
    after = thread_schedstats([os.getpid()])
    read.set()
    worker.join()
    assert worker.native_id in after and worker.native_id not in before
    on_cpu_s = after[worker.native_id][0] / 1e9
    assert on_cpu_s == pytest.approx(spun[0], abs=0.05)
    figures = sched_figures(before, after, time.monotonic() - t0)
    assert figures["busiest_thread_cpu_frac"] >= on_cpu_s / (time.monotonic() - t0) - 0.01 > 0.0
    assert thread_schedstats([2**22 + 12345]) == {}                     # a process that is gone: nothing
