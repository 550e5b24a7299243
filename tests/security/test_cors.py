"""Browsers (CORS), with vLLM's flags and defaults (``allowed_origins`` … ``allowed_headers``; pdproxy/http/cors.py):
off unless origins are allowed; then the generation routes' answers — served by pdproxy's own HTTP protocol — carry
the same headers as the routes Starlette's middleware serves, and preflights are answered, through the real
``openai`` client's requests and raw ones on loopback."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import pytest

from pdproxy.cli import _Parser, add_serve_arguments, settings_from_args
from tests.conftest import Fleet
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(60)

APP = "https://app.example"
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}


def proxy_of(fleet: Fleet, **settings: object) -> ProxyThread:
    return ProxyThread(prefill=[s.url for s in fleet.prefillers], decode=[s.url for s in fleet.decoders],
                       **settings).start()


@pytest.fixture(scope="module")
def listed(fleet: Fleet) -> Iterator[ProxyThread]:
    p = proxy_of(fleet, allowed_origins=[APP], allow_credentials=True)
    yield p
    p.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_listed_origins_generation_answer_names_it(listed: ProxyThread, sims: Fleet, stream: bool) -> None:
    r = httpx.post(listed.url + "/v1/chat/completions", json={**CHAT, "stream": stream},
                   headers={"Origin": APP}, timeout=30)
    assert r.status_code == 200 and (r.text.rstrip().endswith("[DONE]") if stream else r.json()["choices"])
    assert r.headers["access-control-allow-origin"] == APP and r.headers["vary"] == "Origin"
    assert r.headers["access-control-allow-credentials"] == "true"
    other = httpx.post(listed.url + "/v1/chat/completions", json=CHAT, headers={"Origin": "https://evil.example"},
                       timeout=30)
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    plain = httpx.post(listed.url + "/v1/chat/completions", json=CHAT, timeout=30)   # no Origin: no CORS header
    assert not [k for k in plain.headers if k.startswith("access-control-")]


def test_errors_and_control_routes_carry_the_headers_too(listed: ProxyThread, sims: Fleet) -> None:
    bad = httpx.post(listed.url + "/v1/chat/completions", json={"model": "nope", "messages": []},
                     headers={"Origin": APP}, timeout=30)
    assert bad.status_code in (400, 404) and bad.headers["access-control-allow-origin"] == APP
    models = httpx.get(listed.url + "/v1/models", headers={"Origin": APP}, timeout=30)
    assert models.status_code == 200 and models.headers["access-control-allow-origin"] == APP
    assert not [r for s in sims.all for r in s.received() if r["path"] != "/v1/models"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/models", "/tokenize"])
def test_a_preflight_is_answered_for_a_listed_origin_only(listed: ProxyThread, sims: Fleet, path: str) -> None:
    ask = {"Origin": APP, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    ok = httpx.options(listed.url + path, headers=ask, timeout=10)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == APP
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert ok.headers["access-control-allow-headers"].lower() == "authorization, content-type"
    no = httpx.options(listed.url + path, headers={**ask, "Origin": "https://evil.example"}, timeout=10)
    assert no.status_code == 400 and "access-control-allow-origin" not in no.headers
    assert not [r for s in sims.all for r in s.received()]


def test_any_origin_is_star_and_off_by_default(fleet: Fleet, sims: Fleet) -> None:
    star = proxy_of(fleet, allowed_origins='["*"]')          # vLLM's form: one JSON list
    try:
        r = httpx.post(star.url + "/v1/completions", json={"model": "sim-model", "prompt": "hi", "max_tokens": 2},
                       headers={"Origin": "https://anyone.example"}, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-credentials" not in r.headers
    finally:
        star.stop()
    off = proxy_of(fleet)
    try:
        r = httpx.post(off.url + "/v1/completions", json={"model": "sim-model", "prompt": "hi", "max_tokens": 2},
                       headers={"Origin": APP}, timeout=30)
        assert r.status_code == 200 and not [k for k in r.headers if k.startswith("access-control-")]
        pre = httpx.options(off.url + "/v1/chat/completions",
                            headers={"Origin": APP, "Access-Control-Request-Method": "POST"}, timeout=10)
        assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers
    finally:
        off.stop()


@pytest.mark.parametrize(("argv", "origins"), [
    (["--allowed-origins", '["https://a.example", "https://b.example"]'], ["https://a.example", "https://b.example"]),
    (["--allowed-origins", "https://a.example", "https://b.example"], ["https://a.example", "https://b.example"]),
    (["--allowed-origins", '["*"]'], ["*"]), ([], [])])
def test_vllms_flag_spelling_is_read(argv: list[str], origins: list[str]) -> None:
    """vLLM reads ``--allowed-origins`` as one JSON list; pdproxy takes that and a list of words."""
    p = _Parser(prog="pdproxy serve")
    add_serve_arguments(p)
    s = settings_from_args(p.parse_args(["--prefill", "http://p:1", "--decode", "http://d:2", *argv]))
    assert s.allowed_origins == origins and s.allowed_methods == ["*"] and s.allowed_headers == ["*"]


@pytest.mark.parametrize(("settings", "headers", "want"), [
    ({"allowed_origins": ["*"], "allow_credentials": True}, {"Origin": APP},
     {"access-control-allow-origin": APP, "access-control-allow-credentials": "true", "vary": "Origin"}),
    ({"allowed_origins": ["*"]}, {"Origin": APP, "Cookie": "a=1"},
     {"access-control-allow-origin": "*", "vary": "Origin"}),
    ({"allowed_origins": [APP]}, {"Origin": "https://evil.example"}, {"vary": "Origin"}),
    ({"allowed_origins": [APP]}, {}, {"vary": "Origin"}),
])
def test_generation_answers_follow_starlettes_rule_like_every_other_route(
        fleet: Fleet, sims: Fleet, settings: dict[str, object], headers: dict[str, str],
        want: dict[str, str]) -> None:
    """The generation routes (pdproxy's own server) add exactly what Starlette's middleware adds on the other
    routes (``/v1/models`` here) — ``*`` with credentials is a browser's refusal, so the origin is named."""
    p = proxy_of(fleet, **settings)
    try:
        gen = httpx.post(p.url + "/v1/completions", json={"model": "sim-model", "prompt": "hi", "max_tokens": 2},
                         headers=headers, timeout=30)
        ctl = httpx.get(p.url + "/v1/models", headers=headers, timeout=30)
    finally:
        p.stop()
    assert gen.status_code == ctl.status_code == 200

    def cors(r: httpx.Response) -> dict[str, str]:
        return {k: v for k, v in r.headers.items() if k.startswith("access-control-") or k == "vary"}

    assert cors(gen) == want and cors(ctl) == want


def head_of(port: int, request: bytes) -> bytes:
    """The lower-cased response head the proxy answers ``request`` with (raw socket, one request)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    try:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data and (piece := s.recv(65536)):
            data += piece
    finally:
        s.close()
    return data.split(b"\r\n\r\n")[0].lower()


def test_the_first_origin_counts_and_refusals_carry_the_headers(listed: ProxyThread, sims: Fleet) -> None:
    """Two ``Origin`` fields: the first decides, as Starlette reads it; the server's own 413 on a generation route
    carries the CORS headers, so a browser page can read why."""
    body = b'{"model": "sim-model", "prompt": "hi", "max_tokens": 2}'
    head = head_of(listed.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://evil.example\r\n"
                   b"Origin: " + APP.encode() + b"\r\nContent-Type: application/json\r\nContent-Length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert head.startswith(b"http/1.1 200") and b"access-control-allow-origin" not in head
    head = head_of(listed.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: " + APP.encode()
                   + b"\r\nContent-Type: application/json\r\nContent-Length: 67108865\r\n\r\n")
    assert head.startswith(b"http/1.1 413") and b"access-control-allow-origin: " + APP.encode() in head
