"""The engine core of one DP rank: vLLM V1's scheduler, as a pure state machine driven by an explicit clock.

``EngineCore.schedule()`` plans one step and ``EngineCore.complete(plan, now)`` applies it. Tests call
:meth:`EngineCore.step` with a fake clock; the async runner sleeps ``plan.duration_s`` between the two.
The model follows ``vllm/v1/core/sched/scheduler.py`` (v0.26):

* token budget ``max_num_batched_tokens`` per step. RUNNING requests are served first, in list order. Each
  takes ``min(remaining, long_prefill_token_threshold or ∞, budget)`` tokens, so a decode takes 1 and a
  chunked prefill takes the rest of the budget;
* then WAITING requests in FCFS order, while ``len(running) < max_num_seqs`` and budget remains. This is
  skipped in a step that preempted;
* admission reserves blocks for the *whole* prompt (``scheduler_reserve_full_isl=True``, the v0.26 default),
  minus prefix-cache hits. If the head of the queue cannot get its blocks, either admission stops
  (``hol_blocking=True``: vLLM-Ascend 0.23 in ``docs/field-reports.md``, and vLLM 0.32 on CPU as measured by
  ``tests/real_vllm/test_kv_pressure.py``) or later requests that fit go ahead (``hol_blocking=False``: a
  what-if; vLLM 0.32's ``schedule()`` stops at the first waiting request ``allocate_slots`` cannot place);
* a RUNNING request that cannot get a block preempts the *last* running request (recompute: its blocks are
  freed, and it re-prefills prompt + output later). With ``recompute_stop`` the victim instead finishes with
  ``finish_reason="stop"``, ``stop_reason="recomputed"`` (vLLM-Ascend ``RecomputeScheduler`` on a kv_consumer);
* a decoder request with remote prefill (``do_remote_prefill``) first gets its prompt blocks, then waits in
  ``WAITING_FOR_REMOTE_KVS`` (counted as ``reason="deferred"``) until its pull finishes. It then has
  ``num_computed_tokens = prompt - 1`` and recomputes only the last prompt token;
* a prefiller request with ``do_remote_decode`` that finishes length-capped keeps its blocks *pinned* until
  :meth:`release_pin` or expiry (``expire_pins``).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdproxy.sim.config import SimConfig
from pdproxy.sim.kvcache import BlockPool, block_hashes, blocks_for
from pdproxy.sim.metrics import EngineStats, RankGauges

KV_BYTES_PER_TOKEN = 1024
"""Modelled KV bytes per token for ``vllm:nixl_bytes_transferred`` (the tiny real-vLLM model's figure: 2 layers
× 2 KV heads × head_dim 64 × K and V × 2 bytes)."""


class Status(enum.Enum):
    """Request lifecycle states (subset of ``vllm/v1/request.py::RequestStatus``)."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class EngineRequest:
    """One sequence inside the engine. ``max_tokens`` caps output (finish "length"). ``eos_after`` is the
    natural output length (finish "stop"; None = never). Times are loop seconds."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_at: float
    eos_after: int | None = None
    remote_prefill: dict[str, Any] | None = None
    pin_on_finish: bool = False
    listener: Callable[[EngineRequest], None] | None = None
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = -1
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    unannounced: list[int] = field(default_factory=list)
    """Indices of blocks cached when this step allocated them, whose ``BlockStored`` goes out when it completes."""
    kv_ready: bool = False
    kv_failed: bool = False
    kv_blocked: bool = False
    """A step could not place it for want of free KV blocks (counted once in ``EngineStats.kv_capacity_waits``)."""
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None
    pinned: bool = False
    external_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt length in tokens."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.prompt_token_ids) + self.num_output_tokens

    @property
    def finished(self) -> bool:
        """Whether the request has left the engine (its blocks may still be pinned)."""
        return self.status is Status.FINISHED


@dataclass(slots=True)
class Pin:
    """KV blocks a prefiller keeps for a decoder (``remote_request_id`` → blocks until ``expires_at``)."""

    request: EngineRequest
    blocks: list[int]
    expires_at: float
    pulling: bool = False


@dataclass(slots=True)
class StepPlan:
    """One scheduled step: ``(request, num_tokens)`` pairs, its token mix and modelled duration (seconds)."""

    scheduled: list[tuple[EngineRequest, int]]
    prefill_tokens: int
    decode_tokens: int
    duration_s: float
    pulls: list[EngineRequest]
    finished_early: list[EngineRequest]

    @property
    def empty(self) -> bool:
        """True when nothing was scheduled and nothing changed (the engine is idle or blocked)."""
        return not self.scheduled and not self.pulls and not self.finished_early


class EngineCore:
    """The scheduler + KV pool of one rank. Not thread-safe; owned by one event loop (or one test)."""

    def __init__(self, config: SimConfig, dp_rank: int = 0) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.pool = BlockPool(config.num_gpu_blocks, config.block_size, config.enable_prefix_caching)
        self.running: list[EngineRequest] = []
        self.waiting: deque[EngineRequest] = deque()
        self.pins: dict[str, Pin] = {}
        self.stats = EngineStats()
        self.num_steps = 0
        self.num_finished = 0
        self.num_aborted = 0
        self._now = 0.0

    # ---- requests in ------------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Queue ``request`` (FCFS). Its prompt block hashes are computed here."""
        request.hashes = block_hashes(request.prompt_token_ids, self.config.block_size)
        request.status = Status.WAITING
        self.waiting.append(request)

    def abort(self, request: EngineRequest, now: float) -> bool:
        """Finish ``request`` with reason "abort" and free its blocks. Returns False if it had finished."""
        if request.finished:
            return False
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.num_aborted += 1
        self._finish(request, "abort", now)
        return True

    def finish_remote_kv(self, request: EngineRequest, ok: bool, now: float, xfer_s: float = 0.0) -> None:
        """Mark a deferred request's pull done (``xfer_s``: its duration, seconds). On failure it finishes with
        reason "error" (policy "fail").

        Like vLLM 0.32 on a decoder: the whole prompt counts as ``external_kv_transfer`` (and as cached in
        ``vllm:prompt_tokens_cached_total``), nothing as ``local_compute``. The response's
        ``usage.prompt_tokens_details.cached_tokens`` is 0 with the NIXL connector (vLLM 0.32 as observed) and
        ``prompt - 1`` with Mooncake (vLLM-Ascend counts local + external hits there).
        """
        if request.finished:
            return
        if ok:
            prompt = request.num_prompt_tokens
            request.kv_ready = True
            request.num_computed_tokens = prompt - 1
            request.num_cached_tokens = 0 if self.config.kv_connector == "nixl" else prompt - 1
            request.external_tokens = prompt
            stats = self.stats
            stats.prompt_tokens += prompt
            stats.prompt_tokens_external += prompt
            stats.prompt_tokens_cached += prompt
            blocks = len(request.blocks)
            stats.nixl_xfer_time.observe(xfer_s)
            stats.nixl_post_time.observe(min(xfer_s, 0.001))
            stats.nixl_bytes.observe(blocks * self.config.block_size * KV_BYTES_PER_TOKEN)
            stats.nixl_descriptors.observe(2 * blocks)
            full = request.num_computed_tokens // self.config.block_size
            self.pool.cache_blocks(request.blocks[:full], request.hashes[:full], request.prompt_token_ids)
            return
        request.kv_failed = True
        self.stats.kv_failed_transfers += 1
        try:
            self.waiting.remove(request)
        except ValueError:
            pass
        self._finish(request, "error", now)

    # ---- pins (prefiller side) ----------------------------------------------------------------------------
    def release_pin(self, remote_request_id: str) -> Pin | None:
        """Free a pinned request's blocks (decoder pulled them, or told us it never will)."""
        pin = self.pins.pop(remote_request_id, None)
        if pin is not None:
            self.pool.free(pin.blocks)
            pin.request.pinned = False
        return pin

    def clear_pins(self) -> int:
        """Release every pin (pulling or not) without counting it as expired; returns how many there were."""
        rids = list(self.pins)
        for rid in rids:
            self.release_pin(rid)
        return len(rids)

    def expire_pins(self, now: float) -> list[str]:
        """Free pins whose ``expires_at`` has passed; returns their ids (``vllm:nixl_num_kv_expired_reqs``)."""
        expired = [rid for rid, pin in self.pins.items() if pin.expires_at <= now and not pin.pulling]
        for rid in expired:
            self.release_pin(rid)
            self.stats.kv_expired_reqs += 1
        return expired

    def next_pin_expiry(self) -> float | None:
        """The earliest ``expires_at`` of the current pins, or None."""
        return min((p.expires_at for p in self.pins.values()), default=None)

    # ---- one step ---------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """Whether a step could make progress (something running, or something waiting)."""
        return bool(self.running or self.waiting)

    def schedule(self, now: float) -> StepPlan:
        """Plan one step at ``now`` (allocates blocks, admits waiting requests, preempts). See the module docstring."""
        self._now = now
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold
        scheduled: list[tuple[EngineRequest, int]] = []
        finished_early: list[EngineRequest] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if threshold > 0:
                n = min(n, threshold)
            need = blocks_for(req.num_computed_tokens + n, cfg.block_size) - len(req.blocks)
            while need > self.pool.num_free:
                victim = self.running.pop()
                preempted = True
                self._preempt(victim, finished_early)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            if need > 0:
                req.blocks.extend(self.pool.allocate(need))
            self._cache_scheduled(req, n)
            scheduled.append((req, n))
            budget -= n
            i += 1
        pulls: list[EngineRequest] = []
        if not preempted:
            budget = self._admit(budget, threshold, scheduled, pulls)
        prefill = decode = 0
        for req, n in scheduled:
            if req.num_computed_tokens + n >= req.num_tokens:
                decode += 1
            if req.num_computed_tokens < req.num_prompt_tokens + max(req.num_output_tokens - 1, 0):
                prefill += n
        duration = 0.0
        if scheduled:
            duration = cfg.step_overhead_s
            if cfg.prefill_tokens_per_s > 0:
                duration += prefill / cfg.prefill_tokens_per_s
            if cfg.decode_tokens_per_s > 0 and decode:
                duration += 1.0 / cfg.decode_tokens_per_s
            duration += decode * cfg.decode_seq_cost_s
            duration *= cfg.slow_factor
        return StepPlan(scheduled, prefill, decode, duration, pulls, finished_early)

    def _admit(self, budget: int, threshold: int, scheduled: list[tuple[EngineRequest, int]],
               pulls: list[EngineRequest]) -> int:
        cfg = self.config
        skipped: list[EngineRequest] = []
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[0]
            if req.status is Status.WAITING_FOR_REMOTE_KVS:
                if not req.kv_ready:
                    skipped.append(self.waiting.popleft())
                    continue
                req.status = Status.WAITING
            if req.remote_prefill is not None and not req.blocks:
                need = blocks_for(req.num_prompt_tokens, cfg.block_size)
                if not self.pool.can_allocate(need):
                    self._kv_blocked(req)
                    if cfg.hol_blocking:
                        break
                    skipped.append(self.waiting.popleft())
                    continue
                req.blocks = self.pool.allocate(need)
                req.status = Status.WAITING_FOR_REMOTE_KVS
                self.stats.prefix_cache_queries += req.num_prompt_tokens
                self.stats.external_prefix_cache_queries += req.num_prompt_tokens
                self.stats.external_prefix_cache_hits += req.num_prompt_tokens
                pulls.append(req)
                skipped.append(self.waiting.popleft())
                continue
            cached: list[int] = []
            if req.num_computed_tokens == 0 and not req.blocks:
                cached = self.pool.cached_prefix(req.hashes, req.num_tokens - 1)
            need = blocks_for(req.num_tokens, cfg.block_size) - len(cached) - len(req.blocks)
            if not self.pool.can_allocate(max(need, 0), cached):
                self._kv_blocked(req)
                if cfg.hol_blocking:
                    break
                skipped.append(self.waiting.popleft())
                continue
            self.waiting.popleft()
            if need > 0 or cached:
                req.blocks = [*req.blocks, *self.pool.allocate(max(need, 0), cached)]
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = len(cached) * cfg.block_size
                stats = self.stats
                stats.prefix_cache_queries += req.num_prompt_tokens
                stats.prefix_cache_hits += req.num_cached_tokens
                stats.prompt_tokens_cached += req.num_cached_tokens
                stats.prompt_tokens_cache_hit += req.num_cached_tokens
                stats.prompt_tokens += req.num_cached_tokens
                stats.external_prefix_cache_queries += req.num_prompt_tokens - req.num_cached_tokens
            if cached:
                req.num_computed_tokens = len(cached) * cfg.block_size
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if threshold > 0:
                n = min(n, threshold)
            req.status = Status.RUNNING
            if req.scheduled_at is None:
                req.scheduled_at = self._now
            self.running.append(req)
            self._cache_scheduled(req, n)
            scheduled.append((req, n))
            budget -= n
        if skipped:
            self.waiting.extendleft(reversed(skipped))
        return budget

    def _kv_blocked(self, req: EngineRequest) -> None:
        if not req.kv_blocked:
            req.kv_blocked = True
            self.stats.kv_capacity_waits += 1

    def _cache_scheduled(self, req: EngineRequest, n: int) -> None:
        """Cache the prompt blocks ``req`` fills in this step (``n`` tokens) now, as vLLM does when it allocates
        them (``vllm/v1/core/kv_cache_manager.py::allocate_slots``): a request admitted after it in this step
        finds them.  Their ``BlockStored`` events wait for the step to complete."""
        if req.remote_prefill is not None or req.num_computed_tokens >= req.num_prompt_tokens:
            return
        full = min(req.num_computed_tokens + n, req.num_prompt_tokens) // self.config.block_size
        new = self.pool.cache_blocks(req.blocks[:full], req.hashes[:full], req.prompt_token_ids, announce=False)
        req.unannounced.extend(new)

    def complete(self, plan: StepPlan, now: float) -> list[EngineRequest]:
        """Apply ``plan`` at time ``now``: advance computed tokens, sample, finish. Returns requests with news."""
        self.num_steps += 1
        touched: list[EngineRequest] = list(plan.finished_early)
        bs = self.config.block_size
        for req, n in plan.scheduled:
            if req.unannounced:
                self.pool.announce(req.unannounced, req.hashes, req.prompt_token_ids)
                req.unannounced = []
            if req.status is not Status.RUNNING:
                continue
            before = req.num_computed_tokens
            req.num_computed_tokens += n
            if before < req.num_prompt_tokens:
                local = min(req.num_computed_tokens, req.num_prompt_tokens) - max(before, req.external_tokens)
                if local > 0:
                    self.stats.prompt_tokens += local
                    self.stats.prompt_tokens_local += local
                done = min(req.num_computed_tokens, req.num_prompt_tokens) // bs
                self.pool.cache_blocks(req.blocks[:done], req.hashes[:done], req.prompt_token_ids)
            if req.num_computed_tokens < req.num_tokens:
                continue
            req.num_output_tokens += 1
            self.stats.generation_tokens += 1
            if req.first_token_at is None:
                req.first_token_at = now
                self.stats.ttft.observe(now - req.arrival_at)
                if req.scheduled_at is not None:
                    self.stats.queue_time.observe(max(req.scheduled_at - req.arrival_at, 0.0))
            elif req.last_token_at is not None:
                self.stats.itl.observe(now - req.last_token_at)
            req.last_token_at = now
            if req.eos_after is not None and req.num_output_tokens >= req.eos_after:
                self.running.remove(req)
                self._finish(req, "stop", now)
            elif req.num_output_tokens >= req.max_tokens:
                self.running.remove(req)
                self._finish(req, "length", now)
            touched.append(req)
        return touched

    def step(self, now: float) -> tuple[StepPlan, list[EngineRequest]]:
        """Schedule and complete one step at ``now`` (tests: advance a fake clock by ``plan.duration_s``)."""
        plan = self.schedule(now)
        return plan, self.complete(plan, now + plan.duration_s)

    # ---- internals --------------------------------------------------------------------------------------
    def _preempt(self, victim: EngineRequest, finished_early: list[EngineRequest]) -> None:
        self.stats.num_preemptions += 1
        if self.config.recompute_stop:
            victim.stop_reason = "recomputed"
            self._finish(victim, "stop", self._now)
            finished_early.append(victim)
            return
        self.pool.free(victim.blocks)
        victim.blocks = []
        victim.num_computed_tokens = 0
        victim.external_tokens = 0
        # vLLM pulls a prompt's KV once per request (``do_remote_prefill`` is cleared once its blocks are allocated:
        # vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py, "Only trigger 1 KV transfer per
        # request"): a preempted request recomputes its prompt here; a second pull would find the prefiller's
        # blocks freed and fail the request
        victim.remote_prefill = None
        victim.status = Status.PREEMPTED
        self.waiting.appendleft(victim)

    def _finish(self, req: EngineRequest, reason: str, now: float) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.num_finished += 1
        self.stats.success[reason] = self.stats.success.get(reason, 0) + 1
        self.stats.e2e.observe(max(now - req.arrival_at, 0.0))
        if req.pin_on_finish and reason == "length" and req.blocks:
            self.pins[req.request_id] = Pin(req, req.blocks, now + self.config.kv_pin_timeout_s)
            req.pinned = True
        elif req.blocks:
            self.pool.free(req.blocks)
        req.blocks = []

    def gauges(self) -> RankGauges:
        """Current gauge values (running, waiting by reason, KV usage, pins)."""
        remote = [r for r in self.waiting if r.status is Status.WAITING_FOR_REMOTE_KVS]
        loaded = sum(1 for r in remote if r.kv_ready)
        return RankGauges(len(self.running), len(self.waiting) - len(remote), len(remote), self.pool.usage,
                          sum(len(p.blocks) for p in self.pins.values()), len(self.pins),
                          kv_fetch_in_progress=len(remote) - loaded, kv_fetch_completed_waiting=loaded)
