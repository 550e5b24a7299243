"""Endpoint health: active ``/health`` probes and passive failure recording.

First version: probes mark endpoints healthy/unhealthy; passive failures are counted.  Issue 5 adds the
circuit breaker (closed → open → half-open).
"""

from __future__ import annotations

import asyncio
import contextlib

from pdproxy.endpoints import Endpoint
from pdproxy.engines import EngineClient, EngineInfo
from pdproxy.pool import EndpointPool


class HealthMonitor:
    """Keeps ``pool`` health flags and ``infos`` (what each engine declares) up to date."""

    def __init__(self, pool: EndpointPool, engines: EngineClient, infos: dict[Endpoint, EngineInfo], *,
                 interval_s: float, refresh_interval_s: float) -> None:
        self.pool = pool
        self.engines = engines
        self.infos = infos
        self.interval_s = interval_s
        self.refresh_interval_s = refresh_interval_s
        self._task: asyncio.Task[None] | None = None

    def record_failure(self, endpoint: Endpoint) -> None:
        """A request to ``endpoint`` failed at the transport level or with a 5xx."""

    def record_success(self, endpoint: Endpoint) -> None:
        """A request to ``endpoint`` succeeded."""

    async def refresh_all(self) -> None:
        """Probe every endpoint once and refresh its :class:`EngineInfo` (concurrently)."""
        async def one(e: Endpoint) -> None:
            info = self.infos.setdefault(e, EngineInfo())
            await self.engines.refresh(e, info)
            with contextlib.suppress(KeyError):
                self.pool.load(e).healthy = info.reachable and await self.engines.health(e)
        await asyncio.gather(*(one(e) for e in self.pool.endpoints()))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh_all()

    async def start(self) -> None:
        await self.refresh_all()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
