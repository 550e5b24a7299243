"""A non-streamed decode leg is bounded as a whole by ``decode_nonstream_timeout_s``, and its body by
``decode_idle_timeout_s`` once the status line is in: vLLM sends a non-streamed answer's status line when the answer
is done, its body with it.

Found with a decoder that sent its status line and then nothing (a simulated decoder's ``headers_then_stall``): a
non-streamed client waited ``decode_nonstream_timeout_s`` (600 s) for the head and as long again for the body, on
each of its ``decode_attempts`` decoders — over ten minutes for one Messages request before its 503, where a
streamed one got it after 3 × ``decode_first_byte_timeout_s``."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.stand_in import MODEL, PREFILL_ANSWER, StandInEngine, StandInHandler
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(60)


class Prefiller(StandInEngine):
    def post(self, handler: StandInHandler, body: bytes) -> None:
        handler.answer(200, PREFILL_ANSWER)


class Decoder(StandInEngine):
    """Sends a 200's status line and headers after ``head_after_s``, then the start of a JSON answer, then one byte
    of it every ``trickle_s`` seconds (None: nothing more) until the client goes away or the engine stops."""

    def __init__(self, head_after_s: float, trickle_s: float | None) -> None:
        super().__init__(MODEL)
        self.head_after_s, self.trickle_s = head_after_s, trickle_s
        self.gone = 0

    def post(self, handler: StandInHandler, body: bytes) -> None:
        if self.release.wait(self.head_after_s):
            return
        try:
            handler.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                b"transfer-encoding: chunked\r\n\r\n" + b"5\r\n{\"id\"\r\n")
            handler.wfile.flush()
            while not self.release.wait(self.trickle_s if self.trickle_s is not None else 0.05):
                if self.trickle_s is not None:
                    handler.wfile.write(b"1\r\n \r\n")
                    handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.gone += 1
        handler.close_connection = True


@pytest.mark.parametrize(("api", "path"), [("chat", "/v1/chat/completions"), ("messages", "/v1/messages")])
@pytest.mark.parametrize(("head_after_s", "trickle_s", "within_s"), [
    (0.0, None, 2.5),       # silent after its head: lost after decode_idle_timeout_s (1 s), not 4 s
    (2.0, 0.2, 5.5),        # never silent, never done: the whole leg within decode_nonstream_timeout_s (4 s), not 6 s
])
def test_a_non_streamed_decode_leg_that_stalls_after_its_head_is_bounded(
        api: str, path: str, head_after_s: float, trickle_s: float | None, within_s: float) -> None:
    with Prefiller(MODEL).running() as prefiller, Decoder(head_after_s, trickle_s).running() as decoder:
        proxy = ProxyThread(prefill=[prefiller.url], decode=[decoder.url], token_count="estimate",
                            request_log=False, decode_attempts=1, decode_nonstream_timeout_s=4.0,
                            decode_idle_timeout_s=1.0, retry_backoff_s=0.0, breaker_open_s=30).start()
        try:
            started = time.monotonic()
            resp = httpx.post(proxy.url + path, timeout=30, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            took = time.monotonic() - started
            assert resp.status_code in (503, 504), resp.text[:300]
            body = resp.json()
            assert (body["type"] == "error") if api == "messages" else ("error" in body and "code" in body["error"])
            assert took < within_s, f"answered after {took:.1f} s"
            proxy.wait_idle()
        finally:
            proxy.stop()


class ErrorDecoder(StandInEngine):
    """Sends a 400's status line and headers after ``head_after_s`` (a body of 100 bytes announced), then nothing
    until the client goes away or the engine stops."""

    def __init__(self, head_after_s: float) -> None:
        super().__init__(MODEL)
        self.head_after_s = head_after_s

    def post(self, handler: StandInHandler, body: bytes) -> None:
        if self.release.wait(self.head_after_s):
            return
        try:
            handler.wfile.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                                b"content-length: 100\r\n\r\n{\"error\"")
            handler.wfile.flush()
            self.release.wait(30)
        except (BrokenPipeError, ConnectionResetError):
            pass
        handler.close_connection = True


def test_a_decoders_error_body_is_read_by_the_legs_first_byte_deadline() -> None:
    """The error body's wait ends by the leg's deadline (at least 1 s after the head), not
    ``decode_first_byte_timeout_s`` again from the head: head at 3 s of 4, then silence — 4 s, not 7."""
    with Prefiller(MODEL).running() as prefiller, ErrorDecoder(3.0).running() as decoder:
        proxy = ProxyThread(prefill=[prefiller.url], decode=[decoder.url], token_count="estimate",
                            request_log=False, decode_attempts=1, decode_first_byte_timeout_s=4.0,
                            retry_backoff_s=0.0, breaker_open_s=30).start()
        try:
            started = time.monotonic()
            resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=30, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True})
            took = time.monotonic() - started
            assert resp.status_code == 400, resp.text[:300]
            assert "error" in resp.json()
            assert took < 6.0, f"answered after {took:.1f} s"
            proxy.wait_idle()
        finally:
            proxy.stop()


class LateDecoder(StandInEngine):
    """A non-streamed answer whose status line comes after ``head_after_s`` and its body ``body_after_s`` later."""

    def __init__(self, head_after_s: float, body_after_s: float) -> None:
        super().__init__(MODEL)
        self.head_after_s, self.body_after_s = head_after_s, body_after_s

    def post(self, handler: StandInHandler, body: bytes) -> None:
        answer = (b'{"id": "chatcmpl-d", "object": "chat.completion", "created": 1, "model": "' + MODEL.encode() +
                  b'", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, '
                  b'"finish_reason": "stop"}], "usage": {"prompt_tokens": 5, "completion_tokens": 1, '
                  b'"total_tokens": 6}}')
        if self.release.wait(self.head_after_s):
            return
        try:
            handler.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                b"content-length: %d\r\n\r\n" % len(answer))
            handler.wfile.flush()
            if self.release.wait(self.body_after_s):
                return
            handler.wfile.write(answer)
            handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass


def test_a_head_just_before_the_legs_deadline_still_gets_its_body() -> None:
    """The leg's deadline gives a body that follows its status line ``decode_idle_timeout_s`` at least: a head at
    3.5 s of 4 and its body 0.8 s later is an answer, not a 504 (and no strike on a decoder that answered)."""
    with Prefiller(MODEL).running() as prefiller, LateDecoder(3.5, 0.8).running() as decoder:
        proxy = ProxyThread(prefill=[prefiller.url], decode=[decoder.url], token_count="estimate",
                            request_log=False, decode_attempts=1, decode_nonstream_timeout_s=4.0,
                            decode_idle_timeout_s=2.0, retry_backoff_s=0.0, breaker_open_s=30).start()
        try:
            resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=30, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert resp.status_code == 200, resp.text[:300]
            assert resp.json()["choices"][0]["message"]["content"] == "hi"
            proxy.wait_idle()
        finally:
            proxy.stop()
