"""Authorization and the body-size limit.

Default: the client's ``Authorization`` reaches both legs, so an engine started with ``--api-key`` answers a wrong
key with its own 401 after ONE attempt.  With ``api_keys`` pdproxy checks client keys itself and sends the
engines ``engine_api_key`` (or nothing).  Bodies above ``max_body_bytes`` get 413 and reach no engine.
"""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.reliability.harness import CHAT, Fleet4

pytestmark = pytest.mark.timeout(30)

UNAUTHORIZED = {"error": {"message": "Unauthorized", "type": "AuthenticationError", "param": None, "code": 401}}


def auths(fleet: Fleet4) -> list[str | None]:
    return [r["headers"].get("authorization") for s in fleet.all for r in s.completions_received()]


def post(url: str, body: object, key: str | None = None, **kw: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=20, **kw)  # type: ignore


def test_engine_401_passes_through_after_one_attempt(fleet4: Fleet4) -> None:
    proxy = fleet4.proxy()
    try:
        for sim in fleet4.prefillers:  # what `vllm serve --api-key K` answers a wrong key
            sim.faults({"kind": "status", "status": 401, "body": UNAUTHORIZED})
        r = post(proxy.url, {**CHAT, "stream": False, "stream_options": None}, "sk-wrong")
        assert r.status_code == 401 and r.json() == UNAUTHORIZED
        assert auths(fleet4) == ["Bearer sk-wrong"]  # one prefill attempt, no decoder
        assert all(proxy.state.health.snapshot(e).breaker == "closed" for e in proxy.state.pool.endpoints())
        proxy.wait_idle()
    finally:
        proxy.stop()


@pytest.mark.parametrize("engine_key", ["sk-engine", None])
def test_proxy_keys_never_reach_the_engines(fleet4: Fleet4, engine_key: str | None) -> None:
    proxy = fleet4.proxy(api_keys=["sk-proxy"], engine_api_key=engine_key)
    try:
        body = {**CHAT, "stream": False, "stream_options": None}
        assert post(proxy.url, body).status_code == 401
        assert post(proxy.url, body, "sk-engine").status_code == 401
        assert auths(fleet4) == []  # rejected before any engine
        assert post(proxy.url, body, "sk-proxy").status_code == 200
        expected = f"Bearer {engine_key}" if engine_key else None
        assert auths(fleet4) == [expected, expected]  # prefill and decode legs
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_the_model_list_needs_a_client_key_when_api_keys_are_set(fleet4: Fleet4) -> None:
    """``GET /v1/models`` is a ``/v1`` route: with ``api_keys`` it needs one of them, as vLLM's ``--api-key``
    guards it (it answered anyone its models and their ``max_model_len``); ``x-api-key`` serves too."""
    proxy = fleet4.proxy(api_keys=["sk-proxy"])
    try:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-wrong"}):
            r = httpx.get(proxy.url + "/v1/models", headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401, (headers, r.text)
        for headers in ({"Authorization": "Bearer sk-proxy"}, {"x-api-key": "sk-proxy"}):
            r = httpx.get(proxy.url + "/v1/models", headers=headers, timeout=10)
            assert r.status_code == 200 and r.json()["data"], (headers, r.text)
    finally:
        proxy.stop()
    open_proxy = fleet4.proxy()                           # no api_keys: open, as before
    try:
        assert httpx.get(open_proxy.url + "/v1/models", timeout=10).status_code == 200
    finally:
        open_proxy.stop()


def test_body_limit_413_before_any_engine(fleet4: Fleet4) -> None:
    proxy = fleet4.proxy(max_body_bytes=4096)
    try:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
        r = post(proxy.url, big)
        assert r.status_code == 413 and r.json()["error"]["code"] == 413

        def chunks() -> object:
            yield b'{"model": "sim-model", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}]}'
        r = httpx.post(proxy.url + "/v1/chat/completions", content=chunks(), timeout=20)  # no Content-Length
        assert r.status_code == 413
        assert fleet4.prefillers[0].completions_received() == fleet4.prefillers[1].completions_received() == []
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_default_limit_admits_multi_megabyte_images(fleet4: Fleet4) -> None:
    proxy = fleet4.proxy()
    try:
        image = "data:image/png;base64," + base64.b64encode(b"\x89PNG" + b"\0" * 3_000_000).decode()
        body = {**CHAT, "stream": False, "stream_options": None,
                "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                          {"type": "image_url", "image_url": {"url": image}}]}]}
        r = post(proxy.url, body)
        assert r.status_code == 200, r.text[:300]
        sizes = [rec["raw_len"] for s in fleet4.all for rec in s.completions_received()]
        assert len(sizes) == 2 and min(sizes) > 4_000_000  # both legs carried the image
        proxy.wait_idle()
    finally:
        proxy.stop()
