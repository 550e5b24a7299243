"""The prefill budget follows the prefiller's measured rate, end to end (``pdproxy/scheduling/prefill_rate.py``):
on a prefiller that answers at once, two prompts each larger than ``prefill_budget_tokens`` are in flight together;
on one that computes 10K tokens/s (the admission benchmark's engine) the same settings keep them one at a time.
Read as an operator reads it: ``GET /debug/load``'s ``prefill_budget_tokens`` / ``prefill_tokens_per_s``, what the
prefiller received, the queue's depth; the counters back to zero."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from pdproxy.scheduling.prefill_rate import MIN_PREFILLS
from pdproxy.tokens import sim_prompt
from tests.admission.conftest import Pair
from tests.admission.test_flow_e2e import open_request, prefills
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(60)

BUDGET_TOKENS = 300
BIG = 400
"""Each big prompt is over the token budget: alone, it runs only on an idle prefiller."""


def prefiller_row(proxy: ProxyThread) -> dict[str, Any]:
    """The prefiller's row of ``GET /debug/load`` (the proxy has one prefiller)."""
    load = httpx.get(proxy.url + "/debug/load", timeout=10).json()
    (row,) = [e for e in load["endpoints"] if e["role"] == "prefill"]
    return dict(row)


def budget_gauge(proxy: ProxyThread) -> int:
    """``pdproxy_prefill_budget_tokens`` of the one prefiller, as ``GET /metrics`` exposes it."""
    text = httpx.get(proxy.url + "/metrics", timeout=10).text
    (value,) = [float(line.rpartition(" ")[2]) for line in text.splitlines()
                if line.startswith("pdproxy_prefill_budget_tokens{")]
    return int(value)


def warm_up(proxy: ProxyThread, pair: Pair) -> None:
    """:data:`MIN_PREFILLS` prefills of ``BIG`` tokens one after another: the rate is measured from here on."""
    for seed in range(MIN_PREFILLS):
        reply = httpx.post(proxy.url + "/v1/completions", timeout=20, json={
            "model": "sim-model", "prompt": sim_prompt(BIG, unique=True, seed=100 + seed), "max_tokens": 1})
        assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == BIG
    assert prefills(pair) == [BIG] * MIN_PREFILLS


def two_big_held(proxy: ProxyThread, pair: Pair, stack: ExitStack) -> None:
    """Two more ``BIG`` prompts whose prefills the prefiller never answers (held in flight until their clients
    leave, when ``stack`` closes)."""
    pair.prefiller.faults({"kind": "hang", "on_request": 1, "times": 2})
    for seed in (1, 2):
        stack.enter_context(open_request(proxy.port, {"prompt": sim_prompt(BIG, unique=True, seed=seed),
                                                      "max_tokens": 1}))


def settle(proxy: ProxyThread) -> None:
    proxy.wait_idle(timeout_s=20)
    queue = proxy.state.admission.queue
    wait_until(queue.idle, 10, what="queue and ledger empty")
    row = prefiller_row(proxy)
    assert row["prefill_inflight_tokens"] == 0 and row["kv_held_tokens"] == 0 and row["requests"] == 0


def test_a_prefiller_that_answers_at_once_takes_several_prompts_over_the_token_budget(pair_of: Any) -> None:
    pair: Pair = pair_of("sim512")                       # free prefill
    proxy = pair.proxy(tokenizer="sim", prefill_budget_tokens=BUDGET_TOKENS, prefill_budget_s=10.0,
                       decode_only_busy_max_prompt_tokens=0)
    try:
        before = prefiller_row(proxy)
        assert before["prefill_budget_tokens"] == BUDGET_TOKENS and before["prefill_tokens_per_s"] is None
        assert budget_gauge(proxy) == BUDGET_TOKENS
        warm_up(proxy, pair)
        row = prefiller_row(proxy)
        assert row["prefill_tokens_per_s"] > 2 * BIG / 10.0           # ≥ 80 tokens/s: 400 tokens well within 5 s
        assert row["prefill_budget_tokens"] == int(row["prefill_tokens_per_s"] * 10.0) >= 2 * BIG
        assert budget_gauge(proxy) == row["prefill_budget_tokens"]
        with ExitStack() as stack:
            two_big_held(proxy, pair, stack)
            wait_until(lambda: len(prefills(pair)) == MIN_PREFILLS + 2, 20, what="both big prefills dispatched")
            assert prefiller_row(proxy)["prefill_inflight_tokens"] == 2 * BIG
            assert proxy.state.admission.queue.depth == 0
        settle(proxy)
    finally:
        proxy.stop()


def test_a_prefiller_at_10k_tokens_per_s_keeps_the_token_budget(pair_of: Any) -> None:
    pair: Pair = pair_of("flow")                         # 10,000 prefill tokens/s: 0.04 s per 400 tokens
    proxy = pair.proxy(tokenizer="sim", prefill_budget_tokens=BUDGET_TOKENS, prefill_budget_s=0.025,
                       decode_only_busy_max_prompt_tokens=0)
    try:
        warm_up(proxy, pair)
        row = prefiller_row(proxy)
        assert 0 < row["prefill_tokens_per_s"] <= 10_000                # busy time ≥ the engine's compute time
        assert row["prefill_budget_tokens"] == BUDGET_TOKENS           # 0.025 s × ≤ 10,000 ≤ 250 < 300
        queue = proxy.state.admission.queue
        with ExitStack() as stack:
            two_big_held(proxy, pair, stack)
            wait_until(lambda: queue.depth == 1 and len(prefills(pair)) == MIN_PREFILLS + 1, 20,
                       what="one big prompt dispatched, the other queued")
            assert prefiller_row(proxy)["prefill_inflight_tokens"] == BIG
        settle(proxy)
    finally:
        proxy.stop()
