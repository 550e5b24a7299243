"""Stale upstream keep-alive connections are retried once on a fresh connection, without running a request twice.

The engine here is a raw asyncio server on 127.0.0.1 that answers the first request of each connection with a
keep-alive JSON response and, when ``drop_reused`` is set, closes a reused connection right after reading the
next request without acting on it — what a client sees when the engine closed an idle keep-alive connection as the
request was sent.  ``processed`` counts requests the engine acted on (answered).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.errors import UpstreamUnavailable
from pdproxy.http.upstream import Upstream

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]


@dataclass
class Engine:
    drop_reused: bool = True
    drop_fresh: bool = False
    processed: int = 0
    received: int = 0
    connections: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                self.received += 1
                if (served and self.drop_reused) or (not served and self.drop_fresh):
                    writer.close()  # closed "between requests": this request is never acted on
                    return
                self.processed += 1
                served += 1
                body = b'{"ok": true, "kv_transfer_params": null}'
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def _serve(engine: Engine) -> tuple[asyncio.AbstractServer, Endpoint]:
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, Endpoint(f"http://127.0.0.1:{port}", Role.PREFILL)


async def test_stale_connection_is_retried_once_on_a_fresh_one() -> None:
    engine = Engine(drop_reused=True)
    server, endpoint = await _serve(engine)
    up = Upstream(connect_timeout_s=1.0)
    await up.start()
    try:
        for _ in range(3):
            assert await up.post_json(endpoint, "/v1/completions", b"{}", {}, timeout_s=5) == {
                "ok": True, "kv_transfer_params": None}
        assert engine.processed == 3           # each request ran exactly once
        assert up.stale_retries == 2           # the 2nd and 3rd met a closed pooled connection
    finally:
        await up.close()
        server.close()


async def test_failure_on_a_fresh_connection_is_not_retried() -> None:
    engine = Engine(drop_reused=False, drop_fresh=True)
    server, endpoint = await _serve(engine)
    up = Upstream(connect_timeout_s=1.0)
    await up.start()
    try:
        with pytest.raises(UpstreamUnavailable):
            await up.post_json(endpoint, "/v1/completions", b"{}", {}, timeout_s=5)
        assert engine.received == 1 and up.stale_retries == 0
    finally:
        await up.close()
        server.close()
