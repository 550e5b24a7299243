"""``max_request_head_bytes`` at its boundary: a head of exactly the limit is served, one byte more gets 431.

docs/limits.md: request line + header fields larger than ``max_request_head_bytes`` → 431 (and the connection
closes).  The server (pdproxy/http/server.py ``ServerProtocol.on_header``) counts the request target plus, for each
header field, its name, its value and 4 bytes (the ``": "`` and the line's CRLF); the method, the version and the
blank line that ends the head are not counted.  Both the target and a header value are padded here to land on the
limit exactly, then one byte past it; nothing refused reaches an engine."""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest

from tests.conftest import Fleet
from tests.relay.rawclient import RawConn
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(60)

LIMIT = 4096  # the proxy's max_request_head_bytes here


def counted(target: str, fields: list[tuple[str, str]]) -> int:
    """The head size the limit applies to (module docstring)."""
    return len(target) + sum(len(name) + len(value) + 4 for name, value in fields)


def request(target: str, fields: list[tuple[str, str]]) -> bytes:
    return (f"GET {target} HTTP/1.1\r\n" + "".join(f"{n}: {v}\r\n" for n, v in fields) + "\r\n").encode()


def head_of(size: int, where: str) -> bytes:
    """A ``GET /version`` whose counted head is ``size`` bytes, padded in the target or in a header value."""
    target, fields = "/version", [("Host", "127.0.0.1"), ("X-Pad", "")]
    pad = size - counted(target, fields)
    assert pad > 0
    if where == "target":
        target = "/version?p=" + "a" * (pad - len("?p="))
    else:
        fields[1] = ("X-Pad", "a" * pad)
    assert counted(target, fields) == size
    return request(target, fields)


def engine_requests(sims: Fleet) -> int:
    return sum(len(s.received()) for s in sims.all)


@pytest.fixture(scope="module")
def edge(fleet: Fleet) -> Iterator[ProxyThread]:
    p = ProxyThread(prefill=[s.url for s in fleet.prefillers], decode=[s.url for s in fleet.decoders],
                    max_request_head_bytes=LIMIT).start()
    try:
        yield p
        p.wait_idle()
    finally:
        p.stop()


@pytest.mark.parametrize("where", ["header", "target"])
def test_a_head_of_exactly_the_limit_is_served_and_keeps_its_connection(edge: ProxyThread, where: str) -> None:
    c = RawConn(edge.port)
    try:
        c.send(head_of(LIMIT, where))
        (m,) = c.read_messages(1)
        assert m.status == 200, m.body
        assert "version" in orjson.loads(m.body)
        assert m.header("connection") != "close"
        c.send(head_of(LIMIT, where))                     # the same connection serves the next one too
        assert [x.status for x in c.read_messages(2)] == [200, 200]
        assert not c.closed
    finally:
        c.close()


@pytest.mark.parametrize("where", ["header", "target"])
def test_a_head_one_byte_over_the_limit_gets_431_and_the_connection_closes(edge: ProxyThread, sims: Fleet,
                                                                          where: str) -> None:
    before = engine_requests(sims)
    c = RawConn(edge.port)
    try:
        c.send(head_of(LIMIT + 1, where))
        (m,) = c.read_messages(1)
        assert m.status == 431 and m.header("connection") == "close"
        error = orjson.loads(m.body)["error"]
        assert error["code"] == 431 and str(LIMIT) in error["message"]
        assert c.wait_closed()
    finally:
        c.close()
    assert engine_requests(sims) == before
