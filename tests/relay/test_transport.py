"""The engine-side transport (pdproxy/http/client.py): interim answers, repeated headers, head limit, connection cap,
large bodies, and its error tree as the proxy maps it (pdproxy/http/upstream.py)."""

from __future__ import annotations

import asyncio

import pytest

from pdproxy.errors import UpstreamTimeout, UpstreamUnavailable
from pdproxy.http import client as h1client
from pdproxy.http.client import H1Pool, PoolTimeout
from pdproxy.http.errors import transport_error
from pdproxy.http.upstream import UpstreamRefused
from tests.unit.rawengine import Engine, Peer, answer, once, post, serving

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]


async def test_interim_100_continue_is_skipped() -> None:
    async with serving(once(b"HTTP/1.1 100 Continue\r\n\r\n", answer(b'{"ok": 1}'))) as (engine, pool):
        resp = await post(pool, engine.key)
        assert resp.status == 200
        assert await resp.read() == b'{"ok": 1}'
        resp.release()


async def test_interim_and_final_in_one_write_and_103_early_hints() -> None:
    both = b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 100 Continue\r\n\r\n" + answer(b"{}", "X-A: 1")
    async with serving(once(both)) as (engine, pool):
        resp = await post(pool, engine.key)
        assert (resp.status, resp.headers.get("x-a"), resp.headers.get("link")) == (200, "1", None)
        assert await resp.read() == b"{}"
        resp.release()


async def test_repeated_header_fields_are_kept() -> None:
    async with serving(once(answer(b"{}", "Set-Cookie: a=1", "X-Trace: t1", "x-trace: t2"))) as (engine, pool):
        resp = await post(pool, engine.key)
        assert resp.headers.get("X-Trace") == "t1, t2"
        assert resp.headers.get("set-cookie") == "a=1"
        await resp.read()
        resp.release()


async def test_response_head_over_the_limit_is_a_protocol_error() -> None:
    big = b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: %s\r\n" % (i, b"v" * 1000) for i in range(80)) + b"\r\n"
    async with serving(once(big)) as (engine, pool):
        with pytest.raises(h1client.ProtocolError, match="larger than"):
            await post(pool, engine.key)
        assert pool.open.get(engine.key, 0) == 0  # the connection was dropped, its place freed


async def test_connection_cap_makes_the_next_request_wait_for_a_free_connection() -> None:
    gate = asyncio.Event()

    async def slow(peer: Peer) -> None:
        while True:
            await peer.request()
            await gate.wait()
            await peer.send(answer(b"{}"))

    async with Engine(slow) as engine:
        pool = H1Pool(connect_timeout_s=1.0, keepalive_s=30.0, max_per_endpoint=1, wait_s=5.0)
        try:
            first, reused = await pool.acquire(engine.key)
            assert not reused
            waiting = asyncio.ensure_future(pool.acquire(engine.key))
            await asyncio.sleep(0.05)
            assert not waiting.done() and engine.accepts == 1  # at the cap: no second connection is opened
            head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n"
            req = asyncio.ensure_future(first.request(head, b"{}", None))
            gate.set()
            resp = await req
            await resp.read()
            resp.release()  # back to the pool: the waiter takes this very connection
            second, reused = await waiting
            assert second is first and reused and engine.accepts == 1
            second.abort()
        finally:
            pool.close()


async def test_connection_cap_wait_is_bounded() -> None:
    async def hold(peer: Peer) -> None:
        await peer.request()
        await peer.wait_gone()

    async with Engine(hold) as engine:
        pool = H1Pool(connect_timeout_s=1.0, keepalive_s=30.0, max_per_endpoint=1, wait_s=0.1)
        try:
            conn, _ = await pool.acquire(engine.key)
            with pytest.raises(PoolTimeout, match="stayed busy"):
                await pool.acquire(engine.key)
            conn.abort()
            again, reused = await pool.acquire(engine.key)  # a closed connection frees its place at once
            assert not reused
            again.abort()
        finally:
            pool.close()


async def test_large_request_body_is_written_under_flow_control() -> None:
    body = b'{"p": "' + b"x" * (8 << 20) + b'"}'
    got: list[int] = []

    async def slow_reader(peer: Peer) -> None:
        got.append(len(await peer.request()))
        await peer.send(answer(b"{}"))
        await peer.wait_gone()

    async with serving(slow_reader) as (engine, pool):
        resp = await post(pool, engine.key, body, headers_s=5.0)
        assert resp.status == 200 and got == [len(body)]
        await resp.read()
        resp.release()


def test_the_error_tree_maps_to_proxy_errors() -> None:
    who = "decoder http://d:1"
    assert isinstance(transport_error(h1client.ConnectError("refused"), who, "d"), UpstreamRefused)
    assert isinstance(transport_error(PoolTimeout("busy"), who, "d"), UpstreamTimeout)
    assert isinstance(transport_error(h1client.ReadTimeout("idle"), who, "d"), UpstreamTimeout)
    for exc in (h1client.Disconnected("gone"), h1client.ProtocolError("bad")):
        err = transport_error(exc, who, "d", " mid-stream")
        assert type(err) is UpstreamUnavailable and err.endpoint == "d" and "mid-stream" in err.message
    assert issubclass(PoolTimeout, TimeoutError) and issubclass(h1client.ReadTimeout, TimeoutError)
    assert all(issubclass(c, h1client.TransportError) for c in (h1client.ConnectError, PoolTimeout,
                                                                 h1client.Disconnected, h1client.ProtocolError,
                                                                 h1client.ReadTimeout))
