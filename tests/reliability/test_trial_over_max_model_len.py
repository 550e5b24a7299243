"""A request refused at the prefill step (more output tokens than the prefiller's ``max_model_len``: vLLM's 400,
no engine asked) gives back the half-open trial its pick took.

Found by an attacker round: a lone prefiller failed once (its breaker opened), and the first request after the
open period asked ``max_tokens: 100000`` — its pick took the half-open breaker's one trial, the leg was refused
before it was sent, and the trial was never given back: the breaker stayed half-open with its trial "in flight"
and every later request was a 503 (no probe re-admits a half-open breaker) until pdproxy restarted."""

from __future__ import annotations

import threading

import httpx
import orjson
import pytest

from pdproxy.endpoints import Role
from pdproxy.engines.breaker import BreakerState
from tests.stand_in import MODEL, PREFILL_ANSWER, StandInEngine, StandInHandler
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(60)

class Prefiller(StandInEngine):
    """Answers 503 while :attr:`failing` is set, else a prefill answer with a handle."""

    def __init__(self) -> None:
        super().__init__(MODEL)
        self.failing = threading.Event()

    def post(self, handler: StandInHandler, body: bytes) -> None:
        if self.failing.is_set():
            handler.answer(503, b'{"error": {"message": "busy", "type": "ServiceUnavailable", "code": 503}}')
        else:
            handler.answer(200, PREFILL_ANSWER)


class Decoder(StandInEngine):
    def post(self, handler: StandInHandler, body: bytes) -> None:
        handler.answer(200, orjson.dumps({
            "id": "chatcmpl-d", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}))


def chat(proxy: ProxyThread, max_tokens: int) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/chat/completions", timeout=20, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": False})


def test_a_request_refused_for_its_max_tokens_gives_the_half_open_trial_back() -> None:
    with Prefiller().running() as prefiller, Decoder().running() as decoder:
        proxy = ProxyThread(prefill=[prefiller.url], decode=[decoder.url],
                            token_count="estimate", request_log=False, retry_backoff_s=0.0, prefill_attempts=1,
                            breaker_failures=1, breaker_open_s=0.3, health_interval_s=30).start()
        try:
            breaker = proxy.state.health.breaker(proxy.state.pool.endpoints(Role.PREFILL)[0])
            prefiller.failing.set()
            assert chat(proxy, 4).status_code == 503              # the prefiller's 503: its breaker opens
            assert breaker.state is BreakerState.OPEN
            prefiller.failing.clear()
            wait_until(breaker.can_take, 5, what="the open period over")
            refused = chat(proxy, 100_000)                        # its pick takes the half-open trial
            assert refused.status_code == 400 and "max_model_len" in refused.json()["error"]["message"]
            assert breaker.can_take(), (breaker.state, "its trial was never given back")
            served = chat(proxy, 4)
            assert served.status_code == 200, served.text[:300]
            assert breaker.state is BreakerState.CLOSED
            proxy.wait_idle()
        finally:
            proxy.stop()
