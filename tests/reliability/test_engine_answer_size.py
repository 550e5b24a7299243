"""An engine answer is read within bounds: an error answer's body up to 1 MiB, any other whole answer up to
``engine_answer_max_bytes`` — then the connection is closed and the engine judged, whatever it goes on sending.

Found by an attacker's engine: a prefiller that answered 500 with a 400 MB chunked body was read whole (the error
keeps 1 MiB of it), so the proxy grew to 1 GB of RSS and the client got nothing until the prefill timeout, then
the same again on each retry; a non-streamed decode answer or a prefill answer without end held the request until
its timeout and all its bytes in memory."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.stand_in import MODEL, PREFILL_ANSWER, StandInEngine, StandInHandler
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(60)

def endless(handler: StandInHandler, status: int, engine: StandInEngine, first: bytes = b"") -> None:
    """Answer ``status`` with a chunked body that never ends (``first`` then 64 KiB chunks of ``x``) until the
    client goes away or the engine stops."""
    handler.wfile.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                        "transfer-encoding: chunked\r\n\r\n".encode())
    block = b"x" * 65536
    piece = b"%x\r\n%s\r\n" % (len(block), block)
    try:
        if first:
            handler.wfile.write(b"%x\r\n%s\r\n" % (len(first), first))
        while not engine.release.is_set():
            handler.wfile.write(piece)
    except (BrokenPipeError, ConnectionResetError):
        engine.gone += 1
    handler.close_connection = True


class Prefiller(StandInEngine):
    """Answers every prefill leg with ``mode``: ``"ok"`` a one-token answer with a handle, ``"endless_500"`` a 500
    whose body never ends, ``"endless_200"`` a 200 whose JSON never ends."""

    def __init__(self, mode: str) -> None:
        super().__init__(MODEL)
        self.mode = mode
        self.gone = 0

    def post(self, handler: StandInHandler, body: bytes) -> None:
        if self.mode == "ok":
            handler.answer(200, PREFILL_ANSWER)
        elif self.mode == "endless_500":
            endless(handler, 500, self, b'{"error": {"message": "boom", "type": "InternalServerError", "code": 500, '
                                        b'"detail": "')
        else:
            endless(handler, 200, self, PREFILL_ANSWER[:-1] + b', "x": "')


class Decoder(StandInEngine):
    """Answers every non-streamed decode leg with a 200 whose JSON never ends."""

    def __init__(self) -> None:
        super().__init__(MODEL)
        self.gone = 0

    def post(self, handler: StandInHandler, body: bytes) -> None:
        endless(handler, 200, self, b'{"id": "chatcmpl-d", "object": "chat.completion", "choices": [], "x": "')


def chat(proxy: ProxyThread) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": False})


def _judged(mode: str, cut: str, **settings: Any) -> httpx.Response:
    """One chat through a pdproxy whose prefiller answers as ``mode`` (``Prefiller``) with
    ``engine_answer_max_bytes`` 1 MiB and ``settings`` (a 30 s leg timeout): its answer, asserted to come well
    before that timeout and with the ``cut`` engine's (``"prefiller"``/``"decoder"``) connection closed, not read
    on."""
    with Prefiller(mode).running() as prefiller, Decoder().running() as decoder:
        proxy = ProxyThread(prefill=[prefiller.url], decode=[decoder.url], token_count="estimate",
                            request_log=False, retry_backoff_s=0.0, engine_answer_max_bytes=1 << 20,
                            **settings).start()
        try:
            started = time.monotonic()
            resp = chat(proxy)
            took = time.monotonic() - started
            assert took < 10, f"answered after {took:.1f} s: the body was read until the leg's timeout"
            proxy.wait_idle()
            engine = prefiller if cut == "prefiller" else decoder
            wait_until(lambda: engine.gone >= 1, 10, what="its connection closed, not read on")
            return resp
        finally:
            proxy.stop()


@pytest.mark.parametrize("mode", ["endless_500", "endless_200"])
def test_a_prefiller_answer_without_end_is_judged_at_its_bound_not_at_the_prefill_timeout(mode: str) -> None:
    resp = _judged(mode, "prefiller", prefill_attempts=1, prefill_timeout_base_s=30)
    if mode == "endless_500":      # the engine's own error, its body cut at 1 MiB
        assert resp.status_code == 500, resp.text[:300]
    else:                          # a failed prefiller: pdproxy's error in vLLM's envelope
        assert resp.status_code in (502, 503), resp.text[:300]
        assert "too large" in resp.json()["error"]["message"]


def test_a_non_streamed_decode_answer_without_end_is_judged_at_its_bound_not_at_the_decode_timeout() -> None:
    resp = _judged("ok", "decoder", decode_attempts=1, decode_nonstream_timeout_s=30)
    assert resp.status_code in (502, 503), resp.text[:300]
    assert "too large" in resp.json()["error"]["message"]
