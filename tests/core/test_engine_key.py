"""Engines started with ``--api-key``: with ``engine_api_key`` every call pdproxy makes carries it — the engines'
limits are learned through ``/v1/models`` and requests flow on both legs; without it the engines refuse
``/v1/models`` and pdproxy says why, in its 503 and its log, before any completion reaches an engine."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import httpx
import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.http.engine_headers import EngineHeaders
from pdproxy.tokens import sim_prompt
from tests.support import ProxyThread, SimProcess, running, wait_until

pytestmark = pytest.mark.timeout(60)

KEY = "sk-engine"
ARGS = ("--served-model-name", "sim-model", "--max-model-len", "2048", "--api-key", KEY)
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def keyed() -> Iterator[tuple[SimProcess, SimProcess]]:
    with running(SimProcess("prefill", *ARGS), SimProcess("decode", *ARGS)) as (p, d):
        yield p, d


def auths(*sims: SimProcess) -> list[str | None]:
    return [r["headers"].get("authorization") for s in sims for r in s.completions_received()]


def test_with_the_engine_key_limits_are_learned_and_requests_flow(keyed: tuple[SimProcess, SimProcess]) -> None:
    p, d = keyed
    p.reset()
    d.reset()
    proxy = ProxyThread(prefill=[p.url], decode=[d.url], engine_api_key=KEY).start()
    try:
        infos = proxy.state.infos
        assert {e.name: (i.max_model_len, i.auth_failed) for e, i in infos.items()} == {
            p.url: (2048, False), d.url: (2048, False)}                         # from the guarded /v1/models
        r = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sk-client"},
                       timeout=20)
        assert r.status_code == 200, r.text
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                          timeout=20) as s:
            assert s.status_code == 200 and b"[DONE]" in s.read()
        assert auths(p, d) == [f"Bearer {KEY}"] * 4                             # both legs, twice
        long = {**CHAT, "messages": [{"role": "user", "content": sim_prompt(2100, unique=True)}]}
        too_long = httpx.post(proxy.url + "/v1/chat/completions", json=long, timeout=20)
        assert too_long.status_code == 400 and "2048" in too_long.json()["error"]["message"]
        assert len(auths(p, d)) == 4                                            # refused before any engine
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_without_the_engine_key_pdproxy_says_which_setting_is_missing(
        keyed: tuple[SimProcess, SimProcess], caplog: pytest.LogCaptureFixture) -> None:
    p, d = keyed
    p.reset()
    d.reset()
    caplog.set_level(logging.WARNING, logger="pdproxy.health")
    proxy = ProxyThread(prefill=[p.url], decode=[d.url])
    proxy.thread.start()                                      # not .start(): it waits for a healthy proxy
    try:
        wait_until(lambda: proxy.server.started and proxy.state is not None, 15, 0.02, "proxy started")
        assert all(i.auth_failed for i in proxy.state.infos.values())
        assert httpx.get(proxy.url + "/health").status_code == 503
        r = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=20)
        assert r.status_code == 503 and "retry-after" in r.headers
        message = r.json()["error"]["message"]
        assert "engine_api_key" in message and "401" in message and "127.0.0.1" not in message
        assert auths(p, d) == []
        assert any("engine_api_key" in rec.getMessage() and p.url in rec.getMessage() for rec in caplog.records)
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_one_rule_for_every_engine_call() -> None:
    rank = Endpoint("http://d:1", Role.DECODE, dp_rank=3, internal_dp=True)
    keyed = EngineHeaders(engine_api_key=KEY, forward_client_authorization=True)
    assert keyed.leg(rank, "req-1", "Bearer sk-client") == {
        "Content-Type": "application/json", "X-Request-Id": "req-1", "Authorization": f"Bearer {KEY}",
        "X-data-parallel-rank": "3"}
    assert keyed.control() == {"Authorization": f"Bearer {KEY}", "Via": "1.1 pdproxy"}
    passthrough = EngineHeaders()
    assert passthrough.leg(rank, "r", "Bearer sk-client")["Authorization"] == "Bearer sk-client"
    assert "Authorization" not in passthrough.leg(rank, "r", None) and passthrough.control() == {"Via": "1.1 pdproxy"}
    enforced = EngineHeaders(forward_client_authorization=False)           # api_keys set, no engine key
    assert "Authorization" not in enforced.leg(rank, "r", "Bearer sk-proxy")
