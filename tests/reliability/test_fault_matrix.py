"""Fault matrix: each cell = 20 requests at concurrency 16 against simulated engines with one fault kind.

Every cell asserts the client-visible status and body, that no request outlived its deadline, that pinned KV,
engine streams and the proxy's load counters are back to zero, and that the healthy endpoints kept serving.
Faults are the simulator's (``POST /sim/faults``, pdproxy/sim/faults.py), installed on one endpoint (``P0``/``D0``)
or on every endpoint of a role (``P*``/``D*``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import orjson
import pytest

from pdproxy.endpoints import Role
from tests.reliability.harness import CHAT, Fleet4, Result, run
from tests.support import SimProcess

pytestmark = pytest.mark.timeout(40)

N = 20
MAX_TOKENS = CHAT["max_tokens"]
BAD_REQUEST = {"error": {"message": "This model's maximum context length is 4096 tokens (sim fault)",
                         "type": "BadRequestError", "param": "input_tokens", "code": 400}}
# vLLM's answer when the engine core died under a request (vllm/v1/engine/exceptions.py EngineDeadError): the one
# 500 worth another engine (pdproxy.errors.classify)
ENGINE_DEAD = {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                         "type": "InternalServerError", "param": None, "code": 500}}
# deadlines of the cell proxies (seconds): a hung leg is cut at these, and no request may outlive the total
FAST = {"prefill_timeout_base_s": 1.0, "prefill_timeout_per_1k_tokens_s": 0.0, "decode_first_byte_timeout_s": 1.0,
        "request_timeout_s": 6.0}


def targets(fleet: Fleet4, where: str) -> list[SimProcess]:
    return {"P0": fleet.prefillers[:1], "P*": fleet.prefillers, "D0": fleet.decoders[:1],
            "D*": fleet.decoders}[where]


def complete_stream(r: Result) -> bool:
    """200, one role chunk, MAX_TOKENS tokens of text, one finish_reason, usage, exactly one [DONE], no error."""
    if r.status != 200 or r.errors or r.done != 1:
        return False
    roles = [e for e in r.events if e["choices"] and "role" in e["choices"][0].get("delta", {})]
    finishes = [e["choices"][0]["finish_reason"] for e in r.events if e["choices"]
                and e["choices"][0].get("finish_reason")]
    usage = [e["usage"] for e in r.events if e.get("usage")]
    return (len(roles) == 1 and finishes == ["length"] and len(usage) == 1
            and usage[0]["completion_tokens"] == MAX_TOKENS and len(r.text.split()) == MAX_TOKENS)


def cut_stream(r: Result) -> bool:
    """200, some text, then an SSE error event and exactly one [DONE] (no silent truncation, no finish)."""
    return (r.status == 200 and len(r.errors) == 1 and r.done == 1 and r.body.rstrip().endswith(b"data: [DONE]")
            and not any(e["choices"][0].get("finish_reason") for e in r.events if e["choices"]))


def received(sims: list[SimProcess]) -> int:
    return sum(len(s.completions_received()) for s in sims)


# (cell id, where, fault spec, proxy settings)
CELLS: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("prefiller-refuses", "P0", {"kind": "refuse"}, {}),
    ("prefiller-400", "P*", {"kind": "status", "status": 400, "body": BAD_REQUEST}, {}),
    ("prefiller-500", "P0", {"kind": "status", "status": 500, "body": ENGINE_DEAD}, {}),
    ("prefiller-503-retry-after", "P0", {"kind": "status", "status": 503, "retry_after": 2}, {}),
    ("prefiller-hangs", "P0", {"kind": "hang"}, FAST),
    ("decoder-refuses", "D0", {"kind": "refuse"}, {}),
    ("decoder-400", "D0", {"kind": "status", "status": 400, "body": BAD_REQUEST}, {}),
    ("decoder-503", "D0", {"kind": "status", "status": 503}, {}),
    ("decoder-hangs", "D0", {"kind": "hang"}, FAST),
    ("decoder-headers-then-stall", "D0", {"kind": "headers_then_stall"}, FAST),
    ("decoder-resets-mid-stream", "D*", {"kind": "reset_after_events", "events": 3}, {}),
    ("decoder-closes-without-done", "D*", {"kind": "close_without_done", "events": 3}, {}),
    ("decoder-recomputed", "D*", {"kind": "recomputed", "tokens": 3, "times": N // 2}, {"recompute_decoders": ["*"]}),
]


@pytest.mark.parametrize(("cell", "where", "fault", "settings"), CELLS, ids=[c[0] for c in CELLS])
def test_fault_cell(fleet4: Fleet4, cell: str, where: str, fault: dict[str, Any], settings: dict[str, Any]) -> None:
    proxy = fleet4.proxy(**{"request_timeout_s": 10.0, **settings})
    try:
        faulty = targets(fleet4, where)
        healthy = [s for s in fleet4.all if s not in faulty]
        for sim in faulty:
            sim.faults(fault)
        results = run(proxy.url, n=N, concurrency=16)
        statuses = Counter(r.status for r in results)

        # no request outlived its deadline (end-to-end bound of the cell's proxy, plus scheduling slack)
        deadline = proxy.settings.request_timeout_s
        assert deadline is not None
        assert max(r.elapsed_s for r in results) < deadline + 0.5, [round(r.elapsed_s, 2) for r in results]

        if cell == "prefiller-400":
            # a 4xx is the request's: passed through verbatim after ONE attempt, never to a decoder
            assert statuses == {400: N}
            assert all(r.json() == BAD_REQUEST for r in results)
            assert received(fleet4.prefillers) == N and received(fleet4.decoders) == 0
            assert all(proxy.state.health.snapshot(e).breaker == "closed" for e in proxy.state.pool.endpoints())
        elif cell == "decoder-400":
            # requests that met D0 get its 400 (no failover on a 4xx); the others complete on D1
            assert set(statuses) <= {200, 400}
            bad = [r for r in results if r.status == 400]
            assert all(r.json() == BAD_REQUEST for r in bad)
            assert all(complete_stream(r) for r in results if r.status == 200)
            assert len(bad) == received(faulty)
        elif cell in ("decoder-resets-mid-stream", "decoder-closes-without-done"):
            # after the first byte: never replayed; error event + [DONE]; each cut counts against its decoder, whose
            # breaker opens: a request that then finds none open is 503 + Retry-After before any leg
            assert set(statuses) <= {200, 503}, statuses
            assert all(cut_stream(r) for r in results if r.status == 200), results[0].body
            assert all(r.headers.get("retry-after") for r in results if r.status == 503)
            # (a 503 may follow a decoder that took the request and reset before its first event)
            assert statuses.get(200, 0) >= 1 and statuses[200] <= received(fleet4.decoders) <= N
            assert sum(proxy.state.health.snapshot(e).opened_total
                       for e in proxy.state.pool.endpoints(Role.DECODE)) >= 1
        else:
            # failover or continuation: every client gets the complete answer
            assert statuses == {200: N}, [r.body[:200] for r in results if r.status != 200]
            assert all(complete_stream(r) for r in results), next(r.body for r in results if not complete_stream(r))
            # the healthy endpoints kept serving
            assert received(healthy) >= N

        if cell == "decoder-recomputed":
            legs = [r["body"] for s in fleet4.decoders for r in s.completions_received()]
            continuations = [b for b in legs if b.get("continue_final_message")]
            assert len(continuations) >= N // 2
            assert all(b["messages"][-1]["role"] == "assistant" and b["add_generation_prompt"] is False
                       and b["max_tokens"] < MAX_TOKENS for b in continuations)
        if cell in ("prefiller-refuses", "prefiller-500", "prefiller-503-retry-after", "prefiller-hangs",
                    "decoder-refuses", "decoder-503", "decoder-hangs", "decoder-headers-then-stall"):
            # a failing engine gets a bounded number of attempts: the first concurrent wave, then its breaker
            attempts = sum(len([r for r in s.completions_received() if not _release_leg(r)]) for s in faulty)
            assert attempts <= 16, attempts
            name = faulty[0].url
            snap = proxy.state.health.snapshot(next(e for e in proxy.state.pool.endpoints() if e.url == name))
            assert snap.opened_total >= 1
        fleet4.assert_clean(proxy)
    finally:
        proxy.stop()


def _release_leg(record: dict[str, Any]) -> bool:
    body = record.get("body") or {}
    return body.get("max_tokens") == 1 and (body.get("kv_transfer_params") or {}).get("do_remote_prefill") is True


@pytest.mark.parametrize("body", [None, ENGINE_DEAD], ids=["deterministic", "engine-dead"])
def test_prefiller_500_everywhere_is_answered(fleet4: Fleet4, body: dict[str, Any] | None) -> None:
    """A 500 without a dead engine core fails the same on every prefiller: it reaches the client at once, never
    retried.  A dead core's 500 is retried at most once elsewhere.  Either way the engine's 500 (or, once both
    breakers are open, a 503 with Retry-After) reaches the client; decoders untouched."""
    proxy = fleet4.proxy()
    try:
        for sim in fleet4.prefillers:
            sim.faults({"kind": "status", "status": 500, **({"body": body} if body else {})})
        results = run(proxy.url, n=N, concurrency=16)
        assert {r.status for r in results} <= {500, 503}
        assert all("retry-after" in r.headers for r in results if r.status == 503)
        assert all(orjson.loads(r.body)["error"]["code"] in (500, 503) for r in results)
        assert received(fleet4.prefillers) <= (2 * N if body else N)
        assert received(fleet4.decoders) == 0
        fleet4.assert_clean(proxy)
    finally:
        proxy.stop()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engine_process_gone_connection_refused(fleet4: Fleet4, role: str) -> None:
    """A third engine that is killed after the proxy started: TCP refusals open its breaker at once; for a decoder
    the KV handle is reused on another decoder (no second prefill)."""
    from tests.reliability.harness import SIM_ARGS

    extra = SimProcess(role, *SIM_ARGS).start()
    key = "prefill" if role == "prefill" else "decode"
    group = fleet4.prefillers if role == "prefill" else fleet4.decoders
    proxy = fleet4.proxy(**{key: [s.url for s in group] + [extra.url], "health_interval_s": 30.0})
    try:
        extra.stop()  # now nothing listens on its port
        results = run(proxy.url, n=N, concurrency=16)
        assert all(complete_stream(r) for r in results)
        dead = next(e for e in proxy.state.pool.endpoints() if e.url == extra.url)
        assert proxy.state.health.snapshot(dead).breaker == "open"
        if role == "decode":
            assert received(fleet4.prefillers) == N  # refused before the decoder saw it: KV handle reused
        fleet4.assert_clean(proxy)
    finally:
        proxy.stop()
