"""The floor of a Python PD relay: uvloop + httptools on both sides and nothing else, a baseline of the
per-request benchmarks (``loadtest/users_bench.py``, target ``bare_relay``).

Per request it does what any PD relay written in Python must: read the client's body whole and parse it once
(orjson); send the prefill leg (the client's fields with ``max_tokens`` 1, ``stream`` false and
``kv_transfer_params.do_remote_decode``, ``docs/pd-protocol.md`` §1) and read its JSON answer; send the decode leg
(the client's fields with the answer's ``kv_transfer_params``) and relay the decoder's body to the client piece by
piece as it arrives (chunked transfer coding).  Nothing else: one prefiller and one decoder, no validation,
admission, prefix keys, metrics, logs, timeouts or flow control; any failure is a 502.  Not a proxy to run — it
prices the part of a request's CPU that no feature of pdproxy adds, so the benchmark can tell a feature's cost
from Python's on the same machine in the same run.

Run: ``python -m loadtest.bare_relay --port 9000 --prefill http://127.0.0.1:9100 --decode http://127.0.0.1:9200``.
"""

from __future__ import annotations

import argparse
import asyncio
import urllib.parse
from collections.abc import Callable
from typing import Any

import httptools
import orjson

_HEALTH = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
_BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_STREAM_HEAD = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ntransfer-encoding: chunked\r\n\r\n"


class EngineConnection(asyncio.Protocol):
    """One keep-alive connection to an engine, one exchange at a time: ``head(status, content_type)``, then
    ``sink(piece)`` per body piece, then ``end(whole)`` — also what a lost connection calls (``whole`` False)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.content_type = b"application/json"
        self.head: Callable[[int, bytes], None] = _ignore_head
        self.sink: Callable[[bytes], None] = _ignore
        self.end: Callable[[bool], None] = _ignore_end
        self.open = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        self.end(False)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.open = False
            assert self.transport is not None
            self.transport.close()

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value

    def on_headers_complete(self) -> None:
        self.head(self.parser.get_status_code(), self.content_type)

    def on_body(self, body: bytes) -> None:
        self.sink(body)

    def on_message_complete(self) -> None:
        end, self.end = self.end, _ignore_end
        self.head, self.sink = _ignore_head, _ignore
        end(True)


def _ignore(data: bytes) -> None:
    pass


def _ignore_head(status: int, content_type: bytes) -> None:
    pass


def _ignore_end(whole: bool) -> None:
    pass


def _settler(done: asyncio.Future[bool]) -> Callable[[bool], None]:
    def end(whole: bool) -> None:
        if not done.done():
            done.set_result(whole)
    return end


class Engine:
    """An engine's address and its idle keep-alive connections."""

    def __init__(self, url: str) -> None:
        u = urllib.parse.urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.host_header = f"{self.host}:{self.port}".encode()
        self.idle: list[EngineConnection] = []

    async def connection(self) -> EngineConnection:
        while self.idle:
            conn = self.idle.pop()
            if conn.open:
                return conn
        _, conn = await asyncio.get_running_loop().create_connection(EngineConnection, self.host, self.port)
        return conn

    def release(self, conn: EngineConnection) -> None:
        if conn.open:
            self.idle.append(conn)

    def send(self, conn: EngineConnection, path: bytes, body: bytes) -> None:
        assert conn.transport is not None
        conn.transport.writelines((b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                                   b"content-length: %d\r\n\r\n" % (path, self.host_header, len(body)), body))


class Relay:
    """The two engines and the per-request steps."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefiller = Engine(prefill)
        self.decoder = Engine(decode)

    async def prefill(self, path: bytes, req: dict[str, Any]) -> dict[str, Any]:
        """The prefill leg: its answer's ``kv_transfer_params``."""
        leg = dict(req)
        leg["stream"] = False
        leg["max_tokens"] = 1
        leg.pop("max_completion_tokens", None)
        leg.pop("stream_options", None)
        leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                     "remote_block_ids": None, "remote_host": None, "remote_port": None}
        engine = self.prefiller
        conn = await engine.connection()
        parts: list[bytes] = []
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        conn.sink = parts.append
        conn.end = _settler(done)
        engine.send(conn, path, orjson.dumps(leg))
        if not await done:
            raise ConnectionError("the prefiller's answer broke off")
        engine.release(conn)
        return dict(orjson.loads(b"".join(parts))["kv_transfer_params"])

    async def decode(self, path: bytes, req: dict[str, Any], client: asyncio.Transport) -> None:
        """The decode leg, relayed to ``client`` as it arrives."""
        engine = self.decoder
        conn = await engine.connection()
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def head(status: int, content_type: bytes) -> None:
            client.write(_STREAM_HEAD % (status, b"OK" if status == 200 else b"Error", content_type))

        def piece(data: bytes) -> None:
            client.writelines((b"%x\r\n" % len(data), data, b"\r\n"))

        conn.head = head
        conn.sink = piece
        conn.end = _settler(done)
        engine.send(conn, path, orjson.dumps(req))
        whole = await done
        if not whole:
            client.close()
            return
        client.write(b"0\r\n\r\n")
        engine.release(conn)

    async def handle(self, path: bytes, body: bytes, client: asyncio.Transport) -> None:
        try:
            req = orjson.loads(body)
            req["kv_transfer_params"] = await self.prefill(path, req)
            await self.decode(path, req, client)
        except Exception:
            client.write(_BAD_GATEWAY)
            client.close()


class ClientConnection(asyncio.Protocol):
    """One client connection: a request's body is read whole, then relayed (no pipelining)."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url
        self.body = []

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.transport is not None
        path = self.url.split(b"?", 1)[0]
        if path == b"/health":
            self.transport.write(_HEALTH)
            return
        asyncio.get_running_loop().create_task(self.relay.handle(path, b"".join(self.body), self.transport))


async def serve(host: str, port: int, relay: Relay) -> None:
    server = await asyncio.get_running_loop().create_server(lambda: ClientConnection(relay), host, port,
                                                            backlog=4096)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True, help="the prefiller's URL")
    ap.add_argument("--decode", required=True, help="the decoder's URL")
    args = ap.parse_args(argv)
    import uvloop

    uvloop.run(serve(args.host, args.port, Relay(args.prefill, args.decode)))


if __name__ == "__main__":
    main()
