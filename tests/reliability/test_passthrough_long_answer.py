"""A passthrough request whose answer takes longer than ``decode_first_byte_timeout_s`` is no verdict on the engine.

vLLM answers a non-streamed request (``/inference/v1/generate``, the pooling routes, a transcription) only once it
is done, so a request asking for a long answer — many output tokens with ``ignore_eos`` — sends nothing until
then.  pdproxy cannot tell that from a hung engine: the time-out was counted against the engine's breaker and the
request tried on the next engine, both roles in turn, so three such requests from one client opened the breaker of
every engine, and every client's request on every route was a 503 (pdproxy/app/passthrough.py ``_Unanswered``)."""

from __future__ import annotations

import threading

import httpx
import pytest

from pdproxy.endpoints import Role
from tests.stand_in import MODEL, StandInEngine, StandInHandler
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(60)

GENERATE = "/inference/v1/generate"


class SlowEngine(StandInEngine):
    """The stand-in (tests/stand_in.py) whose ``POST`` answers only when :attr:`release` is set (a long
    generation); :attr:`received` counts the generate requests that reached it."""

    def __init__(self) -> None:
        super().__init__(MODEL)
        self.received = 0
        self.lock = threading.Lock()

    def post(self, handler: StandInHandler, body: bytes) -> None:
        if handler.path == GENERATE:
            with self.lock:
                self.received += 1
        self.release.wait(30)
        handler.answer(200, b'{"choices": [{"index": 0, "token_ids": [1]}]}')


def test_long_passthrough_answers_open_no_breaker_and_are_not_retried() -> None:
    engine = SlowEngine()
    with engine.running():
        proxy = ProxyThread(prefill=[engine.url], decode=[engine.url], prefix_routing="off",
                            decode_first_byte_timeout_s=0.3, breaker_failures=3, breaker_open_s=30).start()
        try:
            health = proxy.state.health
            engines = [*proxy.state.pool.endpoints(Role.DECODE), *proxy.state.pool.endpoints(Role.PREFILL)]
            body = {"model": MODEL, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4000, "ignore_eos": True}}
            for i in range(4):                               # more than breaker_failures, one client
                late = httpx.post(proxy.url + GENERATE, json=body, timeout=10)
                assert late.status_code == 504, late.text
                assert "127.0.0.1" not in late.text
                assert engine.received == i + 1            # one engine tried: another would take as long
            assert all(health.can_take(e) for e in engines), [health.breaker(e).state for e in engines]
            engine.release.set()
            ok = httpx.post(proxy.url + "/tokenize", json={"model": MODEL, "prompt": "x"}, timeout=10)
            assert ok.status_code == 200, ok.text
            proxy.wait_idle()
        finally:
            proxy.stop()
