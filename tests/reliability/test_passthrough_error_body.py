"""A passthrough engine's error answer whose body does not end is not read on: its first MiB within
``decode_first_byte_timeout_s`` seconds, then the engine is judged (a 503 fails over; a 404 that never ends is no
"route not served").  Before, such a 503 or 404 was read with ``aread()`` — httpx's read timeout is per read, so
a body trickling in held the client's request for as long as the engine kept writing (found with an engine
answering ``/v1/embeddings`` 503 and 1 KB every 0.25 s: the client waited past its own 12 s timeout)."""

from __future__ import annotations

import gzip
import time

import httpx
import orjson
import pytest

from tests.ops.promtext import scrape
from tests.stand_in import MODEL, StandInEngine, StandInHandler
from tests.support import ProxyThread, wait_until

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


class ErrorEngine(StandInEngine):
    """Answers every ``POST`` with ``status`` and the JSON ``body``."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(MODEL)
        self.status, self.body = status, body

    def post(self, handler: StandInHandler, body: bytes) -> None:
        handler.answer(self.status, self.body)


OPENAI_ERROR = b'{"error": {"message": "no", "type": "SomeError", "param": "body.x", "code": 400}}'


@pytest.mark.parametrize(("status", "body", "expected"), [
    (400, OPENAI_ERROR, {"type": "error", "error": {"type": "SomeError", "message": "no"}}),
    (422, OPENAI_ERROR, {"type": "error", "error": {"type": "SomeError", "message": "no"}}),
    (404, OPENAI_ERROR, {"type": "error", "error": {"type": "SomeError", "message": "no"}}),   # not "route unknown"
    (501, OPENAI_ERROR, {"type": "error", "error": {"type": "SomeError", "message": "no"}}),   # relayed, not failed over
    (400, b'{"type": "error", "error": {"type": "invalid_request_error", "message": "own"}}',   # as it came
     {"type": "error", "error": {"type": "invalid_request_error", "message": "own"}}),
    (400, b'{"error": "x"}', {"error": "x"}),                                                  # no envelope: as it came
])
def test_count_tokens_engine_errors_are_in_the_anthropic_envelope(status: int, body: bytes,
                                                                  expected: dict[str, object]) -> None:
    """``/v1/messages/count_tokens`` is passed through; an engine's error in vLLM's OpenAI envelope (its request
    validation errors, on every route) reaches the client in Anthropic's, with its status, ``type`` and ``message``,
    as on ``/v1/messages`` — before, it was relayed as it came."""
    with ErrorEngine(status, body).running() as engine:
        proxy = ProxyThread(prefill=[engine.url], decode=[engine.url], request_log=False,
                            retry_backoff_s=0.0, breaker_open_s=30).start()
        try:
            resp = httpx.post(proxy.url + "/v1/messages/count_tokens", timeout=20,
                              json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
            assert resp.status_code == status and resp.headers["content-type"] == "application/json"
            assert resp.json() == expected
            assert int(resp.headers["content-length"]) == len(resp.content)
            proxy.wait_idle()
        finally:
            proxy.stop()


def test_a_count_tokens_error_whose_body_never_ends_is_the_engines_failure_in_the_anthropic_envelope() -> None:
    with TrickleEngine(400).running() as engine:
        proxy = ProxyThread(prefill=[engine.url], decode=[engine.url], request_log=False,
                            retry_backoff_s=0.0, decode_first_byte_timeout_s=1.0, breaker_open_s=30).start()
        try:
            started = time.monotonic()
            resp = httpx.post(proxy.url + "/v1/messages/count_tokens", timeout=20,
                              json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})
            took = time.monotonic() - started
            assert took < 8, f"answered after {took:.1f} s"
            # an error answer that does not end is the engine's failure (as a 404's is, or a relayed body cut):
            # every engine tried failed it, so pdproxy's 503, in Anthropic's envelope
            assert resp.status_code == 503 and resp.json()["type"] == "error", resp.text[:300]
            assert "answered 400 with a body that did not end" in resp.json()["error"]["message"]
            proxy.wait_idle()
        finally:
            proxy.stop()


class GzipErrorEngine(StandInEngine):
    """Answers every ``POST`` with ``status`` and ``body`` gzip'd (``content-encoding: gzip``), as a gateway in
    front of an engine may (pdproxy's engine client asks for it: httpx's ``accept-encoding``)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(MODEL)
        self.status, self.body = status, gzip.compress(body)

    def post(self, handler: StandInHandler, body: bytes) -> None:
        handler.answer(self.status, self.body, {"content-encoding": "gzip"})


@pytest.mark.parametrize(("path", "status", "expected"), [
    ("/v1/messages/count_tokens", 422, {"type": "error", "error": {"type": "SomeError", "message": "no"}}),  # rewritten
    ("/tokenize", 404, orjson.loads(OPENAI_ERROR)),             # a 404 not "route unknown": read whole, as it came
])
def test_an_error_relayed_whole_is_sent_as_read_and_counted_as_the_engines_refusal(
        path: str, status: int, expected: dict[str, object]) -> None:
    """An engine's error answer relayed whole was read decoded: the client gets no ``content-encoding: gzip`` on
    plain bytes (before, it could not read the body), and the request is counted ``upstream_rejected``, not ok."""
    with GzipErrorEngine(status, OPENAI_ERROR).running() as engine:
        proxy = ProxyThread(prefill=[engine.url], decode=[engine.url], request_log=False,
                            retry_backoff_s=0.0, breaker_open_s=30).start()
        try:
            body = ({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]} if "messages" in path
                    else {"model": MODEL, "prompt": "Hi"})
            resp = httpx.post(proxy.url + path, timeout=20, json=body)
            assert resp.status_code == status, resp.text[:300]
            assert "content-encoding" not in resp.headers and resp.headers["content-type"] == "application/json"
            assert resp.json() == expected
            assert int(resp.headers["content-length"]) == len(resp.content)
            proxy.wait_idle()     # a passthrough request is recorded just after it leaves in_flight: wait for it
            wait_until(lambda: scrape(proxy.url).total("pdproxy_requests_total") == 1, 5, what="the request counted")
            assert scrape(proxy.url).total("pdproxy_requests_total", outcome="upstream_rejected") == 1
        finally:
            proxy.stop()
