"""A fault in pdproxy's own step between a leg's pick and its send (a bug, an exception while building the leg's
body) gives back the half-open trial the pick took.

Left as it was, the breaker of a lone engine stayed half-open with its one trial "in flight" for ever (no probe
re-admits a half-open breaker, no trial times out): every later request was a 503 until pdproxy restarted.  The
fault is injected (no input is known to raise there today); what the test holds is the release on that path."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import orjson
import pytest

from pdproxy.apis import kv_transfer
from pdproxy.endpoints import Role
from pdproxy.engines.breaker import BreakerState
from tests.stand_in import MODEL, PREFILL_ANSWER, StandInEngine, StandInHandler
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(60)

DECODE_ANSWER = orjson.dumps({
    "id": "chatcmpl-d", "object": "chat.completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}})


class Engine(StandInEngine):
    """Answers 503 while :attr:`failing` is set, else ``answer``."""

    def __init__(self, answer: bytes) -> None:
        super().__init__(MODEL)
        self.answer = answer
        self.failing = threading.Event()
        self.posts = 0

    def post(self, handler: StandInHandler, body: bytes) -> None:
        self.posts += 1
        if self.failing.is_set():
            handler.answer(503, b'{"error": {"message": "busy", "type": "ServiceUnavailable", "code": 503}}')
        else:
            handler.answer(200, self.answer)


def chat(proxy: ProxyThread) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/chat/completions", timeout=20, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": False})


@pytest.fixture()
def engines() -> Iterator[tuple[Engine, Engine, ProxyThread]]:
    with Engine(PREFILL_ANSWER).running() as prefiller, Engine(DECODE_ANSWER).running() as decoder:
        proxy = ProxyThread(prefill=[prefiller.url], decode=[decoder.url], token_count="estimate",
                            request_log=False, retry_backoff_s=0.0, prefill_attempts=1, decode_attempts=1,
                            breaker_failures=1, breaker_open_s=0.3, health_interval_s=30).start()
        try:
            yield prefiller, decoder, proxy
        finally:
            proxy.stop()


def half_open_fault(proxy: ProxyThread, engine: Engine, role: Role, monkeypatch: pytest.MonkeyPatch,
                    step: str) -> None:
    """Open ``engine``'s breaker with one 503, then send a request whose leg to it raises in pdproxy at ``step``
    (a function of :mod:`pdproxy.apis.kv_transfer`) after the pick took the half-open trial."""
    breaker = proxy.state.health.breaker(proxy.state.pool.endpoints(role)[0])
    engine.failing.set()
    assert chat(proxy).status_code in (502, 503)               # the engine's 503: its breaker opens
    assert breaker.state is BreakerState.OPEN
    engine.failing.clear()
    wait_until(breaker.can_take, 5, what="the open period over")
    posts = engine.posts

    def fault(*args: object, **kwargs: object) -> object:
        raise RuntimeError("injected")

    with monkeypatch.context() as m:
        m.setattr(kv_transfer, step, fault)
        broken = chat(proxy)                                   # its pick takes the half-open trial, then raises
    assert broken.status_code == 500, broken.text[:300]
    if role is Role.PREFILL:     # (a decoder may get the release leg of the prefiller's KV meanwhile: no verdict)
        assert engine.posts == posts, "the leg was never sent"
    assert breaker.can_take(), (breaker.state, "its trial was never given back")
    served = chat(proxy)
    assert served.status_code == 200, served.text[:300]
    assert breaker.state is BreakerState.CLOSED
    proxy.wait_idle()


def test_a_fault_building_the_decode_leg_gives_the_half_open_trial_back(
        engines: tuple[Engine, Engine, ProxyThread], monkeypatch: pytest.MonkeyPatch) -> None:
    _, decoder, proxy = engines
    half_open_fault(proxy, decoder, Role.DECODE, monkeypatch, "decode_leg_body")


def test_a_fault_before_the_prefill_leg_is_sent_gives_the_half_open_trial_back(
        engines: tuple[Engine, Engine, ProxyThread], monkeypatch: pytest.MonkeyPatch) -> None:
    prefiller, _, proxy = engines
    half_open_fault(proxy, prefiller, Role.PREFILL, monkeypatch, "engine_must_judge")
