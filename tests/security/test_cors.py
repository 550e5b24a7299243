"""Browsers (CORS), with vLLM's flags and defaults (``allowed_origins`` … ``allowed_headers``; pdproxy/http/cors.py):
off unless origins are allowed; then the generation routes' answers — served by pdproxy's own HTTP protocol — carry
the same headers as the routes Starlette's middleware serves, and preflights are answered, through the real
``openai`` client's requests and raw ones on loopback."""

from __future__ import annotations

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
