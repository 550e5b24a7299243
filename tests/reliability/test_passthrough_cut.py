"""A passthrough engine (pdproxy/app/passthrough.py) that breaks mid-answer — its status line and part of its body
sent, then the connection reset — is a failure for its circuit breaker (pdproxy/engines/health.py), as a decoder
lost mid-stream is; and the client learns its answer is incomplete the way a PD route's client does: an SSE stream
ends with the error event and ``data: [DONE]`` (``pdproxy.errors.sse_error_event``), any other body is cut (the
connection closes before the body's end).  Old code: the breaker recorded a success and the client got a well-formed,
silently truncated 200.  Never retried on another engine: the client had bytes already."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import orjson
import pytest

from pdproxy.endpoints import Endpoint, Role
from tests.support import ProxyThread, free_port

pytestmark = pytest.mark.timeout(60)

MODEL = "sim-model"
SSE_PIECE = b'data: {"token_ids": [7]}\n\n'


class CuttingEngine:
    """A vLLM stand-in serving both roles: ``/health``, ``/v1/models``; every ``POST`` answers 200 and part of its
    body, then resets the connection (RST: ``SO_LINGER`` 0): an SSE stream of two events when the body asks
    ``"stream": true``, else a JSON body declared 100 bytes longer than sent.  ``posts`` counts the ``POST``s."""

    def __init__(self) -> None:
        self.posts = 0
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/health":
                    self._answer(200, b"")
                elif self.path == "/v1/models":
                    self._answer(200, orjson.dumps({"object": "list", "data": [
                        {"id": MODEL, "object": "model", "owned_by": "vllm", "max_model_len": 4096}]}))
                else:
                    self._answer(404, b'{"detail": "Not Found"}')

            def do_POST(self) -> None:
                body = orjson.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
                engine.posts += 1
                self.send_response(200)
                if body.get("stream"):
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for _ in range(2):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(SSE_PIECE), SSE_PIECE))
                else:
                    part = b'{"count": 3, "tokens": [1, 2'
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(part) + 100))
                    self.end_headers()
                    self.wfile.write(part)
                self.wfile.flush()
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()           # a reset, mid-answer
                self.close_connection = True

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @contextlib.contextmanager
    def running(self) -> Iterator[CuttingEngine]:
        self.thread.start()
        try:
            yield self
        finally:
            self.server.shutdown()
            self.server.server_close()


@pytest.fixture
def rig() -> Iterator[tuple[CuttingEngine, ProxyThread, Endpoint, Endpoint]]:
    """The engine, pdproxy in front of it (as prefiller and decoder) and its decode and prefill endpoints
    (passthrough tries decoders first)."""
    engine = CuttingEngine()
    with engine.running():
        proxy = ProxyThread(prefill=[engine.url], decode=[engine.url], prefix_routing="off").start()
        try:
            (decoder,) = proxy.state.pool.endpoints(Role.DECODE)
            (prefiller,) = proxy.state.pool.endpoints(Role.PREFILL)
            yield engine, proxy, decoder, prefiller
        finally:
            proxy.stop()


def failures(proxy: ProxyThread, endpoint: Endpoint) -> int:
    return int(proxy.state.health.breaker(endpoint).consecutive_failures)


def test_an_sse_passthrough_cut_mid_stream_ends_with_an_error_event_and_counts_against_the_engine(
        rig: tuple[CuttingEngine, ProxyThread, Endpoint, Endpoint]) -> None:
    engine, proxy, decoder, prefiller = rig
    with httpx.stream("POST", proxy.url + "/inference/v1/generate", timeout=10,
                      json={"model": MODEL, "token_ids": [1, 2, 3], "stream": True,
                            "sampling_params": {"max_tokens": 4}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()                                   # the body ends well-formed: the client reads it all
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[:2] == [SSE_PIECE.strip()] * 2      # what the engine sent, as it sent it
    assert events[-1] == b"data: [DONE]"
    error = orjson.loads(events[2].removeprefix(b"data: "))
    assert error == {"error": {"message": "the connection to the engine broke mid-answer; the response is incomplete",
                               "type": "BadGatewayError", "param": None, "code": 502}}
    assert len(events) == 4
    assert engine.posts == 1                             # never retried once the client had bytes
    assert failures(proxy, decoder) == 1 and failures(proxy, prefiller) == 0
    proxy.wait_idle()


def test_a_json_passthrough_cut_mid_body_is_cut_for_the_client_and_counts_against_the_engine(
        rig: tuple[CuttingEngine, ProxyThread, Endpoint, Endpoint]) -> None:
    engine, proxy, decoder, prefiller = rig
    with httpx.stream("POST", proxy.url + "/tokenize", json={"model": MODEL, "prompt": "hello"}, timeout=10) as r:
        assert r.status_code == 200
        with pytest.raises(httpx.RemoteProtocolError):   # the body never ends: the client cannot take it as whole
            r.read()
    assert engine.posts == 1
    assert failures(proxy, decoder) == 1 and failures(proxy, prefiller) == 0
    proxy.wait_idle()
