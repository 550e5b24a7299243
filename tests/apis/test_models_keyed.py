"""``GET /v1/models`` when the engines require ``--api-key`` and pdproxy has no ``engine_api_key`` (simulated
engines on loopback): pdproxy knows nothing of their models, so it answers as the engines would for the client's
key — its list for the engines' key (also sent as ``x-api-key``), their 401 for another or none — and, when it
enforces its own ``api_keys`` (client keys never reach the engines), a 503 naming the setting; never a 200 with
an empty list.  pdproxy/app/application.py, pdproxy/engines/control.py."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.support import ProxyThread, SimProcess, running, wait_until

pytestmark = pytest.mark.timeout(60)

KEY = "sk-engine"
ARGS = ("--served-model-name", "sim-model", "--max-model-len", "2048", "--api-key", KEY)


@pytest.fixture(scope="module")
def keyed() -> Iterator[tuple[SimProcess, SimProcess]]:
    with running(SimProcess("prefill", *ARGS), SimProcess("decode", *ARGS)) as (p, d):
        yield p, d


def unready_proxy(p: SimProcess, d: SimProcess, **settings: object) -> ProxyThread:
    proxy = ProxyThread(prefill=[p.url], decode=[d.url], **settings)
    proxy.thread.start()                                       # not .start(): it waits for a healthy proxy
    wait_until(lambda: proxy.server.started and proxy.state is not None
               and all(i.auth_failed for i in proxy.state.infos.values()), 15, 0.02, "engines refused")
    return proxy


def test_the_engines_answer_for_the_clients_key(keyed: tuple[SimProcess, SimProcess]) -> None:
    proxy = unready_proxy(*keyed)
    try:
        ok = httpx.get(proxy.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert ok.status_code == 200 and [m["id"] for m in ok.json()["data"]] == ["sim-model"], ok.text
        anthropic = httpx.get(proxy.url + "/v1/models", headers={"x-api-key": KEY}, timeout=10)
        assert anthropic.status_code == 200 and anthropic.json()["data"], anthropic.text
        for headers in ({"Authorization": "Bearer sk-wrong"}, {},
                        {"Authorization": "Bearer sk-\xe9ng".encode("latin-1")}):    # not sendable: not sent (a 500)
            refused = httpx.get(proxy.url + "/v1/models", headers=headers, timeout=10)
            assert refused.status_code == 401 and refused.json()["error"] == "Unauthorized", refused.text
    finally:
        proxy.stop()


def test_with_pdproxys_own_client_keys_it_names_the_missing_setting(keyed: tuple[SimProcess, SimProcess]) -> None:
    proxy = unready_proxy(*keyed, api_keys=["sk-client"])
    try:
        r = httpx.get(proxy.url + "/v1/models", headers={"Authorization": "Bearer sk-client"}, timeout=10)
        assert r.status_code == 503 and "engine_api_key" in r.json()["error"]["message"], r.text
    finally:
        proxy.stop()
