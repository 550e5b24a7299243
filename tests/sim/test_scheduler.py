"""The engine-core model without sockets: EngineCore driven step by step with a fake clock (seconds)."""

from __future__ import annotations

import pytest

from pdproxy.sim.config import SimConfig
from pdproxy.sim.scheduler import EngineCore, EngineRequest, Status
from pdproxy.tokens import SimTokenizer, sim_prompt

pytestmark = pytest.mark.timeout(15)

SEED_000 = SimConfig(max_model_len=133120, block_size=4, num_gpu_blocks_override=1146)


def req(rid: str, n_prompt: int, max_tokens: int = 4, *, tokens: list[int] | None = None, **kw: object) -> EngineRequest:
    return EngineRequest(rid, tokens if tokens is not None else list(range(n_prompt)), max_tokens, 0.0, **kw)


class Clock:
    """Fake clock: ``run`` steps the core and advances by each step's modelled duration."""

    def __init__(self, core: EngineCore) -> None:
        self.core, self.now = core, 0.0
        self.finish_step: dict[str, int] = {}

    def step(self) -> None:
        plan, touched = self.core.step(self.now)
        self.now += plan.duration_s
        for r in touched:
            if r.finished:
                self.finish_step.setdefault(r.request_id, self.core.num_steps)

    def run(self, max_steps: int) -> None:
        for _ in range(max_steps):
            if not self.core.has_work():
                return
            self.step()


def test_seed_000_hol_blocking_a_10k_request_waits_forever_and_blocks_a_2_token_request() -> None:
    core = EngineCore(SEED_000.replace(hol_blocking=True))
    big, small = req("big", 10_000), req("small", 2)
    core.add_request(big)
    core.add_request(small)
    Clock(core).run(200)
    g = core.gauges()
    assert (g.running, g.waiting_capacity, g.waiting_deferred, g.kv_usage) == (0, 2, 0, 0.0)
    assert big.status is Status.WAITING and small.num_output_tokens == 0
    assert core.num_steps == 200  # the engine keeps stepping and nothing moves


def test_requests_kept_waiting_for_kv_blocks_are_counted_once_each() -> None:
    """``kv_capacity_waits`` (``/sim/state``) counts the requests a step could not place for want of free blocks,
    once each however many steps they wait; a request that fits is never counted."""
    core = EngineCore(SimConfig(max_model_len=2048, block_size=128, num_gpu_blocks_override=18))
    first, second = req("a", 2000, 2), req("b", 2000, 2, tokens=list(range(5000, 7000)))   # no shared prefix
    small = req("c", 2, 2, tokens=[9000, 9001])
    for r in (first, second):
        core.add_request(r)
    Clock(core).run(3)
    assert core.stats.kv_capacity_waits == 1 and second.kv_blocked and not first.kv_blocked
    Clock(core).run(200)
    assert second.finished and core.stats.kv_capacity_waits == 1
    core.add_request(small)
    Clock(core).run(50)
    assert small.finished and core.stats.kv_capacity_waits == 1


def test_seed_000_without_hol_blocking_the_small_request_goes_ahead() -> None:
    core = EngineCore(SEED_000.replace(hol_blocking=False))
    big, small = req("big", 10_000), req("small", 2)
    core.add_request(big)
    core.add_request(small)
    Clock(core).run(50)
    assert small.finish_reason == "length" and big.status is Status.WAITING
    assert core.gauges().waiting_capacity == 1


def test_seed_000_with_an_8x_pool_both_complete() -> None:
    core = EngineCore(SEED_000.replace(num_gpu_blocks_override=1146 * 8))
    big, small = req("big", 10_000), req("small", 2)
    core.add_request(big)
    core.add_request(small)
    Clock(core).run(100)
    assert (big.finish_reason, small.finish_reason) == ("length", "length")
    assert core.pool.num_used == 0 and not core.has_work()


def long_prefill_race(threshold: int) -> tuple[Clock, int]:
    cfg = SimConfig(max_model_len=131072, max_num_batched_tokens=8192, long_prefill_token_threshold=threshold,
                    prefill_tokens_per_s=10_000, step_overhead_s=0.01)
    core = EngineCore(cfg)
    clock = Clock(core)
    core.add_request(req("long", 120_000, 1))
    clock.run(3)  # the long prefill is running when the short request arrives
    core.add_request(req("short", 2, 1))
    arrived_at = core.num_steps
    clock.run(100)
    return clock, arrived_at


def test_chunked_prefill_a_2_token_request_finishes_within_a_few_steps_of_a_120k_prefill() -> None:
    clock, arrived = long_prefill_race(threshold=8192 - 256)
    long_done, short_done = clock.finish_step["long"], clock.finish_step["short"]
    assert short_done - arrived <= 2 < long_done - arrived
    assert long_done >= 120_000 // 7936  # the long prompt still needs its ~16 chunks


def test_without_a_long_prefill_threshold_the_running_prefill_takes_the_whole_budget() -> None:
    clock, _ = long_prefill_race(threshold=0)  # vLLM's default (vllm/config/scheduler.py): TTFT head-of-line
    assert clock.finish_step["short"] >= clock.finish_step["long"]  # admitted into the last chunk's leftover budget
    assert clock.finish_step["long"] == -(-120_000 // 8192)


def test_step_time_follows_the_documented_model() -> None:
    cfg = SimConfig(prefill_tokens_per_s=1000, decode_tokens_per_s=50, step_overhead_s=0.01, decode_seq_cost_s=0.001)
    core = EngineCore(cfg)
    core.add_request(req("a", 100, 3))
    core.add_request(req("b", 100, 3, tokens=list(range(1000, 1100))))   # no prefix shared with "a"
    plan, _ = core.step(0.0)
    assert (plan.prefill_tokens, plan.decode_tokens) == (200, 2)
    assert plan.duration_s == pytest.approx(0.01 + 200 / 1000 + 1 / 50 + 2 * 0.001)
    plan, _ = core.step(1.0)
    assert (plan.prefill_tokens, plan.decode_tokens) == (0, 2)
    assert plan.duration_s == pytest.approx(0.01 + 1 / 50 + 0.002)


def test_max_num_seqs_caps_running() -> None:
    core = EngineCore(SimConfig(max_num_seqs=2))
    for i in range(5):
        core.add_request(req(f"r{i}", 4, 10))
    core.step(0.0)
    assert len(core.running) == 2 and len(core.waiting) == 3


def test_prefix_cache_repeated_filler_hits_and_unique_text_does_not() -> None:
    tok = SimTokenizer()
    core = EngineCore(SimConfig(max_model_len=20_000, block_size=16))
    clock = Clock(core)
    cached = {}
    for i in range(3):
        for kind, text in (("filler", sim_prompt(4000)), ("unique", sim_prompt(4000, unique=True, seed=100 + i))):
            r = req(f"{kind}{i}", 0, 1, tokens=tok.encode(text))
            core.add_request(r)
            clock.run(10)
            cached[r.request_id] = r.num_cached_tokens
    assert cached["filler0"] == 0 and cached["filler1"] >= 3984 and cached["filler2"] >= 3984
    assert cached["unique0"] == cached["unique1"] == cached["unique2"] == 0
    assert core.stats.prefix_cache_hits == cached["filler1"] + cached["filler2"]
    assert core.stats.prefix_cache_queries == 6 * 4000


def test_prefix_cache_off_never_hits() -> None:
    core = EngineCore(SimConfig(enable_prefix_caching=False))
    for i in range(2):
        r = req(f"r{i}", 100, 1)
        core.add_request(r)
        Clock(core).run(5)
        assert r.num_cached_tokens == 0


def test_decode_out_of_blocks_preempts_the_last_running_request_and_recomputes() -> None:
    core = EngineCore(SimConfig(block_size=4, num_gpu_blocks_override=4, max_model_len=64))
    a, b = req("a", 4, 6), req("b", 4, 6)
    core.add_request(a)
    core.add_request(b)
    Clock(core).run(60)
    assert core.stats.num_preemptions >= 1
    assert a.finish_reason == b.finish_reason == "length"
    assert a.num_output_tokens == b.num_output_tokens == 6
    assert core.pool.num_used == 0


def test_recompute_stop_finishes_the_victim_with_stop_reason_recomputed() -> None:
    core = EngineCore(SimConfig(block_size=4, num_gpu_blocks_override=4, max_model_len=64, recompute_stop=True))
    a, b = req("a", 4, 6), req("b", 4, 6)
    core.add_request(a)
    core.add_request(b)
    Clock(core).run(60)
    assert (b.finish_reason, b.stop_reason) == ("stop", "recomputed") and b.num_output_tokens < 6
    assert a.finish_reason == "length" and core.pool.num_used == 0


def test_abort_frees_blocks_at_any_stage() -> None:
    core = EngineCore(SimConfig(max_num_batched_tokens=64))
    running, waiting = req("run", 500, 10), req("wait", 10, 10)
    core.add_request(running)
    core.step(0.0)
    core.add_request(waiting)
    assert core.pool.num_used > 0
    assert core.abort(running, 1.0) and core.abort(waiting, 1.0)
    assert not core.abort(running, 1.0)
    assert core.pool.num_used == 0 and not core.has_work() and core.num_aborted == 2


def test_prefiller_pins_length_capped_requests_until_released_or_expired() -> None:
    core = EngineCore(SimConfig(kv_pin_timeout_s=480.0))
    kept, expired, eos = (req("kept", 100, 1, pin_on_finish=True),     # distinct prompts: no shared blocks
                          req("exp", 50, 1, pin_on_finish=True, tokens=list(range(1000, 1050))),
                          req("eos", 100, 1, pin_on_finish=True, eos_after=1, tokens=list(range(2000, 2100))))
    for r in (kept, expired, eos):
        core.add_request(r)
    Clock(core).run(5)
    assert set(core.pins) == {"kept", "exp"}  # a first-token EOS ("stop") returns no params and frees at once
    assert core.gauges().pinned_blocks == 7 + 4 and core.pool.num_used == 11
    core.pins["kept"].pulling = True
    assert core.expire_pins(480.0) == ["exp"] and core.stats.kv_expired_reqs == 1
    assert core.release_pin("kept") is not None and core.release_pin("kept") is None
    assert core.pool.num_used == 0


def test_decoder_waits_deferred_then_recomputes_only_the_last_prompt_token() -> None:
    core = EngineCore(SimConfig(prefill_tokens_per_s=1000))
    r = req("d", 1000, 3, remote_prefill={"remote_request_id": "x"})
    core.add_request(r)
    plan, _ = core.step(0.0)
    assert plan.pulls == [r] and core.gauges().waiting_deferred == 1 and core.pool.num_used == 63
    plan, _ = core.step(0.0)
    assert plan.empty  # nothing to do until the pull finishes
    core.finish_remote_kv(r, True, 0.0)
    plan, _ = core.step(0.0)
    assert plan.prefill_tokens == 1 and r.num_output_tokens == 1
    # vLLM 0.32 (NIXL): usage cached_tokens 0; the whole prompt counts as external_kv_transfer, none as local
    assert r.num_cached_tokens == 0
    assert (core.stats.prompt_tokens_external, core.stats.prompt_tokens_local, core.stats.prompt_tokens) == (
        1000, 0, 1000)
    assert core.stats.nixl_xfer_time.count == 1
    Clock(core).run(5)
    assert r.finish_reason == "length" and core.pool.num_used == 0


def test_failed_pull_finishes_with_error_and_frees_blocks() -> None:
    core = EngineCore(SimConfig())
    r = req("d", 100, 3, remote_prefill={"remote_request_id": "x"})
    core.add_request(r)
    core.step(0.0)
    core.finish_remote_kv(r, False, 0.0)
    assert r.finish_reason == "error" and r.kv_failed and core.pool.num_used == 0 and not core.has_work()


def test_a_preempted_remote_prefill_request_recomputes_its_prompt_instead_of_pulling_again() -> None:
    """vLLM pulls a request's KV once (``do_remote_prefill`` cleared after the first allocation): when decode runs
    out of blocks and preempts it, it recomputes locally and finishes — no second pull that would find the
    prefiller's blocks freed."""
    core = EngineCore(SimConfig(block_size=4, num_gpu_blocks_override=5, max_model_len=64))
    a, b = req("a", 8, 8), req("b", 4, 8, remote_prefill={"remote_request_id": "x"}, tokens=list(range(100, 104)))
    core.add_request(a)
    core.add_request(b)
    pulls: list[EngineRequest] = []
    now = 0.0
    for _ in range(200):
        if not core.has_work():
            break
        plan, _ = core.step(now)
        now += plan.duration_s
        for r in plan.pulls:
            pulls.append(r)
            core.finish_remote_kv(r, True, now)
    assert core.stats.num_preemptions >= 1
    assert pulls == [b]
    assert a.finish_reason == b.finish_reason == "length" and not b.kv_failed
    assert a.num_output_tokens == b.num_output_tokens == 8 and core.pool.num_used == 0
