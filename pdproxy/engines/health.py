"""Endpoint health: active ``/health`` probes, passive outlier detection, and one circuit breaker per endpoint.

- **Active**: every ``interval_s`` seconds each endpoint's ``GET /health`` is probed (vLLM answers 200, or 503
  when the engine core is dead — ``vllm/entrypoints/serve``); the results drive the pool's ``healthy`` flag with
  Envoy's hysteresis (active health checking's ``unhealthy_threshold`` / ``healthy_threshold``): an endpoint is
  taken out after ``unhealthy_threshold`` consecutive failed probes *and only if no request to it succeeded since
  the first of them* — an engine busy with a burst answers ``/health`` late but keeps serving, and real traffic
  outweighs a probe — and comes back after ``healthy_threshold`` consecutive good probes.  What the engine
  declares (``/v1/models``, ``/metrics``) is refreshed every ``refresh_interval_s`` seconds into ``infos`` (used by
  admission and routing).
- **Passive**: the request path reports each leg's verdict, once, through a :class:`Verdict` (:meth:`judging`:
  a leg that ends without one — cancelled, refused before it was sent, a defect — gives a half-open trial back).
  Transport failures, timeouts and 5xx answers count
  against the endpoint (``record_failure``); 4xx answers are the request's fault and must not be reported.  A
  failure also triggers an immediate probe, so a killed engine leaves the pool within one probe round trip.
- **Breaker** (:mod:`pdproxy.engines.breaker`; Envoy's outlier detection): consecutive failures open it; picks skip
  open endpoints (:meth:`can_take`, the scheduler's breaker filter), whatever ``/health`` says; a successful
  request closes it.  A successful probe after a failure to reach the engine at all (a refused connection, a
  connect timeout: it never saw the request) closes it too — nothing listened, now ``/health`` answers: the
  engine restarted, and its traffic comes back at once rather than one trial request at a time (a trial that is a
  long prefill would hold every other request out meanwhile).  After other failures a successful probe lets a
  trial request through at once, except after a timeout: an engine whose generation hangs while its API server
  answers ``/health`` (timeouts to the first byte) waits out the open period (``breaker_open_s``, doubling per
  failed trial — Envoy's ejection time) and comes back through a trial request that it answers.  With ``--workers N`` the
  breakers are shared by all workers (``make_breaker``, :mod:`pdproxy.workers.breaker`); probes stay per worker.

So a dead engine gets at most ``breaker_failures`` (+ in-flight) attempts, is re-admitted within about one probe
interval of answering ``/health`` again, and with no usable prefiller or decoder the scheduler raises
``NoEndpointAvailable`` (503 + ``Retry-After``) at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pdproxy.endpoints import Endpoint
from pdproxy.engines.breaker import BreakerState, CircuitBreaker, Clock
from pdproxy.engines.control import EngineClient, EngineInfo
from pdproxy.engines.events import EngineEvents
from pdproxy.engines.models import ServedModels
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import ProxyError, UpstreamTimeout, classify

log = logging.getLogger("pdproxy.health")


class BreakerFactory(Protocol):
    """Builds ``endpoint``'s breaker from :class:`CircuitBreaker`'s keyword arguments."""

    def __call__(self, endpoint: Endpoint, *, failure_threshold: int, open_s: float, max_open_s: float,
                 clock: Clock) -> CircuitBreaker: ...


def _local_breaker(endpoint: Endpoint, *, failure_threshold: int, open_s: float, max_open_s: float,
                   clock: Clock) -> CircuitBreaker:
    return CircuitBreaker(failure_threshold=failure_threshold, open_s=open_s, max_open_s=max_open_s, clock=clock)


@dataclass(frozen=True, slots=True)
class BreakerSnapshot:
    """One endpoint's circuit breaker: its ``breaker`` state, the ``consecutive_failures`` counted, how many times
    it ``opened_total``, and ``retry_in_s`` (seconds until an open breaker admits a trial; 0 otherwise)."""

    breaker: BreakerState
    consecutive_failures: int
    opened_total: int
    retry_in_s: float

    def fields(self) -> dict[str, object]:
        """The ``/admin/endpoints`` row's members (``breaker`` as its string value)."""
        return {"breaker": self.breaker.value, "consecutive_failures": self.consecutive_failures,
                "opened_total": self.opened_total, "retry_in_s": self.retry_in_s}


class Verdict:
    """A leg's one verdict on the engine it was picked for (:meth:`HealthMonitor.judging`), a context manager:
    :meth:`success`, :meth:`error` or :meth:`neutral` gives it (the first one counts, later calls are ignored); a
    leg that leaves the block without one (cancelled, refused before it was sent, a defect) gives it as
    :meth:`neutral` on exit, so a half-open breaker's trial its pick took is never kept (exceptions pass on)."""

    __slots__ = ("endpoint", "given", "health")

    def __init__(self, health: HealthMonitor, endpoint: Endpoint) -> None:
        self.health = health
        self.endpoint = endpoint
        self.given = False

    def __enter__(self) -> Verdict:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.given:
            self.neutral()

    def success(self) -> None:
        """The engine served the leg (:meth:`HealthMonitor.record_success`)."""
        if not self.given:
            self.given = True
            self.health.record_success(self.endpoint)

    def error(self, exc: ProxyError, *, again: bool = False) -> bool:
        """The leg ended with ``exc`` (:meth:`HealthMonitor.record_error`: True when that says the engine is
        unwell; False, as for a verdict already given, when it is the request's own fault)."""
        if self.given:
            return classify(exc).engine_fault
        self.given = True
        return self.health.record_error(self.endpoint, exc, again=again)

    def neutral(self) -> None:
        """No verdict on the engine (client left, 4xx, never sent): its half-open trial slot, if any, given back."""
        if not self.given:
            self.given = True
            self.health.record_neutral(self.endpoint)


class HealthMonitor:
    """Keeps ``pool`` health flags, per-endpoint breakers and ``infos`` (what each engine declares) up to date.

    ``interval_s``: probe period (seconds); ``refresh_interval_s``: ``/v1/models`` + ``/metrics`` refresh period;
    ``breaker_failures`` / ``breaker_open_s``: see :class:`CircuitBreaker`; ``unhealthy_threshold`` /
    ``healthy_threshold``: consecutive failed / good probes that take an endpoint out / bring it back (module
    docstring; failed probes count only while no request to it succeeds); ``clock``: monotonic seconds;
    ``make_breaker``: builds an endpoint's breaker from its settings (``--workers N``: one shared by every worker,
    :mod:`pdproxy.workers.breaker`); given, every endpoint's breaker is made up front, so a breaker another process
    opened is seen before this one ever failed.  ``served``: the served-model view (the operator's pins) its log of
    the models one role serves judges by (:class:`~pdproxy.engines.events.EngineEvents`; None: the listings alone).
    Start with :meth:`start`, stop with :meth:`stop` (the app lifespan owns both).
    """

    def __init__(self, pool: EndpointPool, engines: EngineClient, infos: dict[Endpoint, EngineInfo], *,
                 interval_s: float, refresh_interval_s: float, breaker_failures: int = 3,
                 breaker_open_s: float = 3.0, clock: Clock = time.monotonic,
                 make_breaker: BreakerFactory | None = None, unhealthy_threshold: int = 1,
                 healthy_threshold: int = 1, served: ServedModels | None = None) -> None:
        self.pool = pool
        self.engines = engines
        self.infos = infos
        self.interval_s = interval_s
        self.refresh_interval_s = refresh_interval_s
        self.breaker_failures = breaker_failures
        self.breaker_open_s = breaker_open_s
        self.clock = clock
        self.unhealthy_threshold = unhealthy_threshold
        self.healthy_threshold = healthy_threshold
        self._probe_streak: dict[Endpoint, int] = {}       # > 0: consecutive good probes, < 0: failed ones
        self._failing_since: dict[Endpoint, float] = {}    # clock() of the first of the failed probes
        self._served_at: dict[Endpoint, float] = {}        # clock() of the last request it served
        self._timed_out: set[Endpoint] = set()             # its last failure was a timeout: probes do not re-admit
        self._unreached: set[Endpoint] = set()             # its last failure never reached it: a good probe closes
        self.breakers: dict[Endpoint, CircuitBreaker] = {}
        self.leaving: set[Endpoint] = set()
        self._task: asyncio.Task[None] | None = None
        self._probing: dict[Endpoint, asyncio.Task[bool]] = {}
        self.events = EngineEvents(served)  # logs each change of reachability, limits, breaker, models once
        self._make_breaker = make_breaker or _local_breaker
        if make_breaker is not None:
            for e in pool.endpoints():
                self.breaker(e)
        self._refresh_listeners: list[Callable[[Endpoint, EngineInfo], None]] = []
        self._remove_listeners: list[Callable[[Endpoint], None]] = []

    def add_refresh_listener(self, listener: Callable[[Endpoint, EngineInfo], None]) -> None:
        """Call ``listener(endpoint, info)`` after each refresh of an engine's :class:`EngineInfo` (the prefix
        cache takes the block size and KV pool from it)."""
        self._refresh_listeners.append(listener)

    def add_remove_listener(self, listener: Callable[[Endpoint], None]) -> None:
        """Call ``listener(endpoint)`` when ``endpoint`` leaves the pool (:meth:`remove`: the admin API), so what
        others keep of it goes too (the prefix cache's entries of it)."""
        self._remove_listeners.append(listener)

    # --- breakers -------------------------------------------------------------------------------------------
    def breaker(self, endpoint: Endpoint) -> CircuitBreaker:
        """The endpoint's breaker (created closed on first use)."""
        b = self.breakers.get(endpoint)
        if b is None:
            b = self._make_breaker(endpoint, failure_threshold=self.breaker_failures, open_s=self.breaker_open_s,
                                   max_open_s=max(10 * self.breaker_open_s, 30.0), clock=self.clock)
            self.breakers[endpoint] = b
        return b

    def can_take(self, endpoint: Endpoint) -> bool:
        """True when the endpoint's breaker lets a request in (the scheduler's breaker filter asks this)."""
        b = self.breakers.get(endpoint)
        return b is None or b.can_take()

    def on_pick(self, endpoint: Endpoint) -> bool:
        """Call right after the scheduler chose ``endpoint``: takes a half-open trial slot if needed; False when
        the breaker does not let the request in after all (:meth:`CircuitBreaker.on_pick`)."""
        b = self.breakers.get(endpoint)
        if b is None:
            return True
        before = b.state
        if before is BreakerState.CLOSED:      # nothing to take (the common case: one read)
            return True
        taken = b.on_pick()
        self.events.breaker_changed(endpoint, before, b.state)
        return taken

    def retry_after_s(self, endpoints: list[Endpoint]) -> int:
        """Whole seconds until one of ``endpoints`` may take traffic again (≥ 1), for ``Retry-After``."""
        waits = [self.breakers[e].seconds_until_retry() for e in endpoints if e in self.breakers]
        return max(1, math.ceil(min(waits))) if waits else max(1, math.ceil(self.interval_s))

    def record_failure(self, endpoint: Endpoint, *, retry_after_s: float | None = None, hard: bool = False) -> None:
        """A leg to ``endpoint`` failed at the transport level, timed out or got a 5xx (never a 4xx).
        ``retry_after_s``: the engine's ``Retry-After`` (seconds), honoured by the breaker; ``hard``: the
        connection was refused (nothing listens), which opens the breaker at once."""
        b = self.breaker(endpoint)
        before = b.state
        b.record_failure(retry_after_s=retry_after_s, hard=hard)
        self.events.breaker_changed(endpoint, before, b.state, failures=b.consecutive_failures,
                                    retry_in_s=b.seconds_until_retry())
        self.probe_soon(endpoint)

    def record_error(self, endpoint: Endpoint, exc: ProxyError, *, again: bool = False) -> bool:
        """Record a leg to ``endpoint`` that ended with ``exc``; True when it says the engine is unwell (transport
        failure, timeout, 5xx: :meth:`record_failure`, honouring its ``Retry-After``; a refused connection opens the
        breaker at once), False for the request's own fault (a 4xx: :meth:`record_neutral`); the verdict is
        :func:`pdproxy.errors.classify`'s.  ``again``: the same request failed on ``endpoint`` before (a lone
        engine tried once more): no further strike, unless the engine said ``Retry-After`` or refused the
        connection — one request's attempts count once, so a request whose content makes an engine fail (a
        malformed answer, a 502) cannot open the breaker, and refuse every other client, by itself.  A breaker not
        closed (the attempt was a half-open trial, or others opened it meanwhile) records the failure as ever."""
        verdict = classify(exc)
        if not verdict.engine_fault:
            self.record_neutral(endpoint)
            return False
        if isinstance(exc, UpstreamTimeout):
            self._timed_out.add(endpoint)
        else:
            self._timed_out.discard(endpoint)
        if verdict.unsent:
            self._unreached.add(endpoint)
        else:
            self._unreached.discard(endpoint)
        if again and verdict.retry_after_s is None and not verdict.unsent:
            b = self.breakers.get(endpoint)
            if b is None or b.state is BreakerState.CLOSED:   # (not a trial: an open or half-open one fails as ever)
                return True
        self.record_failure(endpoint, retry_after_s=verdict.retry_after_s, hard=verdict.unsent)
        return True

    def record_success(self, endpoint: Endpoint) -> None:
        """A leg to ``endpoint`` succeeded (closes its breaker; outweighs failed probes)."""
        self._served_at[endpoint] = self.clock()
        self._timed_out.discard(endpoint)
        self._unreached.discard(endpoint)
        b = self.breakers.get(endpoint)
        if b is not None and (b.state is not BreakerState.CLOSED or b.consecutive_failures):
            before = b.state
            b.record_success()
            self.events.breaker_changed(endpoint, before, b.state)

    def judging(self, endpoint: Endpoint) -> Verdict:
        """The verdict of one leg to ``endpoint``, from its pick on (:class:`Verdict`: ``with health.judging(e) as
        verdict:``)."""
        return Verdict(self, endpoint)

    def record_neutral(self, endpoint: Endpoint) -> None:
        """A leg ended without a verdict on the engine (client left, 4xx): frees a half-open trial slot."""
        b = self.breakers.get(endpoint)
        if b is not None:
            b.release_trial()

    def forget(self, endpoint: Endpoint) -> None:
        """Drop an endpoint's breaker and probe (admin remove)."""
        self.breakers.pop(endpoint, None)
        for memo in (self._probe_streak, self._failing_since, self._served_at):
            memo.pop(endpoint, None)
        self._timed_out.discard(endpoint)
        self._unreached.discard(endpoint)
        self.events.forget(endpoint)
        task = self._probing.pop(endpoint, None)
        if task is not None:
            task.cancel()

    def snapshot(self, endpoint: Endpoint) -> BreakerSnapshot:
        """``endpoint``'s breaker now, for ``/admin/endpoints`` and the metrics (closed when it has none)."""
        b = self.breakers.get(endpoint)
        if b is None:
            return BreakerSnapshot(BreakerState.CLOSED, 0, 0, 0.0)
        return BreakerSnapshot(b.state, b.consecutive_failures, b.opened_total, round(b.seconds_until_retry(), 3))

    # --- membership (admin API) ------------------------------------------------------------------------------
    def leave_when_idle(self, endpoint: Endpoint) -> None:
        """Remove the (draining) endpoint once it has no in-flight requests (checked now and every probe tick)."""
        self.leaving.add(endpoint)
        self.reap()

    def reap(self) -> list[Endpoint]:
        """Remove leaving endpoints that are idle; returns them."""
        gone = []
        for e in list(self.leaving):
            try:
                idle = self.pool.load(e).requests == 0
            except KeyError:
                idle = True
            if idle:
                self.remove(e)
                gone.append(e)
        return gone

    def remove(self, endpoint: Endpoint) -> None:
        """Take ``endpoint`` out of the pool, its breaker, probe and engine info."""
        self.leaving.discard(endpoint)
        self.pool.remove(endpoint)
        self.infos.pop(endpoint, None)
        self.forget(endpoint)
        for listener in self._remove_listeners:
            listener(endpoint)

    # --- active probes ----------------------------------------------------------------------------------------
    async def probe(self, endpoint: Endpoint) -> bool:
        """Probe ``GET /health`` once; update the pool flag, the breaker and (when due) the engine info."""
        ok = await self.engines.health(endpoint)
        if endpoint not in self.pool.endpoints(endpoint.role):  # removed meanwhile (admin API)
            return False
        info = self.infos.setdefault(endpoint, EngineInfo())
        due = (not info.reachable or info.refreshed_at is None
               or time.monotonic() - info.refreshed_at >= self.refresh_interval_s)
        if ok and due:
            await self._refresh(endpoint, info)
            ok = info.reachable
        elif not ok:           # /health failed: the engine is not up now (pdproxy_engine_up), refreshed once back
            info.reachable = False
            info.error = self.engines.health_failure(endpoint) or info.error
        try:
            load = self.pool.load(endpoint)
        except KeyError:
            return False
        load.healthy = healthy = self._verdict(endpoint, ok, load.healthy)
        self.events.observe(endpoint, info, healthy)
        if ok and endpoint in self._unreached:   # it did not listen, now it answers: restarted (module docstring)
            self._unreached.discard(endpoint)
            b = self.breakers.get(endpoint)
            if b is not None and b.state is not BreakerState.CLOSED:
                before = b.state
                b.record_success()
                self.events.breaker_changed(endpoint, before, b.state)
        elif ok and endpoint not in self._timed_out:
            b = self.breakers.get(endpoint)
            if b is not None:
                b.probe_ok()
        return healthy

    def _verdict(self, endpoint: Endpoint, ok: bool, was: bool) -> bool:
        """Whether ``endpoint`` is healthy after a probe that succeeded (``ok``) or not, given it ``was``
        (module docstring: thresholds, and served traffic outweighing failed probes)."""
        streak = self._probe_streak.get(endpoint)
        if streak is None:                      # never probed (just added): the first probe decides
            self._probe_streak[endpoint] = 1 if ok else -1
            if not ok:
                self._failing_since[endpoint] = self.clock()
            return ok
        if ok:
            self._probe_streak[endpoint] = streak = max(streak, 0) + 1
            self._failing_since.pop(endpoint, None)
            return was or streak >= self.healthy_threshold
        self._probe_streak[endpoint] = streak = min(streak, 0) - 1
        now = self.clock()
        since = self._failing_since.setdefault(endpoint, now)
        if not was or -streak < self.unhealthy_threshold:
            return was
        if self._served_at.get(endpoint, -math.inf) >= since:  # it served requests meanwhile: they outweigh the
            self._probe_streak[endpoint] = 0                    # probes; the next round counts from here
            self._failing_since[endpoint] = now
            return True
        return False

    def probe_soon(self, endpoint: Endpoint) -> None:
        """Schedule one probe of ``endpoint`` now (at most one at a time per endpoint); no-op without a loop."""
        if endpoint in self._probing:
            return
        try:
            task = asyncio.get_running_loop().create_task(self.probe(endpoint))
        except RuntimeError:
            return
        self._probing[endpoint] = task
        task.add_done_callback(lambda _t: self._probing.pop(endpoint, None))

    async def _refresh(self, endpoint: Endpoint, info: EngineInfo) -> None:
        """Refresh ``info``; log (once per change) when the engine starts or stops refusing pdproxy's key."""
        refused = info.auth_failed
        await self.engines.refresh(endpoint, info)
        if endpoint not in self.pool:                            # removed while it was read (admin API)
            return
        for listener in self._refresh_listeners:
            listener(endpoint, info)
        self.events.served_models(self.infos)
        if info.auth_failed and not refused:
            log.warning("%s %s refuses pdproxy's control-plane calls (%s): it was started with --api-key; set "
                        "engine_api_key to that key", endpoint.role.value, endpoint.name, info.error)
        elif refused and not info.auth_failed:
            log.info("%s %s accepts pdproxy's engine key again", endpoint.role.value, endpoint.name)

    async def refresh_all(self) -> None:
        """Probe every endpoint once and refresh its :class:`EngineInfo` (concurrently)."""
        async def one(e: Endpoint) -> None:
            info = self.infos.setdefault(e, EngineInfo())
            await self._refresh(e, info)
            up = info.reachable and await self.engines.health(e)
            with contextlib.suppress(KeyError):
                self.pool.load(e).healthy = up
            self._probe_streak[e] = 1 if up else -1     # the first verdict; later probes need the thresholds
            if not up:
                self._failing_since[e] = self.clock()
            self.events.observe(e, info, up)
        await asyncio.gather(*(one(e) for e in self.pool.endpoints()))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.reap()
            await asyncio.gather(*(self.probe(e) for e in self.pool.endpoints()), return_exceptions=True)

    async def start(self) -> None:
        """Probe every endpoint once (awaited), then start the background loop probing every ``interval_s`` seconds."""
        await self.refresh_all()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Cancel the background loop and any pending probes and wait for them; never raises."""
        tasks = [t for t in (self._task, *self._probing.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._probing.clear()
