"""The proxy-side prefill queue: a per-prefiller budget of in-flight prefill tokens, small prompts ahead of large
ones with aging, dispatch tied to decoder capacity, 429 when full, 503 past the deadline.

Why: vLLM's scheduler serves RUNNING requests first, so a running chunked prefill takes the whole token budget every
step until it ends (reference §4); prompts that reach an engine behind it wait for all of it.  Holding large
prompts here instead of piling them onto engines' FCFS queues keeps the order ours to choose.

- **Budget.**  A prefiller may hold ``budget_tokens`` of dispatched-but-unanswered prefill tokens; a prompt larger
  than the budget runs only on an otherwise idle prefiller.  ``budget_tokens = 0`` turns the budget off.
- **KV pool.**  The prompt tokens in flight *or pinned* on a prefiller must also fit its KV pool
  (``EngineInfo.kv_pool_tokens`` via :class:`~pdproxy.limits.Limits`, from ``vllm:cache_config_info``): after the
  prefill the engine keeps the prompt's blocks until the decoder pulls them (reference §1.4), and the director
  holds the prefill's pool lease until the decoder's first event.  So the effective per-prefiller budget is
  ``min(budget_tokens, kv pool)``, counted over the pool's prefill leases (plus slots granted but not yet leased)
  rather than over unanswered prefills only.  Counting is in whole blocks (``block_size``; a held lease counts as
  at most ``block_size − 1`` tokens more than its prompt), as vLLM allocates them.  Without it a second long
  prompt is dispatched and waits inside the engine, where it holds every smaller request behind it (vLLM's
  head-of-line blocking, seed 000).
- **Order.**  Waiters are served by ``key = prompt_tokens − aging_tokens_per_s × waited_s`` (smallest first): a
  small prompt goes ahead of a large one, and a large one's key falls every second it waits until it is first.
  Dispatch is strict in that order (the first waiter that cannot be placed blocks the ones behind it), so a large
  prompt is never starved.
- **Decoder capacity.**  A prefill is dispatched only if the decoders' free KV (their KV pool minus the tokens the
  pool's decode leases hold, minus the prefills already dispatched and not yet decoding) has room for the prompt + 1
  token, and (``decoder_max_requests`` > 0) a decoder has a free request slot.  A prefill whose decoder never comes
  would only pin KV on the prefiller until it expires (reference §1.4).
- **Bounds.**  More than ``max_waiting`` waiters → :class:`~pdproxy.errors.Overloaded` (429, ``Retry-After``);
  waiting longer than ``timeout_s`` → :class:`QueueTimeout` (503, ``Retry-After``).  Nothing waits forever.

Waiters are re-checked when a slot's prefill ends or its decode starts and when any pool lease is released
(:meth:`EndpointPool.add_release_listener`: a prefill lease ending unpins prefiller KV, a decode lease ending frees
decoder KV), synchronously inside that release; the ``poll_s`` poll is only the safety net.

Single event loop, no awaits while the state is changed, so no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from pdproxy.endpoints import Endpoint, Role
from pdproxy.errors import NoEndpointAvailable, Overloaded, QueueTimeout
from pdproxy.limits import Limits
from pdproxy.pool import EndpointPool
from pdproxy.scheduler import Scheduler

POLL_S = 0.25
"""A waiter re-checks at least this often (seconds, default of ``poll_s``): health and KV-pool refreshes and
other workers' lease releases do not notify the queue.  This process's slot and pool-lease releases do."""
FULL_RETRY_AFTER_S = 2


@dataclass(slots=True)
class QueueStats:
    """Counters for metrics (``waited_total``: requests that had to wait; ``wait_seconds_total``: their time)."""

    granted_total: int = 0
    waited_total: int = 0
    rejected_full_total: int = 0
    timed_out_total: int = 0
    wait_seconds_total: float = 0.0


class PrefillSlot:
    """One dispatched prefill: ``tokens`` held against ``endpoint``'s budget until :meth:`prefill_done`, and
    ``decode_tokens`` reserved on the decoders until :meth:`decode_started`.  Both releases are idempotent."""

    __slots__ = ("_decode_held", "_prefill_held", "_queue", "_unleased", "decode_tokens", "endpoint", "tokens")

    def __init__(self, queue: PrefillQueue, endpoint: Endpoint, tokens: int, decode_tokens: int) -> None:
        self._queue = queue
        self.endpoint = endpoint
        self.tokens = tokens
        self.decode_tokens = decode_tokens
        self._prefill_held = True
        self._decode_held = True
        self._unleased = True
        queue._inflight.setdefault(endpoint, _Held()).add(tokens, 1)
        queue._unleased.setdefault(endpoint, _Held()).add(tokens, 1)
        queue._pending_decode += decode_tokens

    def handed_over(self) -> None:
        """The holder has the slot and takes its pool lease on ``endpoint`` at once (the director does, from
        here until the decoder's first event): the KV it pins is counted by that lease from now on."""
        if self._unleased:
            self._unleased = False
            self._queue._unleased[self.endpoint].add(-self.tokens, -1)

    def prefill_done(self) -> None:
        """The prefiller answered (or failed): its budget is free again (its KV stays counted by the lease)."""
        self.handed_over()
        if self._prefill_held:
            self._prefill_held = False
            q = self._queue
            q._inflight[self.endpoint].add(-self.tokens, -1)
            q.notify()

    def decode_started(self) -> None:
        """The decoder lease is taken: the pool's decode accounting now covers this request."""
        if self._decode_held:
            self._decode_held = False
            self._queue._pending_decode -= self.decode_tokens
            self._queue.notify()

    def release(self) -> None:
        """Both releases (any exit path)."""
        self.prefill_done()
        self.decode_started()


@dataclass(slots=True)
class _Held:
    """Prompt tokens and requests held against one prefiller."""

    tokens: int = 0
    requests: int = 0

    def add(self, tokens: int, requests: int) -> None:
        self.tokens += tokens
        self.requests += requests


Fits = Callable[[Endpoint], bool]
Choose = Callable[[Fits], Endpoint]
"""``choose(room)``: pick a prefiller among those ``room`` accepts (plus the caller's own filters: health, limits,
endpoints already tried); raises :class:`NoEndpointAvailable` when none is left."""


@dataclass(slots=True)
class _Waiter:
    tokens: int
    decode_tokens: int
    exclude: Sequence[Endpoint]
    fits: Fits | None
    choose: Choose
    seq: int
    arrived_at: float = field(default_factory=time.monotonic)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    slot: PrefillSlot | None = None


class PrefillQueue:
    """See the module docstring.  ``limits`` gives decoders' KV pools; the pool gives decode leases and calls
    :meth:`notify` on every lease release.  ``poll_s``: the safety-net re-check interval (seconds)."""

    def __init__(self, pool: EndpointPool, scheduler: Scheduler, limits: Limits, *, budget_tokens: int,
                 max_waiting: int, timeout_s: float, aging_tokens_per_s: float, busy_tokens: int,
                 decoder_capacity: bool = True, decoder_max_requests: int = 0, poll_s: float = POLL_S) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.limits = limits
        self.budget_tokens = budget_tokens
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.aging_tokens_per_s = aging_tokens_per_s
        self.busy_tokens = busy_tokens
        self.decoder_capacity = decoder_capacity
        self.decoder_max_requests = decoder_max_requests
        self.stats = QueueStats()
        self._inflight: dict[Endpoint, _Held] = {}
        self._unleased: dict[Endpoint, _Held] = {}
        self._pending_decode = 0
        self._waiting: list[_Waiter] = []
        self._seq = itertools.count()
        self.poll_s = poll_s
        pool.add_release_listener(self.notify)   # a lease released (prefill KV unpinned, decoder KV freed): wake

    # ---- state for routing and metrics
    @property
    def depth(self) -> int:
        """Requests waiting now."""
        return len(self._waiting)

    def inflight_tokens(self, endpoint: Endpoint) -> int:
        """Prefill tokens dispatched to ``endpoint`` and not answered yet."""
        held = self._inflight.get(endpoint)
        return held.tokens if held is not None else 0

    def kv_held_tokens(self, endpoint: Endpoint) -> int:
        """An upper bound on the KV (tokens, whole blocks) that prompts in flight or pinned hold on ``endpoint``:
        the pool's leases on it (the director's prefill leases, held until the decoder's first event) plus slots
        granted and not yet leased — or the unanswered prefills alone if more (a holder that takes no lease)."""
        lim = self.limits.of(endpoint)
        pad = lim.block_size - 1 if lim.block_size else 0
        try:
            load = self.pool.load(endpoint)
            leased_tokens, leased_requests = load.tokens, load.requests
        except KeyError:                      # removed: only our own slots are left
            leased_tokens = leased_requests = 0
        unleased = self._unleased.get(endpoint) or _Held()
        flying = self._inflight.get(endpoint) or _Held()
        return max(leased_tokens + unleased.tokens + pad * (leased_requests + unleased.requests),
                   flying.tokens + pad * flying.requests)

    def idle(self) -> bool:
        """True when nothing waits, no prefill is in flight and no decode capacity is reserved."""
        return (not self._waiting and self._pending_decode == 0
                and not any(h.tokens or h.requests for h in (*self._inflight.values(), *self._unleased.values())))

    def congested(self, fits: Fits | None = None) -> bool:
        """True when every healthy prefiller that ``fits`` has at least ``busy_tokens`` prefill tokens in flight
        (prefill capacity is taken by long work).  False when no prefiller fits (routing will tell)."""
        candidates = [e for e in self.pool.available(Role.PREFILL) if fits is None or fits(e)]
        return bool(candidates) and all(self.inflight_tokens(e) >= self.busy_tokens for e in candidates)

    # ---- dispatch
    def _has_room(self, endpoint: Endpoint, tokens: int) -> bool:
        """Budget, then KV pool (module docstring); an idle prefiller takes any prompt the limits let in."""
        held = self.inflight_tokens(endpoint)
        if not (self.budget_tokens <= 0 or held == 0 or held + tokens <= self.budget_tokens):
            return False
        lim = self.limits.of(endpoint)
        if lim.kv_pool_tokens is None:
            return True
        pinned = self.kv_held_tokens(endpoint)
        need = -(-tokens // lim.block_size) * lim.block_size if lim.block_size else tokens
        return pinned == 0 or pinned + need <= lim.kv_pool_tokens

    def _decode_room(self, need: int) -> bool:
        if not self.decoder_capacity:
            return True
        decoders = self.pool.available(Role.DECODE)
        if not decoders:
            return True                      # the decode leg answers 503 itself
        free_total = 0
        free_best = 0
        load_of, limits_of = self.pool.load, self.limits.of
        for d in decoders:
            load = load_of(d)
            if self.decoder_max_requests and load.requests >= self.decoder_max_requests:
                continue
            kv = limits_of(d).kv_pool_tokens
            if kv is None:
                return True
            free = max(0, kv - load.tokens)
            free_total += free
            free_best = max(free_best, free)
        return free_best >= need and free_total - self._pending_decode >= need

    def _try_grant(self, w: _Waiter) -> bool:
        if not self._decode_room(w.decode_tokens):
            return False
        try:
            endpoint = w.choose(lambda e: self._has_room(e, w.tokens))
        except NoEndpointAvailable:
            return False
        w.slot = PrefillSlot(self, endpoint, w.tokens, w.decode_tokens)
        self.stats.granted_total += 1
        w.event.set()
        return True

    def _placeable(self, w: _Waiter) -> bool:
        """Some healthy prefiller could take ``w`` once capacity frees up (else it must not wait)."""
        return any(e not in w.exclude and (w.fits is None or w.fits(e)) for e in self.pool.available(Role.PREFILL))

    def _unplaceable(self, w: _Waiter) -> None:
        """No prefiller can take ``w`` whatever the load: let ``choose`` raise its :class:`NoEndpointAvailable`
        (with its ``Retry-After``); should it still find one, take it."""
        endpoint = w.choose(lambda e: True)
        w.slot = PrefillSlot(self, endpoint, w.tokens, w.decode_tokens)
        self.stats.granted_total += 1

    def notify(self) -> None:
        """Capacity may have changed: grant waiters in key order, stopping at the first that cannot be placed."""
        if not self._waiting:
            return
        now = time.monotonic()
        order = sorted((w for w in self._waiting if w.slot is None),
                       key=lambda w: (w.tokens - self.aging_tokens_per_s * (now - w.arrived_at), w.seq))
        for w in order:
            if not self._try_grant(w) and self._placeable(w):
                break

    @contextlib.asynccontextmanager
    async def slot(self, tokens: int, decode_tokens: int, *, exclude: Sequence[Endpoint] = (),
                   fits: Fits | None = None, choose: Choose | None = None) -> AsyncIterator[PrefillSlot]:
        """Wait for and hold a prefill slot for a prompt of ``tokens`` tokens needing ``decode_tokens`` of decoder
        KV, on a prefiller not in ``exclude`` that ``fits`` accepts, picked by ``choose`` (default: the scheduler).
        Raises :class:`NoEndpointAvailable` at once when no healthy prefiller fits, :class:`Overloaded` when
        ``max_waiting`` requests already wait, :class:`QueueTimeout` after ``timeout_s`` seconds."""
        excluded = tuple(exclude)

        def default_choose(room: Fits) -> Endpoint:
            return self.scheduler.choose(Role.PREFILL, exclude=excluded,
                                         fits=lambda e: (fits is None or fits(e)) and room(e))
        w = _Waiter(tokens, decode_tokens, excluded, fits, choose or default_choose, next(self._seq))
        if not self._placeable(w):
            self._unplaceable(w)
        elif not self._waiting and self._try_grant(w):
            pass
        elif len(self._waiting) >= self.max_waiting:
            self.stats.rejected_full_total += 1
            raise Overloaded(f"pdproxy's prefill queue is full ({self.max_waiting} requests waiting); retry later",
                             headers={"retry-after": str(FULL_RETRY_AFTER_S)})
        else:
            await self._wait(w)
        assert w.slot is not None
        w.slot.handed_over()
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
                if w.slot is None:
                    self.notify()
                if w.slot is None and not self._placeable(w):
                    self._unplaceable(w)
        except BaseException:
            if w.slot is not None:           # granted while being cancelled: give it back
                w.slot.release()
            raise
        finally:
            self._waiting.remove(w)
            self.stats.wait_seconds_total += time.monotonic() - w.arrived_at
            if w.slot is None:
                self.notify()
