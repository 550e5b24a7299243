"""The health verdict's thresholds (pdproxy/engines/health.py, docs/health.md): an engine leaves rotation after
``health_unhealthy_threshold`` failed probes in a row and comes back only after ``health_healthy_threshold`` good
ones in a row — one good probe between failures does not flap it back."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineClient, EngineInfo
from pdproxy.engines.health import HealthMonitor
from pdproxy.engines.pool import EndpointPool

pytestmark = pytest.mark.timeout(20)

D = Endpoint("http://d0:9100", Role.DECODE)


class ScriptedHealth(EngineClient):
    """``GET /health`` answers from a script (True: 200), no sockets."""

    def __init__(self, answers: list[bool]) -> None:
        super().__init__(timeout_s=1.0)
        self.answers = answers

    async def health(self, endpoint: Endpoint) -> bool:
        return self.answers.pop(0)

    async def refresh(self, endpoint: Endpoint, info: EngineInfo) -> EngineInfo:
        """``/v1/models`` answers (a probe after a failed one refreshes the engine's info first)."""
        info.reachable = True
        info.refreshed_at = time.monotonic()
        return info


@pytest.mark.parametrize(("unhealthy", "healthy", "answers", "verdicts"), [
    (1, 2, [True, False, True, True, False, True, False, True, True],
     [True, False, False, True, False, False, False, False, True]),
    (2, 1, [True, False, True, False, False, True],
     [True, True, True, True, False, True]),
    (1, 3, [False, True, True, True], [False, False, False, True]),
])
def test_probes_in_a_row_decide_rotation(unhealthy: int, healthy: int, answers: list[bool],
                                         verdicts: list[bool]) -> None:
    async def run() -> list[bool]:
        pool = EndpointPool([D])
        infos = {D: EngineInfo(reachable=True, refreshed_at=time.monotonic())}     # no refresh is due
        engines = ScriptedHealth(list(answers))
        monitor = HealthMonitor(pool, engines, infos, interval_s=60, refresh_interval_s=1e9,
                                unhealthy_threshold=unhealthy, healthy_threshold=healthy)
        try:
            out = []
            for _ in answers:
                out.append(await monitor.probe(D))
                assert pool.load(D).healthy is out[-1]
            return out
        finally:
            await engines.aclose()

    assert asyncio.run(run()) == verdicts
