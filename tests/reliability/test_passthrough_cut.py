"""A passthrough engine (pdproxy/app/passthrough.py) that breaks mid-answer — its status line and part of its body
sent, then the connection reset — is a failure for its circuit breaker (pdproxy/engines/health.py), as a decoder
lost mid-stream is; and the client learns its answer is incomplete the way a PD route's client does: an SSE stream
ends with the error event and ``data: [DONE]`` (``pdproxy.errors.sse_error_event``), any other body is cut (the
connection closes before the body's end).  Old code: the breaker recorded a success and the client got a well-formed,
silently truncated 200.  Never retried on another engine: the client had bytes already."""

from __future__ import annotations

import gzip
import socket
import struct
from collections.abc import Iterator

import httpx
import orjson
import pytest

from pdproxy.endpoints import Endpoint, Role
from tests.stand_in import MODEL, StandInEngine, StandInHandler
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(60)

SSE_PIECE = b'data: {"token_ids": [7]}\n\n'


class CuttingEngine(StandInEngine):
    """The stand-in (tests/stand_in.py) whose every ``POST`` answers 200 and part of its body, then resets the
    connection (RST: ``SO_LINGER`` 0): an SSE stream of two events when the body asks ``"stream": true``, else a
    JSON body declared 100 bytes longer than sent.  ``posts`` counts the ``POST``s; with ``clean_end`` the SSE body
    ends well-formed (its last chunk sent, no reset) but without ``data: [DONE]``, as an engine that stopped
    writing at an event boundary."""

    def __init__(self) -> None:
        super().__init__(MODEL)
        self.posts = 0
        self.clean_end = False
        self.last: bytes = b""
        """Sent after the two events (before the last chunk, or the reset)."""
        self.gzip = False
        """With ``clean_end``: the events (and ``last``) gzip-compressed, ``content-encoding: gzip``."""

    def post(self, handler: StandInHandler, body: bytes) -> None:
        self.posts += 1
        handler.send_response(200)
        if orjson.loads(body).get("stream"):
            handler.send_header("content-type", "text/event-stream")
            handler.send_header("transfer-encoding", "chunked")
            if self.gzip:
                handler.send_header("content-encoding", "gzip")
            handler.end_headers()
            pieces = [SSE_PIECE, SSE_PIECE, self.last]
            if self.gzip:
                pieces = [gzip.compress(b"".join(pieces))]
            for piece in filter(None, pieces):
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            if self.clean_end:
                handler.wfile.write(b"0\r\n\r\n")
                handler.wfile.flush()
                return
        else:
            part = b'{"count": 3, "tokens": [1, 2'
            handler.send_header("content-type", "application/json")
            handler.send_header("content-length", str(len(part) + 100))
            handler.end_headers()
            handler.wfile.write(part)
        handler.wfile.flush()
        handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        handler.connection.close()           # a reset, mid-answer
        handler.close_connection = True


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


def test_an_sse_passthrough_ended_without_done_is_broken_not_whole(
        rig: tuple[CuttingEngine, ProxyThread, Endpoint, Endpoint]) -> None:
    """vLLM's generate stream always ends with ``data: [DONE]`` (``scale_out/token_in_token_out/serving.py``), its
    errors too: one that ends cleanly before it was cut short — the client gets the error event and ``[DONE]``,
    and the engine's breaker a failure.  Old code: a well-formed 200 the client read as whole."""
    engine, proxy, decoder, prefiller = rig
    engine.clean_end = True
    with httpx.stream("POST", proxy.url + "/inference/v1/generate", timeout=10,
                      json={"model": MODEL, "token_ids": [1, 2, 3], "stream": True,
                            "sampling_params": {"max_tokens": 4}}) as r:
        assert r.status_code == 200
        raw = r.read()
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[:2] == [SSE_PIECE.strip()] * 2 and events[-1] == b"data: [DONE]" and len(events) == 4
    error = orjson.loads(events[2].removeprefix(b"data: "))["error"]
    assert error == {"message": "the engine ended the stream without data: [DONE]; the response may be incomplete",
                     "type": "BadGatewayError", "param": None, "code": 502}
    assert engine.posts == 1
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


@pytest.mark.parametrize(("last", "gzipped"), [
    (b"data: [DONE]\n\n: keep-alive\n\n", False),       # a comment after [DONE]: the stream had ended
    (b"data:[DONE]\r\n\r\n", False),
    (b"", True)])                                       # compressed: not read, so not judged
def test_an_sse_passthrough_that_held_done_or_is_compressed_is_whole(
        rig: tuple[CuttingEngine, ProxyThread, Endpoint, Endpoint], last: bytes, gzipped: bool) -> None:
    """Old code judged only the body's last bytes, compressed or not: a comment after ``[DONE]``, or any gzip
    body, read as cut — an error event appended (into a gzip stream) and a strike against a healthy engine."""
    engine, proxy, decoder, _prefiller = rig
    engine.clean_end, engine.last, engine.gzip = True, last, gzipped
    with httpx.stream("POST", proxy.url + "/inference/v1/generate", timeout=10,
                      json={"model": MODEL, "token_ids": [1, 2, 3], "stream": True,
                            "sampling_params": {"max_tokens": 4}}) as r:
        assert r.status_code == 200
        raw = r.read()                                   # httpx undoes the gzip
    assert raw == SSE_PIECE * 2 + last
    assert failures(proxy, decoder) == 0
    proxy.wait_idle()


@pytest.mark.parametrize(("body", "done"), [
    (b'{"a": 1}\n\ndata: [DONE]\n\n', True), (b"data:[DONE]\n\n", True), (b"data: [DONE]\r\n\r\n", True),
    (b"data: [DONE]\n\n\n", True),                       # a blank line more: still ended
    (b"data: [DONE]\n\n: keep-alive\n\n", True),        # a comment after it: still ended
    (b'data: {"token_ids": [7]}\n\n', False), (b"data: [DONE]", False),   # the line's end never came
    (b"data: [DONE]x\n\n", False), (b"xdata: [DONE]\n\n", False), (b'data: "[DONE]"\n\n', False),
    (b"[DONE]\n\n", False), (b"", False),
    (b"xdata: [DONE]\n" + b"y" * 20, False)])           # the carried window's first byte is no line's start
def test_what_counts_as_an_sse_body_that_held_done(body: bytes, done: bool) -> None:
    """Whole, and cut into pieces at every byte (the window carried between pieces)."""
    from pdproxy.http.sse import DoneWatch, holds_done
    assert holds_done(body) is done
    for cut in range(len(body) + 1):
        watch = DoneWatch()
        watch.feed(b"x" * 40 + b"\n" + body[:cut])
        watch.feed(body[cut:])
        assert watch.seen is done, cut


def test_an_sse_passthrough_cut_after_its_done_is_whole(rig: tuple[CuttingEngine, ProxyThread, Endpoint, Endpoint]
                                                        ) -> None:
    """The connection reset after ``data: [DONE]`` (no last chunk): the answer was whole — relayed as it came, no
    error event after ``[DONE]``, no strike (old code: both)."""
    engine, proxy, decoder, _prefiller = rig
    engine.last = b"data: [DONE]\n\n"
    with httpx.stream("POST", proxy.url + "/inference/v1/generate", timeout=10,
                      json={"model": MODEL, "token_ids": [1, 2, 3], "stream": True,
                            "sampling_params": {"max_tokens": 4}}) as r:
        assert r.status_code == 200
        raw = r.read()
    assert raw == SSE_PIECE * 2 + b"data: [DONE]\n\n"
    assert failures(proxy, decoder) == 0
    proxy.wait_idle()
