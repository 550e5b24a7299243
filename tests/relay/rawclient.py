"""A raw-socket HTTP/1.x client for the server-edge tests: exact bytes out, every response message parsed back.

:class:`RawConn` writes whatever bytes a test gives it (several pipelined requests, HTTP/1.0, oversized heads)
and parses what comes back with httptools into :class:`Message` objects in arrival order, so a test asserts
statuses, headers, bodies, the framing used (chunked, sized, close-delimited) and whether the proxy closed the
connection.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import httptools


@dataclass
class Message:
    """One response: status, headers (lower-case names, in order), body (de-chunked) and its framing."""

    status: int = 0
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""
    complete: bool = False
    chunked: bool = False

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name), None)


class _Parser:
    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self.messages.append(Message())

    def on_header(self, name: bytes, value: bytes) -> None:
        self.messages[-1].headers.append((name.decode().lower(), value.decode()))

    def on_headers_complete(self) -> None:
        m = self.messages[-1]
        m.status = self.parser.get_status_code()
        m.chunked = (m.header("transfer-encoding") or "").lower() == "chunked"

    def on_body(self, body: bytes) -> None:
        self.messages[-1].body += body

    def on_message_complete(self) -> None:
        self.messages[-1].complete = True


class RawConn:
    """One TCP connection to ``port`` on 127.0.0.1."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.p = _Parser()
        self.closed = False
        self.raw = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read_messages(self, n: int, timeout_s: float = 10.0) -> list[Message]:
        """Read until ``n`` complete messages (or EOF); returns all messages so far."""
        deadline = time.monotonic() + timeout_s
        while sum(m.complete for m in self.p.messages) < n and not self.closed:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                raise AssertionError(f"timed out waiting for {n} responses; got {self.p.messages}") from None
            except ConnectionResetError:
                data = b""
            self._feed(data)
        return self.p.messages

    def _feed(self, data: bytes) -> None:
        self.raw += data
        if not data:
            self.closed = True
            try:
                self.p.parser.feed_data(b"")  # a close-delimited body ends here
            except httptools.HttpParserError:
                pass
            if self.p.messages and not self.p.messages[-1].complete and self.p.messages[-1].status:
                last = self.p.messages[-1]
                last.complete = last.header("content-length") is None and not last.chunked
            return
        self.p.parser.feed_data(data)

    def read_raw_until(self, marker: bytes, timeout_s: float = 10.0) -> None:
        """Read (and parse) until the raw bytes so far contain ``marker``."""
        deadline = time.monotonic() + timeout_s
        while marker not in self.raw:
            if self.closed or time.monotonic() > deadline:
                raise AssertionError(f"no {marker!r} in {self.raw!r}")
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            self._feed(self.sock.recv(65536))

    def wait_closed(self, timeout_s: float = 10.0) -> bool:
        """Read (and parse) until the proxy closes the connection; True if it did within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.closed and time.monotonic() < deadline:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                data = b""
            self._feed(data)
        return self.closed

    def close(self) -> None:
        self.sock.close()


def post(path: str, body: bytes, *, version: str = "1.1", headers: str = "") -> bytes:
    """The bytes of one POST request with a ``Content-Length`` body."""
    return (f"POST {path} HTTP/{version}\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{headers}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def get(path: str, *, version: str = "1.1", headers: str = "", method: str = "GET") -> bytes:
    """The bytes of one bodiless request."""
    return f"{method} {path} HTTP/{version}\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode()
