"""A raw HTTP/1.1 engine on 127.0.0.1 scripted byte by byte, and a client helper, for the h1client tests.

An :class:`Engine` runs one script per accepted connection (a :class:`Peer`: read a request, write exact bytes,
reset, wait for the client to go away) and counts accepts and received request bodies, so tests assert what
went over the wire: which connection served which request, whether a request ran twice, whether the engine saw
the client close.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from pdproxy.http.client import H1Pool, H1Response

Key = tuple[str, int]


class Peer:
    """The engine's side of one accepted connection."""

    def __init__(self, engine: Engine, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.engine = engine
        self.reader = reader
        self.writer = writer
        self.gone = asyncio.Event()

    async def request(self) -> bytes:
        """Read one request (head + ``Content-Length`` body) and return its body."""
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        body = await self.reader.readexactly(length)
        self.engine.received.append(body)
        return body

    async def send(self, *pieces: bytes) -> None:
        """Write each piece on its own; between pieces the loop turns twice, so the client reads them apart."""
        for piece in pieces:
            self.writer.write(piece)
            await self.writer.drain()
            if len(pieces) > 1:
                await asyncio.sleep(0)
                await asyncio.sleep(0)

    async def wait_gone(self) -> None:
        """Return once the client closed or reset the connection (sets ``gone``)."""
        try:
            while await self.reader.read(65536):
                pass
        except ConnectionError:
            pass
        self.gone.set()

    def reset(self) -> None:
        """Close with an RST (SO_LINGER 0)."""
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.writer.transport.abort()


Script = Callable[[Peer], Awaitable[None]]


class Engine:
    """A raw HTTP/1.1 server: ``scripts[i]`` serves the i-th accepted connection (the last one repeats)."""

    def __init__(self, *scripts: Script) -> None:
        self.scripts = scripts
        self.peers: list[Peer] = []
        self.received: list[bytes] = []
        self.errors: list[BaseException] = []
        self.jobs: set[asyncio.Future[None]] = set()
        self.server: asyncio.AbstractServer | None = None
        self.key: Key = ("127.0.0.1", 0)

    @property
    def accepts(self) -> int:
        return len(self.peers)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = Peer(self, reader, writer)
        self.peers.append(peer)
        script = self.scripts[min(len(self.peers), len(self.scripts)) - 1]
        job = asyncio.ensure_future(script(peer))
        self.jobs.add(job)
        try:
            await job
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        except Exception as exc:  # reported by Engine.__aexit__
            self.errors.append(exc)
        finally:
            writer.close()

    async def __aenter__(self) -> Engine:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.key = ("127.0.0.1", self.server.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for peer in self.peers:
            peer.writer.transport.abort()
        for job in self.jobs:
            job.cancel()
        await asyncio.gather(*self.jobs, return_exceptions=True)
        assert not self.errors, self.errors


@asynccontextmanager
async def serving(*scripts: Script, keepalive_s: float = 30.0) -> AsyncIterator[tuple[Engine, H1Pool]]:
    async with Engine(*scripts) as engine:
        pool = H1Pool(connect_timeout_s=1.0, keepalive_s=keepalive_s)
        try:
            yield engine, pool
        finally:
            pool.close()


def once(*pieces: bytes) -> Script:
    """A script: read one request, write ``pieces`` (each on its own), then wait for the client to go."""
    async def script(peer: Peer) -> None:
        await peer.request()
        await peer.send(*pieces)
        await peer.wait_gone()
    return script


def answer(body: bytes, *headers: str) -> bytes:
    """A 200 with a ``Content-Length`` body."""
    extra = "".join(f"{h}\r\n" for h in headers)
    return (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            .encode() + body)


def chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk of a chunked body (size line, data, CRLF)."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def chunked(*chunks: bytes) -> bytes:
    """A 200 SSE head and its chunked body (one chunk extension, a trailer)."""
    out = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\nTransfer-Encoding: chunked\r\n\r\n"]
    for i, c in enumerate(chunks):
        out.append(f"{len(c):x}{';ext=1' if i == 1 else ''}\r\n".encode() + c + b"\r\n")
    return b"".join(out) + b"0\r\nX-Trailer: t\r\n\r\n"


async def post(pool: H1Pool, key: Key, body: bytes = b'{"n": 1}', *, idle_s: float | None = None,
               headers_s: float = 3.0, deadline_s: float | None = None) -> H1Response:
    """POST on a pooled connection (or a new one) and return once the response headers are in."""
    conn = pool.take(key) or await pool.connect(key)
    now = asyncio.get_running_loop().time()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {key[0]}:{key[1]}\r\nContent-Length: {len(body)}\r\n\r\n"
    return await conn.request(head.encode(), body, idle_s, headers_by=now + headers_s,
                              deadline_at=None if deadline_s is None else now + deadline_s)


async def until(cond: Callable[[], object], what: str, timeout_s: float = 3.0) -> None:
    """Poll ``cond`` (letting the loop run) until it is true; fail after ``timeout_s`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


def pooled(pool: H1Pool, key: Key) -> int:
    return len(pool.idle.get(key, []))
