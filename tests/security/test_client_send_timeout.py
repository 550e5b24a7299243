"""Bytes written to a client must move (pdproxy/http/server.py ``close_draining``, the send timer; docs/limits.md
``client_send_timeout_s``): a client that never reads holds one answer in the proxy, not every answer it asked for,
and a connection closing with bytes its client never takes is aborted, not kept open forever."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import orjson
import pytest

from tests.conftest import Fleet
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(60)

SEND_TIMEOUT_S = 0.5
KERNEL_SNDBUF = 16 * 1024


@contextlib.contextmanager
def proxy_for(sims: Fleet) -> Iterator[ProxyThread]:
    p = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                    client_send_timeout_s=SEND_TIMEOUT_S, timeout_keep_alive_s=1)
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
    with proxy_for(sims) as p:
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
        wait_until(lambda: p.app.state is not None and p.app.state.in_flight, 20, 0.02, "the stream under way")
        wait_until(lambda: not p.server.server_state.connections, 20, 0.05, "the non-reading client's connection gone")
        p.wait_idle()
        got = b""
        with contextlib.suppress(ConnectionResetError):
            while piece := s.recv(65536):
                got += piece
        assert got.startswith(b"HTTP/1.1 200 ") and len(got) < 3000 * 100, len(got)   # cut, not the whole answer
        s.close()
