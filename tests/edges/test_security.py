"""Safe errors and the operator surfaces: client-facing errors never carry an engine's address (the log does);
``/debug/load``, the admin API and ``/metrics`` behind their keys; a missing or wrong key is a 401 typed as an
authentication error (a 403, a permission error, only where no key opens the route); drain that keeps the
endpoint; and normal operation that logs nothing alarming."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import Fleet
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(30)

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
ADMIN = {"Authorization": "Bearer admin-secret"}


def addresses(sims: Fleet) -> list[str]:
    return ["127.0.0.1", *(str(s.port) for s in sims.all)]


def test_engine_failures_name_the_role_not_the_address(sims: Fleet, tmp_path: Path) -> None:
    """Prefill and decode failures (refused, reset mid-stream) reach the client without any engine address;
    the request's log line keeps the full message and the engines it used."""
    log = tmp_path / "requests.jsonl"
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                        request_log_path=str(log), prefill_attempts=1, retry_backoff_s=0).start()
    try:
        sims.prefillers[0].faults({"kind": "refuse", "times": 1})
        r = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 503 and "retry-after" in r.headers
        message = r.json()["error"]["message"]
        assert message.startswith("no prefiller could serve") and not any(a in r.text for a in addresses(sims)), message

        for d in sims.decoders:
            d.faults({"kind": "reset_after_events", "events": 2, "times": 1})
        r = httpx.post(proxy.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10)
        assert r.status_code == 200 and '"error"' in r.text and r.text.rstrip().endswith("data: [DONE]")
        assert not any(a in r.text for a in addresses(sims)), r.text
        proxy.wait_idle()
    finally:
        proxy.stop()
    lines = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    refused, reset = lines[0], lines[1]
    assert sims.prefillers[0].url in refused["error"] and refused["prefiller"] == sims.prefillers[0].url
    assert reset["error"] and reset["decoder"] in {d.url for d in sims.decoders}


def test_debug_load_and_admin_sit_behind_the_admin_key_when_clients_need_keys(sims: Fleet) -> None:
    urls = {"prefill": [s.url for s in sims.prefillers], "decode": [s.url for s in sims.decoders]}
    open_proxy = ProxyThread(**urls).start()
    try:
        assert httpx.get(open_proxy.url + "/debug/load").status_code == 200      # no client keys: trusted network
    finally:
        open_proxy.stop()
    proxy = ProxyThread(**urls, api_keys=["sk-client"], admin_key="admin-secret").start()
    try:
        for headers in ({}, {"Authorization": "Bearer sk-client"}):
            r = httpx.get(proxy.url + "/debug/load", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        assert httpx.get(proxy.url + "/debug/load", headers=ADMIN).status_code == 200
        r = httpx.get(proxy.url + "/admin/endpoints", headers={"Authorization": "Bearer sk-client"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    finally:
        proxy.stop()
    keyless = ProxyThread(**urls, api_keys=["sk-client"]).start()
    try:   # client keys but no admin key: the operator surfaces are off
        assert httpx.get(keyless.url + "/debug/load", headers={"Authorization": "Bearer sk-client"}).status_code == 403
    finally:
        keyless.stop()


def test_metrics_open_or_behind_metrics_key(sims: Fleet) -> None:
    urls = {"prefill": [s.url for s in sims.prefillers], "decode": [s.url for s in sims.decoders]}
    proxy = ProxyThread(**urls, metrics_key="scrape-me").start()
    try:
        r = httpx.get(proxy.url + "/metrics")
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        ok = httpx.get(proxy.url + "/metrics", headers={"Authorization": "Bearer scrape-me"})
        assert ok.status_code == 200 and "pdproxy_requests_total" in ok.text
    finally:
        proxy.stop()


def test_drain_on_an_idle_decoder_keeps_it_listed_and_undrain_finds_it(sims: Fleet) -> None:
    d0, d1 = sims.decoders
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[d0.url, d1.url],
                        admin_key="admin-secret").start()
    try:
        ref = {"url": d0.url, "role": "decode"}
        r = httpx.post(proxy.url + "/admin/endpoints/drain", json=ref, headers=ADMIN)
        assert r.status_code == 202 and r.json()["draining"][0]["state"] == "drained"
        rows = {e["url"]: e for e in httpx.get(proxy.url + "/admin/endpoints", headers=ADMIN).json()["endpoints"]}
        assert rows[d0.url]["state"] == "drained" and rows[d1.url]["state"] == "active"
        for _ in range(4):
            assert httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
        assert not d0.completions_received()
        r = httpx.post(proxy.url + "/admin/endpoints/undrain", json=ref, headers=ADMIN)
        assert r.status_code == 200 and r.json()["endpoints"][0]["state"] == "active"
        r = httpx.request("DELETE", proxy.url + "/admin/endpoints", json=ref, headers={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_normal_operation_logs_nothing_alarming(sims: Fleet, caplog: pytest.LogCaptureFixture) -> None:
    """Successful requests, a decoder that refuses a request (its 4xx frees the KV itself: no release leg)
    and a client that leaves mid-stream log no warning, no release leg and no engine 5xx (INFO lines such as an
    engine coming up are fine)."""
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders]).start()
    caplog.set_level(logging.INFO, logger="pdproxy")
    try:
        for stream in (False, True):
            r = httpx.post(proxy.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=10)
            assert r.status_code == 200
        bad = {"error": {"message": "no", "type": "BadRequestError", "param": None, "code": 400}}
        for d in sims.decoders:
            d.faults({"kind": "status", "status": 400, "body": bad, "times": 1})
        assert httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 400
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", timeout=10,
                          json={**CHAT, "stream": True, "max_tokens": 400}) as resp:
            next(resp.iter_bytes())
        wait_until(lambda: all(s.state()["pinned_blocks"] == 0 for s in sims.prefillers), 5, 0.05,
                   "pinned KV freed")
        proxy.wait_idle()
    finally:
        proxy.stop()
    alarming: list[Any] = [r for r in caplog.records if r.name.startswith("pdproxy") and r.name != "pdproxy.requests"
                           and (r.levelno >= logging.WARNING or "release leg" in r.getMessage()
                                or "HTTP 5" in r.getMessage())]
    assert not alarming, [f"{r.name} {r.levelname} {r.getMessage()}" for r in alarming]
