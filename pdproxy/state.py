"""ProxyState: everything one proxy process owns, built in the app's lifespan (no module-level state)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdproxy.admission import Admission
from pdproxy.endpoints import Endpoint
from pdproxy.engines import EngineClient, EngineInfo
from pdproxy.health import HealthMonitor
from pdproxy.pool import EndpointPool
from pdproxy.scheduler import Scheduler
from pdproxy.settings import Settings
from pdproxy.timeline import RequestContext
from pdproxy.upstream import Upstream


@dataclass
class ProxyState:
    """The proxy's components.  ``shutting_down`` is set on SIGTERM / lifespan shutdown."""

    settings: Settings
    pool: EndpointPool
    scheduler: Scheduler
    upstream: Upstream
    engines: EngineClient
    infos: dict[Endpoint, EngineInfo]
    health: HealthMonitor
    admission: Admission
    shutting_down: bool = False
    in_flight: int = 0
    extras: dict[str, object] = field(default_factory=dict)

    @classmethod
    def build(cls, settings: Settings,
              pool_factory: Callable[[list[Endpoint]], EndpointPool] | None = None) -> ProxyState:
        """Construct (not start) every component from settings.  ``pool_factory`` (``--workers N``: a pool on the
        shared load board, pdproxy/loadboard.py) replaces the default per-process :class:`EndpointPool`."""
        pool = (pool_factory or EndpointPool)(settings.all_endpoints())
        engines = EngineClient(timeout_s=settings.health_timeout_s, api_key=settings.engine_api_key)
        infos: dict[Endpoint, EngineInfo] = {e: EngineInfo() for e in pool.endpoints()}
        health = HealthMonitor(pool, engines, infos, interval_s=settings.health_interval_s,
                               refresh_interval_s=settings.engine_refresh_interval_s,
                               breaker_failures=settings.breaker_failures, breaker_open_s=settings.breaker_open_s)
        scheduler = Scheduler(pool)
        upstream = Upstream(connect_timeout_s=settings.connect_timeout_s)
        admission = Admission(settings, pool, infos, scheduler=scheduler, upstream=upstream)
        state = cls(settings=settings, pool=pool, scheduler=scheduler, upstream=upstream, engines=engines,
                    infos=infos, health=health, admission=admission)
        admission.engine_authorization = state.engine_authorization
        return state

    async def start(self) -> None:
        """Start the upstream pool, admission and health monitoring (health probes every engine once first)."""
        await self.upstream.start()
        await self.admission.start()
        await self.health.start()

    async def stop(self) -> None:
        """Stop health monitoring, admission, the upstream pool and the engine client, in that order."""
        await self.health.stop()
        await self.admission.aclose()
        await self.upstream.close()
        await self.engines.aclose()

    def engine_authorization(self, client_authorization: str | None) -> str | None:
        """The ``Authorization`` header for engine legs.

        By default the client's header passes through (engines started with ``--api-key`` work behind pdproxy as
        they do directly).  When pdproxy enforces its own client keys (``api_keys``), those never reach the
        engines: the configured ``engine_api_key`` is sent instead, or nothing.
        """
        if self.settings.api_keys:
            key = self.settings.engine_api_key
            return f"Bearer {key}" if key else None
        return client_authorization

    def routing_headers(self, ctx: RequestContext) -> list[tuple[bytes, bytes]]:
        """Optional response headers naming the prefiller and decoder used (``expose_routing_headers``)."""
        if not self.settings.expose_routing_headers:
            return []
        out = []
        if ctx.prefiller:
            out.append((b"x-pdproxy-prefiller", ctx.prefiller.encode()))
        if ctx.decoder:
            out.append((b"x-pdproxy-decoder", ctx.decoder.encode()))
        return out
