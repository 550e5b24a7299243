"""Routing through the running proxy: a model no engine serves gets vLLM's 404 before any engine is asked, and
prefix hints supplied at the director's seam steer prefills (what a prefix index will plug into)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from pdproxy.apis.request import ProxyRequest
from pdproxy.endpoints import Endpoint
from pdproxy.scheduling import PrefixHints
from pdproxy.timeline import RequestContext
from tests.conftest import SIM_ARGS
from tests.support import ProxyThread, SimProcess, running

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "route me"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[SimProcess, ...]]:
    with running(SimProcess("prefill", *SIM_ARGS), SimProcess("prefill", *SIM_ARGS),
                 SimProcess("decode", *SIM_ARGS)) as sims:
        yield sims


@pytest.fixture
def proxy(fleet: tuple[SimProcess, ...]) -> Iterator[ProxyThread]:
    for s in fleet:
        s.reset()
    p = ProxyThread(prefill=[s.url for s in fleet[:2]], decode=[fleet[2].url], expose_routing_headers=True).start()
    try:
        yield p
        p.wait_idle()
    finally:
        p.stop()


def test_a_model_no_engine_serves_is_a_404_before_any_engine(proxy: ProxyThread,
                                                              fleet: tuple[SimProcess, ...]) -> None:
    r = httpx.post(proxy.url + "/v1/chat/completions", json={**CHAT, "model": "gpt-4o"}, timeout=20)
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `gpt-4o` does not exist. Valid aliases: sim-model.",
                                  "type": "NotFoundError", "param": "model", "code": 404}}
    assert [s.completions_received() for s in fleet] == [[], [], []]
    ok = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=20)
    assert ok.status_code == 200


class HoldsItAll:
    """A prefix source that says one prefiller holds every prompt but its last token."""

    def __init__(self, holder: str, proxy: ProxyThread) -> None:
        self.endpoint = next(e for e in proxy.state.pool.endpoints() if e.name == holder)

    async def hints(self, req: ProxyRequest, ctx: RequestContext) -> PrefixHints:
        return PrefixHints(cached_tokens={self.endpoint: (req.prompt_tokens or 1) - 1})

    @contextlib.contextmanager
    def prefilling(self, req: ProxyRequest, ctx: RequestContext, endpoint: Endpoint) -> Iterator[None]:
        yield


def test_prefix_hints_at_the_directors_seam_steer_the_prefill(proxy: ProxyThread,
                                                                fleet: tuple[SimProcess, ...]) -> None:
    def prefillers(n: int) -> Counter[str]:
        seen: Counter[str] = Counter()
        for i in range(n):
            body = {**CHAT, "messages": [{"role": "user", "content": f"conversation {i}: route me"}]}
            r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=20)
            assert r.status_code == 200
            seen[r.headers["x-pdproxy-prefiller"]] += 1
        return seen

    assert set(prefillers(24)) == {fleet[0].url, fleet[1].url}          # no hints: spread by request id
    director = proxy.app.director
    assert director is not None
    director.prefix = HoldsItAll(fleet[1].url, proxy)
    assert prefillers(12) == {fleet[1].url: 12}                         # the holder's 1 uncached token wins
