"""ProxyState: everything one proxy process owns, built in the app's lifespan (no module-level state).

:meth:`ProxyState.build` is the wiring: each component gets the parts it uses, nothing gets the state itself.
:meth:`ProxyState.start` starts the components top to bottom on one ``AsyncExitStack``, so :meth:`ProxyState.stop`
(or a component's start failing half-way) stops what was started, in reverse order; ``async with state:`` does
both.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdproxy.admission.admission import Admission, AdmissionStats
from pdproxy.app.passthrough import Passthrough
from pdproxy.endpoints import Endpoint
from pdproxy.engines.control import EngineClient, EngineInfo
from pdproxy.engines.health import HealthMonitor
from pdproxy.engines.limits import Limits
from pdproxy.engines.models import ServedModels
from pdproxy.engines.pool import EndpointPool
from pdproxy.http.engine_headers import EngineHeaders
from pdproxy.http.upstream import Upstream
from pdproxy.ops.tracing import Tracing, tracing_from_settings
from pdproxy.pd.continuation import LiveStreams
from pdproxy.pd.director import Director
from pdproxy.pd.kv_release import KVReleaser
from pdproxy.prefix.cache import PrefixCache
from pdproxy.prefix.routing import PrefixRouter
from pdproxy.prefix.source import PrefixSource
from pdproxy.scheduling import Scheduler
from pdproxy.scheduling.queue import PrefillLedger, PrefillQueue, QueueStats
from pdproxy.settings import Settings

if TYPE_CHECKING:
    from pdproxy.workers.share import WorkerShare


@dataclass
class ProxyState:
    """The proxy's components.  ``shutting_down`` is set on SIGTERM / lifespan shutdown."""

    settings: Settings
    pool: EndpointPool
    infos: dict[Endpoint, EngineInfo]
    served: ServedModels
    limits: Limits
    health: HealthMonitor
    ledger: PrefillLedger
    scheduler: Scheduler
    queue: PrefillQueue
    headers: EngineHeaders
    upstream: Upstream
    engines: EngineClient
    admission: Admission
    tracing: Tracing
    passthrough: Passthrough
    prefix_cache: PrefixCache
    prefix: PrefixRouter
    shutting_down: bool = False
    in_flight: int = 0
    share: WorkerShare | None = None
    _stack: AsyncExitStack | None = field(default=None, repr=False)
    live_streams: LiveStreams = field(default_factory=LiveStreams)

    @classmethod
    def build(cls, settings: Settings, share: WorkerShare | None = None) -> ProxyState:
        """Construct (not start) every component from settings.  ``share`` (``--workers N``,
        pdproxy/workers/share.py) puts the pool, the prefill ledger's counts and the breakers on the shared load
        board instead of in this process."""
        s = settings
        endpoints = s.all_endpoints()
        pool = share.pool(endpoints) if share is not None else EndpointPool(endpoints)
        tracing = tracing_from_settings(s)
        headers = EngineHeaders.from_settings(s, propagate=tracing.propagate)
        engines = EngineClient(timeout_s=s.health_timeout_s, api_key=s.engine_api_key)
        infos: dict[Endpoint, EngineInfo] = {e: EngineInfo() for e in pool.endpoints()}
        served = ServedModels(infos, s.model_pins())
        limits = Limits(pool, infos, max_model_len_override=s.max_model_len, clamp=s.max_tokens_overflow == "clamp",
                        served=served)
        health = HealthMonitor(pool, engines, infos, interval_s=s.health_interval_s,
                               refresh_interval_s=s.engine_refresh_interval_s,
                               breaker_failures=s.breaker_failures, breaker_open_s=s.breaker_open_s,
                               make_breaker=share.make_breaker if share is not None else None,
                               unhealthy_threshold=s.health_unhealthy_threshold,
                               healthy_threshold=s.health_healthy_threshold, served=served)
        ledger = PrefillLedger(pool, limits, budget_tokens=s.prefill_budget_tokens,
                               budget_s=s.prefill_budget_s,
                               decoder_capacity=s.prefill_tied_to_decoders, decoder_max_requests=s.decoder_max_requests,
                               counts=share.ledger_counts() if share is not None else None)
        scheduler = Scheduler.standard(pool, health=health, infos=infos, limits=limits, ledger=ledger,
                                       picker=s.routing_picker, served=served,
                                       prefill_resolution_tokens=s.prefill_cost_resolution_tokens)
        queue = PrefillQueue(ledger, scheduler, max_waiting=s.prefill_queue_max, timeout_s=s.prefill_queue_timeout_s,
                             aging_tokens_per_s=s.prefill_queue_aging_tokens_per_s, busy_tokens=s.prefill_busy_tokens)
        upstream = Upstream(connect_timeout_s=s.connect_timeout_s, max_connections=s.upstream_max_connections,
                            pool_wait_s=s.upstream_pool_wait_s, max_answer_bytes=s.engine_answer_max_bytes)
        admission = Admission(s, limits=limits, queue=queue, scheduler=scheduler, upstream=upstream, headers=headers)
        if share is not None:
            share.connect(pool, ledger)     # this worker's releases wake the other workers' waiters
        passthrough = Passthrough(s, scheduler=scheduler, served=served, pool=pool, health=health, headers=headers,
                                  limits=limits)
        prefix_cache = PrefixCache(s)
        health.add_refresh_listener(prefix_cache.update_engine)        # block size, KV pool of each engine
        health.add_remove_listener(prefix_cache.remove_endpoint)       # an endpoint gone: what it held goes too
        prefix = PrefixRouter(s, cache=prefix_cache, admission=admission, pool=pool, infos=infos)
        return cls(settings=s, pool=pool, infos=infos, served=served, limits=limits, health=health, ledger=ledger,
                   scheduler=scheduler, queue=queue, headers=headers, upstream=upstream, engines=engines,
                   admission=admission, tracing=tracing, passthrough=passthrough, prefix_cache=prefix_cache,
                   prefix=prefix, share=share,
                   live_streams=LiveStreams(check_interval_s=s.stream_continuation_stall_min_s / 4))

    # --- what /metrics reads (pdproxy/ops/collector.py's MetricsState) ------------------------------------------
    @property
    def admission_counts(self) -> AdmissionStats:
        """Admission's counters."""
        return self.admission.stats

    @property
    def queue_counts(self) -> QueueStats:
        """The prefill queue's counters."""
        return self.queue.stats

    @property
    def queue_depth(self) -> int:
        """Requests waiting in this process's prefill queue."""
        return self.queue.depth

    def prefill_budget_tokens(self, endpoint: Endpoint) -> int:
        """``endpoint``'s prefill budget now (tokens; 0 = none): the ledger's :meth:`PrefillLedger.budget`."""
        return self.ledger.budget(endpoint)

    @property
    def worker_requests(self) -> list[int] | None:
        """With ``--workers N``: the engine requests each worker holds, by board row; None with one process."""
        board = self.share.board if self.share is not None else None
        if board is None or board.cells is None:          # one process, or the board is closed
            return None
        return [board.row_totals(row)[0] for row in range(board.rows)]

    def director(self, prefix: PrefixSource | None = None) -> Director:
        """A :class:`~pdproxy.pd.director.Director` on these components (the app lifespan's wiring), with its own
        release-leg runner; ``prefix`` defaults to :attr:`prefix` (the :class:`~pdproxy.prefix.routing.PrefixRouter`)."""
        releaser = KVReleaser(scheduler=self.scheduler, pool=self.pool,
                              upstream=self.upstream, headers=self.headers,
                              timeout_s=self.settings.kv_release_timeout_s,
                              retry_s=self.settings.kv_release_retry_s)
        return Director(self.settings, admission=self.admission, scheduler=self.scheduler, queue=self.queue,
                        pool=self.pool, health=self.health, upstream=self.upstream, headers=self.headers,
                        releaser=releaser, prefix=prefix or self.prefix, tracing=self.tracing, served=self.served,
                        live=self.live_streams)

    async def start(self) -> None:
        """Start, in this order: the upstream pool, admission (its token-count threads and tokenizers), the prefix
        cache's KV event subscriber, health monitoring (which probes every engine once first) and, with ``share``,
        the wake-ups from other workers.  Each one's stop is pushed on the exit stack before it starts (every stop
        is safe on a component that never started), so a start that raises stops the earlier ones, newest first,
        and re-raises."""
        async with AsyncExitStack() as stack:
            stack.push_async_callback(self._flush_spans)              # last out: spans the others still emit
            stack.push_async_callback(self.engines.aclose)            # the control-plane client (health uses it)
            stack.push_async_callback(self.passthrough.aclose)        # the passthrough routes' client
            stack.push_async_callback(self.upstream.close)
            await self.upstream.start()
            stack.push_async_callback(self.admission.aclose)
            await self.admission.start()
            await stack.enter_async_context(self.prefix_cache)
            stack.push_async_callback(self.health.stop)
            await self.health.start()
            if self.share is not None:
                stack.callback(self.share.close)
                self.share.listen(self.queue.notify)
            self._stack = stack.pop_all()

    async def stop(self) -> None:
        """Stop what :meth:`start` started, in reverse order: the wake-ups, health monitoring, the KV event
        subscriber, admission, the upstream pool, the passthrough client and the engine client, then flush the
        spans still buffered (tracing on).  A no-op when not started (or stopped already)."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await stack.aclose()

    async def __aenter__(self) -> ProxyState:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _flush_spans(self) -> None:
        if self.tracing.enabled:
            await asyncio.to_thread(self.tracing.shutdown)
