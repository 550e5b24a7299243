"""HTTP/1 strictness at the client edge (RFC 9112), through raw sockets on loopback (pdproxy/http/server.py):
trailer fields never become headers, HTTP/1.0 framed by Transfer-Encoding closes after its answer, a request
line without a version, another version, a missing or doubled Host and a target that is not a path are refused
and closed, and an over-long X-Request-Id is cut in answers, logs and engine ids alike."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from pdproxy.timeline import CLIENT_REQUEST_ID_MAX
from tests.conftest import Fleet
from tests.ops.promtext import scrape
from tests.relay.rawclient import RawConn, get, post
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(60)

JSON = orjson.dumps({"model": "sim-model", "prompt": "hello edge", "max_tokens": 3})


def chunked(path: str, body: bytes, trailers: bytes, *, version: str = "1.1", headers: bytes = b"") -> bytes:
    return (b"POST %s HTTP/%s\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n%s"
            b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n%s\r\n"
            % (path.encode(), version.encode(), headers, len(body), body, trailers))


@pytest.fixture
def keyed(sims: Fleet, tmp_path: Path) -> Iterator[ProxyThread]:
    p = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                    api_keys=["sk-client"], request_log_path=str(tmp_path / "requests.jsonl")).start()
    try:
        yield p
        p.wait_idle()
    finally:
        p.stop()


def decoder_headers(sims: Fleet) -> list[dict[str, str]]:
    return [r["headers"] for d in sims.decoders for r in d.completions_received()]


def test_a_key_sent_only_in_a_trailer_is_not_accepted(keyed: ProxyThread, sims: Fleet) -> None:
    c = RawConn(keyed.port)
    c.send(chunked("/v1/completions", JSON, b"Authorization: Bearer sk-client\r\n"))
    m = c.read_messages(1)[0]
    assert m.status == 401
    assert not decoder_headers(sims)
    c.close()


def test_a_generation_request_without_a_key_is_refused_at_its_head_before_its_body_is_read(
        sims: Fleet, tmp_path: Path) -> None:
    """A keyless client cannot make the server read, hold or ask for a body (the shared pending-body budget): the
    401 comes once the head is read — no ``100 Continue`` — in the route's error shape, and the connection closes;
    keyless partial bodies that together exceed ``max_pending_body_bytes`` leave a keyed request's body served."""
    p = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                    api_keys=["sk-client"], max_body_bytes=100_000, max_pending_body_bytes=200_000,
                    request_log_path=str(tmp_path / "requests.jsonl")).start()
    try:
        c = RawConn(p.port)
        c.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Expect: 100-continue\r\nContent-Length: 90000\r\n\r\n")
        (m,) = c.read_messages(1)
        assert m.status == 401 and b"100 Continue" not in c.raw and c.wait_closed()
        assert orjson.loads(m.body)["error"] == {"message": "invalid or missing API key", "type": "AuthenticationError",
                                                 "param": None, "code": 401}
        anthropic = RawConn(p.port)
        anthropic.send(post("/v1/messages", b"{", headers="x-api-key: wrong\r\n"))
        (m,) = anthropic.read_messages(1)
        assert m.status == 401 and orjson.loads(m.body) == {
            "type": "error", "error": {"type": "AuthenticationError", "message": "invalid or missing API key"}}
        held = []
        for _ in range(5):                          # 5 × 45,000 bytes of keyless bodies: over the 200,000 budget
            h = RawConn(p.port)
            h.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 90000\r\n\r\n" + b" " * 45_000)
            assert h.read_messages(1)[0].status == 401 and h.wait_closed()
            held.append(h)
        body = JSON + b" " * 30_000                 # 30 KB: over what the keyless bodies would have left
        keyed = RawConn(p.port)
        keyed.send(post("/v1/completions", body, headers="Authorization: Bearer sk-client\r\n"))
        assert keyed.read_messages(1)[0].status == 200
        big = RawConn(p.port)                       # keyed, but declared over max_body_bytes: the server's 413
        big.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-client\r\n"
                 b"X-Request-Id: big-1\r\nContent-Type: application/json\r\nContent-Length: 100001\r\n\r\n")
        (m,) = big.read_messages(1)
        assert m.status == 413 and m.header("x-request-id") == "big-1"    # as the application's answers carry it
        for h in [c, anthropic, *held, keyed, big]:
            h.close()
        p.wait_idle()
        m = scrape(p.url)                 # refused by the server, counted as the application counts its own
        assert m.value("pdproxy_requests_total", api="completions", status="413", outcome="payload_too_large") == 1
        assert m.value("pdproxy_rejections_total", reason="too_large", detail="body") == 1
        assert m.value("pdproxy_requests_total", api="chat", status="401", outcome="unauthorized") == 1
        assert m.value("pdproxy_requests_total", api="messages", status="401", outcome="unauthorized") == 1
        assert m.value("pdproxy_requests_total", api="completions", status="401", outcome="unauthorized") == 5
        assert m.value("pdproxy_rejections_total", reason="unauthorized", detail="") == 7
        assert m.total("pdproxy_requests_in_progress") == 0
        assert m.total("pdproxy_time_to_first_token_seconds_count") == 1      # the keyed request alone
        log = [orjson.loads(x) for x in (tmp_path / "requests.jsonl").read_bytes().splitlines()]
        (line,) = [x for x in log if x.get("status") == 413]
        assert line["client_request_id"] == "big-1" and line["request_id"].startswith("big-1-")
        keyless = [x for x in log if x.get("status") == 401]
        assert len(keyless) == 7 and all(x["client_request_id"] is None and x["request_id"] for x in keyless)
        assert c.raw.count(b"x-request-id: ") == 1          # a keyless answer names the id it was logged under
    finally:
        p.stop()


def test_trailer_fields_never_reach_an_engine_or_the_answer(keyed: ProxyThread, sims: Fleet) -> None:
    c = RawConn(keyed.port)
    c.send(chunked("/v1/completions", JSON, b"X-Request-Id: from-trailer\r\nX-Api-Key: other\r\n",
                   headers=b"Authorization: Bearer sk-client\r\n"))
    m = c.read_messages(1)[0]
    assert m.status == 200 and "trailer" not in (m.header("x-request-id") or "")
    (engine,) = decoder_headers(sims)
    assert "trailer" not in engine["x-request-id"] and "x-api-key" not in engine
    assert not c.closed  # the trailer section was read: the connection goes on
    c.send(get("/health"))
    assert c.read_messages(2)[1].status == 200
    c.close()


def test_http10_framed_by_transfer_encoding_is_answered_then_closed(keyed: ProxyThread) -> None:
    c = RawConn(keyed.port)
    c.send(chunked("/v1/completions", JSON, b"", version="1.0",
                   headers=b"Connection: keep-alive\r\nAuthorization: Bearer sk-client\r\n") + get("/health"))
    assert c.wait_closed()
    assert [m.status for m in c.p.messages] == [200]  # the pipelined second request is never read


@pytest.mark.parametrize(("raw", "status"), [
    (b"GET /v1/models\r\n\r\n", 400),                                                  # no version (HTTP/0.9)
    (b"GET /v1/models HTTP/2.0\r\nHost: x\r\n\r\n", 505),                              # HTTP/2 on the h1 port
    (b"GET /v1/models HTTP/1.1\r\n\r\n", 400),                                         # HTTP/1.1 without Host
    (b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),                  # two Host fields
    (b"GET /v1/models HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    (b"GET http://169.254.169.254/v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 400),       # absolute-form
    (b"GET * HTTP/1.1\r\nHost: x\r\n\r\n", 400),                                      # asterisk-form, not OPTIONS
], ids=["no-version", "http2", "no-host", "two-hosts", "two-hosts-1.0", "absolute-form", "asterisk"])
def test_malformed_request_lines_and_hosts_get_refused_and_closed(keyed: ProxyThread, raw: bytes,
                                                                   status: int) -> None:
    c = RawConn(keyed.port)
    c.send(raw + get("/health"))
    assert c.wait_closed()
    assert c.raw.startswith(b"HTTP/1.1 %d " % status), c.raw[:200]
    assert len(c.p.messages) == 1 and c.p.messages[0].header("connection") == "close"
    body = c.raw.split(b"\r\n\r\n", 1)[1]
    assert orjson.loads(body)["error"]["code"] == status


def test_http10_without_host_is_still_served(keyed: ProxyThread) -> None:
    c = RawConn(keyed.port)
    c.send(b"GET /health HTTP/1.0\r\n\r\n")
    assert c.wait_closed()
    assert c.p.messages[0].status == 200


def test_a_long_x_request_id_is_cut_in_the_answer_the_log_and_the_engine_id(keyed: ProxyThread, sims: Fleet,
                                                                            tmp_path: Path) -> None:
    rid = "r" * 10_000
    c = RawConn(keyed.port)
    c.send(post("/v1/completions", JSON, headers=f"Authorization: Bearer sk-client\r\nX-Request-Id: {rid}\r\n"))
    m = c.read_messages(1)[0]
    assert m.status == 200 and m.header("x-request-id") == rid[:CLIENT_REQUEST_ID_MAX]
    c.close()
    keyed.wait_idle()
    (engine,) = decoder_headers(sims)
    assert engine["x-request-id"].startswith(rid[:CLIENT_REQUEST_ID_MAX] + "-")
    (line,) = [orjson.loads(x) for x in (tmp_path / "requests.jsonl").read_bytes().splitlines()]
    assert line["client_request_id"] == rid[:CLIENT_REQUEST_ID_MAX]


@pytest.mark.parametrize("codings", [b"Transfer-Encoding: gzip, chunked\r\n",
                                     b"Transfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n",
                                     b"Transfer-Encoding: x-custom ,chunked\r\n"],
                         ids=["gzip-chunked", "two-fields", "unknown"])
def test_a_transfer_coding_other_than_chunked_is_a_501_and_reaches_no_engine(keyed: ProxyThread, sims: Fleet,
                                                                          codings: bytes) -> None:
    """RFC 9112 §6.1: a coding the server does not understand is a 501 (it read a gzip-coded body as plain)."""
    c = RawConn(keyed.port)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-client\r\n"
           b"Content-Type: application/json\r\n%b\r\n%x\r\n%b\r\n0\r\n\r\n" % (codings, len(JSON), JSON))
    assert c.wait_closed()
    assert c.raw.startswith(b"HTTP/1.1 501 "), c.raw[:200]
    assert orjson.loads(c.raw.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 501
    assert not decoder_headers(sims)


def test_chunked_in_any_case_is_still_read(keyed: ProxyThread, sims: Fleet) -> None:
    c = RawConn(keyed.port)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-client\r\n"
           b"Content-Type: application/json\r\nTransfer-Encoding: Chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n"
           % (len(JSON), JSON))
    assert c.read_messages(1)[0].status == 200
    c.close()
