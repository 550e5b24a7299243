"""The proxy-side prefill queue: a per-prefiller budget of in-flight prefill tokens, small prompts ahead of large
ones with aging, dispatch tied to decoder capacity, 429 when full, 503 past the deadline.

Why: vLLM's scheduler serves RUNNING requests first (``vllm/v1/core/sched/scheduler.py::schedule``), so a running
chunked prefill takes the whole token budget every step until it ends; prompts that reach an engine behind it wait
for all of it.  Holding large prompts here instead of piling them onto engines' FCFS queues keeps the order ours to
choose.

Two parts: :class:`PrefillLedger` counts what is held against each prefiller and reserved on the decoders (its
:meth:`~PrefillLedger.has_room` is the scheduler's prefill-room filter,
:class:`~pdproxy.scheduling.filters.HasPrefillRoom`); :class:`PrefillQueue` makes requests wait, in order, until
the scheduler finds a prefiller that passes every filter including that one.

- **Budget.**  A prefiller may hold ``budget_tokens`` of dispatched-but-unanswered prefill tokens; a prompt larger
  than the budget runs only on an otherwise idle prefiller.  ``budget_tokens = 0`` turns the budget off.  The
  tokens counted are those the prefiller will compute: the prompt minus what the prefix index says it holds
  (``PickRequest.hints``, :mod:`pdproxy.prefix.routing`), so a 100K-token turn with 99K cached is a 1K prefill.
  What a prompt queued behind them waits for is time, so with ``budget_s`` > 0 the budget is the larger of
  ``budget_tokens`` and the tokens the prefiller computes in ``budget_s`` seconds at its measured rate
  (:mod:`pdproxy.scheduling.prefill_rate`, from answers that report their cached tokens): a prefiller that
  answers a 64K-token prompt in milliseconds takes several, one that needs seconds keeps the token budget.
- **KV pool.**  The prompt tokens in flight *or pinned* on a prefiller must also fit its KV pool
  (``EngineInfo.kv_pool_tokens`` via :class:`~pdproxy.engines.limits.Limits`, from ``vllm:cache_config_info``): after the
  prefill the engine keeps the prompt's blocks until the decoder pulls them (the KV connector's delayed free,
  ``request_finished`` in ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py``), and the director
  holds the prefill's pool lease until the decoder starts answering.  So the effective per-prefiller budget is
  ``min(budget, kv pool)``, counted over the pool's prefill leases (plus slots granted but not yet leased)
  rather than over unanswered prefills only.  Counting is in whole blocks (``block_size``; a held lease counts as
  at most ``block_size − 1`` tokens more than its prompt), as vLLM allocates them.  Without it a second long
  prompt is dispatched and waits inside the engine, where it holds every smaller request behind it (vLLM's
  head-of-line blocking: docs/field-reports.md).
- **Order.**  Waiters are served by ``key = uncached tokens − aging_tokens_per_s × waited_s`` (smallest first;
  uncached = the prompt minus the most any prefiller holds of it, the whole prompt when nothing is known): a
  small prompt goes ahead of a large one, and a large one's key falls every second it waits until it is first.
  Dispatch is strict in that order (the first waiter that cannot be placed blocks the ones behind it), so a large
  prompt is never starved.
- **Decoder capacity.**  A prefill is dispatched only if the decoders' free KV (their KV pool minus the tokens the
  pool's decode leases hold — each its prompt and at most ``decode_reserved_output_tokens`` of its output,
  :func:`pdproxy.pd.decode.decode_lease_tokens` — minus the prefills already dispatched and not yet decoding) has
  room for the prompt + 1 token, and (``decoder_max_requests`` > 0) a decoder has a free request slot.  A prefill
  whose decoder never comes would only pin KV on the prefiller until the connector's timeout frees it.
- **Bounds.**  More than ``max_waiting`` waiters → :class:`~pdproxy.errors.Overloaded` (429, ``Retry-After``);
  waiting longer than ``timeout_s`` → :class:`QueueTimeout` (503, ``Retry-After``).  Nothing waits forever.

Waiters are re-checked when a slot's prefill ends or its decode starts and when any pool lease is released
(:meth:`EndpointPool.add_release_listener`: a prefill lease ending unpins prefiller KV, a decode lease ending frees
decoder KV), synchronously inside that release; the ``poll_s`` poll is only the safety net (one re-check per
``poll_s`` however many wait).

Single event loop, no awaits while the state is changed, so no locks within a process.  With ``--workers N`` the
counts live on the shared load board (:class:`LedgerCounts` is the per-process store, :mod:`pdproxy.workers.ledger`
the shared one): every room check reads the totals of all workers, and a grant re-checks the room and publishes its
reservation inside the board's lock (:meth:`PrefillLedger.try_hold`), so two workers granting at the same instant
cannot overshoot the budget, the KV pool or the decoders' reservation.  Each worker orders its own waiters; across
workers, a worker does not grant ahead of another worker's first blocked waiter with a smaller key
(:meth:`LedgerCounts.ahead_elsewhere`), so the order — and "a large prompt is never starved" — is global too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.limits import EngineLimits, Limits
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import Overloaded, QueueTimeout
from pdproxy.scheduling.prefill_rate import PrefillRate, computed_tokens
from pdproxy.scheduling.request import PickRequest
from pdproxy.scheduling.scheduler import Scheduler

POLL_S = 0.25
"""The queue re-checks its waiters at least this often (seconds, default of ``poll_s``; once per interval however
many wait): health and KV-pool refreshes do not notify the queue.  This process's slot and pool-lease releases do,
and with ``--workers N`` so do the other workers' (a wake-up, :mod:`pdproxy.workers.wakeup`)."""
FULL_RETRY_AFTER_S = 2


@dataclass(slots=True)
class QueueStats:
    """Counters for metrics (``waited_total``: requests that had to wait; ``wait_seconds_total``: their time)."""

    granted_total: int = 0
    waited_total: int = 0
    rejected_full_total: int = 0
    timed_out_total: int = 0
    wait_seconds_total: float = 0.0


def _nothing() -> None:
    return None


class PrefillSlot:
    """One dispatched prefill of a ``tokens``-token prompt: ``compute_tokens`` of it (the tokens the prefiller
    has not cached; default all) held against ``endpoint``'s budget until :meth:`prefill_done` (the ledger's
    in-flight count), the whole prompt unleased until :meth:`handed_over`, and ``decode_tokens`` reserved on the
    decoders until :meth:`decode_started`.  The releases are idempotent."""

    __slots__ = ("_counts", "_decode_held", "_ledger", "_long", "_prefill_held", "_rate", "_unleased",
                 "compute_tokens", "decode_tokens", "endpoint", "tokens")

    def __init__(self, ledger: PrefillLedger, endpoint: Endpoint, tokens: int, decode_tokens: int,
                 compute_tokens: int | None = None) -> None:
        self._ledger = ledger
        self._counts = counts = ledger.counts
        self.endpoint = endpoint
        self.tokens = tokens
        self.compute_tokens = tokens if compute_tokens is None else compute_tokens
        self.decode_tokens = decode_tokens
        self._prefill_held = True
        self._decode_held = True
        self._unleased = True
        self._long = self.compute_tokens >= ledger.long_tokens
        if self._long:
            ledger.add_long(endpoint, 1)
        counts.add_inflight(endpoint, self.compute_tokens, 1)
        counts.add_unleased(endpoint, tokens, 1)
        counts.add_pending_decode(decode_tokens)
        self._rate = ledger.rate(endpoint)
        self._rate.started(ledger.clock())

    def handed_over(self) -> None:
        """The holder took its pool lease on ``endpoint`` (the director does, right after the grant, and holds it
        until the decoder starts answering): the KV it pins is counted by that lease from now on.  Call it after
        taking the lease, so that another worker reading the two counts never sees the prompt in neither."""
        if self._unleased:
            self._unleased = False
            self._counts.add_unleased(self.endpoint, -self.tokens, -1)

    def prefilled(self, prompt_tokens: int | None = None, cached_tokens: int | None = None) -> None:
        """The prefiller answered, reporting ``prompt_tokens`` and ``cached_tokens`` (its ``usage``; None: not
        reported): :meth:`prefill_done`, and its measured rate (:mod:`pdproxy.scheduling.prefill_rate`) credited
        with the tokens it computed when it reported both (:func:`~pdproxy.scheduling.prefill_rate.
        computed_tokens`), else with the time alone."""
        self._finish(computed_tokens(self.tokens, prompt_tokens, cached_tokens))

    def prefill_done(self) -> None:
        """The prefill ended (failed, abandoned, or answered and credited): its budget is free again (its KV stays
        counted by the lease); a first call without :meth:`prefilled` credits the rate with the time alone."""
        self._finish(None)

    def _finish(self, computed: int | None) -> None:
        self.handed_over()
        if self._prefill_held:
            self._prefill_held = False
            self._free_budget(computed)

    def _free_budget(self, computed: int | None) -> None:
        """Give this prefill's budget back (``computed``: the tokens the engine computed, None: unknown)."""
        if self._long:
            self._ledger.add_long(self.endpoint, -1)
        self._counts.add_inflight(self.endpoint, -self.compute_tokens, -1)
        self._rate.finished(computed, self._ledger.clock())
        self._ledger.changed()

    def hand_off_prefill(self) -> Callable[[], None]:
        """The prefill goes on without its holder (the request left while the engine computed it and the releaser
        drains its answer, :meth:`KVReleaser.drain <pdproxy.pd.kv_release.KVReleaser.drain>`): its budget stays held
        until the returned callable is called (idempotent), as it is still dispatched and unanswered; the holder's
        own release no longer frees it."""
        if not self._prefill_held:
            return _nothing
        self._prefill_held = False
        self.handed_over()
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                self._free_budget(None)
        return finish

    def decode_started(self) -> None:
        """The decoder lease is taken: the pool's decode accounting now covers this request."""
        if self._decode_held:
            self._decode_held = False
            self._counts.add_pending_decode(-self.decode_tokens)
            self._ledger.changed()

    def release(self) -> None:
        """Both releases (any exit path)."""
        self.prefill_done()
        self.decode_started()


class LedgerCounts:
    """Where a :class:`PrefillLedger` keeps its numbers — this implementation: in this process (one proxy
    process).  Per prefiller: prompt ``(tokens, requests)`` dispatched and unanswered (``inflight``) and granted but
    not yet leased (``unleased``); overall: decoder tokens reserved by prefills not yet decoding
    (``pending_decode``).  The readers return totals over every process that shares the counts
    (:class:`~pdproxy.workers.ledger.BoardLedgerCounts`: all workers); the writers change this process's share.

    ``concurrent``: other processes grant against the same totals, so a grant must re-check inside
    :meth:`exclusive`.  The queue hooks (:meth:`publish_queue`, :meth:`ahead_elsewhere`) do nothing here."""

    concurrent = False

    def __init__(self) -> None:
        self._inflight: dict[Endpoint, list[int]] = {}
        self._unleased: dict[Endpoint, list[int]] = {}
        self._pending_decode = 0

    # --- this process's share
    def add_inflight(self, endpoint: Endpoint, tokens: int, requests: int) -> None:
        """Add (or with negative values, remove) dispatched prompt tokens/requests on ``endpoint``."""
        held = self._inflight.setdefault(endpoint, [0, 0])
        held[0] += tokens
        held[1] += requests

    def add_unleased(self, endpoint: Endpoint, tokens: int, requests: int) -> None:
        """Add (or remove) granted-but-not-leased prompt tokens/requests on ``endpoint``."""
        held = self._unleased.setdefault(endpoint, [0, 0])
        held[0] += tokens
        held[1] += requests

    def add_pending_decode(self, tokens: int) -> None:
        """Add (or remove) decoder tokens reserved by dispatched prefills."""
        self._pending_decode += tokens

    def own_idle(self) -> bool:
        """True when this process holds nothing (no prefill in flight, no unleased slot, no reservation)."""
        return self._pending_decode == 0 and not any(
            t or r for t, r in (*self._inflight.values(), *self._unleased.values()))

    # --- totals
    def inflight(self, endpoint: Endpoint) -> tuple[int, int]:
        """``(tokens, requests)`` dispatched to ``endpoint`` and not answered yet."""
        held = self._inflight.get(endpoint)
        return (held[0], held[1]) if held is not None else (0, 0)

    def unleased(self, endpoint: Endpoint) -> tuple[int, int]:
        """``(tokens, requests)`` granted on ``endpoint`` whose holder has not taken its pool lease yet."""
        held = self._unleased.get(endpoint)
        return (held[0], held[1]) if held is not None else (0, 0)

    def pending_decode(self) -> int:
        """Decoder tokens reserved by prefills dispatched and not yet decoding."""
        return self._pending_decode

    # --- grants and the queue across processes
    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """The section in which a grant re-checks and publishes (nothing to exclude in one process)."""
        return contextlib.nullcontext()

    def epoch(self) -> int:
        """A number that changes with every grant (any process); read it before reading the counts for a grant
        (:meth:`PrefillLedger.try_hold` skips the re-check when it has not moved)."""
        return 0

    def granted(self) -> None:
        """Count one grant (called inside :meth:`exclusive`, after the slot's counts are published)."""

    def publish_queue(self, waiting: int, head_base: float | None) -> None:
        """This process's queue: ``waiting`` requests, the first blocked one with ordering base ``head_base``
        (``tokens + aging × arrived_at``; None when nothing is blocked).  Nothing to publish in one process."""

    def ahead_elsewhere(self, base: float) -> bool:
        """True when another process's first blocked waiter comes before a waiter of ordering base ``base``."""
        return False


class PrefillLedger:
    """What is held against each prefiller (unanswered prefills against its :meth:`budget` — ``budget_tokens``, or
    ``budget_s`` seconds of its measured rate (:meth:`rate`, timed by ``clock``, seconds) when more —, prompts in
    flight or pinned against its KV pool) and reserved on the decoders (prefills dispatched, not yet decoding), per
    the module docstring.  ``limits`` gives the engines' KV pools and block sizes; ``decoder_capacity``: tie dispatch
    to the decoders' free KV; ``decoder_max_requests``: decode requests per decoder before prefills wait (0: no
    limit); ``counts``: where the numbers live (default: this process only).  Listeners (:meth:`add_listener`) hear
    every release.  ``long_tokens``: a prefill computing at least this many tokens is *long work*; the ledger
    counts those in flight per prefiller (:meth:`long_prefills`, this process's own; the queue sets it from
    ``prefill_busy_tokens``)."""

    def __init__(self, pool: EndpointPool, limits: Limits, *, budget_tokens: int, budget_s: float = 0.0,
                 decoder_capacity: bool = True, decoder_max_requests: int = 0,
                 counts: LedgerCounts | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.limits = limits
        self.budget_tokens = budget_tokens
        self.budget_s = budget_s
        self.clock = clock
        self._rates: dict[Endpoint, PrefillRate] = {}
        self.decoder_capacity = decoder_capacity
        self.decoder_max_requests = decoder_max_requests
        self.counts = counts if counts is not None else LedgerCounts()
        self._listeners: list[Callable[[], None]] = []
        self.long_tokens = 1 << 62
        self._long: dict[Endpoint, int] = {}
        self._long_total = 0

    def add_long(self, endpoint: Endpoint, prefills: int) -> None:
        """Add (or remove) long prefills in flight on ``endpoint`` (:class:`PrefillSlot` does)."""
        self._long[endpoint] = self._long.get(endpoint, 0) + prefills
        self._long_total += prefills

    @property
    def any_long_prefills(self) -> bool:
        """True when some prefiller has a long prefill in flight (:meth:`long_prefills` > 0 for one at least)."""
        return self._long_total > 0

    def long_prefills(self, endpoint: Endpoint) -> int:
        """Prefills of at least ``long_tokens`` uncached tokens dispatched to ``endpoint`` and not answered yet (this
        process's own: with ``--workers N`` each worker sees the long prefills it sent)."""
        return self._long.get(endpoint, 0)

    @property
    def pending_decode(self) -> int:
        """Decoder tokens reserved by dispatched prefills not yet decoding (all workers)."""
        return self.counts.pending_decode()

    def add_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` (synchronously) whenever a slot gives budget or decoder reservation back."""
        self._listeners.append(listener)

    def changed(self) -> None:
        """Tell the listeners that capacity was given back."""
        for listener in self._listeners:
            listener()

    def hold(self, endpoint: Endpoint, tokens: int, decode_tokens: int,
             compute_tokens: int | None = None) -> PrefillSlot:
        """Grant a slot (no check): a ``tokens``-token prompt on ``endpoint`` of which ``compute_tokens`` (default
        all) are not cached there and count against its budget; ``decode_tokens`` reserved on the decoders."""
        return PrefillSlot(self, endpoint, tokens, decode_tokens, compute_tokens)

    def try_hold(self, endpoint: Endpoint, tokens: int, decode_tokens: int,
                 checked_at: int | None = None, compute_tokens: int | None = None) -> PrefillSlot | None:
        """Grant a slot the caller found room for (the scheduler's :meth:`has_room` filter, :meth:`decode_room`),
        reading the counts after :meth:`LedgerCounts.epoch` returned ``checked_at``.  When other workers grant
        against the same counts, the slot is published inside the counts' exclusive section — after checking the
        room again if any grant happened since ``checked_at`` (None: always) — so no two grants overshoot
        together; None when the room is gone."""
        counts = self.counts
        if not counts.concurrent:
            return self.hold(endpoint, tokens, decode_tokens, compute_tokens)
        with counts.exclusive():
            if counts.epoch() != checked_at and not (self.has_room(endpoint, tokens, compute_tokens)
                                                      and self.decode_room(decode_tokens)):
                return None
            slot = self.hold(endpoint, tokens, decode_tokens, compute_tokens)
            counts.granted()
            return slot

    def inflight_tokens(self, endpoint: Endpoint) -> int:
        """Prefill tokens dispatched to ``endpoint``, not answered yet and not cached there (all workers): the
        prefill work queued on it (the budget's measure and the prefill scorer's load)."""
        return self.counts.inflight(endpoint)[0]

    def kv_held_tokens(self, endpoint: Endpoint, lim: EngineLimits | None = None) -> int:
        """An upper bound on the KV (tokens, whole blocks) that prompts in flight or pinned hold on ``endpoint``:
        the pool's leases on it (the director's prefill leases, held until the decoder starts answering) plus
        slots granted and not yet leased — or the unanswered prefills alone if more (a holder that takes no
        lease; those count their uncached tokens).  ``lim``: the endpoint's limits when the caller has them.
        With ``--workers N`` a read racing another worker's :meth:`PrefillSlot.handed_over` may count that prompt
        twice (in its lease and still unleased), never in neither: the bound errs on the safe side."""
        lim = lim or self.limits.of(endpoint)
        block = lim.block_size or 1
        pad = block - 1
        counts = self.counts
        unleased_tokens, unleased_requests = counts.unleased(endpoint)  # before the leases: see handed_over()
        try:
            load = self.pool.load(endpoint)
            leased_tokens, leased_requests = load.tokens, load.requests
        except KeyError:                      # removed: only our own slots are left
            leased_tokens = leased_requests = 0
        flying_tokens, flying_requests = counts.inflight(endpoint)
        held = max(leased_tokens + unleased_tokens + pad * (leased_requests + unleased_requests),
                   flying_tokens + pad * flying_requests)
        # each prompt rounded up to whole blocks sums to a multiple of the block below its tokens + a pad each:
        # rounded down, the sum is still a bound, and exact for one prompt (1,998 tokens in 128s: 2,048, not 2,125)
        return held // block * block

    def rate(self, endpoint: Endpoint) -> PrefillRate:
        """``endpoint``'s measured prefill rate (this process's prefills; created on first use)."""
        rate = self._rates.get(endpoint)
        if rate is None:
            rate = self._rates[endpoint] = PrefillRate()
        return rate

    def measured_rate(self, endpoint: Endpoint) -> float | None:
        """``endpoint``'s measured prefill rate now (tokens computed per busy second; None: not measured, or stale:
        :meth:`PrefillRate.tokens_per_s`).  A read: it creates no entry."""
        rate = self._rates.get(endpoint)
        return rate.tokens_per_s(self.clock()) if rate is not None else None

    def budget(self, endpoint: Endpoint) -> int:
        """``endpoint``'s prefill budget in tokens to compute (0: none): ``budget_tokens``, or the tokens it computes
        in ``budget_s`` seconds at its measured rate when that is more (module docstring)."""
        budget = self.budget_tokens
        if budget > 0 and self.budget_s > 0:
            per_s = self.measured_rate(endpoint)
            if per_s is not None and per_s * self.budget_s > budget:
                return int(per_s * self.budget_s)
        return budget

    def has_room(self, endpoint: Endpoint, tokens: int, compute_tokens: int | None = None) -> bool:
        """True when a prompt of ``tokens`` tokens, ``compute_tokens`` of them not cached on ``endpoint``
        (default all), fits its budget (:meth:`budget`, by the tokens to compute), then its KV pool (by the whole
        prompt; module docstring); an idle prefiller takes any prompt the limits let in."""
        held = self.inflight_tokens(endpoint)
        if held:
            budget = self.budget(endpoint)
            if budget > 0 and held + (tokens if compute_tokens is None else compute_tokens) > budget:
                return False
        lim = self.limits.of(endpoint)
        pool = lim.usable_pool
        if pool is None:
            return True
        pinned = self.kv_held_tokens(endpoint, lim)
        need = -(-tokens // lim.block_size) * lim.block_size if lim.block_size else tokens
        return pinned == 0 or pinned + need <= pool

    def decode_room(self, need: int) -> bool:
        """True when the decoders' free KV has room for ``need`` more tokens (and a request slot when
        ``decoder_max_requests`` is set); always True without ``decoder_capacity``, without decoders (the decode
        leg answers 503 itself) or when a decoder's KV pool is unknown."""
        if not self.decoder_capacity:
            return True
        decoders = self.pool.available(Role.DECODE)
        if not decoders:
            return True
        pending = self.counts.pending_decode()       # before the leases: decode_started() follows the lease
        free_total = 0
        free_best = 0
        load_of, limits_of = self.pool.load, self.limits.of
        for d in decoders:
            load = load_of(d)
            if self.decoder_max_requests and load.requests >= self.decoder_max_requests:
                continue
            kv = limits_of(d).usable_pool
            if kv is None:
                return True
            free = max(0, kv - load.tokens)
            free_total += free
            free_best = max(free_best, free)
        return free_best >= need and free_total - pending >= need

    def idle(self) -> bool:
        """True when this process has no prefill in flight, no slot unleased and no decode capacity reserved."""
        return self.counts.own_idle()


@dataclass(slots=True)
class _Waiter:
    tokens: int
    decode_tokens: int
    exclude: Sequence[Endpoint]
    request: PickRequest
    seq: int
    order_tokens: int = 0
    """The queue key's tokens: the prompt minus the most any prefiller holds of it (what will be computed)."""
    arrived_at: float = field(default_factory=time.monotonic)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    slot: PrefillSlot | None = None


class PrefillQueue:
    """See the module docstring.  The prefiller of a slot is the ``scheduler``'s pick (every prefill filter,
    including the ledger's room); ``ledger`` holds the accounting.  ``busy_tokens``: the uncached tokens of one
    prefill that make it long work, its prefiller "busy with long work" while it runs (:meth:`congested`); ``poll_s``: the safety-net re-check interval
    (seconds).  The pool's lease releases and the ledger's changes call :meth:`notify` (with ``--workers N``,
    other workers' releases too, through :mod:`pdproxy.workers.wakeup`)."""

    def __init__(self, ledger: PrefillLedger, scheduler: Scheduler, *, max_waiting: int, timeout_s: float,
                 aging_tokens_per_s: float, busy_tokens: int, poll_s: float = POLL_S) -> None:
        self.ledger = ledger
        self.scheduler = scheduler
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.aging_tokens_per_s = aging_tokens_per_s
        self.busy_tokens = busy_tokens
        ledger.long_tokens = busy_tokens
        self.poll_s = poll_s
        self.stats = QueueStats()
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()
        self._counts = ledger.counts
        self._notified_at = 0.0
        self._published: tuple[int, float | None] = (0, None)
        ledger.add_listener(self.notify)
        ledger.pool.add_release_listener(self.notify)  # a lease released (prefill KV unpinned, decoder KV freed)

    # ---- state for routing and metrics
    @property
    def depth(self) -> int:
        """Requests waiting now (in this process)."""
        return len(self._waiting)

    def idle(self) -> bool:
        """True when nothing waits, no prefill is in flight and no decode capacity is reserved (this process)."""
        return not self._waiting and self.ledger.idle()

    def congested(self, request: PickRequest | None = None) -> bool:
        """True when every prefiller that could take ``request`` (all filters but capacity) is busy with long work:
        it is computing a prefill of at least ``busy_tokens`` uncached tokens (:meth:`PrefillLedger.long_prefills`),
        behind which a small prompt would wait (vLLM runs a chunked prefill to its end before newer requests).  Many
        small prefills in flight are not long work, however many tokens they add up to.  False when no prefiller
        could take it (routing will tell)."""
        if not self.ledger.any_long_prefills:  # the common case: no filtering needed to say no
            return False
        candidates = self.scheduler.eligible(Role.PREFILL, request or PickRequest(), capacity=False)
        long_prefills = self.ledger.long_prefills
        return bool(candidates) and all(long_prefills(e) > 0 for e in candidates)

    # ---- dispatch
    def _base(self, w: _Waiter) -> float:
        """``w``'s ordering key without the clock: key(now) = base − aging × now, so bases order waiters the way
        keys do at any instant, in any process (one monotonic clock per machine)."""
        return w.order_tokens + self.aging_tokens_per_s * w.arrived_at

    def _try_grant(self, w: _Waiter) -> bool:
        counts = self._counts
        if counts.ahead_elsewhere(self._base(w)):   # another worker's first blocked waiter goes first
            return False
        epoch = counts.epoch()                       # before the room is read (try_hold re-checks if it moved)
        if not self.ledger.decode_room(w.decode_tokens):
            return False
        endpoint = self.scheduler.try_pick(Role.PREFILL, w.request, w.exclude)
        if endpoint is None:         # no room now (or no longer placeable: its own wait loop will say so)
            return False
        compute = max(0, w.tokens - w.request.hints.cached(endpoint))
        slot = self.ledger.try_hold(endpoint, w.tokens, w.decode_tokens, epoch, compute)
        if slot is None:             # another worker took the room since the filters read it
            self.scheduler.unpick(endpoint)
            return False
        w.slot = slot
        self.stats.granted_total += 1
        w.event.set()
        return True

    def notify(self) -> None:
        """Capacity may have changed: grant waiters in key order.  The first waiter that cannot be granted but
        could be placed later blocks the waiters behind it that could go to the same prefillers (strict order per
        pool), not those of other pools: a model whose prefillers are full does not hold up another model's.  The
        first such waiter is published, with the number waiting, for the other workers
        (:meth:`LedgerCounts.publish_queue`)."""
        if not self._waiting and self._published == (0, None):
            return
        self._notified_at = now = time.monotonic()
        head: _Waiter | None = None
        order = sorted((w for w in self._waiting if w.slot is None),
                       key=lambda w: (w.order_tokens - self.aging_tokens_per_s * (now - w.arrived_at), w.seq))
        blocked: set[Endpoint] = set()
        for w in order:
            placeable: list[Endpoint] | None = None
            if blocked:
                placeable = self.scheduler.eligible(Role.PREFILL, w.request, w.exclude, capacity=False)
                if not blocked.isdisjoint(placeable):
                    continue
            if not self._try_grant(w):
                if placeable is None:
                    placeable = self.scheduler.eligible(Role.PREFILL, w.request, w.exclude, capacity=False)
                if placeable:
                    head = head or w
                    blocked.update(placeable)
                    if blocked.issuperset(self.ledger.pool.endpoints(Role.PREFILL)):
                        break                            # one pool (the usual case): nothing behind can go
        published = (sum(w.slot is None for w in self._waiting), None if head is None else self._base(head))
        if published != self._published:
            self._published = published
            self._counts.publish_queue(*published)

    @contextlib.asynccontextmanager
    async def slot(self, tokens: int, decode_tokens: int, *, exclude: Sequence[Endpoint] = (),
                   request: PickRequest | None = None) -> AsyncIterator[PrefillSlot]:
        """Wait for and hold a prefill slot for a prompt of ``tokens`` tokens needing ``decode_tokens`` of decoder
        KV, on the prefiller the scheduler picks for ``request`` (default: one that says only its size), not in
        ``exclude``.  The holder calls :meth:`PrefillSlot.handed_over` once it took its pool lease.  Raises the
        scheduler's refusal at once when no prefiller could ever take it
        (:class:`~pdproxy.errors.NoEndpointAvailable`, :class:`~pdproxy.errors.ModelNotFound`),
        :class:`Overloaded` when ``max_waiting`` requests already wait, :class:`QueueTimeout` after ``timeout_s``
        seconds."""
        seq = next(self._seq)
        if request is None:
            request = PickRequest(request_id=f"prefill-slot-{seq}", prompt_tokens=tokens)
        elif request.prompt_tokens is None:
            request = dataclasses.replace(request, prompt_tokens=tokens)
        cached = request.hints.cached_tokens
        w = _Waiter(tokens, decode_tokens, tuple(exclude), request, seq,
                    max(0, tokens - max(cached.values(), default=0)))
        if self._waiting or not self._try_grant(w):        # somebody ahead, or no room now
            self.scheduler.require(Role.PREFILL, w.request, w.exclude)   # never placeable: its refusal, at once
            if len(self._waiting) >= self.max_waiting:
                self.stats.rejected_full_total += 1
                raise Overloaded(f"pdproxy's prefill queue is full ({self.max_waiting} requests waiting); retry "
                                 "later", headers={"retry-after": str(FULL_RETRY_AFTER_S)})
            await self._wait(w)
        assert w.slot is not None
        try:
            yield w.slot
        finally:
            w.slot.release()

    async def _wait(self, w: _Waiter) -> None:
        self._waiting.append(w)
        self.stats.waited_total += 1
        try:
            self.notify()
            deadline = w.arrived_at + self.timeout_s
            while w.slot is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.stats.timed_out_total += 1
                    raise QueueTimeout(time.monotonic() - w.arrived_at)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(remaining, self.poll_s)):
                        await w.event.wait()
                if w.slot is None and time.monotonic() - self._notified_at >= self.poll_s:
                    self.notify()                          # the safety net: once per poll_s for all waiters
                if w.slot is None:
                    self.scheduler.require(Role.PREFILL, w.request, w.exclude)  # no longer placeable: refuse
        except BaseException:
            if w.slot is not None:           # granted while being cancelled: give it back, and the half-open
                w.slot.release()             # breaker trial its pick may have taken (never sent: no verdict)
                self.scheduler.unpick(w.slot.endpoint)
            raise
        finally:
            self._waiting.remove(w)
            self.stats.wait_seconds_total += time.monotonic() - w.arrived_at
            if w.slot is None or not self._waiting:
                self.notify()
