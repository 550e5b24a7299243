"""A half-open breaker's one trial taken by a passthrough request (pdproxy/app/passthrough.py) is given back.

An engine whose breaker opened and was re-admitted by a good ``/health`` probe lets exactly one trial request in
(pdproxy/engines/breaker.py); passthrough routes (``/tokenize``, ``/inference/v1/generate``, the pooling routes…)
pick their engine with a trial too.  When that request's client leaves while the engine works, or the engine
answers an error status that is relayed as it is (a 500), the trial must still end — freed
(``HealthMonitor.record_neutral``) or judged — or the engine never takes a request again: every request for its
role is a 503 "half-open with its one trial request in flight" until pdproxy restarts.  The PD legs' twin of this
is tests/reliability/test_trial_cancel.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import orjson
import pytest

from pdproxy.endpoints import Endpoint, Role
from tests.relay.rawclient import RawConn
from tests.stand_in import MODEL, StandInEngine, StandInHandler
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(60)

HELD = "/tokenize"
"""The route whose answer the engine holds until the test releases it (the client leaves meanwhile)."""
FAILING = "/detokenize"
"""The route the engine answers with vLLM's JSON 500."""
REFUSED = "/v1/embeddings"
"""The route the engine answers 400 (the request's own fault)."""
BUSY = "/pooling"
"""The route the engine answers 503 with ``Retry-After: 30``."""


class Engine(StandInEngine):
    """The stand-in (tests/stand_in.py): ``POST`` :data:`HELD` answers once :attr:`release` is set (:attr:`held` is
    set when one arrived), :data:`FAILING` 500, :data:`REFUSED` 400, :data:`BUSY` 503 with ``Retry-After: 30``, any
    other ``{"ok": true}``."""

    def __init__(self) -> None:
        super().__init__(MODEL)
        self.held = threading.Event()

    def post(self, handler: StandInHandler, body: bytes) -> None:
        path = handler.path
        if path == HELD:
            self.held.set()
            self.release.wait(30)
        if path == FAILING:
            handler.answer(500, b'{"error": {"message": "boom", "type": "InternalServerError", "param": null, '
                                b'"code": 500}}')
        elif path == REFUSED:
            handler.answer(400, b'{"error": {"message": "bad input", "type": "BadRequestError", "param": null, '
                                b'"code": 400}}')
        elif path == BUSY:
            handler.answer(503, b"{}", {"retry-after": "30"})
        else:
            handler.answer(200, b'{"ok": true}')


@pytest.fixture
def rig() -> Iterator[tuple[Engine, ProxyThread, Endpoint]]:
    """The engine, pdproxy in front of it (one prefiller, one decoder: the same engine) and the decode endpoint,
    whose breaker the tests open (passthrough tries decoders first)."""
    engine = Engine()
    with engine.running():
        proxy = ProxyThread(prefill=[engine.url], decode=[engine.url], prefix_routing="off",
                            breaker_open_s=0.2).start()
        try:
            (decoder,) = proxy.state.pool.endpoints(Role.DECODE)
            yield engine, proxy, decoder
        finally:
            proxy.stop()


def half_open_ready(proxy: ProxyThread, endpoint: Endpoint) -> None:
    """Open ``endpoint``'s breaker (a refused connection opens it at once) and wait for the probe that follows to
    re-admit it: its one trial is free."""
    health = proxy.state.health

    async def fail() -> None:
        health.record_failure(endpoint, hard=True)

    assert proxy.loop is not None
    opened = health.breaker(endpoint).opened_total
    asyncio.run_coroutine_threadsafe(fail(), proxy.loop).result(5)
    assert health.breaker(endpoint).opened_total == opened + 1    # (a probe may re-admit it at once: 0.2 s)
    wait_until(lambda: health.can_take(endpoint), 10, what="the probe re-admitting the decoder for a trial")


def test_a_passthrough_trial_whose_client_leaves_frees_the_trial(rig: tuple[Engine, ProxyThread, Endpoint]) -> None:
    engine, proxy, decoder = rig
    health = proxy.state.health
    half_open_ready(proxy, decoder)

    conn = RawConn(proxy.port)
    body = orjson.dumps({"model": MODEL, "prompt": "hello"})
    conn.send(b"POST " + HELD.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert engine.held.wait(10), "the passthrough request never reached the engine"
    assert not health.can_take(decoder)                  # the one trial is in flight
    conn.close()                                         # the client leaves while the engine works
    wait_until(lambda: health.can_take(decoder), 10,
               what="the cancelled passthrough trial giving the half-open decoder's trial slot back")
    engine.release.set()

    after = httpx.post(proxy.url + "/tokenize", json={"model": MODEL, "prompt": "x"}, timeout=10)
    assert after.status_code == 200, after.text
    proxy.wait_idle()


def test_a_passthrough_trial_answered_500_ends_the_trial(rig: tuple[Engine, ProxyThread, Endpoint]) -> None:
    engine, proxy, decoder = rig
    health = proxy.state.health
    engine.release.set()
    half_open_ready(proxy, decoder)

    failed = httpx.post(proxy.url + FAILING, json={"model": MODEL, "tokens": [1]}, timeout=10)
    assert failed.status_code == 500                     # the engine's answer, relayed
    assert orjson.loads(failed.content)["error"]["message"] == "boom"
    # judged (the breaker opens again, then a probe re-admits a trial) or freed: never held with nothing in flight
    wait_until(lambda: health.can_take(decoder), 10,
               what="the decoder taking requests again after its trial was answered 500")
    after = httpx.post(proxy.url + "/tokenize", json={"model": MODEL, "prompt": "x"}, timeout=10)
    assert after.status_code == 200, after.text
    proxy.wait_idle()


def test_a_passthrough_trial_answered_400_gives_the_trial_back_without_closing_the_breaker(
        rig: tuple[Engine, ProxyThread, Endpoint]) -> None:
    """A 4xx is the request's own fault: the trial is given back and the breaker stays half-open (the next request
    is the trial) — a relayed 400 had closed it, as if the engine had proven itself."""
    engine, proxy, decoder = rig
    health = proxy.state.health
    engine.release.set()
    half_open_ready(proxy, decoder)
    refused = httpx.post(proxy.url + REFUSED, json={"model": MODEL, "input": "x"}, timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["message"] == "bad input"
    wait_until(lambda: health.can_take(decoder), 10, what="the trial given back")
    assert health.breaker(decoder).state.value == "half_open"
    proxy.wait_idle()


def test_a_passthrough_503_with_retry_after_keeps_the_engine_out_that_long(
        rig: tuple[Engine, ProxyThread, Endpoint]) -> None:
    """A relayed 5xx is judged as the PD legs judge one (pdproxy.errors.classify): the engine's ``Retry-After``
    holds its breaker open that long, as a PD leg's 503 does."""
    engine, proxy, decoder = rig
    breaker = proxy.state.health.breaker(decoder)
    engine.release.set()
    half_open_ready(proxy, decoder)
    busy = httpx.post(proxy.url + BUSY, json={"model": MODEL, "input": "x"}, timeout=10)
    assert busy.status_code == 503
    wait_until(lambda: breaker.seconds_until_retry() > 20, 10,   # Retry-After: 30, not breaker_open_s's 0.2 s
               what="the breaker held open for the engine's Retry-After")
