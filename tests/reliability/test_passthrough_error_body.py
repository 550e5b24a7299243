"""A passthrough engine's error answer whose body does not end is not read on: its first MiB within
``decode_first_byte_timeout_s`` seconds, then the engine is judged (a 503 fails over; a 404 that never ends is no
"route not served").  Before, such a 503 or 404 was read with ``aread()`` — httpx's read timeout is per read, so
a body trickling in held the client's request for as long as the engine kept writing (found with an engine
answering ``/v1/embeddings`` 503 and 1 KB every 0.25 s: the client waited past its own 12 s timeout)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.stand_in import MODEL, StandInEngine, StandInHandler
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(60)


class TrickleEngine(StandInEngine):
    """Answers every ``POST`` with ``status`` and a chunked body of 1 KB every 50 ms that ends only when the engine
    stops or the client goes away."""

    def __init__(self, status: int) -> None:
        super().__init__(MODEL)
        self.status = status

    def post(self, handler: StandInHandler, body: bytes) -> None:
        handler.wfile.write(f"HTTP/1.1 {self.status} X\r\ncontent-type: application/json\r\n"
                            "transfer-encoding: chunked\r\n\r\n".encode())
        piece = b"%x\r\n%s\r\n" % (1000, b"x" * 1000)
        try:
            while not self.release.wait(0.05):
                handler.wfile.write(piece)
                handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass
        handler.close_connection = True


@pytest.mark.parametrize("status", [503, 404])
def test_an_error_answer_whose_body_never_ends_does_not_hold_the_client(status: int) -> None:
    with TrickleEngine(status).running() as engine:
        proxy = ProxyThread(prefill=[engine.url], decode=[engine.url], request_log=False,
                            retry_backoff_s=0.0, decode_first_byte_timeout_s=1.0, breaker_open_s=30).start()
        try:
            started = time.monotonic()
            resp = httpx.post(proxy.url + "/v1/embeddings", json={"model": MODEL, "input": "hi"}, timeout=20)
            took = time.monotonic() - started
            assert took < 8, f"answered after {took:.1f} s"
            assert resp.status_code in (502, 503), resp.text[:300]
            assert resp.json()["error"]["code"] == resp.status_code
            proxy.wait_idle()
        finally:
            proxy.stop()
