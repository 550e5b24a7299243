"""A minimal raw HTTP/1.1 client for fault tests: exposes the individual chunks of a chunked response."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RawResponse:
    """What arrived: the head, each transfer-encoding chunk, and how the connection ended."""

    head: bytes = b""
    chunks: list[bytes] = field(default_factory=list)
    complete: bool = False  # the terminal 0-length chunk arrived
    reset: bool = False  # the peer reset the connection
    eof_before_head: bool = False

    @property
    def status(self) -> int:
        return int(self.head.split(b" ", 2)[1]) if self.head else 0

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def header(self, name: str) -> str | None:
        for line in self.head.decode("latin-1").split("\r\n")[1:]:
            key, _, value = line.partition(":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None


async def raw_post(port: int, path: str, body: Any, timeout_s: float = 5.0) -> RawResponse:
    """POST ``body`` as JSON with ``Connection: close``; read until the body ends, EOF or reset."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = json.dumps(body).encode()
    writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    await writer.drain()
    out = RawResponse()
    try:
        await asyncio.wait_for(_read(reader, out), timeout_s)
    except (ConnectionResetError, asyncio.IncompleteReadError):
        out.reset = True
    finally:
        writer.close()
    return out


async def _read(reader: asyncio.StreamReader, out: RawResponse) -> None:
    try:
        out.head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        out.eof_before_head = not exc.partial
        if exc.partial:
            raise
        return
    if (out.header("Transfer-Encoding") or "").lower() != "chunked":
        length = int(out.header("Content-Length") or 0)
        out.chunks.append(await reader.readexactly(length))
        out.complete = True
        return
    while True:
        size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            out.complete = True
            return
        out.chunks.append(data[:-2])
