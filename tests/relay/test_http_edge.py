"""The client-facing HTTP edge, through raw sockets: versions, keep-alive, pipelining, limits (pdproxy/http/server.py)."""

from __future__ import annotations

import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from pdproxy.settings import Settings
from tests.conftest import Fleet
from tests.ops.promtext import Samples, scrape
from tests.relay.rawclient import RawConn, get, post
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(60)

STREAM = orjson.dumps({"model": "sim-model", "prompt": "hello edge", "max_tokens": 5, "stream": True})
JSON = orjson.dumps({"model": "sim-model", "prompt": "hello edge", "max_tokens": 3})


@pytest.fixture(scope="module")
def edge(fleet: Fleet) -> Iterator[ProxyThread]:
    p = ProxyThread(prefill=[s.url for s in fleet.prefillers], decode=[s.url for s in fleet.decoders],
                    max_request_head_bytes=4096, max_body_bytes=4096).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def proxy(edge: ProxyThread, sims: Fleet) -> Iterator[ProxyThread]:
    yield edge
    edge.wait_idle()


def sse_events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


def test_http11_keep_alive_serves_streams_and_json_on_one_connection(proxy: ProxyThread) -> None:
    c = RawConn(proxy.port)
    c.send(post("/v1/completions", STREAM))
    first = c.read_messages(1)[0]
    assert first.status == 200 and first.chunked and first.header("connection") is None
    assert sse_events(first.body)[-1] == b"data: [DONE]"
    c.send(post("/v1/completions", JSON))
    second = c.read_messages(2)[1]
    assert second.status == 200 and second.header("content-length") == str(len(second.body))
    assert orjson.loads(second.body)["choices"][0]["text"]
    assert not c.closed
    c.close()


def test_http10_without_keep_alive_gets_a_close_delimited_stream(proxy: ProxyThread) -> None:
    c = RawConn(proxy.port)
    c.send(post("/v1/completions", STREAM, version="1.0"))
    assert c.wait_closed()
    m = c.p.messages[0]
    assert m.status == 200 and not m.chunked and m.header("content-length") is None
    assert m.header("connection") == "close"
    assert sse_events(m.body)[-1] == b"data: [DONE]"  # the raw SSE bytes, no chunk framing
    assert c.raw.startswith(b"HTTP/1.1 200 ")


def test_http10_keep_alive_is_kept_for_sized_answers_and_closed_after_a_stream(proxy: ProxyThread) -> None:
    c = RawConn(proxy.port)
    c.send(post("/v1/completions", JSON, version="1.0", headers="Connection: keep-alive\r\n"))
    m = c.read_messages(1)[0]
    assert m.status == 200 and m.header("connection") == "keep-alive" and m.header("content-length")
    c.send(get("/health", version="1.0", headers="Connection: keep-alive\r\n"))
    h = c.read_messages(2)[1]
    assert h.status == 200 and h.header("connection") == "keep-alive"
    c.send(post("/v1/completions", STREAM, version="1.0", headers="Connection: keep-alive\r\n"))
    assert c.wait_closed()  # a 1.0 stream has no chunked framing: its end is the close
    s = c.p.messages[2]
    assert s.status == 200 and s.header("connection") == "close" and sse_events(s.body)[-1] == b"data: [DONE]"


def test_pipelined_requests_are_answered_in_order(proxy: ProxyThread, sims: Fleet) -> None:
    c = RawConn(proxy.port)
    c.send(post("/v1/completions", STREAM) + get("/health") + post("/v1/completions", JSON)
           + get("/v1/models") + post("/v1/completions", STREAM, headers="X-Request-Id: last\r\n"))
    ms = c.read_messages(5)
    assert [m.status for m in ms] == [200] * 5
    assert sse_events(ms[0].body)[-1] == b"data: [DONE]"
    assert ms[1].body == b""
    assert "choices" in orjson.loads(ms[2].body)
    assert orjson.loads(ms[3].body)["data"][0]["id"] == "sim-model"
    assert ms[4].header("x-request-id") == "last" and sse_events(ms[4].body)[-1] == b"data: [DONE]"
    assert not c.closed
    c.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_pipelines_then_leaves_has_its_running_request_cancelled(proxy: ProxyThread, sims: Fleet,
                                                                               stream: bool) -> None:
    """Reading is paused behind a pipelined request while the one before it runs, so the client's FIN is never
    read; the hang-up watch (pdproxy/http/server.py ``HANGUP_CHECK_S``) still notices it and the running request is
    cancelled, its leases given back, as when a client leaves without pipelining (the prefill leg hangs: only the
    client's leaving can end it)."""
    def gone() -> float:
        return scrape(proxy.url).value("pdproxy_requests_total", api="completions", status="0",
                                       outcome="client_disconnected") or 0.0

    before = gone()
    sims.prefillers[0].faults({"kind": "hang", "on_request": 1})
    c = RawConn(proxy.port)
    c.send(post("/v1/completions", STREAM if stream else JSON) + get("/v1/models"))

    def running() -> Samples | None:
        m = scrape(proxy.url)
        return m if m.total("pdproxy_inflight_requests", role="prefill") == 1 else None

    m = wait_until(running, 10, 0.05, "the prefill leg running")
    assert m.total("pdproxy_requests_in_progress") == 1
    c.close()
    proxy.wait_idle(10)                     # every lease given back, nothing in flight
    m = scrape(proxy.url)
    assert m.total("pdproxy_requests_in_progress") == 0 and gone() == before + 1
    assert m.total("pdproxy_inflight_requests") == 0 and m.total("pdproxy_inflight_tokens") == 0


def test_connection_close_request_is_answered_then_closed_and_later_bytes_ignored(proxy: ProxyThread,
                                                                                  sims: Fleet) -> None:
    before = sum(len(d.completions_received()) for d in sims.decoders)
    c = RawConn(proxy.port)
    c.send(post("/v1/completions", JSON, headers="Connection: close\r\n") + post("/v1/completions", JSON))
    assert c.wait_closed()
    assert [m.status for m in c.p.messages] == [200]
    assert c.p.messages[0].header("connection") == "close"
    assert sum(len(d.completions_received()) for d in sims.decoders) == before + 1  # the 2nd never ran


def test_idle_keep_alive_outlasts_the_clients_pool_expiry(proxy: ProxyThread) -> None:
    # httpx (the openai client's transport) drops idle pooled connections after keepalive_expiry (5 s) and
    # reuses them until then; a server that closes at the same moment loses the request sent on it.  The proxy
    # keeps idle connections open well past that, so the client always closes first.
    expiry = httpx.Limits().keepalive_expiry
    assert expiry is not None
    assert Settings().timeout_keep_alive_s >= 2 * expiry
    c = RawConn(proxy.port)
    c.send(get("/health"))
    c.read_messages(1)
    time.sleep(expiry + 0.5)  # the longest a pooled connection sits idle before httpx reuses it
    c.send(post("/v1/completions", JSON))
    assert c.read_messages(2)[1].status == 200
    c.close()


def test_idle_connection_is_closed_after_timeout_keep_alive(sims: Fleet) -> None:
    p = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                    timeout_keep_alive_s=0.3).start()
    try:
        c = RawConn(p.port)
        c.send(get("/health"))
        assert c.read_messages(1)[0].status == 200
        assert c.wait_closed(timeout_s=20)  # closed by the server, with nothing in flight
        assert len(c.p.messages) == 1
    finally:
        p.stop()


def test_oversized_request_head_gets_431_and_close(proxy: ProxyThread, sims: Fleet) -> None:
    c = RawConn(proxy.port)
    c.send(post("/v1/completions", JSON, headers="X-Big: " + "a" * 5000 + "\r\n"))
    assert c.wait_closed()
    m = c.p.messages[0]
    assert m.status == 431 and m.header("connection") == "close"
    assert "header" in orjson.loads(m.body)["error"]["message"]
    assert all(not d.completions_received() for d in sims.decoders)


def test_oversized_url_gets_414(proxy: ProxyThread) -> None:
    c = RawConn(proxy.port)
    c.send(get("/v1/models?" + "q" * 9000))
    assert c.wait_closed()
    assert c.p.messages[0].status == 414


def test_body_over_the_limit_is_refused_from_its_content_length_without_100_continue(proxy: ProxyThread) -> None:
    c = RawConn(proxy.port)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n")
    assert c.wait_closed()
    assert b"100 Continue" not in c.raw
    m = c.p.messages[0]
    assert m.status == 413 and orjson.loads(m.body)["error"]["code"] == 413


def test_expect_100_continue_gets_100_then_the_answer(proxy: ProxyThread) -> None:
    c = RawConn(proxy.port)
    c.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Type: application/json"
           b"\r\nContent-Length: " + str(len(JSON)).encode() + b"\r\n\r\n")
    c.read_raw_until(b"\r\n\r\n")  # the body is not sent until the proxy asks for it
    assert c.raw == b"HTTP/1.1 100 Continue\r\n\r\n"
    c.send(JSON)
    ms = c.read_messages(2)
    assert [m.status for m in ms] == [100, 200]
    c.close()


def test_malformed_request_gets_400_json(proxy: ProxyThread) -> None:
    c = RawConn(proxy.port)
    c.send(b"POST /v1/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n")
    assert c.wait_closed()
    m = c.p.messages[0]
    assert m.status == 400 and orjson.loads(m.body)["error"]["type"] == "BadRequestError"


def test_control_plane_405_404_and_head_through_the_same_server(proxy: ProxyThread) -> None:
    c = RawConn(proxy.port)
    c.send(get("/v1/completions") + get("/nope"))
    ms = c.read_messages(2)
    assert ms[0].status == 405 and ms[0].header("allow") == "POST"
    assert ms[1].status == 404 and orjson.loads(ms[1].body)["error"]["code"] == 404
    c.close()
    c = RawConn(proxy.port)
    c.sock.sendall(get("/nope", method="HEAD") + get("/version"))
    data = b""
    while data.count(b"HTTP/1.1 ") < 2 or not data.endswith(b"}"):
        data += c.sock.recv(65536)
    head, rest = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 404 ") and b"content-length: " in head.lower()
    assert rest.startswith(b"HTTP/1.1 200 ")  # a HEAD answer has no body: the next response follows the head
    c.close()


def test_completion_routes_and_control_plane_over_tls(sims: Fleet, tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    p = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                    ssl_context=ctx).start()
    try:
        client = openai.OpenAI(base_url=p.url + "/v1", api_key="x", max_retries=0, timeout=20,
                               http_client=httpx.Client(verify=str(cert)))
        chunks = list(client.completions.create(model="sim-model", prompt="tls", max_tokens=4, stream=True))
        assert chunks and chunks[-1].choices[0].finish_reason == "length"
        assert httpx.get(p.url + "/v1/models", verify=str(cert)).json()["data"][0]["id"] == "sim-model"
        p.wait_idle()
    finally:
        p.stop()


@pytest.mark.parametrize(("request_head", "status", "anthropic"), [
    (b"POST /v1/messages/count_tokens HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n", 400, True),
    (b"GET /v1/messages HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n", 431, True),
    (b"GET /v1/messages/count_tokens HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400, True),
    (b"PUT /v1/messages/ HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400, True),
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n", 431, False),
    (b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n", 400, False),
])
def test_the_servers_own_refusal_on_an_anthropic_route_is_in_anthropics_shape(proxy: ProxyThread,
                                                                              request_head: bytes, status: int,
                                                                              anthropic: bool) -> None:
    """A request to ``/v1/messages`` or ``/v1/messages/count_tokens`` refused by the HTTP server before any handler
    (a malformed head, a head over ``max_request_head_bytes``, two Host fields), whatever its method, is answered in
    Anthropic's envelope, as those routes answer their own errors (old code: only a POST to ``/v1/messages``;
    count_tokens and the other methods got vLLM's OpenAI envelope).  Other routes keep vLLM's envelope."""
    c = RawConn(proxy.port)
    c.send(request_head)
    assert c.wait_closed()
    m = c.p.messages[0]
    body = orjson.loads(m.body)
    assert m.status == status and m.header("connection") == "close"
    if anthropic:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    else:
        assert body["error"]["code"] == status
