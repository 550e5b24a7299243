"""A drain with ``migrate`` (``POST /admin/endpoints/drain``) moves a decoder's live streams to the other decoders
at once: no stream breaks, each equals its uninterrupted run, and the drained decoder gets no new leg."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from tests.reliability.harness import Fleet4, Result, drive
from tests.support import wait_until

pytestmark = pytest.mark.timeout(60)

LONG = 600
BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "A long answer, please."}],
        "max_tokens": LONG, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def test_drain_with_migrate_moves_live_streams(fleet5: Fleet4) -> None:
    proxy = fleet5.proxy(stream_continuation=True, admin_key="k")
    try:
        base = asyncio.run(drive(proxy.url, BODY, n=1, concurrency=1))[0]
        assert base.status == 200 and not base.errors
        results: list[Result] = []
        runner = threading.Thread(target=lambda: results.extend(asyncio.run(
            drive(proxy.url, BODY, n=24, concurrency=24))), daemon=True)
        runner.start()
        victim = fleet5.decoders[0]
        name = next(e.name for e in proxy.state.pool.endpoints() if e.url == victim.url)
        wait_until(lambda: proxy.state.live_streams.count(name, movable=True) >= 3, 20, 0.005,
                   "streams past their first event on the victim")
        answer = httpx.post(proxy.url + "/admin/endpoints/drain", headers={"authorization": "Bearer k"},
                            json={"url": victim.url, "role": "decode", "migrate": True}, timeout=10).json()
        assert answer["migrated"] >= 3
        runner.join(timeout=40)
        assert len(results) == 24
        broken = [r.body[-300:] for r in results if r.status != 200 or r.errors or r.done != 1]
        assert not broken, broken
        assert all(r.text == base.text for r in results)
        usage: list[dict[str, Any]] = [e["usage"] for r in results for e in r.events if e.get("usage")]
        assert len(usage) == 24 and all(u["completion_tokens"] == LONG for u in usage)
        # drained: every continuation (a token-id prompt on /v1/completions) went to another decoder; a first leg
        # picked just before the drain may still reach the victim, so only continuation legs are counted
        continued = [r for s in fleet5.decoders for r in s.received() if isinstance(r["body"].get("prompt"), list)]
        assert len(continued) >= answer["migrated"]
        assert not [r for r in victim.received() if isinstance(r["body"].get("prompt"), list)]
        snap = proxy.state.health.snapshot(next(e for e in proxy.state.pool.endpoints() if e.url == victim.url))
        assert snap.breaker == "closed"           # planned: no verdict against the decoder
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()
