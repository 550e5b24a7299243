"""Process CPU and memory from ``/proc`` (Linux), and a description of the machine.

CPU is read from ``/proc/PID/task/TID/schedstat`` (first field: nanoseconds on CPU, per thread, summed over every
thread of the process — a multi-threaded proxy such as a Rust router is counted whole), falling back to
``utime + stime`` clock ticks of ``/proc/PID/stat``.  Processes are given as root pids; their descendants
(uvicorn ``--workers`` children) are included.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Iterable
from pathlib import Path

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def children_map() -> dict[int, list[int]]:
    """``{ppid: [pid, ...]}`` for every process visible in /proc."""
    out: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def process_tree(roots: Iterable[int]) -> list[int]:
    """The root pids and all their descendants (pids that have exited are skipped later, not here)."""
    kids = children_map()
    seen: list[int] = []
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        todo.extend(kids.get(pid, []))
    return seen


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by every thread of ``pid``; 0.0 if it is gone."""
    total_ns = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    try:
        for tid in tasks:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total_ns += int(f.read().split()[0])
        return total_ns / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * _TICK_S
    except (OSError, ValueError, IndexError):
        return 0.0


def tree_cpu_seconds(pids: Iterable[int]) -> float:
    """Sum of :func:`cpu_seconds` over ``pids``."""
    return sum(cpu_seconds(p) for p in pids)


def stat_cpu_seconds(pid: int) -> float:
    """``utime + stime + cutime + cstime`` of ``pid`` (``/proc/PID/stat``, clock ticks → seconds): its threads,
    live or exited, and its children already reaped; 0.0 if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return sum(int(fields[i]) for i in (11, 12, 13, 14)) * _TICK_S
    except (OSError, ValueError, IndexError):
        return 0.0


def tree_stat_cpu_seconds(pids: Iterable[int]) -> float:
    """Sum of :func:`stat_cpu_seconds` over ``pids`` (a whole process tree: the users' way of counting)."""
    return sum(stat_cpu_seconds(p) for p in pids)


def thread_schedstats(pids: Iterable[int]) -> dict[int, tuple[int, int]]:
    """Each live thread of ``pids``: thread id → (nanoseconds on a CPU, nanoseconds runnable but waiting for one)
    so far (``/proc/PID/task/TID/schedstat`` fields 1 and 2; the kernel's run-queue delay).  Threads that vanish
    while read are left out."""
    out: dict[int, tuple[int, int]] = {}
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    on_cpu, waiting = f.read().split()[:2]
                out[int(tid)] = (int(on_cpu), int(waiting))
            except (OSError, ValueError):
                continue
    return out


def sched_figures(before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]],
                  wall_s: float) -> dict[str, float | None]:
    """Where a process tree's time went between two :func:`thread_schedstats` reads ``wall_s`` seconds apart:
    ``busiest_thread_cpu_frac`` — the busiest thread's share of the wall time on a CPU (near 1.0: that thread is
    the bottleneck, e.g. a saturated event loop); ``run_queue_wait_frac`` — threads' worth of time spent runnable
    but waiting for a CPU (the machine's cores are the bottleneck).  Threads started meanwhile count from 0, and so
    does a thread id the kernel reused (its counters below the earlier ones); threads that ended meanwhile are not
    in ``after`` and count nothing.  Both None when ``after`` is empty (a kernel without per-thread schedstat, or
    the tree gone)."""
    if not after:
        return {"busiest_thread_cpu_frac": None, "run_queue_wait_frac": None}
    busiest = waiting = 0
    for tid, (on_cpu, wait) in after.items():
        on0, wait0 = before.get(tid, (0, 0))
        if on_cpu < on0 or wait < wait0:             # another thread under a reused id: its counters from 0
            on0 = wait0 = 0
        busiest = max(busiest, on_cpu - on0)
        waiting += wait - wait0
    wall_ns = max(wall_s, 1e-9) * 1e9
    return {"busiest_thread_cpu_frac": round(busiest / wall_ns, 3), "run_queue_wait_frac": round(waiting / wall_ns, 3)}


def machine_busy_seconds() -> float:
    """CPU seconds all CPUs spent not idle since boot (``/proc/stat``: user+nice+system+irq+softirq+steal)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()[1:9]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields)
    return (user + nice + system + irq + softirq + steal) * _TICK_S


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (``VmRSS``); 0 if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def tree_rss_bytes(pids: Iterable[int]) -> int:
    """Sum of :func:`rss_bytes` over ``pids`` (bytes)."""
    return sum(rss_bytes(p) for p in pids)


def _package_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def describe_machine() -> dict[str, object]:
    """CPU model, core count, memory, kernel, Python and the hot-path package versions."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kb = 0
    try:
        mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent.parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        git = None
    return {
        "cpu_model": model, "cpus": os.cpu_count(), "cpus_usable": sorted(os.sched_getaffinity(0)),
        "mem_gib": round(mem_kb / 2**20, 1), "kernel": platform.release(), "python": platform.python_version(),
        "packages": {n: _package_version(n) for n in ("uvicorn", "uvloop", "httptools", "aiohttp", "orjson",
                                                      "vllm-router")},
        "git_commit": git, "loadavg": load_average(),
    }


def load_average() -> list[float]:
    """1, 5 and 15 minute load averages (``/proc/loadavg``): other work on the machine skews latency figures."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return []
