"""The passthrough routes on an open port: a multipart body that made the old ``model`` regex run for minutes is
parsed in one pass while other clients are served, and no passthrough body hands an engine a client's
``kv_transfer_params`` / ``ec_transfer_params`` (the recording engine below sees exactly what pdproxy sent)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.ops.promtext import scrape
from tests.relay.rawclient import RawConn, post
from tests.stand_in import MODEL, StandInEngine, StandInHandler
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(60)

HOSTILE = {"remote_host": "169.254.169.254", "remote_port": 7777, "remote_engine_id": "x", "remote_block_ids": [1],
           "do_remote_prefill": True}


class RecordingEngine(StandInEngine):
    """The stand-in (tests/stand_in.py) recording every POST (``path``, raw ``body``) and answering ``{"ok": true}``
    — a POST to ``hold_path`` only once :attr:`release` is set."""

    def __init__(self, hold_path: str | None = None) -> None:
        super().__init__(MODEL)
        self.hold_path = hold_path
        self.received: list[tuple[str, bytes]] = []
        self.headers: list[dict[str, str]] = []
        """Per POST, its headers (lower-case names; values as latin-1 text)."""

    def post(self, handler: StandInHandler, body: bytes) -> None:
        self.received.append((handler.path, body))
        self.headers.append({k.lower(): v for k, v in handler.headers.items()})
        if handler.path == self.hold_path:
            self.release.wait(30)
        handler.answer(200, b'{"ok": true}')

    def bodies(self, path: str) -> list[bytes]:
        return [b for p, b in self.received if p == path]


HELD = "/v1/audio/translations"
"""The route whose answers the engine holds until released (the attack's, in the first test)."""


@pytest.fixture(scope="module")
def rig() -> Iterator[tuple[RecordingEngine, ProxyThread]]:
    """One recording engine (both roles) and pdproxy in front of it, for the module."""
    engine = RecordingEngine(hold_path=HELD)
    with engine.running():
        proxy = ProxyThread(prefill=[engine.url], decode=[engine.url], prefix_routing="off").start()
        try:
            yield engine, proxy
        finally:
            proxy.stop()


@pytest.fixture
def engine(rig: tuple[RecordingEngine, ProxyThread]) -> RecordingEngine:
    rig[0].received.clear()
    rig[0].headers.clear()
    return rig[0]


@pytest.fixture
def proxy(rig: tuple[RecordingEngine, ProxyThread]) -> Iterator[ProxyThread]:
    yield rig[1]
    rig[1].wait_idle()


def redos_form(size: int) -> tuple[bytes, str]:
    """A valid multipart form (one file part, no ``model`` field) whose data is ``name="model"`` lines with no
    blank line after them: the old ``model`` regex tried every line as a start and ran to the end from each
    (60 KB: ~8 s of event loop; ``size`` 250 KB: minutes)."""
    line = b'name="model"\r\n'
    data = line * (size // len(line)) + b'name="model"'
    body = (b'--bnd\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n--bnd--\r\n")
    return body, "multipart/form-data; boundary=bnd"


def test_a_pathological_multipart_body_never_holds_other_clients(engine: RecordingEngine,
                                                                  proxy: ProxyThread) -> None:
    """While the attack request is in flight (parsed, handed to the engine, its answer held there), a small client
    is answered; then the attack gets its answer too, its body relayed byte for byte."""
    attack, ctype = redos_form(250_000)
    result: dict[str, httpx.Response] = {}

    def send_attack() -> None:
        result["attack"] = httpx.post(proxy.url + HELD, content=attack, headers={"content-type": ctype}, timeout=60)

    sender = threading.Thread(target=send_attack, daemon=True)
    sender.start()
    try:
        wait_until(lambda: engine.bodies(HELD), 30, what="the attack body reached the engine")
        small = httpx.post(proxy.url + "/tokenize", json={"model": MODEL, "prompt": "hello"}, timeout=30)
        assert small.status_code == 200 and "attack" not in result      # answered while the attack is in flight
    finally:
        engine.release.set()
        sender.join(30)
    assert result["attack"].status_code == 200
    assert engine.bodies(HELD) == [attack]


@pytest.mark.parametrize("path", ["/inference/v1/generate", "/v1/completions/render", "/pooling", "/tokenize",
                                  "/v1/embeddings"])
def test_passthrough_json_bodies_reach_the_engine_without_proxy_owned_fields(engine: RecordingEngine,
                                                                            proxy: ProxyThread, path: str) -> None:
    """A client's ``kv_transfer_params`` / ``ec_transfer_params`` are cut out, every other byte kept."""
    sent = (b'{"model": "sim-model", "kv_transfer_params": ' + orjson.dumps(HOSTILE) +
            b', "token_ids": [1, 2, 3],\n "ec_transfer_params": {"remote_host": "10.9.9.9"}, "x": 1.50}')
    r = httpx.post(proxy.url + path, content=sent, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text
    assert engine.bodies(path) == [b'{"model": "sim-model", "token_ids": [1, 2, 3],\n "x": 1.50}']


@pytest.mark.parametrize(("body", "param"), [
    ({"model": MODEL, "token_ids": [1], "sampling_params": {"extra_args": {"kv_transfer_params": HOSTILE}}},
     "sampling_params"),
    ({"model": MODEL, "prompt": "hi", "vllm_xargs": {"kv_transfer_params": "x"}}, "vllm_xargs"),
])
def test_proxy_owned_fields_nested_in_extra_args_are_refused(engine: RecordingEngine, proxy: ProxyThread,
                                                             body: dict[str, Any], param: str) -> None:
    r = httpx.post(proxy.url + "/inference/v1/generate", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not engine.received


def test_multipart_forms_naming_a_proxy_owned_field_are_refused(engine: RecordingEngine, proxy: ProxyThread) -> None:
    """Small forms and uploads (the latter parsed off the event loop) alike."""
    r = httpx.post(proxy.url + "/v1/audio/transcriptions", data={"model": MODEL, "kv_transfer_params": "{}"},
                   files={"file": ("a.wav", b"RIFF")}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
    ok = httpx.post(proxy.url + "/v1/audio/transcriptions", data={"model": MODEL, "language": "en"},
                    files={"file": ("a.wav", b"RIFF")}, timeout=30)
    assert ok.status_code == 200
    upload = httpx.Request("POST", proxy.url + "/v1/audio/transcriptions", data={"model": MODEL},
                           files={"file": ("b.wav", b"RIFF" + b"\x00" * 3_000_000)})
    refused = httpx.Request("POST", proxy.url + "/v1/audio/transcriptions",
                            data={"model": MODEL, "ec_transfer_params": "{}"},
                            files={"file": ("b.wav", b"\x00" * 3_000_000)})
    with httpx.Client(timeout=30) as client:
        assert client.send(upload).status_code == 200
        assert client.send(refused).status_code == 400
    assert [p for p, _ in engine.received] == ["/v1/audio/transcriptions"] * 2
    assert engine.received[1][1] == upload.read()


@pytest.mark.parametrize("xargs", [
    b'{"kv_transfer_params": "x"}',                             # vLLM: str.get() in the connector's scheduler
    b'{"ec_transfer_params": ["remote_host", "10.0.0.9"]}',
    b'{"k\\u0076_transfer_params": 1}',                         # the name escaped
    b'{"kv_transfer_params": NaN}',                             # Python's json reads it, pdproxy's parser does not
], ids=["kv", "ec", "escaped", "nan"])
def test_a_form_vllm_xargs_setting_a_proxy_owned_field_is_refused(engine: RecordingEngine, proxy: ProxyThread,
                                                                   xargs: bytes) -> None:
    """vLLM's speech-to-text routes parse a form's ``vllm_xargs`` (a JSON string) into ``SamplingParams.extra_args``,
    where the engine reads the request's ``kv_transfer_params`` from (``vllm/v1/request.py``): a form setting it
    there reached the engine (only the form's field names were checked)."""
    form = (b"--bnd\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n" + MODEL.encode() + b"\r\n"
            b"--bnd\r\nContent-Disposition: form-data; name=\"vllm_xargs\"\r\n\r\n" + xargs + b"\r\n"
            b"--bnd\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--bnd--\r\n")
    r = httpx.post(proxy.url + "/v1/audio/transcriptions", content=form,
                   headers={"content-type": "multipart/form-data; boundary=bnd"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs", r.text
    assert not engine.received
    ok = httpx.post(proxy.url + "/v1/audio/transcriptions", content=form.replace(xargs, b'{"session_id": "s1"}'),
                    headers={"content-type": "multipart/form-data; boundary=bnd"}, timeout=10)
    assert ok.status_code == 200, ok.text


def test_client_header_values_reach_an_engine_as_visible_ascii_only(engine: RecordingEngine,
                                                                   proxy: ProxyThread) -> None:
    """A non-ASCII ``X-Request-Id``, ``traceparent`` or ``tracestate`` made the passthrough's HTTP client raise
    (a 500 in text/plain and a traceback per request); now the id keeps its ASCII letters and digits, a trace
    header that is not visible ASCII (or a ``traceparent`` not in W3C's form) is dropped, a valid one passes."""
    hostile = [("x-request-id", b"\xffab\xc3\xa9"), ("traceparent", b"00-\xe9-01"), ("tracestate", b"k=\xff")]
    r = httpx.post(proxy.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=hostile, timeout=10)
    assert r.status_code == 200, r.text
    sent = engine.headers[-1]
    assert sent["x-request-id"].startswith("ab-") and sent["x-request-id"].isascii()
    assert "traceparent" not in sent and "tracestate" not in sent
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    r = httpx.post(proxy.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}, timeout=10,
                   headers={"traceparent": parent, "tracestate": "k=v"})
    assert r.status_code == 200, r.text
    assert (engine.headers[-1]["traceparent"], engine.headers[-1]["tracestate"]) == (parent, "k=v")
    bad = httpx.post(proxy.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}, timeout=10,
                     headers={"traceparent": "00-not-a-trace-01"})
    assert bad.status_code == 200 and "traceparent" not in engine.headers[-1]
    body = orjson.dumps({"model": MODEL, "prompt": "hi"})
    conn = RawConn(proxy.port)    # httpx refuses to send these: a raw socket
    for i in range(15):           # a trailing space or tab (h11 refuses it): was a 502, and opened the breakers
        conn.send(post("/tokenize", body, headers="tracestate: k=v \r\nAuthorization: Bearer sk-x\t\r\n"))
        assert conn.read_messages(i + 1)[i].status == 200
        assert "tracestate" not in engine.headers[-1] and "authorization" not in engine.headers[-1]
    conn.close()
    assert all(proxy.state.health.snapshot(e).breaker == "closed" for e in proxy.state.pool.endpoints())


def test_a_control_plane_route_that_fails_answers_a_json_500(engine: RecordingEngine, proxy: ProxyThread,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A passthrough route that raised before answering answers vLLM's JSON error envelope (it was a text/plain
    "Internal Server Error") and is counted as what it was: ``internal_error``, 500 (it was counted "ok", status
    0 — an attacker's 500s showed up as successes)."""
    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(proxy.state.passthrough, "serve", broken)
    r = httpx.post(proxy.url + "/tokenize", json={"model": MODEL, "prompt": "hi"}, timeout=10)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["code"] == 500 and error["type"] and "internal error" in error["message"]
    assert "a bug" not in r.text                      # no internals in what the client reads
    m = scrape(proxy.url)
    assert m.value("pdproxy_requests_total", api="tokenize", outcome="internal_error", status="500") >= 1
    assert m.value("pdproxy_requests_total", api="tokenize", outcome="ok", status="0") == 0


@pytest.mark.parametrize(("content_type", "body", "said"), [
    ("multipart/form-data; boundary=" + "b" * 257,             # python-multipart's limit is 256: was a 500
     b"--" + b"b" * 257 + b'\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\nRIFF\r\n--'
     + b"b" * 257 + b"--\r\n", "There was an error parsing the body"),
    ("multipart/form-data; boundary=bnd; charset=utf-16",      # vLLM's parser would read the names as UTF-16
     "--bnd\r\nContent-Disposition: form-data; name=\"kv_transfer_params\"\r\n\r\n{}\r\n--bnd--\r\n"
     .encode("utf-16-le"), "charset"),
], ids=["long-boundary", "utf-16"])
def test_multipart_forms_pdproxy_cannot_read_as_vllm_does_are_400s(engine: RecordingEngine, proxy: ProxyThread,
                                                                  content_type: str, body: bytes, said: str) -> None:
    before = len(engine.received)
    refused = scrape(proxy.url).value("pdproxy_requests_total", api="audio", outcome="bad_request", status="400")
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        r = httpx.post(proxy.url + path, content=body, headers={"content-type": content_type}, timeout=10)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "body" and error["type"] == "BadRequestError" and said in error["message"]
    assert len(engine.received) == before                               # nothing reached the engine
    assert scrape(proxy.url).value("pdproxy_requests_total", api="audio", outcome="bad_request",
                                   status="400") == refused + 2


def test_a_form_with_two_model_fields_is_routed_by_the_last_as_vllm_reads_it(engine: RecordingEngine,
                                                                            proxy: ProxyThread) -> None:
    """FastAPI's ``Form(...)`` keeps a repeated field's last value: pdproxy routes by that one too (it took the
    first: a form could be checked as one model and served as another)."""
    form = (b"--bnd\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nnot-served\r\n"
            b"--bnd\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n" + MODEL.encode() + b"\r\n"
            b"--bnd\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--bnd--\r\n")
    r = httpx.post(proxy.url + "/v1/audio/transcriptions", content=form,
                   headers={"content-type": "multipart/form-data; boundary=bnd"}, timeout=10)
    assert r.status_code == 200, r.text
    reversed_form = form.replace(b"not-served", b"@@").replace(MODEL.encode(), b"not-served").replace(b"@@",
                                                                                                      MODEL.encode())
    r = httpx.post(proxy.url + "/v1/audio/transcriptions", content=reversed_form,
                   headers={"content-type": "multipart/form-data; boundary=bnd"}, timeout=10)
    assert r.status_code == 404 and "not-served" in r.json()["error"]["message"], r.text


def test_a_fastapi_route_that_fails_answers_a_json_500_too(engine: RecordingEngine, proxy: ProxyThread,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The routes FastAPI serves (``/v1/models``, ``/debug/*``, the admin API) answered an unexpected error with
    Starlette's text/plain 500; now vLLM's envelope too, and the connection closes."""
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(proxy.state.served, "cards", broken)
    r = httpx.get(proxy.url + "/v1/models", timeout=10)
    assert r.status_code == 500 and r.headers["content-type"] == "application/json", r.text
    assert r.headers["connection"] == "close"
    assert r.json()["error"]["code"] == 500 and "a bug" not in r.text
