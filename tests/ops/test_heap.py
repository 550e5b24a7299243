"""glibc's malloc thresholds (``pdproxy/ops/heap.py``, setting ``malloc_trim_threshold_mib``): what
``tune_malloc`` asks of ``mallopt`` and when it leaves malloc alone; and, through ``pdproxy serve`` as a real
process (one process, and ``--workers 2``), that long bodies stop being faulted in again on every request — the
page faults the kernel counts for the process (``/proc/PID/stat`` ``minflt``), with the policy and without it."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from pdproxy.ops.heap import (
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    MMAP_THRESHOLD_MAX,
    HeapOutcome,
    apply_heap_policy,
    tune_malloc,
)
from pdproxy.settings import Settings
from tests.conftest import SIM_ARGS
from tests.ops.serveproc import ServeProcess, worker_pids
from tests.support import SimProcess, running

pytestmark = pytest.mark.timeout(120)

GLIBC = bool(os.confstr("CS_GNU_LIBC_VERSION")) if "CS_GNU_LIBC_VERSION" in os.confstr_names else False


class FakeMallopt:
    """Records ``mallopt(param, value)`` calls; answers ``result``."""

    def __init__(self, result: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.result = result

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.result


def test_default_keeps_64_mib_and_takes_blocks_under_32_mib_from_the_heap() -> None:
    fake = FakeMallopt()
    assert tune_malloc(Settings().malloc_trim_threshold_mib, environ={}, mallopt=fake) == HeapOutcome(True)
    assert fake.calls == [(M_MMAP_THRESHOLD, 32 << 20), (M_TRIM_THRESHOLD, 64 << 20)]   # mmap first (docstring)


def test_the_mmap_threshold_is_half_the_trim_threshold_within_glibcs_ceiling() -> None:
    small, large = FakeMallopt(), FakeMallopt()
    assert tune_malloc(8, environ={}, mallopt=small).applied
    assert small.calls == [(M_MMAP_THRESHOLD, 4 << 20), (M_TRIM_THRESHOLD, 8 << 20)]
    assert tune_malloc(2047, environ={}, mallopt=large).applied
    assert large.calls == [(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_TRIM_THRESHOLD, 2047 << 20)]


@pytest.mark.parametrize("environ, named", [
    ({"MALLOC_TRIM_THRESHOLD_": "131072"}, "MALLOC_TRIM_THRESHOLD_"),
    ({"MALLOC_TRIM_THRESHOLD_": ""}, "MALLOC_TRIM_THRESHOLD_"),          # glibc reads an empty one as set, too
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "MALLOC_MMAP_THRESHOLD_"),
    ({"MALLOC_TOP_PAD_": "0"}, "MALLOC_TOP_PAD_"),
    ({"MALLOC_MMAP_MAX_": "0"}, "MALLOC_MMAP_MAX_"),
    ({"GLIBC_TUNABLES": "glibc.pthread.rseq=0:glibc.malloc.trim_threshold=131072"}, "glibc.malloc.trim_threshold"),
])
def test_an_operators_own_thresholds_are_left_alone(environ: dict[str, str], named: str) -> None:
    fake = FakeMallopt()
    outcome = tune_malloc(64, environ=environ, mallopt=fake)
    assert not outcome.applied and not outcome.refused and named in outcome.why
    assert fake.calls == []


@pytest.mark.parametrize("environ", [{"MALLOC_ARENA_MAX": "2"}, {"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}])
def test_other_malloc_choices_do_not_stop_the_thresholds(environ: dict[str, str]) -> None:
    fake = FakeMallopt()
    assert tune_malloc(64, environ=environ, mallopt=fake).applied
    assert len(fake.calls) == 2


def test_zero_leaves_glibcs_policy() -> None:
    fake = FakeMallopt()
    outcome = tune_malloc(0, environ={}, mallopt=fake)
    assert not outcome.applied and not outcome.refused
    assert fake.calls == []


def test_a_refused_mmap_threshold_leaves_the_trim_threshold_alone() -> None:
    refused = FakeMallopt(result=0)
    outcome = tune_malloc(64, environ={}, mallopt=refused)
    assert outcome.refused and not outcome.applied and "M_MMAP_THRESHOLD" in outcome.why
    assert refused.calls == [(M_MMAP_THRESHOLD, 32 << 20)]


def test_a_threshold_over_mallopts_int_is_refused_before_any_call() -> None:
    fake = FakeMallopt()
    outcome = tune_malloc(2048, environ={}, mallopt=fake)
    assert outcome.refused and "int" in outcome.why
    assert fake.calls == []
    with pytest.raises(ValidationError):
        Settings(malloc_trim_threshold_mib=2048)


def test_a_refusal_is_a_warning_and_a_choice_is_not(caplog: pytest.LogCaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.DEBUG, logger="pdproxy.heap")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert not apply_heap_policy(64).applied
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    caplog.clear()
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    assert apply_heap_policy(4096).refused
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_the_real_mallopt_takes_the_default() -> None:
    code = ("from pdproxy.ops.heap import tune_malloc; "
            "print(tune_malloc(64, environ={}))")   # in a child: the thresholds are process-wide
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.strip() == "HeapOutcome(applied=True, why='', refused=False)"


# ------------------------------------------------------------------ through pdproxy serve, a real process
BODY = {"model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 200_000}]}
"""A 1 MB chat body: over the sims' 4,096-token max_model_len, so each request is read, parsed, counted and
answered 400 by the proxy — the path every long prompt takes before its legs."""
CONCURRENT = 16
"""Requests in flight per process: enough that, even on a loaded machine, glibc's own policy trims the heap
between them."""
ROUNDS = 6


def _minflt(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def _stuck(serve: ServeProcess) -> str:
    """What a request that got no answer found: the proxy's sockets on its port (``ss``), whether a new
    connection is answered, each process's state and kernel wait channel, the end of its log."""
    lines = []
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["ss", "-tnoi", "state", "all", f"( sport = :{serve.port} )"], capture_output=True,
                             text=True, timeout=10).stdout
        lines.append(f"ss ({out.count(chr(10))} lines):\n{out[:6000]}")
    try:
        lines.append(f"GET /health: {httpx.get(serve.url + '/health', timeout=3).status_code}")
    except httpx.HTTPError as e:
        lines.append(f"GET /health: {e!r}")
    if serve.proc is not None:
        for pid in sorted({serve.proc.pid} | worker_pids(serve.proc.pid)):
            with contextlib.suppress(OSError):
                state = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("State"))
                lines.append(f"pid {pid}: {state}, wchan {Path(f'/proc/{pid}/wchan').read_text()}")
    lines.append("log tail:\n" + serve.text()[-4000:])
    return "\n".join(lines)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[SimProcess, SimProcess]]:
    with running(SimProcess("prefill", *SIM_ARGS), SimProcess("decode", *SIM_ARGS)) as (p, d):
        yield p, d


def _faults_per_request(engines: tuple[SimProcess, SimProcess], tmp_path: Path, *args: str,
                        env: dict[str, str] | None = None, processes: int = 1) -> float:
    """Page faults per 1 MB request of a ``pdproxy serve`` (its workers' with ``--workers``), after a warm-up
    round, :data:`CONCURRENT` in flight per process; every answer is vLLM's over-length 400."""
    p, d = engines
    serve = ServeProcess(tmp_path / f"serve{len(list(tmp_path.iterdir()))}.log", "--prefill", p.url,
                         "--decode", d.url, *args, env=env)
    with serve.start(), httpx.Client(base_url=serve.url, timeout=30) as client, \
            ThreadPoolExecutor(CONCURRENT * processes) as pool:
        assert serve.proc is not None

        def one(_i: int) -> None:
            try:
                r = client.post("/v1/chat/completions", json=BODY)
            except httpx.TimeoutException as e:      # once in ~10 CI runs (--workers 2): keep what it looked like
                raise AssertionError(f"{e!r}\n{_stuck(serve)}") from e
            assert r.status_code == 400 and r.json()["error"]["param"] == "input_tokens", r.text[:300]

        batch = range(2 * CONCURRENT * processes)
        list(pool.map(one, batch))
        pids = worker_pids(serve.proc.pid) if "--workers" in args else {serve.proc.pid}
        assert pids
        before = sum(map(_minflt, pids))
        for _ in range(ROUNDS):
            list(pool.map(one, batch))
        return (sum(map(_minflt, pids)) - before) / (ROUNDS * len(batch))


@pytest.mark.skipif(not GLIBC or not Path("/proc/self/stat").exists(), reason="glibc and /proc only")
@pytest.mark.parametrize("workers", [(), ("--workers", "2")], ids=["one-process", "workers-2"])
def test_long_bodies_are_not_faulted_in_again_per_request(engines: tuple[SimProcess, SimProcess],
                                                          tmp_path: Path, workers: tuple[str, ...]) -> None:
    """A 1 MB body is 256 pages.  Kept heap: 14-45 faults per request counted here, on a quiet machine and a
    loaded one.  The reference is an operator's own fixed 128 KiB thresholds (``MALLOC_TRIM_THRESHOLD_``, which
    the setting leaves alone): every such body ``mmap``-ed, ~2,000 faults per request whatever the load.  (glibc's
    default dynamic policy faulted 60-370 per request here, depending on how many requests overlapped — too
    load-dependent to assert on; ``loadtest/RESULTS.md`` §4 "The heap kept".)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    processes = 2 if workers else 1
    kept = _faults_per_request(engines, tmp_path, *workers, env=env, processes=processes)
    theirs = _faults_per_request(engines, tmp_path, *workers, env={**env, "MALLOC_TRIM_THRESHOLD_": "131072"},
                                 processes=processes)
    assert kept < 64, (kept, theirs)
    assert theirs > 4 * kept, (kept, theirs)
