"""``pdproxy serve --workers 2`` as a real process: both workers serve, the decoders' load is split evenly across
them (one view), ``/metrics`` aggregates the workers, a killed worker is replaced with its leases cleared, and
SIGTERM stops everything."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.ops.promtext import scrape
from tests.ops.serveproc import worker_pids
from tests.support import SimProcess, free_port, wait_until

pytestmark = pytest.mark.timeout(60)

SLOW = ("--served-model-name", "sim-model", "--max-model-len", "4096", "--decode-tokens-per-s", "4")


@contextlib.contextmanager
def _serve(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pdproxy", "serve", *args], stdout=out, stderr=out,
                                start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_two_workers_share_one_load_view(tmp_path: Path) -> None:
    sims = [SimProcess("prefill", *SLOW), SimProcess("decode", *SLOW), SimProcess("decode", *SLOW)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "proxy.log"
    streams: list[tuple[Any, Any, Any]] = []
    try:
        for s in sims:
            s.start()
        decoders = [s.url for s in sims[1:]]
        args = ["--workers", "2", "--host", "127.0.0.1", "--port", str(port), "--prefill", sims[0].url,
                "--decode", *decoders, "--health-interval-s", "0.3", "--log-level", "info",
                "--no-request-log", "--shutdown-grace-s", "2"]
        with _serve(args, log) as proc:
            def ready() -> bool:
                try:
                    m = scrape(url)
                except httpx.HTTPError:
                    return False
                return len(m.find("pdproxy_worker_inflight_requests")) == 2 and len(worker_pids(proc.pid)) == 2

            wait_until(ready, 20, 0.1, f"2 workers ready ({log.read_text()[-500:] if log.exists() else ''})")
            assert httpx.get(url + "/health").status_code == 200
            # Counters and histograms of both workers add up in every scrape (prometheus multiprocess mode).
            for i in range(6):
                r = httpx.post(url + "/v1/completions", json={"model": "sim-model", "prompt": f"c {i}", "max_tokens": 1},
                               headers={"Connection": "close"}, timeout=10)
                assert r.status_code == 200
            for _ in range(4):  # new connections: either worker may answer the scrape
                m = scrape(url)
                assert m.value("pdproxy_requests_total", api="completions", status="200", outcome="ok") == 6
                assert m.value("pdproxy_prefill_time_seconds_count", api="completions") == 6

            def decode_load() -> dict[str, int]:
                load = httpx.get(url + "/debug/load", timeout=5).json()
                return {e["name"]: e["requests"] for e in load["endpoints"] if e["role"] == "decode"}

            def held() -> dict[int, float]:
                return {int(lab["worker"]): v for lab, v in scrape(url).find("pdproxy_worker_inflight_requests")}

            def open_stream(i: int) -> None:
                client = httpx.Client(timeout=30)
                cm = client.stream("POST", url + "/v1/completions",
                                   json={"model": "sim-model", "prompt": f"w {i}", "max_tokens": 400, "stream": True})
                resp = cm.__enter__()
                assert resp.status_code == 200
                chunks = resp.iter_raw()
                next(chunks)  # first event relayed: the decode lease is on the board
                streams.append((client, cm, chunks))
                wait_until(lambda: sum(decode_load().values()) == len(streams), 10, 0.02,
                           f"{len(streams)} streams on board")
                counts = decode_load()
                assert max(counts.values()) - min(counts.values()) <= 1, counts

            # Open long streams one at a time, each on a new connection (the kernel hands connections to either
            # worker), until both workers hold some; the all-worker view keeps the decoders within one.
            for i in range(12):
                open_stream(i)
                if i >= 5 and all(r > 0 for r in held().values()):
                    break
            if not all(r > 0 for r in held().values()):
                # The kernel gave every connection to one worker (a loaded machine does): stop that one, so the
                # next connection can only be accepted by the other, then let it run again.
                rows_now = held()
                workers = httpx.get(url + "/debug/load", timeout=5).json()["workers"]
                busy = [w["pid"] for w in workers if rows_now.get(w["row"], 0) > 0]
                for pid in busy:
                    os.kill(pid, signal.SIGSTOP)
                try:
                    open_stream(len(streams))
                finally:
                    for pid in busy:
                        os.kill(pid, signal.SIGCONT)
            rows = list(held().values())
            assert len(rows) == 2 and all(r > 0 for r in rows), f"one worker took every connection: {rows}"
            total = len(streams)
            # the engines agree with the proxy's view
            running = {d.url: d.state()["running"] for d in sims[1:]}
            assert running == decode_load()
            assert sum(rows) == total  # per-worker rows add up to the streams held
            m = scrape(url)
            assert m.total("pdproxy_requests_in_progress") == total  # livesum over both workers

            # A worker dies: the supervisor replaces it and zeroes its row (its leases died with it).
            victim = min(worker_pids(proc.pid))
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda: len(worker_pids(proc.pid)) == 2 and victim not in worker_pids(proc.pid), 20, 0.1,
                       "replacement worker")
            wait_until(lambda: sum(decode_load().values()) < total
                       and sum(decode_load().values()) == sum(d.state()["running"] for d in sims[1:]), 15, 0.05,
                       "board and engines agree after the worker died")
            survivors = sum(decode_load().values())
            assert survivors in [int(r) for r in rows]

            # Clients leave: everything back to zero, on the board and on the engines.
            for client, cm, _ in streams:
                with contextlib.suppress(httpx.HTTPError):
                    cm.__exit__(None, None, None)
                client.close()
            streams.clear()
            wait_until(lambda: sum(decode_load().values()) == 0, 10, 0.05, "board back to zero")
            wait_until(lambda: all(d.state()["running"] == 0 for d in sims[1:]), 10, 0.05, "engines idle")
            m = scrape(url)
            assert m.total("pdproxy_inflight_requests") == 0 and m.total("pdproxy_inflight_tokens") == 0
            assert m.total("pdproxy_requests_total", api="completions") >= 6 + survivors  # the dead one recorded none

            # SIGTERM: workers drain and exit, the supervisor removes its run directory.
            found = re.search(r"run directory (\S+) \(load board", log.read_text())  # the supervisor logs it
            assert found is not None
            run_dir = Path(found.group(1))
            assert (run_dir / "load.board").exists()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=20) == 0
            assert not run_dir.exists()
            assert not worker_pids(proc.pid)
    finally:
        for client, cm, _ in streams:
            with contextlib.suppress(Exception):
                cm.__exit__(None, None, None)
            client.close()
        for s in sims:
            s.stop()
