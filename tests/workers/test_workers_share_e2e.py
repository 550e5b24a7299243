"""``pdproxy serve --workers 2`` in front of simulated engines behaves as one proxy: the per-prefiller prefill budget,
the prefiller's KV-pool guard and a breaker's open state hold across the two workers.

Requests are sent on keep-alive connections pinned to a known worker (tests/workers/support.py).  What the engines
received (``/sim/received``, ``/sim/state``) and the shared view (``/debug/load``) are read at the moments that
matter: a request that must wait is seen waiting in the other worker's queue while the prefiller holds only what
the budget allows; prefills are held in flight by the simulator's ``hang`` fault and given back by closing the
client's connection or killing the worker, so nothing depends on how fast the machine is."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

from pdproxy.tokens import sim_prompt
from tests.support import SimProcess, free_port, running, sampling, wait_until
from tests.workers.support import (
    Conn,
    board_idle,
    conns_on,
    debug_load,
    endpoint_row,
    serve_workers,
    wait_ready,
)

pytestmark = pytest.mark.timeout(90)

MODEL = ("--served-model-name", "sim-model")


def common_args(port: int, prefill: SimProcess, decode: SimProcess) -> list[str]:
    return ["--workers", "2", "--host", "127.0.0.1", "--port", str(port), "--prefill", prefill.url,
            "--decode", decode.url, "--log-level", "warning", "--no-request-log", "--shutdown-grace-s", "1",
            "--tokenizer", "sim", "--token-count", "local", "--prefill-queue-aging-tokens-per-s", "0",
            "--decode-only-busy-max-prompt-tokens", "0", "--prefill-timeout-base-s", "60"]


def completion(tokens: int, seed: int, max_tokens: int = 2) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": sim_prompt(tokens, unique=True, seed=seed), "max_tokens": max_tokens}


def long_prompts(sim: SimProcess, at_least: int) -> int:
    return sum(1 for r in sim.completions_received() if len(r["body"]["prompt"].split()) >= at_least)


def conn_on(port: int, row: int) -> Conn:
    """A fresh connection served by worker ``row`` (taken right before use: idle keep-alive connections close)."""
    return conns_on(port, {row: 1})[row][0]


def test_prefill_budget_is_one_budget_across_workers(tmp_path: Path) -> None:
    """Budget 1,000 tokens: worker 0 dispatches two 400-token prompts (held in flight); worker 1's two 400s wait in
    its queue — the prefiller got 2, not 4 — while a 200 still fits exactly (800 + 200 = 1,000); when worker 0 is
    killed, the supervisor zeroes its reservations and wakes worker 1, whose waiters go."""
    port = free_port()
    log = tmp_path / "proxy.log"
    with running(SimProcess("prefill", *MODEL, "--max-model-len", "1024"),       # prompts > 1 KiB: counted exactly
                 SimProcess("decode", *MODEL, "--max-model-len", "1024")) as (prefiller, decoder), \
            serve_workers(common_args(port, prefiller, decoder) + ["--prefill-budget-tokens", "1000",
                                                                  "--prefill-budget-s", "0"], log) as proc:
        wait_ready(port, 2, proc, log)
        conns = conns_on(port, {0: 2})
        prefiller.faults({"kind": "hang", "on_request": 1, "times": 2})    # worker 0's two prefills stay in flight

        def inflight() -> int:
            for attempt in range(5):
                try:
                    return int(endpoint_row(debug_load(port), prefiller.url)["prefill_inflight_tokens"])
                except OSError:     # the worker that took this poll is the one killed below: ask again
                    if attempt == 4:
                        raise
            raise AssertionError("unreachable")

        with sampling(inflight, 0.005) as seen:
            for i, conn in enumerate(conns[0]):
                conn.send("POST", "/v1/completions", completion(400, seed=i))
            wait_until(lambda: len(prefiller.completions_received()) == 2 and inflight() == 800, 20,
                       what="worker 0's two prefills in flight")
            waiters = conns_on(port, {1: 2})[1]
            for i, conn in enumerate(waiters):
                conn.send("POST", "/v1/completions", completion(400, seed=10 + i))
            wait_until(lambda: debug_load(port)["workers"][1]["waiting"] == 2, 20, what="worker 1's two waiting")
            assert len(prefiller.completions_received()) == 2          # 800 + 400 > 1,000: not dispatched
            status, reply = conn_on(port, 1).request("POST", "/v1/completions", completion(200, seed=20))
            assert status == 200 and reply["usage"]["prompt_tokens"] == 200    # exactly the budget left
            assert len(prefiller.completions_received()) == 3
            assert debug_load(port)["workers"][1]["waiting"] == 2
            victim = debug_load(port)["workers"][0]["pid"]
            os.kill(victim, signal.SIGKILL)                            # worker 0 dies holding 800 tokens
            replies = [conn.response() for conn in waiters]            # worker 1's waiters go
        assert [s for s, _ in replies] == [200, 200]
        assert [r["usage"]["prompt_tokens"] for _, r in replies] == [400, 400]
        assert len(prefiller.completions_received()) == 5
        assert max(seen) <= 1000 and 800 in seen
        wait_until(lambda: board_idle(port), 15, what="shared view back to zero")
        assert debug_load(port)["workers"][0]["pid"] not in (0, victim)   # replaced
        for conn in (*conns[0], *waiters):
            conn.close()


def test_kv_pool_guard_holds_across_workers(tmp_path: Path) -> None:
    """19 × 128 tokens of prefiller KV, 2,304 for requests (one block is vLLM's null block): worker 0's 2,000-token prompt stays pinned (its decoder does not
    answer); worker 1's 2,000-token prompt waits in worker 1's queue, not inside the engine, while small prompts
    on both workers keep completing next to it; when worker 0's client leaves, worker 1's prompt goes."""
    port = free_port()
    log = tmp_path / "proxy.log"
    kv = ("--max-model-len", "2048", "--block-size", "128")
    with running(SimProcess("prefill", *MODEL, *kv, "--num-gpu-blocks-override", "19", "--kv-pin-timeout-s", "2"),
                 SimProcess("decode", *MODEL, *kv)) as (prefiller, decoder), \
            serve_workers(common_args(port, prefiller, decoder)
                          + ["--decode-first-byte-timeout-s", "60", "--decode-nonstream-timeout-s", "60"],
                          log) as proc:
        wait_ready(port, 2, proc, log)
        first = conn_on(port, 0)
        decoder.faults({"kind": "hang", "on_request": 1})          # worker 0's decode never answers: KV pinned

        def held() -> int:
            return int(endpoint_row(debug_load(port), prefiller.url)["kv_held_tokens"])

        with sampling(held, 0.005) as seen:
            first.send("POST", "/v1/completions", completion(2000, seed=1, max_tokens=4))
            wait_until(lambda: len(decoder.completions_received()) == 1 and held() == 16 * 128, 20,
                       what="worker 0's prompt prefilled and pinned")
            assert prefiller.state()["pinned_requests"] == 1
            second = conn_on(port, 1)
            second.send("POST", "/v1/completions", completion(2000, seed=2, max_tokens=4))
            wait_until(lambda: debug_load(port)["workers"][1]["waiting"] == 1, 20, what="worker 1's long one waits")
            state = prefiller.state()
            assert long_prompts(prefiller, 2000) == 1 and state["waiting"] == 0 and state["running"] == 0
            for row in (1, 0):                                     # one block each: fits next to the 16 pinned
                small = conn_on(port, row)
                status, reply = small.request("POST", "/v1/completions", completion(10, seed=30, max_tokens=2))
                small.close()
                assert status == 200 and reply["usage"]["completion_tokens"] == 2
            assert debug_load(port)["workers"][1]["waiting"] == 1 and long_prompts(prefiller, 2000) == 1
            first.close()                                          # worker 0's client leaves: its lease ends
            status, reply = second.response()
        assert status == 200 and reply["usage"]["prompt_tokens"] == 2000
        assert long_prompts(prefiller, 2000) == 2
        # The engine never had to wait for KV or preempt: worker 1's prompt reached it only after worker 0's was
        # released.  (The sampled ``kv_held_tokens`` is an upper bound: read by one worker while another hands a
        # slot over to its lease, one prompt counts twice — see PrefillLedger.kv_held_tokens — so its maximum
        # is no measure of what the engine held.)
        state = prefiller.state()
        assert state["kv_capacity_waits"] == 0 and state["preemptions"] == 0
        assert 16 * 128 in seen
        wait_until(lambda: board_idle(port), 15, what="shared view back to zero")
        second.close()


def test_breaker_state_holds_across_workers(tmp_path: Path) -> None:
    """A prefiller failing in worker 0 (503, Retry-After: 1) is skipped by both workers until it may be tried; then
    one half-open trial is admitted in all (two requests per worker at once: one reaches the engine, three are
    refused by the breaker); a failed trial (Retry-After: 30) opens it again for both — the engine sees nothing
    more from either worker."""
    port = free_port()
    log = tmp_path / "proxy.log"
    admin = {"Authorization": "Bearer k"}
    with running(SimProcess("prefill", *MODEL, "--max-model-len", "4096"),
                 SimProcess("decode", *MODEL, "--max-model-len", "4096")) as (prefiller, decoder), \
            serve_workers(common_args(port, prefiller, decoder)
                          + ["--breaker-failures", "3", "--breaker-open-s", "1", "--prefill-attempts", "1",
                             "--health-interval-s", "30", "--admin-key", "k"], log) as proc:
        wait_ready(port, 2, proc, log)
        prefiller.faults({"kind": "status", "status": 503, "retry_after": 1, "on_request": 1},
                         {"kind": "hang", "on_request": 2},
                         {"kind": "status", "status": 503, "retry_after": 30, "on_request": 3})

        def breaker() -> dict[str, Any]:
            conn = Conn(port)
            try:
                status, body = conn.request("GET", "/admin/endpoints", headers=admin)
            finally:
                conn.close()
            assert status == 200
            return dict(next(e for e in body["endpoints"] if e["role"] == "prefill"))

        def ask(row: int, seed: int) -> tuple[int, Any]:
            conn = conn_on(port, row)
            try:
                return conn.request("POST", "/v1/completions", completion(10, seed=seed))
            finally:
                conn.close()

        def refused(reply: tuple[int, Any]) -> bool:
            status, body = reply
            return status == 503 and "circuit breaker" in body["error"]["message"]

        # 0. An admin change would reach one worker of two: every worker refuses it and changes nothing (a drain
        #    answered 202 by one worker while the other kept sending the endpoint work: an attacker round's find).
        for row in (0, 1):
            for method, path in (("POST", "/admin/endpoints/drain"), ("POST", "/admin/endpoints/undrain"),
                                 ("DELETE", "/admin/endpoints"), ("POST", "/admin/endpoints")):
                conn = conn_on(port, row)
                status, body = conn.request(method, path, {"url": decoder.url, "role": "decode"}, headers=admin)
                conn.close()
                assert status == 409 and "with --workers 2 each worker keeps its own endpoint list" in \
                    body["error"]["message"], (row, method, path, body)
        for row in (0, 1):
            conn = conn_on(port, row)
            status, body = conn.request("GET", "/admin/endpoints", headers=admin)
            conn.close()
            assert status == 200 and [e["state"] for e in body["endpoints"]] == ["active", "active"], body

        # 1. Worker 0 meets the failure: the shared breaker opens at once, for 1 s (the engine's Retry-After).
        status, _ = ask(0, 1)
        assert status == 503 and len(prefiller.completions_received()) == 1
        assert breaker()["breaker"] == "open"
        # 2. Once it may be tried: two requests per worker at once, one trial in all.
        wait_until(lambda: breaker()["retry_in_s"] == 0, 10, what="the breaker admits a trial")
        assert len(prefiller.completions_received()) == 1
        conns = conns_on(port, {0: 2, 1: 2})
        four = [*conns[0], *conns[1]]
        replies: dict[int, tuple[int, Any]] = {}

        def send(i: int) -> None:
            four[i].send("POST", "/v1/completions", completion(10, seed=100 + i))
            try:
                replies[i] = four[i].response()
            except OSError:
                pass

        threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: len(replies) == 3 and len(prefiller.completions_received()) == 2, 20,
                   what="three refused, one trial at the engine")
        assert all(refused(r) for r in replies.values()), replies
        trial = next(i for i in range(4) if i not in replies)
        assert all(i in replies for i in range(4) if i // 2 != trial // 2)   # the other worker sent no trial
        assert breaker()["breaker"] == "half_open"
        four[trial].close()                                        # the trial's client leaves: no verdict
        threads[trial].join(10)
        wait_until(lambda: endpoint_row(debug_load(port), prefiller.url)["requests"] == 0, 10,
                   what="the trial's prefill lease (and trial slot) given back")
        # 3. The next request (worker 1) is the trial; it fails with Retry-After: 30 → open again, for both.
        status, _ = ask(1, 200)
        assert status == 503 and len(prefiller.completions_received()) == 3
        assert breaker()["breaker"] == "open" and breaker()["retry_in_s"] > 20
        for row in (0, 1, 0, 1):
            assert refused(ask(row, 300))
        assert len(prefiller.completions_received()) == 3          # neither worker sent it anything more
        for conn in four:
            conn.close()
        wait_until(lambda: board_idle(port), 15, what="shared view back to zero")


def _children(pid: int) -> set[int]:
    """The supervisor's live worker processes (``/proc``)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found.update(int(c) for c in (task / "children").read_text().split())
    workers = set()
    for c in found:
        with contextlib.suppress(OSError):              # reaped meanwhile
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes():
                workers.add(c)
    return workers


def test_a_replacement_that_dies_before_it_is_ready_is_started_again_not_the_end_of_the_proxy(
        tmp_path: Path) -> None:
    """Worker 0 killed, then its replacement killed while still starting (a crash that repeats, the OOM killer
    again): the supervisor starts the row again after a backoff while worker 1 serves — old code took the
    replacement's death for a start-up failure and stopped the whole proxy, worker 1 and its streams included."""
    port = free_port()
    log = tmp_path / "proxy.log"
    with running(SimProcess("prefill", *MODEL), SimProcess("decode", *MODEL)) as (prefiller, decoder), \
            serve_workers(common_args(port, prefiller, decoder), log) as proc:
        wait_ready(port, 2, proc, log)
        first = _children(proc.pid)
        assert len(first) == 2
        victim = debug_load(port)["workers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)
        replacement = wait_until(lambda: (_children(proc.pid) - first) or None, 20, 0.005,
                                 what="worker 0's replacement started")
        (started,) = replacement
        os.kill(started, signal.SIGKILL)                                   # before it could be ready (~2 s of imports)
        wait_until(lambda: "before it was ready; starting a new one in 1 s" in log.read_text(), 20,
                   what="the supervisor's backoff")
        assert proc.poll() is None                                          # still running
        status, _ = conn_on(port, 1).request("POST", "/v1/completions", completion(20, seed=1))
        assert status == 200                                                # worker 1 serves meanwhile
        wait_ready(port, 2, proc, log)                                      # the row is back after its backoff
        assert debug_load(port)["workers"][0]["pid"] not in (victim, started)
        wait_until(lambda: board_idle(port), 15, what="shared view back to zero")
