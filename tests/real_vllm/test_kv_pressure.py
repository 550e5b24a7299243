"""KV pressure on a real engine: a prefiller whose KV pool (``--num-gpu-blocks-override 18``: 18 × 128 = 2,304
tokens) is only a little above ``max_model_len`` (2,048) — vLLM 0.32 refuses to start below it (docs/real-vllm.md).

- vLLM alone: two long prompts sent at once cannot both hold KV, so the second waits inside the engine
  (``vllm:request_queue_time_seconds``); this shows the pool is really that small. And a small request that would
  fit waits behind that waiting prompt (head-of-line blocking, as on vLLM-Ascend 0.23 in docs/field-reports.md);
- through pdproxy: pdproxy reads the pool from ``vllm:cache_config_info`` and never has more prompt tokens in
  flight or pinned on the prefiller than the pool holds, so the second long prompt waits in pdproxy's queue, not in
  the engine, while small requests keep completing.  The engine reports no request waiting for capacity until the
  first long prompt's decode has started; after that it may report one for a step: pdproxy lets the second go when
  the decoder starts answering, and the prefiller frees the first's blocks at its next step after the decoder's
  pull notification (``_update_from_kv_xfer_finished``, vllm/v1/core/sched/scheduler.py), which a loaded machine
  can put after the second's arrival;
- ``pdproxy doctor`` reports the small pool (a warning: one max_model_len prompt fits, two do not).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import openai
import pytest

from tests.real_vllm.support import REPO, SMALL_POOL_BLOCKS, Engines, Prompts, metric, scrape
from tests.support import ProxyThread, sampling, wait_until

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(120)]
LONG_TOKENS = 2000       # 16 blocks of 128: two never fit in 18
BLOCK_SIZE = 128


def capacity_waiting(url: str) -> float:
    return metric(scrape(url), "vllm:num_requests_waiting_by_reason", reason="capacity")


def finished(url: str) -> float:
    """Requests the engine has finished (``vllm:request_success_total``, every finish reason)."""
    return metric(scrape(url), "vllm:request_success_total")


def test_vllm_alone_makes_the_second_long_prompt_wait(small_pool_engines: Engines, prompts: Prompts) -> None:
    """Two long prompts cannot both hold KV: a second 1,500-token prompt (one token asked) sent while the first
    (1,500 tokens, then 500 generated with ``ignore_eos``: 12 blocks growing to 16 of the 18) is decoding waits
    inside the engine for capacity (``vllm:num_requests_waiting_by_reason{reason="capacity"}``), and gets its token
    only once the first has finished — read from the engine's own count of finished requests when that token
    arrives (2: the first and itself; 1 had it run beside the first), never from the order two client threads
    happened to read their streams in.  vLLM's API server counts a step's finishes before any of that step's
    output reaches a client (``output_handler``, vllm/v1/engine/async_llm.py)."""
    e = small_pool_engines
    longs = [prompts.unique(1500, seed=3000 + i) for i in range(2)]
    queued0 = metric(scrape(e.prefill_url), "vllm:request_queue_time_seconds_count")
    finished0 = finished(e.prefill_url)
    body = {"model": e.served_model, "stream": True}
    with httpx.Client(base_url=e.prefill_url, timeout=120) as engine, ThreadPoolExecutor(1) as pool, \
            engine.stream("POST", "/v1/completions", json={**body, "prompt": longs[0], "max_tokens": 500,
                                                           "ignore_eos": True}) as first:
        assert first.status_code == 200
        lines = first.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))          # running: its blocks held

        def second() -> float:
            """Requests the engine had finished when the second's first token arrived."""
            with engine.stream("POST", "/v1/completions",
                               json={**body, "prompt": longs[1], "max_tokens": 1}) as answer:
                assert answer.status_code == 200
                events = answer.iter_lines()
                assert next(line for line in events if line.startswith("data: {"))
                finished_then = finished(e.prefill_url) - finished0
                assert "data: [DONE]" in list(events)
                return finished_then

        waiting = pool.submit(second)
        wait_until(lambda: waiting.done() or capacity_waiting(e.prefill_url) >= 1, 60, 0.02,
                   "the engine's word: the second waits for KV capacity")
        assert not waiting.done(), "the second long prompt was served without waiting for capacity"
        assert "data: [DONE]" in list(lines)
        assert waiting.result() == 2, "the second long prompt got its token before the first one finished"
    assert metric(scrape(e.prefill_url), "vllm:request_queue_time_seconds_count") - queued0 == 2


def test_vllm_holds_small_requests_behind_a_long_prompt_waiting_for_kv(small_pool_engines: Engines,
                                                                        prompts: Prompts) -> None:
    """Head-of-line blocking in vLLM 0.32 (like vLLM-Ascend 0.23 in docs/field-reports.md; ``pdproxy sim
    --hol-blocking on``): a small request that would fit waits while a long prompt at the head of the queue waits
    for KV blocks.

    A 1,300-token prompt decoding 600 tokens (``ignore_eos``) holds 15 of the 18 blocks; a second one cannot get
    its 11; a 2-token request needs one block.  With nothing waiting, the small request's answer is in before the
    first stream's ``[DONE]`` reaches its reader (a 600-token decode leaves seconds of margin; the engine's count of
    finished requests, scraped after the answer, could already include the first); held behind the waiting long
    prompt, the engine had finished 2 or more requests when its answer came (itself and the first) — not two
    client threads' clocks."""
    e = small_pool_engines

    def scenario(with_waiting_long: bool, seed: int) -> tuple[float, bool]:
        """Requests the engine had finished, since the scenario began, when the small request's answer arrived, and
        whether that answer was in before the first stream's ``[DONE]`` was read."""
        finished0 = finished(e.prefill_url)
        replied = threading.Event()
        before_done = False
        with httpx.Client(base_url=e.prefill_url, timeout=120) as engine, ThreadPoolExecutor(2) as pool, \
                ExitStack() as stack:
            body = {"model": e.served_model, "stream": True}
            with engine.stream("POST", "/v1/completions", json={
                    **body, "prompt": prompts.unique(1300, seed=seed), "max_tokens": 600,
                    "ignore_eos": True}) as first:
                lines = first.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))   # decoding now
                second = None
                if with_waiting_long:                    # queued behind the first: its 11 blocks are not free
                    second = stack.enter_context(engine.stream("POST", "/v1/completions", json={
                        **body, "prompt": prompts.unique(1300, seed=seed + 1), "max_tokens": 8}))
                    assert second.status_code == 200
                    wait_until(lambda: capacity_waiting(e.prefill_url) >= 1, 60, 0.02,
                               "the second long prompt waiting for capacity at the head of the queue")

                def small() -> float:
                    reply = engine.post("/v1/completions", json={"model": e.served_model, "prompt": "Hi",
                                                                 "max_tokens": 2})
                    replied.set()
                    assert reply.status_code == 200
                    return finished(e.prefill_url) - finished0
                answered = pool.submit(small)
                for line in lines:
                    if line == "data: [DONE]":
                        before_done = replied.is_set()
                        break
                else:
                    raise AssertionError("the first stream ended without [DONE]")
                finished_then = answered.result()
                if second is not None:
                    assert "data: [DONE]" in list(second.iter_lines())
        return finished_then, before_done

    assert scenario(False, 5000)[1]          # nothing waiting: the small one is served while the first decodes
    assert scenario(True, 5100)[0] >= 2      # held behind the waiting long prompt until the first ended


def test_pdproxy_reads_the_pool_and_queues_the_second_long_prompt(
        small_pool_engines: Engines, prompts: Prompts, make_proxy: Callable[..., ProxyThread]) -> None:
    e = small_pool_engines
    proxy = make_proxy(e, tokenizer=str(e.model_dir))
    prefiller = next(ep for ep in proxy.state.infos if ep.role.value == "prefill")
    info = proxy.state.infos[prefiller]
    assert (info.num_gpu_blocks, info.block_size) == (SMALL_POOL_BLOCKS, BLOCK_SIZE)
    assert info.kv_pool_tokens == SMALL_POOL_BLOCKS * BLOCK_SIZE == 2304            # pdproxy read the pool
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    longs = [prompts.unique(LONG_TOKENS, seed=4000 + i) for i in range(2)]
    waited0 = proxy.state.admission.snapshot()["queue"]["waited_total"]
    started = time.monotonic()

    def ask(prompt: str, max_tokens: int) -> tuple[int, float]:
        reply = client.completions.create(model=e.served_model, prompt=prompt, max_tokens=max_tokens)
        assert reply.usage is not None and reply.usage.completion_tokens == max_tokens
        return reply.usage.prompt_tokens, time.monotonic() - started

    load = proxy.state.pool.load(prefiller)
    released: list[tuple[float, int]] = []           # (monotonic s, prompt tokens leased on the prefiller after)

    def on_release() -> None:                        # the proxy's loop, right after a lease gave its tokens back
        released.append((time.monotonic(), load.tokens))

    proxy.state.pool.add_release_listener(on_release)
    try:
        with sampling(lambda: (time.monotonic(), load.tokens), 0.001) as held, \
                sampling(lambda: (time.monotonic(), capacity_waiting(e.prefill_url)), 0.02) as engine_waiting, \
                ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(ask, p, 16) for p in longs]
            smalls = []
            while not all(f.done() for f in futures):
                smalls.append(ask("Hi there", 4))
            done = [f.result() for f in futures]
    finally:
        proxy.state.pool.remove_release_listener(on_release)

    assert [tokens for tokens, _ in done] == [prompts.count({"prompt": p}, "completions") for p in longs]
    last_long_s = max(t for _, t in done)
    assert smalls and smalls[0][1] < last_long_s                    # small requests kept completing meanwhile
    most_held = max(tokens for _, tokens in held)
    assert most_held <= info.kv_pool_tokens, (
        f"pdproxy had {most_held} prompt tokens on the prefiller (KV pool {info.kv_pool_tokens}); the engine "
        f"reported up to {max(v for _, v in engine_waiting):g} request(s) waiting for capacity")
    # The first long prompt's lease ends (its decode started) at the first moment pdproxy's leases on the
    # prefiller fall below a long prompt after having held one; the engine's count is read after that moment
    # when its scrape began after it.
    # A long prompt's lease holds pdproxy's count of it: exact (the engine's 1,998 for these) when the byte bounds
    # cannot decide it fits, else a bound above that.
    long = min(tokens for tokens, _ in done)
    timeline = sorted(held + released)
    pinned_at = next(t for t, tokens in timeline if tokens >= long)
    first_released_at = next(t for t, tokens in timeline if t > pinned_at and tokens < long)
    early = [(round(t - first_released_at, 3), v) for t, v in engine_waiting if v and t < first_released_at]
    assert not early, (f"requests waited for KV capacity inside the prefiller while pdproxy still held the first "
                       f"long prompt's blocks there ((s before its release, waiting): {early})")
    assert engine_waiting[-1][1] == 0
    assert proxy.state.admission.snapshot()["queue"]["waited_total"] > waited0     # the second waited in pdproxy


def test_doctor_reports_the_small_kv_pool(small_pool_engines: Engines) -> None:
    e = small_pool_engines
    run = subprocess.run([sys.executable, "-m", "pdproxy", "doctor", "--prefill", e.prefill_url, "--decode",
                          e.decode_url, "--json", "--cold-budget-s", "60", "--cold-timeout-s", "30"],
                         capture_output=True, text=True, timeout=110, cwd=REPO, check=False)
    assert run.returncode == 0, run.stderr[-2000:]                  # warnings only
    report = json.loads(run.stdout)
    rows = {(c["check"], c["target"]): c for c in report["checks"]}
    engine = rows["engine", e.prefill_url]
    assert engine["status"] == "ok" and engine["data"]["max_model_len"] == e.max_model_len
    assert engine["data"]["version"] == "0.32.0" and engine["data"]["models"] == [e.served_model]
    pool = rows["kv_pool", e.prefill_url]
    assert pool["status"] == "warn"
    assert pool["data"] == {"kv_pool_tokens": 2304, "max_model_len": e.max_model_len,
                            "num_gpu_blocks": SMALL_POOL_BLOCKS, "block_size": BLOCK_SIZE}
    assert "2,304" in pool["detail"] and "18" in pool["detail"]
    assert rows["kv_pool", e.decode_url]["status"] == "ok"
    assert rows["kv_connector", f"{e.prefill_url} → {e.decode_url}"]["status"] == "ok"
    assert all(rows["idle", url]["status"] == "ok" for url in (e.prefill_url, e.decode_url))
