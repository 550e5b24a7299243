"""pdproxy.http.client against raw asyncio TCP servers on 127.0.0.1 scripted byte by byte (tests/unit/rawengine.py).

Bodies (sized, chunked, close-delimited, split at every byte), keep-alive reuse and the pool, stale keep-alive
retries (through :class:`Upstream`), timeouts, broken and malformed responses, back-pressure, close/release.
Every test runs on asyncio and on uvloop (the proxy's loop).  Waiting is on events or on conditions polled with a
deadline, never on a sleep.
"""

from __future__ import annotations

import asyncio
import gc
import random
import socket
import weakref
from contextlib import suppress

import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.errors import UpstreamUnavailable
from pdproxy.http import client as h1client
from pdproxy.http.client import _PAUSE_BYTES, ConnectError, H1Pool
from pdproxy.http.upstream import Upstream, UpstreamRefused
from tests.unit.rawengine import Engine, Peer, answer, chunked, once, pooled, post, serving, until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]

SSE = [b'data: {"choices": [{"text": "caf\xc3\xa9"}]}\n\n', b"data: {}\n\n", b"data: [DONE]\n\n"]


# --- bodies ------------------------------------------------------------------------------------------------------
async def test_content_length_body_split_across_writes() -> None:
    body = b'{"id": "cmpl-1", "text": "' + b"x" * 3000 + b'"}'
    wire = answer(body, "X-Request-Id: r1")

    async with serving(once(wire[:10], wire[10:70], wire[70:71], wire[71:2000], wire[2000:])) as (engine, pool):
        resp = await post(pool, engine.key)
        assert (resp.status, resp.content_type, resp.headers.get("x-request-id")) == (200, "application/json", "r1")
        assert await resp.read() == body
        assert resp.at_eof() and await resp.readany() == b""
        resp.release()
        assert engine.received == [b'{"n": 1}']


async def test_zero_length_body_is_complete_at_once() -> None:
    async with serving(once(answer(b""))) as (engine, pool):
        resp = await post(pool, engine.key)
        assert resp.at_eof() and await resp.read() == b""
        resp.release()
        assert pooled(pool, engine.key) == 1


async def test_read_n_keeps_the_rest_of_the_body() -> None:
    async with serving(once(answer(b"0123456789"))) as (engine, pool):
        resp = await post(pool, engine.key)
        await until(lambda: resp._eof, "whole body buffered")
        assert await resp.read(4) == b"0123"
        assert not resp.at_eof()
        assert await resp.read() == b"456789"
        resp.release()


async def test_chunked_body_split_at_every_byte_position_on_one_connection() -> None:
    wire = chunked(*SSE)
    head_len = wire.index(b"\r\n\r\n") + 4
    splits = list(range(head_len, len(wire)))

    async def script(peer: Peer) -> None:
        for i in splits:
            await peer.request()
            await peer.send(wire[:i], wire[i:])
        await peer.wait_gone()

    async with serving(script) as (engine, pool):
        for _ in splits:
            resp = await post(pool, engine.key)
            assert await resp.read() == b"".join(SSE)
            resp.release()
        assert engine.accepts == 1 and len(engine.received) == len(splits)


async def test_chunked_body_one_byte_per_write() -> None:
    wire = chunked(*SSE, b"x" * 300)

    async with serving(once(*(wire[i:i + 1] for i in range(len(wire))))) as (engine, pool):
        resp = await post(pool, engine.key)
        assert resp.headers.get("Content-Type").startswith("text/event-stream")
        parts = []
        while chunk := await resp.readany():
            parts.append(chunk)
        assert b"".join(parts) == b"".join(SSE) + b"x" * 300
        assert len(parts) > 10  # it did arrive in pieces
        resp.release()
        assert pooled(pool, engine.key) == 1


async def test_close_delimited_body_ends_at_eof() -> None:
    """No Content-Length, not chunked: the body is everything up to the engine's FIN (RFC 9112 §6.3 item 8)."""
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\nhello ", b"world")
        peer.writer.close()

    async with serving(script) as (engine, pool):
        resp = await post(pool, engine.key)
        assert await resp.read() == b"hello world"
        assert resp.at_eof()
        resp.release()
        assert pooled(pool, engine.key) == 0


# --- keep-alive and the pool -------------------------------------------------------------------------------------
async def test_a_read_of_many_chunks_is_one_piece_and_a_closed_connection_is_freed_by_refcount() -> None:
    """A chunked body's segments of one read reach the response as one piece (the parser appends them to the
    connection's list, no Python call per chunk); the parser and its callbacks hold the connection's bound methods,
    a cycle broken once the connection is gone, so it is freed without the cycle collector (pdproxy/ops/gcpolicy.py
    runs full collections rarely)."""
    async with serving(once(chunked(*SSE))) as (engine, pool):
        resp = await post(pool, engine.key)
        await until(lambda r=resp: r._eof, "whole body in")
        assert resp._buf == [b"".join(SSE)]          # one write of the engine: one read, one piece
        assert await resp.read() == b"".join(SSE)
        conn = weakref.ref(resp._conn)
        gc.disable()
        try:
            resp.close()
            del resp
            await until(lambda: conn() is None, "the closed connection freed by reference counting")
        finally:
            gc.enable()


async def test_keep_alive_connection_serves_the_next_requests() -> None:
    async def script(peer: Peer) -> None:
        while True:
            body = await peer.request()
            await peer.send(answer(b"echo:" + body))

    async with serving(script) as (engine, pool):
        conns = []
        for i in range(3):
            resp = await post(pool, engine.key, f'{{"i": {i}}}'.encode())
            conns.append(resp._conn)
            assert await resp.read() == f'echo:{{"i": {i}}}'.encode()
            resp.release()
        assert engine.accepts == 1 and conns[0] is conns[1] is conns[2]
        assert engine.received == [b'{"i": 0}', b'{"i": 1}', b'{"i": 2}']


async def test_connection_close_answer_is_not_reused() -> None:
    async with serving(once(answer(b"{}", "Connection: close"))) as (engine, pool):
        for _ in range(2):
            resp = await post(pool, engine.key)
            assert await resp.read() == b"{}"
            resp.release()
            assert pooled(pool, engine.key) == 0
        assert engine.accepts == 2
        await asyncio.wait_for(engine.peers[0].gone.wait(), 3)


async def test_expired_pooled_connection_is_not_taken() -> None:
    async with serving(once(answer(b"{}")), keepalive_s=0.0) as (engine, pool):
        resp = await post(pool, engine.key)
        await resp.read()
        resp.release()
        assert pooled(pool, engine.key) == 1
        assert pool.take(engine.key) is None  # idle longer than keepalive_s: closed instead
        await asyncio.wait_for(engine.peers[0].gone.wait(), 3)


async def test_engine_closing_an_idle_pooled_connection() -> None:
    """The engine closes the connection once it is idle (its keep-alive timer): the next request opens another."""
    released = asyncio.Event()

    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(answer(b"{}"))
        await released.wait()
        peer.writer.close()

    async with serving(script) as (engine, pool):
        resp = await post(pool, engine.key)
        await resp.read()
        resp.release()
        released.set()
        conn = pool.idle[engine.key][0]
        await until(lambda: conn.closed, "the client noticed the FIN")
        resp = await post(pool, engine.key)
        assert await resp.read() == b"{}"
        resp.release()
        assert engine.accepts == 2 and len(engine.received) == 2


async def test_request_on_a_closed_connection_fails_before_sending() -> None:
    async with serving(once(answer(b"{}"))) as (engine, pool):
        conn = await pool.connect(engine.key)
        conn.abort()
        with pytest.raises(h1client.Disconnected):
            await conn.request(b"POST / HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"", None)
        assert not conn.got_bytes  # so Upstream may retry it on a fresh connection
        assert engine.received == []


def _endpoint(engine: Engine) -> Endpoint:
    return Endpoint(f"http://127.0.0.1:{engine.key[1]}", Role.PREFILL)


async def test_stale_keep_alive_request_is_retried_once_on_a_fresh_connection() -> None:
    async def first(peer: Peer) -> None:
        await peer.request()
        await peer.send(answer(b'{"ok": 1}'))
        await peer.request()  # read, never acted on: closed "between requests"
        peer.writer.close()

    async def second(peer: Peer) -> None:
        await peer.request()
        await peer.send(answer(b'{"ok": 2}'))
        await peer.wait_gone()

    async with Engine(first, second) as engine:
        up = Upstream(connect_timeout_s=1.0)
        await up.start()
        try:
            assert await up.post_json(_endpoint(engine), "/v1/completions", b"{}", {}, timeout_s=3) == {"ok": 1}
            assert await up.post_json(_endpoint(engine), "/v1/completions", b"{}", {}, timeout_s=3) == {"ok": 2}
        finally:
            await up.close()
        assert (engine.accepts, up.stale_retries, len(engine.received)) == (2, 1, 3)


async def test_stale_keep_alive_is_not_retried_once_response_bytes_came() -> None:
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(answer(b'{"ok": 1}'))
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Le")
        peer.writer.close()

    async with Engine(script) as engine:
        up = Upstream(connect_timeout_s=1.0)
        await up.start()
        try:
            await up.post_json(_endpoint(engine), "/v1/completions", b"{}", {}, timeout_s=3)
            with pytest.raises(UpstreamUnavailable):
                await up.post_json(_endpoint(engine), "/v1/completions", b"{}", {}, timeout_s=3)
        finally:
            await up.close()
        assert (engine.accepts, up.stale_retries, len(engine.received)) == (1, 0, 2)


async def test_release_after_complete_body_returns_the_connection_to_the_pool() -> None:
    async def script(peer: Peer) -> None:
        while True:
            await peer.request()
            await peer.send(chunked(*SSE))

    async with serving(script) as (engine, pool):
        resp = await post(pool, engine.key)
        conn = resp._conn
        assert await resp.read() == b"".join(SSE)
        resp.release()
        resp.release()  # idempotent
        assert pool.idle[engine.key] == [conn]
        resp = await post(pool, engine.key)
        assert resp._conn is conn and await resp.read() == b"".join(SSE)
        resp.release()
        assert engine.accepts == 1


async def test_release_of_a_complete_but_unread_body_pools_the_connection() -> None:
    async with serving(once(chunked(*SSE))) as (engine, pool):
        resp = await post(pool, engine.key)
        await until(lambda: resp._eof, "whole message in")
        resp.release()
        assert pooled(pool, engine.key) == 1


@pytest.mark.parametrize("when", ["idle", "same_read"])
async def test_unsolicited_bytes_after_the_response_drop_the_connection(when: str) -> None:
    """A second response nobody asked for (e.g. a 408 before a close) never touches the first one's status and
    headers, and the connection is not reused, whether it comes with the response or while pooled."""
    released = asyncio.Event()
    stray = b"HTTP/1.1 408 Request Timeout\r\nX-Stray: 1\r\nContent-Length: 0\r\n\r\n"

    async def script(peer: Peer) -> None:
        await peer.request()
        if when == "same_read":
            await peer.send(answer(b"{}") + stray)
        else:
            await peer.send(answer(b"{}"))
            await released.wait()
            await peer.send(stray)
        await peer.wait_gone()

    async with serving(script) as (engine, pool):
        resp = await post(pool, engine.key)
        assert await resp.read() == b"{}"
        assert resp.status == 200 and resp.headers.get("x-stray") is None
        conn = resp._conn
        resp.release()
        released.set()
        await until(lambda: conn.closed, "the connection dropped")
        assert pool.take(engine.key) is None
        await asyncio.wait_for(engine.peers[0].gone.wait(), 3)


@pytest.mark.parametrize("how", ["close", "release"])
async def test_unfinished_body_aborts_the_connection(how: str) -> None:
    async with serving(once(chunked(*SSE)[:-40])) as (engine, pool):
        resp = await post(pool, engine.key)
        assert await resp.readany()
        getattr(resp, how)()
        await asyncio.wait_for(engine.peers[0].gone.wait(), 3)  # the engine sees EOF/RST: vLLM aborts
        assert pooled(pool, engine.key) == 0 and resp._conn.closed
        if how == "close":
            with pytest.raises(h1client.Disconnected):
                await resp.readany()  # does not wait forever


async def test_with_response_releases_on_exit() -> None:
    """``with resp:`` is :meth:`release` on the way out: a complete message's connection is pooled, an unfinished
    one's is closed (the engine aborts), also when the block raises."""
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(answer(b"{}"))
        await peer.request()
        await peer.send(chunked(*SSE)[:-40])
        await peer.wait_gone()

    async with serving(script) as (engine, pool):
        resp = await post(pool, engine.key)
        with resp as entered:
            assert entered is resp and await resp.read() == b"{}"
        assert pooled(pool, engine.key) == 1
        resp = await post(pool, engine.key)
        with pytest.raises(ValueError), resp:
            assert await resp.readany()
            raise ValueError
        await asyncio.wait_for(engine.peers[0].gone.wait(), 3)
        assert pooled(pool, engine.key) == 0 and resp._conn.closed and engine.accepts == 1


# --- failures ----------------------------------------------------------------------------------------------------
async def test_connect_refused_raises_connect_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        key = ("127.0.0.1", sock.getsockname()[1])
        pool = H1Pool(connect_timeout_s=1.0, keepalive_s=30.0)
        with pytest.raises(ConnectError, match="failed"):
            await pool.connect(key)
        up = Upstream(connect_timeout_s=1.0)
        await up.start()
        try:
            with pytest.raises(UpstreamRefused):
                await up.post_json(Endpoint(f"http://127.0.0.1:{key[1]}", Role.DECODE), "/v1/completions", b"{}",
                                   {}, timeout_s=2)
        finally:
            await up.close()


async def test_headers_timeout_closes_the_connection() -> None:
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.wait_gone()  # never answers

    async with serving(script) as (engine, pool):
        started = asyncio.get_running_loop().time()
        with pytest.raises(TimeoutError):
            await post(pool, engine.key, headers_s=0.2)
        assert asyncio.get_running_loop().time() - started < 2
        await asyncio.wait_for(engine.peers[0].gone.wait(), 3)
        assert pooled(pool, engine.key) == 0


async def test_idle_timeout_mid_body() -> None:
    async with serving(once(chunked(*SSE)[:-60])) as (engine, pool):
        resp = await post(pool, engine.key, idle_s=0.2)
        assert await resp.readany()
        started = asyncio.get_running_loop().time()
        with pytest.raises(h1client.ReadTimeout, match=r"no data for 0\.2 s"):
            await resp.readany()
        assert 0.15 < asyncio.get_running_loop().time() - started < 2
        resp.close()
        await asyncio.wait_for(engine.peers[0].gone.wait(), 3)


async def test_deadline_cuts_a_trickling_body() -> None:
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:  # one event every 20 ms: never idle for long
            await peer.send(b"9\r\ndata: x\n\n\r\n")
            await asyncio.sleep(0.02)

    async with serving(script) as (engine, pool):
        resp = await post(pool, engine.key, idle_s=5.0, deadline_s=0.3)
        with pytest.raises(h1client.ReadTimeout, match="deadline"):
            while await resp.readany():
                pass
        resp.close()


async def test_set_idle_timeout_on_a_live_response() -> None:
    """Shortening the idle timeout during a read re-arms the pending timer; lengthening it lets a slow gap pass."""
    sent_second = asyncio.Event()

    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await asyncio.sleep(1.5)  # a gap longer than the first idle timeout
        await peer.send(b"9\r\ndata: 1\n\n\r\n")
        sent_second.set()
        await peer.wait_gone()

    async with serving(script) as (engine, pool):
        resp = await post(pool, engine.key, idle_s=1.0)    # (a loaded machine may take 0.1 s to resume the read)
        resp.set_idle_timeout(5.0)
        assert await resp.readany() == b"data: 1\n\n"
        assert sent_second.is_set()
        loop = asyncio.get_running_loop()
        pending = asyncio.ensure_future(resp.readany())
        await until(lambda: resp._waiter is not None, "the read waits")
        started = loop.time()
        resp.set_idle_timeout(0.1)
        with pytest.raises(h1client.ReadTimeout, match=r"0\.1 s"):
            await pending
        assert loop.time() - started < 2
        resp.close()


@pytest.mark.parametrize("how", ["fin", "rst"])
@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_connection_broken_mid_body_raises_payload_error(how: str, framing: str) -> None:
    wire = answer(b"x" * 1000) if framing == "length" else chunked(*SSE)

    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(wire[:-30])
        if how == "rst":
            peer.reset()
        else:
            peer.writer.close()

    async with serving(script) as (engine, pool):
        resp = await post(pool, engine.key)
        with pytest.raises(h1client.TransportError):
            await resp.read()
        with pytest.raises(h1client.TransportError):
            await resp.readany()  # stays failed
        resp.release()
        assert pooled(pool, engine.key) == 0


@pytest.mark.parametrize("status_line", [b"HTPT/1.1 200 OK", b"HTTP/1.1 2x0 OK", b"\x16\x03\x01 hello"])
async def test_malformed_status_line_raises_and_closes(status_line: bytes) -> None:
    async with serving(once(status_line + b"\r\nContent-Length: 2\r\n\r\n{}")) as (engine, pool):
        with pytest.raises(h1client.TransportError, match="malformed"):
            await post(pool, engine.key)
        await asyncio.wait_for(engine.peers[0].gone.wait(), 3)
        assert pooled(pool, engine.key) == 0


@pytest.mark.parametrize("writes", [1, 2])
async def test_malformed_chunk_size_mid_body_raises_payload_error(writes: int) -> None:
    """Also when the bad chunk comes in the same read as the headers (the response is still returned)."""
    wire = chunked(b"data: 1\n\n")[:-5] + b"zz\r\nbad\r\n"

    async with serving(once(*([wire] if writes == 1 else [wire[:-10], wire[-10:]]))) as (engine, pool):
        resp = await post(pool, engine.key)
        with pytest.raises(h1client.TransportError, match="malformed"):
            await resp.read()
        await asyncio.wait_for(engine.peers[0].gone.wait(), 3)


# --- back-pressure -----------------------------------------------------------------------------------------------
async def test_large_body_read_slowly_pauses_and_resumes_without_loss() -> None:
    size = 16 << 20
    body = random.Random(7).randbytes(size)
    finished = asyncio.Event()

    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for off in range(0, size, 64 << 10):
            peer.writer.write(body[off:off + (64 << 10)])
            await peer.writer.drain()
        finished.set()
        await peer.wait_gone()

    async with serving(script) as (engine, pool):
        resp = await post(pool, engine.key, idle_s=5.0)
        conn = resp._conn
        got = bytearray()
        pauses, peak = 0, 0
        while not resp.at_eof():
            await until(lambda: conn.paused or resp._eof, "reading paused or the body complete")
            if conn.paused:
                assert conn.transport is not None and not conn.transport.is_reading()
                if not pauses:
                    assert not finished.is_set()  # the engine is held back while the proxy does not read
                pauses += 1
            peak = max(peak, resp._size)
            got += await resp.readany()
        assert bytes(got) == body
        assert pauses >= 8 and peak <= 2 * _PAUSE_BYTES
        resp.release()
        assert not conn.paused and conn.transport is not None and conn.transport.is_reading()
        assert pool.idle[engine.key] == [conn]
        with suppress(Exception):
            await asyncio.wait_for(finished.wait(), 3)
        assert finished.is_set()


@pytest.fixture(params=[pytest.param(("asyncio", {}), id="asyncio"),
                        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop")])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, bool]]:
    """Both loops: the proxy serves on uvloop (``pdproxy serve``), the tests' proxies on asyncio."""
    return request.param  # type: ignore[no-any-return]
