"""The client edge's limits through raw sockets on loopback (pdproxy/http/server.py, docs/limits.md): the bytes
buffered for a head or a trailer section while it arrives, the head and body timeouts (408 and close), the cap on
open client connections (503 and close), and that nothing refused ever reaches an engine."""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from pdproxy.http.server import (
    CONTROL_BODY_HIGH_WATER,
    ENGINE_FD_RESERVE,
    FREE_CHUNKS,
    MAX_HEADER_FIELDS,
    MIN_MEAN_CHUNK_BYTES,
    EdgeLimits,
    PendingBodies,
)
from pdproxy.settings import Settings
from tests.conftest import Fleet
from tests.relay.rawclient import Message, RawConn, get, post
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(60)

JSON = orjson.dumps({"model": "sim-model", "prompt": "hello edge", "max_tokens": 3})
HEAD = 4096  # the proxies' max_request_head_bytes here


def engine_requests(sims: Fleet) -> int:
    return sum(len(s.received()) for s in sims.all)


@contextlib.contextmanager
def edge_proxy(sims: Fleet, **settings: object) -> Iterator[ProxyThread]:
    p = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                    max_request_head_bytes=HEAD, max_body_bytes=HEAD, **settings).start()
    try:
        yield p
        p.wait_idle()
    finally:
        p.stop()


def send_unterminated(c: RawConn, n: int) -> None:
    """Send ``n`` bytes of one header value with no line end (as far as the proxy reads them) and nothing more."""
    c.sock.settimeout(10)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        for _ in range(n // 1024):
            c.sock.sendall(b"a" * 1024)


@pytest.fixture(scope="module")
def timed_edge(fleet: Fleet) -> Iterator[ProxyThread]:
    with edge_proxy(fleet, request_headers_timeout_s=0.5, request_body_timeout_s=0.5) as p:
        yield p


@pytest.fixture
def edge(timed_edge: ProxyThread) -> Iterator[ProxyThread]:
    """The module's proxy with 0.5 s head and body timeouts; after each test its load counters are back to zero
    and it holds no connection."""
    yield timed_edge
    timed_edge.wait_idle()
    wait_until(lambda: not timed_edge.server.server_state.connections, 10, 0.02, "connections released")


def test_a_header_line_that_never_ends_gets_431_once_the_head_limit_is_passed(edge: ProxyThread,
                                                                               sims: Fleet) -> None:
    """The head is bounded while it arrives, not once a line ends: the proxy answers 431 after about
    max_request_head_bytes (+ one read), never buffering what follows."""
    before = engine_requests(sims)
    c = RawConn(edge.port)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Endless: ")
    send_unterminated(c, 8 * HEAD)  # then silence: the answer cannot wait for a line end
    assert c.wait_closed()
    m = c.p.messages[0]
    assert m.status == 431 and m.header("connection") == "close"
    assert orjson.loads(m.body)["error"]["code"] == 431
    assert engine_requests(sims) == before


@pytest.mark.parametrize(("head", "status"), [
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 300_000 + b"\r\n\r\n", 431),
    (b"GET /" + b"a" * 300_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414)])
def test_a_refusal_ends_in_a_clean_close_not_a_reset(edge: ProxyThread, head: bytes, status: int) -> None:
    """300 KB of head in one write: the server refuses after ~max_request_head_bytes and closes the way RFC 9112
    §9.6 advises — half-close, read and drop what follows, then close — so the client reads the 431/414 and then
    a clean end of stream.  A plain close with the rest unread in the socket sent a reset instead, which makes a
    client still writing (curl, http.client) fail before it reads any answer."""
    s = socket.create_connection(("127.0.0.1", edge.port), timeout=10)
    try:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(head)
        data = b""
        while piece := s.recv(65536):                           # a reset raises ConnectionResetError here
            data += piece
    finally:
        s.close()
    assert data.startswith(b"HTTP/1.1 %d " % status) and b"connection: close" in data


def test_an_endless_request_line_gets_414(edge: ProxyThread) -> None:
    c = RawConn(edge.port)
    c.send(b"GET /v1/models?q=")
    send_unterminated(c, 16 * 1024)
    assert c.wait_closed()
    assert c.p.messages[0].status in (414, 431)


def test_a_trailer_line_that_never_ends_gets_431(edge: ProxyThread, sims: Fleet) -> None:
    before = engine_requests(sims)
    c = RawConn(edge.port)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\nX-Trailer: " % (len(JSON), JSON))
    send_unterminated(c, 8 * HEAD)
    assert c.wait_closed()
    assert c.p.messages[0].status == 431
    assert engine_requests(sims) == before


def test_one_byte_then_silence_is_closed_by_the_head_timeout(edge: ProxyThread) -> None:
    c = RawConn(edge.port)
    c.send(b"G")
    assert c.wait_closed(timeout_s=20)
    m = c.p.messages[0]
    assert m.status == 408 and m.header("connection") == "close"
    assert "head" in orjson.loads(m.body)["error"]["message"]


def test_a_head_that_keeps_trickling_is_closed_at_its_deadline(edge: ProxyThread, sims: Fleet) -> None:
    """The head deadline runs from its first byte: more bytes do not extend it (slowloris)."""
    c = RawConn(edge.port)
    c.send(b"POST /v1/completions HTTP/1.1\r\n")
    for _ in range(200):
        try:
            c.sock.sendall(b"X-Slow: 1\r\n")
        except (BrokenPipeError, ConnectionResetError):
            break
        if c.wait_closed(timeout_s=0.05):
            break
    assert c.wait_closed(timeout_s=20)
    assert c.p.messages[0].status == 408


@pytest.mark.parametrize("path", ["/v1/completions", "/tokenize"])
def test_a_stalled_body_is_closed_by_the_body_timeout(edge: ProxyThread, sims: Fleet, path: str) -> None:
    """A completion route (read whole by the server) and a passthrough route (read by the app) alike."""
    before = engine_requests(sims)
    c = RawConn(edge.port)
    c.send(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 100\r\n\r\n{\"model\": ")
    assert c.wait_closed(timeout_s=20)
    m = c.p.messages[0]
    assert m.status == 408 and "body" in orjson.loads(m.body)["error"]["message"]
    assert engine_requests(sims) == before


def test_an_honest_client_is_served_and_kept_alive_across_the_timeouts(edge: ProxyThread) -> None:
    """The timers follow the connection's phase: a whole request, then an idle gap longer than the head and
    body timeouts (the keep-alive idle timeout, 75 s, is what applies between requests), then another."""
    c = RawConn(edge.port)
    c.send(post("/v1/completions", JSON))
    assert c.read_messages(1)[0].status == 200
    assert not c.wait_closed(timeout_s=1.5)  # three head timeouts long: still open
    c.send(post("/v1/completions", JSON)[:40])
    c.send(post("/v1/completions", JSON)[40:])
    assert c.read_messages(2)[1].status == 200
    c.close()


def test_past_max_client_connections_a_new_connection_gets_503_and_the_rest_are_served(sims: Fleet) -> None:
    with edge_proxy(sims, max_client_connections=3) as p:
        held = [RawConn(p.port) for _ in range(3)]
        wait_until(lambda: len(p.server.server_state.connections) == 3, 10, 0.02, "3 connections accepted")
        extra = RawConn(p.port)
        extra.send(get("/v1/models"))
        assert extra.wait_closed()
        m = extra.p.messages[0]
        assert m.status == 503 and m.header("connection") == "close"
        err = orjson.loads(m.body)["error"]
        assert err["code"] == 503 and "connections" in err["message"]
        for c in held:  # the connections within the cap are served as usual
            c.send(get("/v1/models"))
            assert c.read_messages(1)[0].status == 200
        held[0].close()
        wait_until(lambda: len(p.server.server_state.connections) == 2, 10, 0.02, "a slot freed")
        again = RawConn(p.port)
        again.send(post("/v1/completions", JSON))
        assert again.read_messages(1)[0].status == 200
        for c in [*held[1:], again, extra]:
            c.close()


def test_the_default_connection_cap_leaves_room_for_engine_connections() -> None:
    limits = EdgeLimits.of(Settings(), open_files=1024)
    assert limits.max_connections == (1024 - ENGINE_FD_RESERVE) // 2
    assert EdgeLimits.of(Settings(max_client_connections=7), open_files=1024).max_connections == 7


def test_pdproxy_raises_its_open_file_limit_at_start(sims: Fleet) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1024), hard))
    try:
        with edge_proxy(sims):
            now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert now >= min(hard, 65535)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]),
                                                    hard))


def test_a_connection_refused_at_the_cap_is_not_left_open(sims: Fleet) -> None:
    """The refused client reads its 503, then the proxy closes even if the client never does."""
    with edge_proxy(sims, max_client_connections=1) as p:
        held = RawConn(p.port)
        wait_until(lambda: len(p.server.server_state.connections) == 1, 10, 0.02, "1 connection accepted")
        s = socket.create_connection(("127.0.0.1", p.port), timeout=10)
        data = b""
        while True:
            piece = s.recv(65536)
            if not piece:
                break
            data += piece
        assert data.startswith(b"HTTP/1.1 503 ")
        s.close()
        held.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_a_completion_whose_handler_raises_is_answered_500_and_closed(edge: ProxyThread, sims: Fleet,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       path: str) -> None:
    """A completion handler that raises (a defect: it answers every error itself) once held the connection
    forever; the server answers 500 in the route's error shape (OpenAI's, Anthropic's on /v1/messages) and
    closes, and no engine is asked."""
    async def broken(route: str, ex: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(edge.app, "handle_completion", broken)
    before = engine_requests(sims)
    c = RawConn(edge.port)
    c.send(post(path, JSON) + post(path, JSON))           # a pipelined second request is never answered
    assert c.wait_closed(20)
    assert [m.status for m in c.p.messages] == [500]
    m = c.p.messages[0]
    assert m.header("connection") == "close" and m.header("content-type") == "application/json"
    body = orjson.loads(m.body)
    if path == "/v1/messages":
        assert body == {"type": "error", "error": {"type": "InternalServerError",
                                                   "message": "internal error while handling the request"}}
    else:
        assert body["error"]["code"] == 500 and body["error"]["type"] == "InternalServerError"
    assert engine_requests(sims) == before


@pytest.mark.parametrize(("path", "anthropic"), [("/v1/chat/completions", False), ("/v1/messages", True)])
def test_the_servers_own_refusals_take_the_routes_error_shape(edge: ProxyThread, path: str,
                                                              anthropic: bool) -> None:
    """413 (declared and while arriving), 408 (a stalled body), and the refusals of a head still arriving (431 for
    one header field too many, 501 for an unknown transfer coding: the request line names the route; old code
    answered those in OpenAI's envelope everywhere) on a completion route are in that API's error shape: an
    Anthropic client reads ``{"type": "error", ...}`` on /v1/messages, not OpenAI's envelope."""
    def check(m: Message, status: int) -> None:
        assert m.status == status and m.header("connection") == "close"
        body = orjson.loads(m.body)
        if anthropic:
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        else:
            assert body["error"]["code"] == status and "param" in body["error"]

    c = RawConn(edge.port)                                   # declared over max_body_bytes
    c.send(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           f"Content-Length: {HEAD + 1}\r\n\r\n".encode())
    assert c.wait_closed()
    check(c.p.messages[0], 413)
    c = RawConn(edge.port)                                   # chunked, passing the limit while it arrives
    c.send(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           f"Transfer-Encoding: chunked\r\n\r\n".encode() + b"%x\r\n" % (HEAD + 1) + b"a" * (HEAD + 1))
    assert c.wait_closed()
    check(c.p.messages[0], 413)
    c = RawConn(edge.port)                                   # the body stalls past the 0.5 s body timeout
    c.send(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           f"Content-Length: 100\r\n\r\n{{".encode())
    assert c.wait_closed()
    check(c.p.messages[0], 408)
    # with Host, one field too many and one more (a field is complete once the parser sees the next line begin)
    fields = b"".join(b"x-f%d: 1\r\n" % i for i in range(MAX_HEADER_FIELDS + 1))
    c = RawConn(edge.port)
    c.send(f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode() + fields)
    assert c.wait_closed()
    check(c.p.messages[0], 431)
    c = RawConn(edge.port)
    c.send(f"POST {path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\nAccept: */*\r\n".encode())
    assert c.wait_closed()
    check(c.p.messages[0], 501)


def test_a_head_of_the_most_header_fields_allowed_is_served(edge: ProxyThread) -> None:
    """:data:`MAX_HEADER_FIELDS` fields in all (Host and Content-Length included) are served; one more is the 431
    of the test above."""
    fields = b"".join(b"x-f%d: 1\r\n" % i for i in range(MAX_HEADER_FIELDS - 3))
    c = RawConn(edge.port)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + fields
           + b"Content-Length: %d\r\n\r\n" % len(JSON) + JSON)
    assert c.read_messages(1)[0].status == 200


def test_a_chunk_extension_that_never_ends_gets_400_and_short_ones_are_served(edge: ProxyThread,
                                                                              sims: Fleet) -> None:
    """Chunk extensions (``1;name=value``) are skipped by the parser without being buffered, and counted with the
    other bytes a chunked body carries besides its data (``pdproxy.http.server.CHUNK_LINE_BYTES``): one that never ends is refused
    (400) once they pass the head limit — it was read for as long as its bytes kept coming (7 GB in 15 s on one
    connection, never refused by ``max_body_bytes``).  Short extensions on ordinary chunks are served."""
    before = engine_requests(sims)
    c = RawConn(edge.port)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n1;x=" % (len(JSON), JSON))
    send_unterminated(c, 64 * HEAD)                 # then silence: the refusal must not wait for the body timeout
    assert c.wait_closed()
    m = c.p.messages[0]
    assert m.status == 400 and m.header("connection") == "close"
    assert "besides its data" in orjson.loads(m.body)["error"]["message"]
    assert engine_requests(sims) == before
    c = RawConn(edge.port)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(b"1;ext=value\r\n%b\r\n" % JSON[i:i + 1]
                                                          for i in range(len(JSON))) + b"0\r\n\r\n")
    assert c.read_messages(1)[0].status == 200


def chunked_post(port: int, pieces: list[bytes]) -> RawConn:
    """A completion request whose body is sent as one chunk per piece, all in one write."""
    c = RawConn(port)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces)
           + b"0\r\n\r\n")
    return c


def test_a_chunked_body_of_tiny_chunks_is_refused_and_one_of_ordinary_chunks_is_served(edge: ProxyThread,
                                                                                        sims: Fleet) -> None:
    """Past :data:`FREE_CHUNKS` chunks, a chunked body must average :data:`MIN_MEAN_CHUNK_BYTES` a chunk: 1-byte
    chunks are refused (400, no engine contacted) as soon as they pass the count — old code read them all, one
    Python call and one 34-byte object each (a 20 MB body held the event loop for seconds and 2 GB of memory).
    Up to the count, any chunks are read, and the small ones joined into the same body."""
    before = engine_requests(sims)
    c = chunked_post(edge.port, [b" "] * (FREE_CHUNKS + 100) + [JSON])
    assert c.wait_closed()
    m = c.p.messages[0]
    assert m.status == 400 and m.header("connection") == "close"
    assert f"more than {FREE_CHUNKS} chunks averaging under {MIN_MEAN_CHUNK_BYTES} bytes" in (
        orjson.loads(m.body)["error"]["message"])
    assert engine_requests(sims) == before
    body = JSON + b" " * (FREE_CHUNKS - len(JSON))
    c = chunked_post(edge.port, [body[i:i + 1] for i in range(len(body))])      # FREE_CHUNKS 1-byte chunks
    m = c.read_messages(1)[0]
    assert m.status == 200 and orjson.loads(m.body)["choices"][0]["text"]
    prompts = [r["body"]["prompt"] for s in sims.all for r in s.completions_received()[-2:]]
    assert "hello edge" in prompts


@pytest.mark.parametrize(("size", "status"), [(MIN_MEAN_CHUNK_BYTES, 200), (MIN_MEAN_CHUNK_BYTES - 1, 400)])
def test_chunks_of_exactly_the_mean_are_served(sims: Fleet, size: int, status: int) -> None:
    """Chunks of :data:`MIN_MEAN_CHUNK_BYTES` each, past :data:`FREE_CHUNKS`, meet the rule; a byte less does not
    (a chunk is counted once its data is in, not when its size line ends)."""
    p = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders]).start()
    try:
        c = chunked_post(p.port, [JSON.ljust(size)] + [b" " * size] * (FREE_CHUNKS + 4))
        assert c.read_messages(1)[0].status == status
        p.wait_idle()
    finally:
        p.stop()


def read_to_eof(s: socket.socket) -> bytes:
    """Everything the proxy sends until it closes (a reset raises ConnectionResetError)."""
    data = b""
    while piece := s.recv(65536):
        data += piece
    return data


def test_a_refused_pipelined_request_never_takes_the_answer_of_the_one_before(edge: ProxyThread,
                                                                              sims: Fleet) -> None:
    """A Messages request and, in the same write, a chat request over max_body_bytes: the Messages request gets
    its own answer (Anthropic's shape, from the engines), then the chat request its 413 (OpenAI's shape), then a
    clean close — the refusal once replaced the first answer, in the second request's shape."""
    messages = orjson.dumps({"model": "sim-model", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    big = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" \
          f"Content-Length: {HEAD * 50}\r\n\r\n".encode() + b"a" * (HEAD * 50)
    s = socket.create_connection(("127.0.0.1", edge.port), timeout=20)
    try:
        s.sendall(post("/v1/messages", messages) + big)
        data = read_to_eof(s)
    finally:
        s.close()
    first, _, rest = data.partition(b"HTTP/1.1 413 ")
    assert first.startswith(b"HTTP/1.1 200 ") and b'"type":"message"' in first, data[:600]
    assert b"connection: close" not in first              # a response follows it on this connection
    assert b"connection: close" in rest and b'"code":413' in rest


BAD_TAILS = {
    "duplicate Content-Length": (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                                 b"Content-Length: 4\r\n\r\nabc", 400),
    "body over max_body_bytes": (post("/v1/completions", b"")[:-len(b"Content-Length: 0\r\n\r\n")]
                                 + f"Content-Length: {HEAD * 50}\r\n\r\n".encode(), 413),
    "protocol upgrade": (get("/v1/models", headers="Connection: upgrade\r\nUpgrade: websocket\r\n"), 400),
}


@pytest.mark.parametrize("tail", list(BAD_TAILS))
def test_requests_pipelined_before_a_refused_one_are_answered_in_order_then_the_refusal(
        edge: ProxyThread, sims: Fleet, tail: str) -> None:
    """Two completions, a ``GET /health`` and a request the server refuses, all in one write: each whole request
    before the refused one gets its own answer, in order, then the refusal and a close — the refusal once took
    the second request's place and dropped the ones after it (and an upgrade request's 400 cancelled the one
    before it: its engines ran it, its client never got a byte)."""
    bad, status = BAD_TAILS[tail]
    prompts = [orjson.dumps({"model": "sim-model", "prompt": f"pipelined {i}", "max_tokens": 3}) for i in (1, 2)]
    c = RawConn(edge.port)
    try:
        c.send(post("/v1/completions", prompts[0]) + post("/v1/completions", prompts[1]) + get("/health") + bad)
        c.read_messages(4)
        assert c.wait_closed()
    finally:
        c.close()
    got = [(m.status, m.complete) for m in c.p.messages]
    assert got == [(200, True), (200, True), (200, True), (status, True)], c.raw[:2000]
    first, second, health, refusal = c.p.messages
    assert [orjson.loads(m.body)["choices"][0]["index"] for m in (first, second)] == [0, 0]
    assert first.header("connection") != "close" and health.header("connection") != "close"
    assert refusal.header("connection") == "close" and orjson.loads(refusal.body)["error"]["code"] == status
    received = [r["body"]["prompt"] for s in sims.decoders for r in s.completions_received()]
    assert "pipelined 1" in received and "pipelined 2" in received
    edge.wait_idle()


def test_garbage_after_a_request_ends_its_stream_then_closes_cleanly(edge: ProxyThread, sims: Fleet) -> None:
    """A streamed chat request followed in the same connection by 2 MB that is not HTTP: the stream ends whole
    (``[DONE]``), then the connection closes after reading what is left — not with a reset that could destroy
    the tail of the stream."""
    chat = orjson.dumps({"model": "sim-model", "max_tokens": 50, "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]})
    s = socket.create_connection(("127.0.0.1", edge.port), timeout=20)
    try:
        s.sendall(post("/v1/chat/completions", chat))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            s.sendall(b"\x00garbage" * 250_000)
        data = read_to_eof(s)
    finally:
        s.close()
    assert data.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in data


def test_a_body_sent_after_an_early_answer_is_dropped_and_the_connection_closed(edge: ProxyThread) -> None:
    """``GET /health`` answers before its chunked body arrives; the client keeps sending (up to 64 MB, as fast as
    the server reads).  The server drops what follows unparsed and closes after its linger (1 s) — the body's bytes
    once re-armed a body timer that cancelled the close, were buffered without bound (4 such clients took 2 GB)
    and the connection stayed open for good."""
    s = socket.create_connection(("127.0.0.1", edge.port), timeout=10)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"%x\r\n%b\r\n" % (65536, b"a" * 65536)
    budget = 1024                                    # pieces of 64 KiB, then a byte at a time
    data = b""
    closed = False                                   # wholly: a write meets the reset (its half-close is the EOF)
    s.setblocking(False)
    deadline = time.monotonic() + 10
    try:
        while time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):
                s.send(piece if budget else b"a")
                budget = max(budget - 1, 0)
            ready, _, _ = select.select([s], [], [], 0.01)
            if ready:
                data += s.recv(65536)
    except (BrokenPipeError, ConnectionResetError):
        closed = True
    finally:
        s.close()
    assert data.startswith(b"HTTP/1.1 200 ") and closed


@pytest.mark.parametrize(("path", "status"), [("/nope", 404), ("/v1/models", 405)])
def test_an_answer_before_its_body_is_in_says_connection_close(edge: ProxyThread, path: str, status: int) -> None:
    """A route that answers before the request's body is in (an unknown path, a POST to a GET route) ends the
    connection after that answer, and the answer says so (``connection: close``): a client or a pooling proxy in
    front never sends its next request into it (seen: Python's ``http.client``, which sends a body in a write of
    its own, met a closed connection on its next request).  With the body in, the same answer keeps it open."""
    c = RawConn(edge.port)
    c.send(post(path, JSON)[:-len(JSON)])
    (m,) = c.read_messages(1)
    assert m.status == status and m.header("connection") == "close"
    with contextlib.suppress(OSError):
        c.send(JSON)
    assert c.wait_closed()
    c = RawConn(edge.port)
    c.send(post(path, JSON) + get("/health"))
    first, second = c.read_messages(2)
    assert (first.status, first.header("connection"), second.status) == (status, None, 200)
    c.close()


def test_a_control_route_that_has_not_read_its_body_holds_its_high_water_mark(sims: Fleet) -> None:
    """A control-plane handler that is not reading its body yet: the connection stops reading once
    ``CONTROL_BODY_HIGH_WATER`` bytes wait for it (the client's writes then block), and reads on when the handler
    asks — the whole body arrives."""
    size = 64 << 20                    # more than loopback's socket buffers hold
    with edge_proxy(sims, request_body_timeout_s=0.5) as proxy:
        loop = proxy.loop
        assert loop is not None
        opened = asyncio.Event()

        async def slow_reader(scope: dict[str, Any], receive: Any, send: Any) -> None:
            await opened.wait()
            got, more = 0, True
            while more:
                message = await receive()
                got += len(message.get("body", b""))
                more = message.get("more_body", False)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(
                str(got)))]})
            await send({"type": "http.response.body", "body": str(got).encode()})

        proxy.app.control = slow_reader
        s = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
        sent = 0

        def send_body() -> None:
            nonlocal sent
            s.sendall(b"POST /admin/anything HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
            block = b"b" * 65536
            for _ in range(size // len(block)):
                s.sendall(block)
                sent += len(block)

        writer = threading.Thread(target=send_body, daemon=True)
        writer.start()

        def held() -> int:
            return sum(c.current.held for c in proxy.server.server_state.connections if c.current is not None)

        def paused() -> bool:
            return any(c.reading_paused for c in proxy.server.server_state.connections)

        wait_until(paused, 10, 0.01, "reading paused")
        assert CONTROL_BODY_HIGH_WATER < held() <= CONTROL_BODY_HIGH_WATER + (1 << 20)
        assert sent < size
        # the client sent all it could: the body's idle timer (0.5 s) is off while the app is not reading
        assert all(c.timer is None for c in proxy.server.server_state.connections if c.reading_paused)
        loop.call_soon_threadsafe(opened.set)
        writer.join(30)
        data = b""
        while not data.endswith(str(size).encode()):
            piece = s.recv(65536)
            assert piece, data
            data += piece
        s.close()
        assert data.startswith(b"HTTP/1.1 200 ")


def hold_bodies(p: ProxyThread, path: bytes) -> tuple[list[RawConn], PendingBodies]:
    """Three connections to ``path``, each sending a body of ``HEAD`` bytes but its last 100, all read; and the
    server's one budget that counts them."""
    held = []
    for _ in range(3):
        c = RawConn(p.port)
        c.send(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % path
               + b"Content-Length: %d\r\n\r\n" % HEAD + b" " * (HEAD - 100))
        held.append(c)
    protos = p.server.server_state.connections
    wait_until(lambda: len(protos) == 3 and sum(x.body_held for x in protos) == 3 * (HEAD - 100), 10, 0.02,
               "the three bodies read")
    bodies = next(iter(protos)).bodies
    assert bodies is not None and all(x.bodies is bodies for x in protos)       # one budget for the server
    assert bodies.held == 3 * (HEAD - 100)
    return held, bodies


def refused_past_budget(p: ProxyThread, path: bytes) -> Message:
    """A 1,000-byte body to ``path`` once the budget is spent: answered 503 with ``Retry-After: 1``, and closed."""
    c = RawConn(p.port)
    c.send(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % path
           + b"Content-Length: 1000\r\n\r\n" + b" " * 1000)
    assert c.wait_closed()
    m = c.p.messages[0]
    assert m.status == 503 and m.header("retry-after") == "1"
    return m


def test_bodies_still_arriving_are_bounded_across_connections(sims: Fleet) -> None:
    """Each connection's body is bounded by ``max_body_bytes``; all of them together by ``max_pending_body_bytes``
    (old code: none — 30 connections each holding back the last byte of a 60 MB body held 1.65 GB).  The body
    that would pass the budget gets 503 with Retry-After in its route's shape, nothing reaches an engine, and the
    budget comes back as bodies end: a closed connection's bytes are released and the next request is served."""
    before = engine_requests(sims)
    with edge_proxy(sims, max_pending_body_bytes=3 * HEAD) as p:
        held, bodies = hold_bodies(p, b"/v1/completions")
        assert bodies.limit == 3 * HEAD
        m = refused_past_budget(p, b"/v1/messages")
        assert orjson.loads(m.body)["type"] == "error"                  # Anthropic's shape on /v1/messages
        assert bodies.held == 3 * (HEAD - 100)                          # the refused body's bytes given back
        held.pop().sock.close()
        wait_until(lambda: bodies.held == 2 * (HEAD - 100), 10, 0.02, "a closed connection's body released")
        c = RawConn(p.port)
        c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(JSON) + JSON)
        assert c.read_messages(1)[0].status == 200
        # the served body counts until its request's task ends, which is just after its last byte went out
        wait_until(lambda: bodies.held == 2 * (HEAD - 100), 10, 0.02, "the served request's body released")
        for c in held:
            c.sock.close()
        wait_until(lambda: bodies.held == 0, 10, 0.02, "every body released")
    assert engine_requests(sims) == before + 2                          # only the served request's two legs


def test_whole_bodies_count_until_their_request_ends(sims: Fleet) -> None:
    """A generation request's body stays counted in ``max_pending_body_bytes`` until its request ends, since its
    bytes are held that long (the raw body, the parsed one, the legs'); old code: it stopped counting once whole,
    so nothing bounded the whole bodies held (16 streaming requests of 50 MB whose clients never read: 2 GB of
    RSS, and more clients, more).  Two
    streams stalled in decode hold the budget, a third body is refused 503; once a client leaves its bytes come
    back and the next request is served."""
    for d in sims.decoders:
        d.faults({"kind": "stall_after_events", "events": 1, "path": "/v1/completions"})
    body = orjson.dumps({"model": "sim-model", "prompt": "hello edge", "max_tokens": 50, "stream": True,
                         "user": "u" * 3000})
    with edge_proxy(sims, max_pending_body_bytes=2 * len(body) + 20) as p:
        streams = []
        for _ in range(2):
            c = RawConn(p.port)
            c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n" % len(body) + body)
            streams.append(c)
        wait_until(lambda: len(p.server.server_state.connections) == 2, 10, 0.02, "both connected")
        bodies = next(iter(p.server.server_state.connections)).bodies
        wait_until(lambda: sum(len(d.completions_received()) for d in sims.decoders) == 2, 10, 0.02,
                   "both streams in decode")
        assert bodies is not None and bodies.held == 2 * len(body)        # whole, and still counted
        refused_past_budget(p, b"/v1/completions")
        tokenize = orjson.dumps({"model": "sim-model", "prompt": "hello edge"})   # a control route is weighed
        c = RawConn(p.port)                                                  # without the running bodies
        c.send(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(tokenize) + tokenize)
        assert c.read_messages(1)[0].status == 200
        streams.pop().sock.close()
        wait_until(lambda: bodies.held == len(body), 10, 0.02, "the departed client's body released")
        chat = orjson.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        c = RawConn(p.port)
        c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(chat) + chat)
        m = c.read_messages(1)[0]
        assert m.status == 200, m.body
        wait_until(lambda: bodies.held == len(body), 10, 0.02, "a served request's body released")
        # a request pipelined behind a running one holds its body; dropped unrun with its connection, it gives it back
        stalled = orjson.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 50, "stream": True})
        c = RawConn(p.port)
        c.send(b"".join(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (path, len(b), b)
                        for path, b in ((b"/v1/completions", stalled), (b"/v1/chat/completions", chat))))
        wait_until(lambda: bodies.held == len(body) + len(stalled) + len(chat), 10, 0.02, "both bodies counted")
        c.sock.close()
        wait_until(lambda: bodies.held == len(body), 10, 0.02, "the running and the unrun request's bodies released")
        streams.pop().sock.close()
        wait_until(lambda: bodies.held == 0, 10, 0.02, "every body released")


def test_passthrough_bodies_count_against_the_same_budget(sims: Fleet) -> None:
    """A passthrough route's app buffers its body whole, so its bytes still arriving count against
    ``max_pending_body_bytes`` like a generation route's (old code: uncounted — twelve ``/tokenize`` bodies of
    19 MB each held back by their last byte grew the proxy by 228 MB against a 40 MB budget).  The body that would
    pass it gets 503 with Retry-After in vLLM's OpenAI envelope, reaches no engine, and the budget comes back."""
    before = engine_requests(sims)
    with edge_proxy(sims, max_pending_body_bytes=3 * HEAD) as p:
        held, bodies = hold_bodies(p, b"/tokenize")
        error = orjson.loads(refused_past_budget(p, b"/v1/embeddings").body)["error"]
        assert "max_pending_body_bytes" in error["message"] and error["code"] == 503
        assert bodies.held == 3 * (HEAD - 100)
        for c in held:
            c.sock.close()
        wait_until(lambda: bodies.held == 0, 10, 0.02, "every body released")
        body = orjson.dumps({"model": "sim-model", "prompt": "hello edge"})
        c = RawConn(p.port)
        c.send(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n" % len(body) + body)
        m = c.read_messages(1)[0]
        assert m.status == 200 and orjson.loads(m.body)["count"] == 2   # served (by the engine) once it is back
        assert bodies.held == 0
    assert engine_requests(sims) == before                              # no generation request reached one
