"""The routing pipeline in process: each filter, the scorers' arithmetic in tokens, the picker's tie-break across
independent schedulers (and processes), and prefix hints deciding against load."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from pdproxy.endpoints import Endpoint, Role, expand
from pdproxy.engines.control import EngineInfo
from pdproxy.engines.health import HealthMonitor
from pdproxy.engines.limits import Limits
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import ModelNotFound, NoEndpointAvailable
from pdproxy.scheduling import PickRequest, PrefixHints, Scheduler, rendezvous_weight
from pdproxy.scheduling import filters as f
from pdproxy.scheduling.queue import PrefillLedger

pytestmark = pytest.mark.timeout(30)

P = expand(["http://p0:1", "http://p1:1", "http://p2:1"], Role.PREFILL)
D = expand(["http://d0:1"], Role.DECODE, dp_size=4)
ALL = P + D


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def model_info(*ids: str, max_model_len: int | None = None, kv: int | None = None) -> EngineInfo:
    return EngineInfo(models=[{"id": i, "object": "model"} for i in ids], max_model_len=max_model_len,
                      kv_pool_tokens=kv, reachable=True)


def build(infos: dict[Endpoint, EngineInfo] | None = None, *, budget: int = 0, picker: str = "least_cost",
          clock: Clock | None = None) -> tuple[EndpointPool, HealthMonitor, PrefillLedger, Scheduler]:
    infos = infos if infos is not None else {e: EngineInfo() for e in ALL}
    pool = EndpointPool(ALL)
    health = HealthMonitor(pool, engines=None, infos=infos, interval_s=1.0, refresh_interval_s=1.0,  # type: ignore
                           breaker_failures=1, breaker_open_s=5.0, clock=clock or Clock())
    limits = Limits(pool, infos)
    ledger = PrefillLedger(pool, limits, budget_tokens=budget)
    return pool, health, ledger, Scheduler.standard(pool, health=health, infos=infos, limits=limits, ledger=ledger,
                                                    picker=picker)


# ---- filters, one by one ---------------------------------------------------------------------------------------

def test_health_draining_and_breaker_filters_each_remove_their_endpoint() -> None:
    pool, health, _, sched = build()
    req = PickRequest("r")
    pool.load(P[0]).healthy = False
    pool.load(P[1]).draining = True
    assert sched.eligible(Role.PREFILL, req) == [P[2]]
    health.record_failure(P[2])                                       # threshold 1: open
    with pytest.raises(NoEndpointAvailable) as refused:
        sched.pick(Role.PREFILL, req)
    assert "circuit breaker is open" in refused.value.message and refused.value.status_code == 503
    assert refused.value.headers["retry-after"] == "5"
    pool.load(P[1]).draining = False
    assert sched.pick(Role.PREFILL, req) == P[1]
    with pytest.raises(NoEndpointAvailable) as failed:
        sched.pick(Role.PREFILL, req, exclude=P)
    assert "all candidates failed for this request" in failed.value.message


def test_a_retry_leaves_out_the_failed_only_while_another_could_take_it() -> None:
    """A failure is a preference, not a ban: the failed engines are left out while another could serve the request
    (capacity aside), and once none could, only the banned ones (a dead core) are — the lone engine is tried again."""
    pool, _, _, sched = build()
    req = PickRequest("r")
    assert sched.retry_exclusion(Role.PREFILL, req, [P[0]], []) == [P[0]]           # P1, P2 could take it
    pool.load(P[2]).healthy = False
    assert sched.retry_exclusion(Role.PREFILL, req, [P[0], P[1]], [P[1]]) == [P[1]]   # P2 down: P0 again
    assert sched.retry_exclusion(Role.PREFILL, req, [], []) == []
    pinned = PickRequest("r", dp_rank=2)                                            # only D2 could take it
    assert sched.retry_exclusion(Role.DECODE, pinned, [D[2]], []) == []
    assert sched.retry_exclusion(Role.DECODE, req, [D[2]], []) == [D[2]]


def test_unhealthy_because_of_a_missing_engine_key_says_so() -> None:
    infos = {e: EngineInfo(auth_failed=e.role is Role.DECODE) for e in ALL}
    pool, _, _, sched = build(infos)
    for e in D:
        pool.load(e).healthy = False
    with pytest.raises(NoEndpointAvailable) as refused:
        sched.require(Role.DECODE, PickRequest("r"))
    assert "engine_api_key" in refused.value.message and "http://" not in refused.value.message
    pool.load(P[0]).healthy = False
    assert "engine_api_key" not in f.Healthy(pool, infos).refusal(Role.PREFILL, PickRequest()).message


def test_served_model_filter_keeps_servers_and_unknown_lists_and_404s_otherwise() -> None:
    infos = {P[0]: model_info("llama", "llama-lora-sql"), P[1]: model_info("qwen"), P[2]: EngineInfo(),
             **{d: model_info("llama") for d in D}}
    _, _, _, sched = build(infos)
    assert sched.eligible(Role.PREFILL, PickRequest("r", model="llama-lora-sql")) == [P[0], P[2]]  # P2: unknown
    assert sched.eligible(Role.PREFILL, PickRequest("r", model="qwen")) == [P[1], P[2]]
    assert sched.eligible(Role.PREFILL, PickRequest("r")) == P                 # no model asked: any
    with pytest.raises(ModelNotFound) as missing:
        sched.require(Role.DECODE, PickRequest("r", model="qwen"))
    err = missing.value
    assert err.status_code == 404 and err.param == "model" and err.rejection == ("model_not_found", "decode")
    assert err.body()["error"] == {   # P[1] serves it: a prefill/decode name mismatch, said after vLLM's words
        "message": "The model `qwen` does not exist. Valid aliases: llama. (`qwen` is served by prefill engines but "
                   "by no decode engine, and every request needs both: check each engine's --served-model-name)",
        "type": "NotFoundError", "param": "model", "code": 404}
    with pytest.raises(ModelNotFound) as nowhere:                     # served by no engine: vLLM's words alone
        sched.require(Role.DECODE, PickRequest("r", model="mistral"))
    assert nowhere.value.body()["error"]["message"] == "The model `mistral` does not exist. Valid aliases: llama."


def test_a_model_whose_engines_are_all_down_is_a_503_not_a_404() -> None:
    """The model filter runs first: when every endpoint serving the model is unhealthy the refusal is the health
    filter's 503 (try again), not vLLM's 404 listing the model as valid (what a new user saw after the admin API
    added an unreachable decoder pinned to a model)."""
    infos = {**{p: model_info("llama") for p in P}, D[0]: model_info("qwen"),
             **{d: model_info("llama") for d in D[1:]}}
    pool, _, _, sched = build(infos)
    pool.load(D[0]).healthy = False
    with pytest.raises(NoEndpointAvailable) as down:
        sched.require(Role.DECODE, PickRequest("r", model="qwen"))
    assert down.value.status_code == 503
    with pytest.raises(ModelNotFound):                                # nobody serves it at all: still the 404
        sched.require(Role.DECODE, PickRequest("r", model="mistral"))


def test_limits_filter_applies_each_roles_rule_to_the_upper_bound() -> None:
    infos = {P[0]: model_info(max_model_len=2048), P[1]: model_info(max_model_len=4096),
             P[2]: model_info(max_model_len=4096, kv=3000), **{d: model_info(max_model_len=4096) for d in D}}
    _, _, _, sched = build(infos)
    assert sched.eligible(Role.PREFILL, PickRequest("r", prompt_tokens=2047)) == P      # 2047 + 1 ≤ 2048
    fits = sched.eligible(Role.PREFILL, PickRequest("r", prompt_tokens=2000, prompt_tokens_upper=3500))
    assert fits == [P[1]]                                        # P0: max_model_len, P2: KV pool of 3,000
    assert sched.eligible(Role.DECODE, PickRequest("r", prompt_tokens=4095, max_output_tokens=500)) == D  # clamp
    assert sched.eligible(Role.DECODE, PickRequest("r", prompt_tokens=4096)) == []
    assert sched.eligible(Role.PREFILL, PickRequest("r")) == P                          # not counted: no limit


def test_dp_rank_filter_pins_a_rank() -> None:
    _, _, _, sched = build()
    assert sched.pick(Role.DECODE, PickRequest("r", dp_rank=2)) == D[2]
    assert sched.eligible(Role.DECODE, PickRequest("r")) == D
    with pytest.raises(NoEndpointAvailable, match="DP rank 7"):
        sched.pick(Role.DECODE, PickRequest("r", dp_rank=7))


def test_prefill_room_is_a_capacity_filter_over_the_ledger() -> None:
    _, _, ledger, sched = build(budget=1000)
    slots = [ledger.hold(p, 900, 901) for p in P]                 # every prefiller has 900 of 1,000 in flight
    small, large = PickRequest("s", prompt_tokens=100), PickRequest("l", prompt_tokens=101)
    assert sched.eligible(Role.PREFILL, small) == P
    assert sched.eligible(Role.PREFILL, large) == []              # no room now …
    assert sched.eligible(Role.PREFILL, large, capacity=False) == P   # … but each could take it later
    with pytest.raises(NoEndpointAvailable, match="prefill budget or KV pool is full"):
        sched.pick(Role.PREFILL, large)
    slots[1].prefill_done()
    assert sched.pick(Role.PREFILL, large) == P[1]
    for slot in slots:
        slot.release()
    assert ledger.idle()
    assert "prefill_room" not in {r.name for r in sched.profiles[Role.DECODE].filters}


def test_try_pick_is_pick_without_the_refusal() -> None:
    """The prefill queue's grant attempts: the same choice as ``pick``, None where ``pick`` raises (full, every
    one excluded, breaker open), and a half-open breaker's one trial slot taken as ``pick`` takes it."""
    clock = Clock()
    _, health, ledger, sched = build(budget=1000, clock=clock)
    slots = [ledger.hold(p, 900, 901) for p in P]
    large = PickRequest("l", prompt_tokens=101)
    assert sched.try_pick(Role.PREFILL, large) is None                 # where pick raises "budget … is full"
    slots[2].prefill_done()
    assert sched.try_pick(Role.PREFILL, large) == sched.pick(Role.PREFILL, large) == P[2]
    assert sched.try_pick(Role.PREFILL, large, exclude=[P[2]]) is None
    health.record_failure(P[2])                                       # threshold 1: open …
    assert sched.try_pick(Role.PREFILL, large) is None
    clock.now += 6                                                    # … half-open after 5 s: one trial
    assert sched.try_pick(Role.PREFILL, large) == P[2]
    assert sched.try_pick(Role.PREFILL, large) is None                # the trial is out: nobody else
    sched.unpick(P[2])
    assert sched.try_pick(Role.PREFILL, large) == P[2]
    for slot in slots:
        slot.release()


def test_the_first_filter_that_leaves_none_names_the_reason() -> None:
    infos = {e: model_info("llama") for e in ALL}
    pool, _, _, sched = build(infos)
    for p in P:
        pool.load(p).healthy = False
    with pytest.raises(NoEndpointAvailable, match="health checks"):   # served, but every prefiller is down
        sched.pick(Role.PREFILL, PickRequest("r", model="llama"))
    with pytest.raises(ModelNotFound):                                # served by none: the model filter first
        sched.pick(Role.PREFILL, PickRequest("r", model="other"))


# ---- scorers: tokens ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def prefilling(pool: EndpointPool, ledger: PrefillLedger, endpoint: Endpoint, tokens: int,
               compute: int | None = None) -> Iterator[None]:
    """A dispatched prefill as the director holds it: the queue's slot (its uncached ``compute`` tokens against
    the budget) and the pool's lease (the whole prompt's KV)."""
    slot = ledger.hold(endpoint, tokens, 0, compute)
    try:
        with pool.lease(endpoint, tokens):
            yield
    finally:
        slot.release()


def test_prefill_cost_is_uncached_plus_queued_prefill_tokens() -> None:
    pool, _, ledger, sched = build()
    hints = PrefixHints(cached_tokens={P[0]: 8000, P[1]: 2000})
    req = PickRequest("r", prompt_tokens=10_000, hints=hints)
    with (prefilling(pool, ledger, P[0], 5000), prefilling(pool, ledger, P[1], 500),
          prefilling(pool, ledger, P[1], 20_000, compute=500)):       # 19,500 of it cached: 500 to compute
        scores = sched.score(Role.PREFILL, req, P)
        assert scores == [(2000 + 5000, 1), (8000 + 1000, 2), (10_000, 0)]   # tokens, then requests
        assert sched.pick(Role.PREFILL, req) == P[0]


def test_a_busy_cache_holder_loses_to_an_idle_miss() -> None:
    pool, _, ledger, sched = build()
    hints = PrefixHints(cached_tokens={P[0]: 9_000})
    reqs = [PickRequest(f"r{i}", prompt_tokens=10_000, hints=hints) for i in range(20)]
    assert {sched.pick(Role.PREFILL, r) for r in reqs} == {P[0]}     # idle and holding the prefix: 1,000 wins
    with prefilling(pool, ledger, P[0], 120_000):                     # busy with a 120K-token prefill
        assert {sched.pick(Role.PREFILL, r) for r in reqs} == {P[1], P[2]}   # 121,000 > a full 10,000
    with prefilling(pool, ledger, P[0], 120_000, compute=2_000):      # a 120K turn, 118K cached: a small prefill
        assert {sched.pick(Role.PREFILL, r) for r in reqs} == {P[0]}     # 3,000 < 10,000


def test_a_prefix_every_prefiller_holds_spreads_by_load() -> None:
    pool, _, ledger, sched = build()
    everywhere = PrefixHints(cached_tokens=dict.fromkeys(P, 1500), routing_key=b"system-prompt")
    chosen = []
    with ExitStack() as held:                                     # held, as the director holds prefill slots
        for i in range(30):
            req = PickRequest(f"r{i}", prompt_tokens=1600, hints=everywhere)
            e = sched.pick(Role.PREFILL, req)
            chosen.append(e)
            held.enter_context(prefilling(pool, ledger, e, 1600, compute=100))
    assert Counter(chosen) == {P[0]: 10, P[1]: 10, P[2]: 10} and pool.idle() and ledger.idle()


def test_decoder_cost_is_requests_then_tokens() -> None:
    pool, _, _, sched = build()
    with pool.lease(D[0], 10), pool.lease(D[1], 50_000), pool.lease(D[2], 10), pool.lease(D[2], 10):
        assert sched.score(Role.DECODE, PickRequest(), D) == [(1, 10), (1, 50_000), (2, 20), (0, 0)]
        assert sched.pick(Role.DECODE, PickRequest()) == D[3]
        with pool.lease(D[3], 5), pool.lease(D[3], 5):
            assert sched.pick(Role.DECODE, PickRequest()) == D[0]   # one request, fewer tokens than D1


# ---- picker ------------------------------------------------------------------------------------------------------

def test_two_independent_schedulers_break_ties_the_same_way_and_keys_spread() -> None:
    _, _, _, a = build()
    _, _, _, b = build()
    keys = [f"conversation-{i}".encode() for i in range(300)]
    picks_a = [a.pick(Role.PREFILL, PickRequest("ra", hints=PrefixHints(routing_key=k))) for k in keys]
    picks_b = [b.pick(Role.PREFILL, PickRequest("rb", hints=PrefixHints(routing_key=k))) for k in keys]
    assert picks_a == picks_b
    assert picks_a == [max(P, key=lambda e: rendezvous_weight(k, e)) for k in keys]   # the highest weight wins
    assert min(Counter(picks_a).values()) > 60                    # ~100 each of 3
    by_id = [a.pick(Role.DECODE, PickRequest(f"req-{i}")) for i in range(400)]   # no key: the request id
    assert by_id == [b.pick(Role.DECODE, PickRequest(f"req-{i}")) for i in range(400)]
    assert min(Counter(by_id).values()) > 60                      # ~100 each of 4


def test_the_tie_break_is_the_same_in_another_process() -> None:
    keys = [f"k{i}" for i in range(50)]
    code = ("import json, sys; from pdproxy.endpoints import Role, expand; "
            "from pdproxy.scheduling import rendezvous_weight as w; "
            "P = expand(['http://p0:1', 'http://p1:1', 'http://p2:1'], Role.PREFILL); "
            "print(json.dumps([max(P, key=lambda e: w(k.encode(), e)).name for k in json.loads(sys.argv[1])]))")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(keys)], env=env, capture_output=True, text=True,
                         check=True, timeout=20).stdout
    here = [max(P, key=lambda e: rendezvous_weight(k.encode(), e)).name for k in keys]
    assert json.loads(out) == here


def test_power_of_two_is_available_and_unknown_pickers_fail() -> None:
    pool, _, _, sched = build(picker="power_of_two")
    with pool.lease(D[0], 1), pool.lease(D[0], 1):
        picks = {sched.pick(Role.DECODE, PickRequest()) for _ in range(100)}
    assert D[0] not in picks and len(picks) == 3
    with pytest.raises(ValueError, match="unknown routing picker"):
        build(picker="round_robin")


def test_at_debug_each_pick_is_one_line_with_every_candidates_costs(caplog: pytest.LogCaptureFixture) -> None:
    """``--log-level debug`` says why an engine was chosen: its costs beside the others', or that it was the only
    candidate, and which already failed the request."""
    import logging

    caplog.set_level(logging.DEBUG, logger="pdproxy.scheduling")
    _, _, _, sched = build()
    assert sched.pick(Role.PREFILL, PickRequest("r1", prompt_tokens=100), exclude=[P[2]]) in P[:2]
    assert sched.pick(Role.DECODE, PickRequest("r2", dp_rank=1)) == D[1]
    lines = [r.getMessage() for r in caplog.records if r.name == "pdproxy.scheduling"]
    assert len(lines) == 2
    assert lines[0].startswith("request r1: prefill on http://p") and "costs http://p0:1=" in lines[0]
    assert "http://p1:1=" in lines[0] and lines[0].endswith("; failed it already: http://p2:1)")
    assert lines[1] == "request r2: decode on http://d0:1#dp1 (prompt None tokens, dp_rank 1; costs the only candidate)"
    caplog.clear()
    caplog.set_level(logging.INFO, logger="pdproxy.scheduling")
    _, _, _, quiet = build()
    quiet.pick(Role.PREFILL, PickRequest("r3"))
    assert not [r for r in caplog.records if r.name == "pdproxy.scheduling"]
