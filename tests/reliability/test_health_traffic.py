"""Health from real traffic (pdproxy/engines/health.py), through simulated engines on loopback:

- every engine's ``/health`` answers late (past ``health_timeout_s``) for seconds while every generation request is
  served: pdproxy keeps them all in rotation and refuses nothing — the requests they serve outweigh the failed
  probes (Envoy's ``unhealthy_threshold`` counted only while no traffic succeeds);
- a decoder whose generation hangs while ``/health`` answers 200: out of rotation once ``breaker_failures``
  requests timed out to the first byte — within one ``decode_first_byte_timeout_s`` when they were sent together
  — and good probes do not bring it back; it is back through a trial request once the open period
  (``breaker_open_s``) passed and it answers again.  Every client got its answer meanwhile (failover).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from pdproxy.endpoints import Role
from pdproxy.engines.breaker import BreakerState
from tests.reliability.harness import CHAT, Fleet4
from tests.support import ProxyThread, SimProcess, wait_until

pytestmark = pytest.mark.timeout(60)

SLOW_PROBES = 8          # each engine's next 8 probes answer after 1 s (timeout 0.3 s): seconds of failed probes


async def ask(url: str, n: int) -> list[int]:
    async with httpx.AsyncClient(timeout=30) as client:
        async def one() -> int:
            async with client.stream("POST", url + "/v1/chat/completions", json=CHAT) as resp:
                body = b"".join([chunk async for chunk in resp.aiter_raw()])
                return resp.status_code if resp.status_code != 200 or b"[DONE]" in body else -1
        return list(await asyncio.gather(*(one() for _ in range(n))))


def pending_faults(sim: SimProcess) -> list[dict[str, Any]]:
    return list(sim.client.get("/sim/faults").json()["faults"])


def test_engines_answering_health_late_while_serving_stay_in_rotation(fleet4: Fleet4) -> None:
    proxy = fleet4.proxy(health_timeout_s=0.3)
    try:
        for s in fleet4.all:
            s.faults({"kind": "slow_health", "delay_s": 1.0, "path": "/health", "times": SLOW_PROBES})
        statuses: list[int] = []
        while any(pending_faults(s) for s in fleet4.all):            # the probes are failing meanwhile
            statuses += asyncio.run(ask(proxy.url, 4))
        # every engine's 8 probes failed (each fault fired: 1 s late, timeout 0.3 s), more than
        # health_unhealthy_threshold (3) in a row: the requests they served kept them in rotation
        assert statuses and statuses == [200] * len(statuses), statuses
        assert all(proxy.state.pool.load(e).healthy for e in proxy.state.pool.endpoints())
        fleet4.assert_clean(proxy)
    finally:
        proxy.stop()


def breaker(proxy: ProxyThread, sim: SimProcess) -> BreakerState:
    (endpoint,) = [e for e in proxy.state.pool.endpoints(Role.DECODE) if e.url == sim.url]
    b = proxy.state.health.breakers.get(endpoint)
    return BreakerState.CLOSED if b is None else b.state


def open_for_s(proxy: ProxyThread, sim: SimProcess) -> float:
    (endpoint,) = [e for e in proxy.state.pool.endpoints(Role.DECODE) if e.url == sim.url]
    return proxy.state.health.breakers[endpoint].seconds_until_retry()


def probes(sim: SimProcess) -> int:
    """``/health`` requests ``sim`` answered (its zero-delay ``slow_health`` fault counts them)."""
    return sum(f["fired"] for f in pending_faults(sim) if f["kind"] == "slow_health")


def test_a_decoder_whose_generation_hangs_leaves_rotation_though_health_answers(fleet4: Fleet4) -> None:
    hung, good = fleet4.decoders
    proxy = fleet4.proxy(decode_first_byte_timeout_s=1.0, breaker_open_s=6.0)   # the window below fits in 6 s
    try:
        hung.faults({"kind": "hang", "path": "/v1/chat/completions", "times": 1000},
                    {"kind": "slow_health", "delay_s": 0, "path": "/health", "times": 10**6})  # counts the probes
        statuses: list[int] = []
        wait_until(lambda: statuses.extend(asyncio.run(ask(proxy.url, 6))) or
                   breaker(proxy, hung) is BreakerState.OPEN, 15, 0, "the hung decoder's breaker opened")
        assert statuses == [200] * len(statuses)                  # those sent to it failed over to the other
        # /health keeps answering: good probes come, and do not bring it back
        probed = probes(hung)
        wait_until(lambda: probes(hung) >= probed + 2, 5, 0.02, "two more good probes")
        sent_to_hung = len(hung.completions_received())
        assert asyncio.run(ask(proxy.url, 10)) == [200] * 10
        assert breaker(proxy, hung) is BreakerState.OPEN and open_for_s(proxy, hung) > 0
        assert len(hung.completions_received()) == sent_to_hung   # out of rotation
        hung.reset()                                               # it answers again
        wait_until(lambda: asyncio.run(ask(proxy.url, 2)) == [200] * 2 and hung.completions_received()
                   and breaker(proxy, hung) is BreakerState.CLOSED, 25, 0.05,
                   "the decoder back in rotation after the open period")
        assert good.completions_received()
        fleet4.assert_clean(proxy)
    finally:
        proxy.stop()
