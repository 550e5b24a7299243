"""A fuzzer for pdproxy's own HTTP/1 server (pdproxy/http/server.py) through a real socket on loopback.

Hypothesis builds request heads (methods, targets, versions, header fields: Host, lengths, Transfer-Encoding,
Connection, Expect, X-Request-Id, obs-fold, bare LF …), framings (sized, chunked with extensions and trailers,
both, none, a wrong length) and JSON bodies (valid requests with a marker prompt, nested values, broken JSON),
then byte-level mutations and a random split into writes.  Most inputs end with a ``Connection: close`` request,
so a server that parsed everything closes; the others end in silence (one in six, and every head line that never
ends), so the proxy must close by its own timeouts (0.25 s head and body, 0.3 s keep-alive here).  For every
input:

- the proxy closes the connection within a bound (it answered what it could, or refused, or timed out);
- what it sent back parses as HTTP/1.1 responses, and its own refusals carry the OpenAI error shape;
- nothing was logged at ERROR by pdproxy, uvicorn or asyncio (no exception escaped);
- every prompt an engine received appears in the bytes this client sent (no request the client did not send,
  no smuggled one, no trailer field turned into a request), and no engine saw the trailer marker header;
- the proxy holds no connection afterwards; over the run its memory stays bounded.

``PDPROXY_FUZZ_EXAMPLES`` sets the number of inputs (default 200 here; ``make fuzz`` runs 20,000).
"""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httptools
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Fleet
from tests.support import ProxyThread, wait_until

EXAMPLES = int(os.environ.get("PDPROXY_FUZZ_EXAMPLES", "200"))
pytestmark = pytest.mark.timeout(max(120, EXAMPLES))

CLOSE_BOUND_S = 20.0  # the proxy's timeouts are 0.25-0.3 s here; the rest is a busy machine's slack
RSS_GROWTH_BOUND = 256 * 1024 * 1024
TRAILER_MARK = "x-fz-trailer"
CHUNK_LINE = re.compile(rb"\r\n[0-9a-fA-F]+(?:;[^\r\n]*)?\r\n")
SENTINEL = b"GET /health HTTP/1.1\r\nHost: fz\r\nConnection: close\r\n\r\n"
ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/models", "/health",
          "/tokenize", "/inference/v1/generate", "/v1/embeddings", "/metrics", "/nope", "/v1/completions/",
          "/v1/completions?x=1", "/%2e%2e/v1/models", "*", "http://169.254.169.254/v1/completions",
          "/v1/completions#frag", "/\x00", "//v1/completions"]


class ErrorLog(logging.Handler):
    """Records at ERROR and above from the server's loggers."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.split(".")[0] in ("pdproxy", "uvicorn", "asyncio"):
            self.records.append(record)


@dataclass
class Replies:
    """What came back on one connection: parsed responses (status, headers, body) and whether it parsed."""

    raw: bytes = b""
    messages: list[tuple[int, dict[str, str], bytes]] = field(default_factory=list)
    error: str | None = None
    _headers: dict[str, str] = field(default_factory=dict)
    _body: bytes = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.messages.append((self.parser.get_status_code(), self._headers, self._body))
        self._headers, self._body = {}, b""

    def feed(self, data: bytes) -> None:
        self.raw += data
        if self.error is None:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                pass
            except httptools.HttpParserError as exc:
                self.error = repr(exc)

    def __post_init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)


# --- the inputs ----------------------------------------------------------------------------------------------
markers = st.integers(0, 10**9).map(lambda n: f"fz-{n}")


@st.composite
def json_bodies(draw: st.DrawFn) -> tuple[bytes, str | None]:
    """A body and the prompt marker it carries (None when it carries none)."""
    kind = draw(st.sampled_from(["completion", "chat", "nested", "broken", "values", "empty"]))
    mark = draw(markers)
    if kind == "completion":
        body = {"model": draw(st.sampled_from(["sim-model", "other", ""])), "prompt": mark,
                "max_tokens": draw(st.integers(-1, 4)), "stream": draw(st.booleans())}
        extra = draw(st.dictionaries(st.sampled_from(["n", "kv_transfer_params", "stream_options", "echo",
                                                      "logprobs", "temperature"]),
                                     st.one_of(st.none(), st.integers(-2, 3), st.text(max_size=5),
                                               st.booleans()), max_size=2))
        return orjson.dumps({**body, **extra}), mark
    if kind == "chat":
        content = draw(st.one_of(st.just(mark), st.lists(st.just({"type": "text", "text": mark}), max_size=2)))
        body = {"model": "sim-model", "messages": [{"role": draw(st.sampled_from(["user", "system", "x"])),
                                                    "content": content}],
                "max_tokens": draw(st.integers(0, 4)), "stream": draw(st.booleans())}
        return orjson.dumps(body), mark
    if kind == "nested":
        depth = draw(st.integers(1, 1500))      # past max_json_depth (200) and the 1,100 that hung pdproxy
        return b'{"model": "sim-model", "prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}", None
    if kind == "broken":
        text = draw(st.sampled_from([b'{"model": "sim-model", "prompt": "', b"{", b"[]", b"null", b'"x"',
                                     b'{"prompt": "\xff\xfe"}', b'{"a": 1e999999}', b'{"model": NaN}']))
        return text, None
    if kind == "values":
        value = draw(st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8)),
                                  lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5),
                                                                                             kids, max_size=3),
                                  max_leaves=10))
        return json.dumps(value).encode(), None  # not orjson: integers beyond 64 bits are fair input too
    return b"", None


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, list[str]]:
    """One request's bytes and the prompt markers it carries."""
    body, mark = draw(json_bodies())
    method = draw(st.sampled_from(["POST"] * 6 + ["GET", "HEAD", "PUT", "OPTIONS", "DELETE", "PRI", "CONNECT",
                                                  "G\x00T", "post"]))
    target = draw(st.sampled_from(ROUTES))
    version = draw(st.sampled_from(["HTTP/1.1"] * 8 + ["HTTP/1.0", "HTTP/2.0", "", "HTTP/1.2", "http/1.1"]))
    line = f"{method} {target} {version}".rstrip() if version else f"{method} {target}"
    headers: list[str] = []
    hosts = draw(st.sampled_from([1] * 6 + [0, 2]))
    headers += ["Host: 127.0.0.1"] * hosts
    headers.append(draw(st.sampled_from(["Content-Type: application/json"] * 4 + [
        "Content-Type: multipart/form-data; boundary=b", "Content-Type: text/plain", ""])))
    for extra in draw(st.lists(st.sampled_from([
            "Connection: close", "Connection: keep-alive", "Connection: upgrade\r\nUpgrade: websocket",
            "Expect: 100-continue", "X-Request-Id: fz", "X-Request-Id: " + "r" * 300, "Authorization: Bearer x",
            "X-Obs: a\r\n b", "X-Bare: a\nX-Next: b", "X-Long: " + "l" * 3000, "Accept: text/event-stream",
            "Transfer-Encoding: identity", "Content-Length: 0", "X-Nul: a\x00b", ": empty-name",
            "X Space: v", "Cookie: a=b"]), max_size=3)):
        headers.append(extra)
    framing = draw(st.sampled_from(["length"] * 5 + ["chunked"] * 3 + ["none", "both", "short", "long", "twice",
                                                                       "te-list", "negative"]))
    chunks = b""
    if framing in ("chunked", "both", "te-list"):
        headers.append("Transfer-Encoding: " + ("gzip, chunked" if framing == "te-list" else "chunked"))
        if framing == "both":
            headers.append(f"Content-Length: {len(body)}")
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3)))
        pieces = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        ext = draw(st.sampled_from(["", ";a=b", ";" + "e" * 200]))
        chunks = b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext.encode(), p) for p in pieces if p)
        trailer = draw(st.sampled_from([b"", f"{TRAILER_MARK}: 1\r\n".encode(), b"X-Request-Id: trailer\r\n",
                                        b"Content-Length: 5\r\n"]))
        chunks += b"0\r\n" + trailer + b"\r\n"
    elif framing == "length":
        headers.append(f"Content-Length: {len(body)}")
    elif framing == "short":
        headers.append(f"Content-Length: {max(0, len(body) - 3)}")
    elif framing == "long":
        headers.append(f"Content-Length: {len(body) + draw(st.integers(1, 100))}")
    elif framing == "twice":
        headers += [f"Content-Length: {len(body)}", f"Content-Length: {len(body) + 1}"]
    elif framing == "negative":
        headers.append("Content-Length: -1")
    head = (line + "\r\n" + "".join(h + "\r\n" for h in headers if h) + "\r\n").encode("utf-8", "surrogatepass")
    payload = chunks if chunks else (body if framing != "none" else b"")
    return head + payload, [mark] if mark else []


@st.composite
def inputs(draw: st.DrawFn) -> tuple[list[bytes], list[str]]:
    """Several requests, byte-mutated, split into writes, then (usually) the closing sentinel or else silence;
    and the markers they carry."""
    reqs = draw(st.lists(requests(), min_size=1, max_size=3))
    data = b"".join(r for r, _ in reqs)
    marks = [m for _, ms in reqs for m in ms]
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2, 4]))):
        at = draw(st.integers(0, max(0, len(data) - 1)))
        op = draw(st.sampled_from(["flip", "insert", "delete", "crlf", "dup"]))
        if op == "flip":
            data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1:]
        elif op == "insert":
            data = data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
        elif op == "delete":
            data = data[:at] + data[at + draw(st.integers(1, 8)):]
        elif op == "crlf":
            data = data[:at] + b"\r\n" + data[at:]
        else:
            data = data[:at] + data[at:at + 64] + data[at:]
    silence = draw(st.integers(0, 5)) == 0  # the client stops: the proxy must close by itself (its timeouts)
    if silence:  # anywhere: in a head, in a body, between requests
        data = data[:draw(st.integers(0, len(data)))]
    if draw(st.integers(0, 20)) == 0:  # now and then a head line that never ends, then silence
        data += (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Endless: "
                 + b"e" * draw(st.sampled_from([10, 5000, 100_000, 2_000_000])))
        silence = True
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=4)))
    writes = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    return [w for w in writes if w] + ([] if silence else [SENTINEL]), marks


# --- the rig -------------------------------------------------------------------------------------------------
@dataclass
class Rig:
    proxy: ProxyThread
    fleet: Fleet
    errors: ErrorLog
    rss_at_start: int  # the process's peak RSS before the first input (bytes)


@pytest.fixture(scope="module")
def rig(fleet: Fleet) -> Iterator[Rig]:
    errors = ErrorLog()
    logging.getLogger().addHandler(errors)
    p = ProxyThread(prefill=[s.url for s in fleet.prefillers], decode=[s.url for s in fleet.decoders],
                    max_request_head_bytes=16 * 1024, max_body_bytes=64 * 1024, request_headers_timeout_s=0.25,
                    request_body_timeout_s=0.25, timeout_keep_alive_s=0.3, request_log=False,
                    retry_backoff_s=0).start()
    try:
        yield Rig(p, fleet, errors, peak_rss())
    finally:
        p.stop()
        logging.getLogger().removeHandler(errors)


def exchange(port: int, writes: list[bytes]) -> tuple[Replies, float]:
    """Send ``writes``; read until the proxy closes.  Returns the replies and how long
    the close took (``inf`` if it did not come within :data:`CLOSE_BOUND_S`)."""
    replies = Replies()
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=CLOSE_BOUND_S) as s:
        try:
            for w in writes:
                s.sendall(w)
        except (BrokenPipeError, ConnectionResetError):
            pass
        deadline = start + CLOSE_BOUND_S
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return replies, float("inf")
            s.settimeout(left)
            try:
                data = s.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                data = b""
            except TimeoutError:
                continue
            if not data:
                return replies, time.monotonic() - start
            replies.feed(data)


def engine_prompts(fleet: Fleet) -> list[tuple[str, dict[str, str]]]:
    """(prompt text, headers) of every generation request the engines recorded since the last reset."""
    out = []
    for sim in fleet.all:
        for r in sim.received():
            body = r.get("body")
            if not isinstance(body, dict):
                continue
            texts = []
            if isinstance(body.get("prompt"), str):
                texts.append(body["prompt"])
            for m in body.get("messages") or []:
                content = m.get("content") if isinstance(m, dict) else None
                if isinstance(content, str):
                    texts.append(content)
                elif isinstance(content, list):
                    texts += [p.get("text") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)]
            out += [(t, r["headers"]) for t in texts]
    return out


def peak_rss() -> int:
    """This process's (the proxy's and the fuzzer's) peak RSS in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=inputs())
def test_every_input_gets_an_answer_or_a_close_and_engines_see_only_what_was_sent(
        rig: Rig, case: tuple[list[bytes], list[str]]) -> None:
    proxy, fleet, errors = rig.proxy, rig.fleet, rig.errors
    writes, marks = case
    sent = b"".join(writes)
    unchunked = CHUNK_LINE.sub(b"", sent)  # a prompt split across chunks, joined again
    fleet.reset()
    before = len(errors.records)
    replies, took = exchange(proxy.port, writes)
    assert took <= CLOSE_BOUND_S, f"no close within {CLOSE_BOUND_S} s; got {replies.raw[:500]!r}"
    if b"HEAD" not in sent.upper():  # a HEAD answer's length describes no body: the reader cannot frame it
        assert replies.error is None, f"the proxy's answer does not parse: {replies.error}: {replies.raw[:500]!r}"
    for status, headers, body in replies.messages:
        assert 100 <= status < 600
        if status in (400, 408, 413, 414, 431, 503, 505) and headers.get("content-type") == "application/json":
            err = orjson.loads(body)
            assert "error" in err or err.get("type") == "error", body
    wait_until(lambda: len(proxy.server.server_state.connections) == 0, 10, 0.01, "connection released")
    new = errors.records[before:]
    assert not new, [f"{r.name}: {r.getMessage()}" for r in new]
    for text, headers in engine_prompts(fleet):
        quoted = orjson.dumps(text)[1:-1]
        assert text in marks or quoted in sent or quoted in unchunked, f"engine got a prompt never sent: {text!r}"
        assert TRAILER_MARK not in headers
    assert peak_rss() - rig.rss_at_start < RSS_GROWTH_BOUND


def test_the_fuzz_proxy_ends_idle(rig: Rig) -> None:
    """After every input: no request in flight, per-endpoint load back to zero, no error logged."""
    rig.proxy.wait_idle(timeout_s=15)
    assert not rig.errors.records, [f"{r.name}: {r.getMessage()}" for r in rig.errors.records]
