"""Bytes written to a client must move (pdproxy/http/server.py ``close_draining``, the send timer; docs/limits.md
``client_send_timeout_s``): a client that never reads holds one answer in the proxy, not every answer it asked for,
and a connection closing with bytes its client never takes is aborted, not kept open forever."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import types
from collections.abc import Iterator
from typing import Any

import anyio
import orjson
import pytest

from pdproxy.http.server import _SEND_TIMER, EdgeLimits, ServerProtocol
from pdproxy.settings import Settings
from tests.conftest import Fleet
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(60)

SEND_TIMEOUT_S = 0.5
KERNEL_SNDBUF = 16 * 1024


@contextlib.contextmanager
def proxy_for(sims: Fleet, send_timeout_s: float = SEND_TIMEOUT_S) -> Iterator[ProxyThread]:
    p = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                    client_send_timeout_s=send_timeout_s, timeout_keep_alive_s=1)
    # accepted sockets inherit the listener's send buffer: a fixed one (no autotuning up to tcp_wmem's 4 MB)
    # makes "more than the kernel holds for a client that does not read" ~100 KB
    p.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, KERNEL_SNDBUF)
    p.start()
    try:
        yield p
        p.wait_idle()
    finally:
        p.stop()


def request(max_tokens: int, close: bool = False, logprobs: int | None = None) -> bytes:
    """A completions request for an answer of ``max_tokens`` tokens (400: ~3 KB; 3,000 with ``logprobs`` 5:
    ~330 KB)."""
    body = orjson.dumps({"model": "sim-model", "prompt": "a long answer please", "max_tokens": max_tokens,
                         "ignore_eos": True, "logprobs": logprobs})
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + (b"connection: close\r\n" if close else b"")
            + b"content-length: %d\r\n\r\n" % len(body) + body)


def non_reader(port: int) -> socket.socket:
    """A client socket with a small receive buffer that its test never reads from."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.settimeout(5)
    return s


def decoded(sims: Fleet) -> int:
    return sum(len(d.received()) for d in sims.decoders)


def test_a_client_that_pipelines_and_never_reads_is_answered_one_buffer_then_cut(sims: Fleet) -> None:
    with proxy_for(sims) as p:
        s = non_reader(p.port)
        with contextlib.suppress(TimeoutError, OSError):   # the proxy stops reading once it holds an answer
            s.sendall(request(400) * 200)
        wait_until(lambda: decoded(sims), 20, 0.05, "the first requests decoded")
        # the client took nothing: its connection is aborted (a close would wait for it forever)
        wait_until(lambda: not p.server.server_state.connections, 20, 0.05, "the non-reading client's connection gone")
        served = decoded(sims)
        assert 0 < served < 100, served          # not every pipelined request was answered into memory
        s.close()


def test_a_closing_connection_whose_client_never_reads_is_aborted(sims: Fleet) -> None:
    with proxy_for(sims) as p:
        s = non_reader(p.port)
        s.sendall(request(3000, close=True, logprobs=5))
        wait_until(lambda: decoded(sims), 20, 0.05, "the request decoded")
        wait_until(lambda: not p.server.server_state.connections, 20, 0.05, "the closing connection gone")
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while piece := s.recv(65536):
                got += piece
        assert got.startswith(b"HTTP/1.1 200 ")
        s.close()


def test_a_client_that_reads_slowly_gets_every_answer(sims: Fleet) -> None:
    with proxy_for(sims, send_timeout_s=10) as p:           # the wait is bounded, not a race with this thread
        s = non_reader(p.port)
        s.sendall(request(400) * 60)              # ~190 KB of answers: past the high-water mark
        # read nothing until the proxy holds an answer its client has not taken and waits before the next
        wait_until(lambda: any(c.write_paused is not None and c.current is None
                               for c in p.server.server_state.connections), 20, 0.02, "an answer waiting")
        got = b""
        while got.count(b"HTTP/1.1 200 ") < 60 or not got.endswith(b"}"):
            piece = s.recv(4096)
            assert piece, got[-200:]
            got += piece
        assert got.count(b"HTTP/1.1 200 ") == 60
        s.close()


def test_a_passthrough_stream_whose_client_never_reads_is_cut(sims: Fleet) -> None:
    """A control-plane response sent in parts (here vLLM's token-in generate route, passed through) waits for
    its client between parts: that wait is bounded too, and cutting it ends the engine's request."""
    with proxy_for(sims) as p:
        body = orjson.dumps({"model": "sim-model", "token_ids": [1, 2, 3], "stream": True,
                             "sampling_params": {"max_tokens": 3000, "logprobs": 5, "ignore_eos": True}})
        s = non_reader(p.port)
        s.sendall(b"POST /inference/v1/generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % len(body) + body)
        wait_until(lambda: decoded(sims), 20, 0.02, "the stream under way")
        wait_until(lambda: not p.server.server_state.connections, 20, 0.05, "the non-reading client's connection gone")
        p.wait_idle()
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while piece := s.recv(65536):
                got += piece
        assert got.startswith(b"HTTP/1.1 200 ") and len(got) < 3000 * 100, len(got)   # cut, not the whole answer
        s.close()


def test_a_pd_stream_whose_client_never_reads_is_cut_after_the_send_timeout(sims: Fleet) -> None:
    """A PD stream (prefill, then the decoder's SSE) whose client stops reading: once it takes nothing for
    ``client_send_timeout_s`` the connection is aborted and the decode closed, so the decoder's reservation is
    freed — not after ``decode_idle_timeout_s`` (120 s here), which held it for every other request meanwhile."""
    with proxy_for(sims) as p:
        assert p.app.settings.decode_idle_timeout_s == 120
        body = orjson.dumps({"model": "sim-model", "prompt": "a long answer please", "max_tokens": 3000,
                             "ignore_eos": True, "logprobs": 5, "stream": True})
        s = non_reader(p.port)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n" % len(body) + body)
        wait_until(lambda: decoded(sims), 20, 0.02, "the stream under way")
        wait_until(lambda: not p.server.server_state.connections, 20, 0.05, "the non-reading client's connection gone")
        p.wait_idle()                                       # the decoder's lease and the request given back
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while piece := s.recv(65536):
                got += piece
        assert got.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" not in got, len(got)   # cut mid-stream
        s.close()


class _BigAnswers:
    """A served app whose completion route answers ``size`` bytes (and counts its calls): no engines."""

    def __init__(self, size: int) -> None:
        self.completion_routes = {"/v1/completions": "completions"}
        self.error_routes = self.completion_routes
        self.size = size
        self.calls = 0
        self.settings = Settings()

    async def handle_completion(self, api: str, ex: Any) -> None:
        self.calls += 1
        body = b"a" * self.size
        ex.start(200, [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())])
        ex.finish(body)

    def refusal_body(self, route: str, status: int, message: str) -> bytes:
        return orjson.dumps({"error": {"message": message}})

    def edge_refused(self, route: str, status: int, message: str, client_request_id: str | None) -> str | None:
        return None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("no control-plane route here")


@pytest.mark.anyio
async def test_shutdown_while_an_answer_waits_for_its_client_starts_no_queued_request() -> None:
    """uvicorn's shutdown closes a kept-alive connection whose client has not taken its answer: the requests it
    pipelined behind that answer are dropped when the client catches up, never started on the closing
    connection (pdproxy/http/server.py ``resume_writing``)."""
    loop = asyncio.get_running_loop()
    app = _BigAnswers(300_000)
    protos: list[ServerProtocol] = []
    lim = EdgeLimits(keep_alive_s=30, head_timeout_s=30, body_timeout_s=30, send_timeout_s=30, max_head=8192,
                     max_body=1 << 20, max_connections=10)
    state = types.SimpleNamespace(connections=set(), tasks=set(), total_requests=0)

    def factory() -> ServerProtocol:
        protos.append(ServerProtocol(None, state, {}, loop, proxy=app, limits=lim))
        return protos[-1]

    server = await loop.create_server(factory, "127.0.0.1", 0)
    server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, KERNEL_SNDBUF)
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.setblocking(False)
    try:
        await loop.sock_connect(c, server.sockets[0].getsockname())
        await loop.sock_sendall(c, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}" * 3)
        with anyio.fail_after(10):
            while not protos or protos[0].timer_kind != _SEND_TIMER:   # the first answer waits for its client
                await asyncio.sleep(0.01)
        protos[0].shutdown()
        got = b""
        with anyio.fail_after(10):
            while piece := await loop.sock_recv(c, 1 << 20):
                got += piece
        assert app.calls == 1
        assert got.count(b"HTTP/1.1 200 ") == 1 and got.endswith(b"a" * 1000) and len(got) < 2 * app.size
    finally:
        c.close()
        server.close()
