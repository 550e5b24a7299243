"""``request_timeout_s`` is counted from the request's arrival (pdproxy/pd/director.py ``Director.deadline``):
time spent before the P→D path (admission, the prefill queue) is part of it."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdproxy.errors import UpstreamTimeout
from pdproxy.pd.director import Director
from pdproxy.settings import Settings
from pdproxy.timeline import RequestContext

pytestmark = pytest.mark.timeout(20)


def director(limit: float | None) -> Director:
    d = Director.__new__(Director)                     # only the deadline runs: it reads the settings
    d.settings = Settings(prefill=["http://p:1"], decode=["http://d:2"], request_timeout_s=limit)
    return d


@pytest.mark.parametrize(("waited_s", "expires"), [(9.9, True), (30.0, True), (0.0, False)])
def test_the_deadline_counts_from_arrival(waited_s: float, expires: bool) -> None:
    """A 10 s deadline for a request that arrived ``waited_s`` ago: 9.9 s leaves 0.1 s for a 1 s step (504),
    arriving just now leaves it all."""
    async def run() -> str:
        ctx = RequestContext(request_id="r", client_request_id=None, api_label="chat")
        ctx.timeline.arrived_at = time.monotonic() - waited_s
        try:
            async with director(10.0).deadline(ctx):
                await asyncio.sleep(0.3 if not expires else 1.0)
        except UpstreamTimeout as exc:
            return exc.message
        return "finished"

    got = asyncio.run(run())
    assert got == ("request exceeded the end-to-end deadline of 10.0 s" if expires else "finished")


def test_no_deadline_without_the_setting() -> None:
    async def run() -> None:
        ctx = RequestContext(request_id="r", client_request_id=None, api_label="chat")
        ctx.timeline.arrived_at = time.monotonic() - 1e6
        async with director(None).deadline(ctx):
            await asyncio.sleep(0)

    asyncio.run(run())
