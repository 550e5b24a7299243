"""Admin API (pdproxy/app/admin.py): list / add / drain / remove endpoints at runtime, behind the admin key."""

from __future__ import annotations

import logging
import threading
from typing import Any

import httpx
import pytest

from tests.reliability.harness import CHAT, Fleet4, parse_sse
from tests.support import wait_until

pytestmark = pytest.mark.timeout(30)

ADMIN = {"Authorization": "Bearer admin-secret"}


def admin(proxy_url: str, method: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
          path: str = "/admin/endpoints") -> httpx.Response:
    return httpx.request(method, proxy_url + path, json=body, headers=ADMIN if headers is None else headers,
                         timeout=10)


def names(proxy_url: str) -> dict[str, dict[str, Any]]:
    return {e["url"]: e for e in admin(proxy_url, "GET").json()["endpoints"]}


def complete(proxy_url: str) -> None:
    r = httpx.post(proxy_url + "/v1/chat/completions", json={**CHAT, "stream": False, "stream_options": None},
                   timeout=10)
    assert r.status_code == 200, r.text


def test_admin_key_is_required_and_separate_from_client_keys(fleet4: Fleet4) -> None:
    off = fleet4.proxy()
    try:
        assert admin(off.url, "GET").status_code == 403  # no admin_key configured: the API is off
    finally:
        off.stop()
    proxy = fleet4.proxy(admin_key="admin-secret", api_keys=["sk-client"])
    try:
        assert admin(proxy.url, "GET", headers={}).status_code == 401    # a missing or wrong key: vLLM's 401
        assert admin(proxy.url, "GET", headers={"Authorization": "Bearer sk-client"}).status_code == 401
        r = admin(proxy.url, "GET", headers={"X-Admin-Key": "admin-secret"})
        assert r.status_code == 200 and len(r.json()["endpoints"]) == 4
        row = r.json()["endpoints"][0]
        assert {"healthy", "draining", "requests", "tokens", "breaker", "max_model_len"} <= set(row)
    finally:
        proxy.stop()


def test_add_drain_and_remove_at_runtime(fleet4: Fleet4, caplog: pytest.LogCaptureFixture) -> None:
    """Membership changes at runtime, each logged (``event: admin_change``: the admin API's audit trail)."""
    caplog.set_level(logging.INFO, logger="pdproxy.admin")
    d0, d1 = fleet4.decoders
    proxy = fleet4.proxy(admin_key="admin-secret", decode=[d0.url])
    try:
        assert admin(proxy.url, "POST", {"url": d0.url, "role": "decode"}).status_code == 409
        host, port = d0.url.removeprefix("http://").rsplit(":", 1)     # the same engine by its root-dot name
        assert admin(proxy.url, "POST", {"url": f"http://{host}.:{port}", "role": "decode"}).status_code == 409
        bad = admin(proxy.url, "POST", {"url": d1.url, "role": "sideways"})
        assert bad.status_code == 400 and "role: Input should be 'prefill' or 'decode'" in bad.json()["error"][
            "message"] and "errors.pydantic.dev" not in bad.text       # pydantic's words, not its links
        r = admin(proxy.url, "POST", {"url": d1.url, "role": "decode"})
        assert r.status_code == 201 and r.json()["added"][0]["healthy"] is True
        for _ in range(12):
            complete(proxy.url)
        assert d1.completions_received(), "the added decoder takes traffic"

        # drain d0 while one slow stream runs on it: no new work, the stream finishes, d0 stays listed as drained
        for s in fleet4.all:
            s.reset()
        d0.faults({"kind": "slow", "factor": 11, "min_gap_s": 0.01})
        r = admin(proxy.url, "POST", {"url": d1.url, "role": "decode"}, path="/admin/endpoints/drain")
        assert r.status_code == 202 and r.json()["draining"][0]["leaving"] is False
        assert r.json()["draining"][0]["state"] == "drained"          # idle: drained at once, and still listed
        assert names(proxy.url)[d1.url]["state"] == "drained"
        stream: dict[str, Any] = {}
        t = threading.Thread(target=lambda: stream.update(r=httpx.post(
            proxy.url + "/v1/chat/completions", json=CHAT, timeout=20)))
        t.start()
        wait_until(lambda: d0.state()["active_streams"] == 1, 5, what="stream running on d0")
        r = admin(proxy.url, "POST", {"url": d1.url, "role": "decode"}, path="/admin/endpoints/undrain")
        assert r.status_code == 200 and r.json()["endpoints"][0]["draining"] is False
        r = admin(proxy.url, "POST", {"url": d0.url, "role": "decode"}, path="/admin/endpoints/drain")
        assert r.status_code == 202 and r.json()["draining"][0]["requests"] == 1
        assert r.json()["draining"][0]["state"] == "draining"
        before = len(d0.completions_received())
        for _ in range(5):
            complete(proxy.url)
        assert len(d0.completions_received()) == before  # a draining decoder takes no new work
        assert d0.url in names(proxy.url)                # ... and stays while its stream runs
        t.join(20)
        events, done, errors = parse_sse(stream["r"].content)
        assert events
        assert stream["r"].status_code == 200 and done == 1 and not errors
        wait_until(lambda: names(proxy.url)[d0.url]["state"] == "drained", 5, what="d0 drained once idle")
        assert d0.url in names(proxy.url)                # drain never removes: undrain still finds it
        r = admin(proxy.url, "POST", {"url": d0.url, "role": "decode"}, path="/admin/endpoints/undrain")
        assert r.status_code == 200 and r.json()["endpoints"][0]["state"] == "active"

        r = admin(proxy.url, "DELETE", {"url": d0.url, "role": "decode"})  # d1 remains: removed once idle
        assert r.status_code == 202
        wait_until(lambda: d0.url not in names(proxy.url), 5, what="removed decoder left when idle")
        r = admin(proxy.url, "DELETE", {"url": d1.url, "role": "decode"})  # the last decoder: force needed
        assert r.status_code == 409 and r.json()["error"]["param"] == "force" and d1.url in names(proxy.url)
        assert admin(proxy.url, "DELETE", {"url": d1.url, "role": "decode", "force": True}).status_code == 200
        assert names(proxy.url).keys() == {p.url for p in fleet4.prefillers}
        r = httpx.post(proxy.url + "/v1/chat/completions", json={**CHAT, "stream": False, "stream_options": None})
        assert r.status_code == 503 and "retry-after" in r.headers  # no decoder left: 503 at once
        assert admin(proxy.url, "DELETE", {"url": d1.url, "role": "decode"}).status_code == 404
        proxy.wait_idle()
        audit = [(r.action, r.url) for r in caplog.records if getattr(r, "event", None) == "admin_change"]
        assert audit == [("add", d1.url), ("drain", d1.url), ("undrain", d1.url), ("drain", d0.url),
                         ("undrain", d0.url), ("remove (once idle)", d0.url), ("remove (forced)", d1.url)], audit
    finally:
        proxy.stop()


def test_an_added_endpoint_can_be_pinned_to_models(fleet4: Fleet4) -> None:
    """``models`` on ``POST /admin/endpoints`` pins the new endpoint as the config's ``models`` does: a decoder
    pinned to a model it does not serve takes none of ``sim-model``'s requests; re-added pinned to
    ``sim-model`` it does."""
    d0, d1 = fleet4.decoders
    proxy = fleet4.proxy(admin_key="admin-secret", decode=[d0.url])
    try:
        r = admin(proxy.url, "POST", {"url": d1.url, "role": "decode", "models": ["other-model"]})
        assert r.status_code == 201 and r.json()["added"][0]["models"] == []   # pinned ∩ listed: nothing
        names_before = names(proxy.url)
        for _ in range(8):
            complete(proxy.url)
        assert d1.completions_received() == [] and len(d0.completions_received()) == 8
        r = admin(proxy.url, "DELETE", {"url": d1.url, "role": "decode"})     # idle: removed at once, and said
        assert r.status_code == 202 and r.json() == {"leaving": [], "removed": [names_before[d1.url]["name"]]}
        assert d1.url not in names(proxy.url)
        r = admin(proxy.url, "POST", {"url": d1.url, "role": "decode", "models": ["sim-model"]})
        assert r.status_code == 201 and r.json()["added"][0]["models"] == ["sim-model"]
        assert names(proxy.url)[d0.url]["models"] == ["sim-model"]
        for _ in range(12):
            complete(proxy.url)
        assert d1.completions_received(), "pinned to the model it serves, the decoder takes traffic"
        r = admin(proxy.url, "POST", {"url": d1.url, "role": "decode", "models": "sim-model"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
        for not_an_object in ([], None):              # every admin 400 in the admin API's words and type
            err = admin(proxy.url, "POST", not_an_object).json()["error"]
            assert err["message"].startswith("invalid admin request: ") and err["type"] == "BadRequestError", err
        raw = httpx.post(proxy.url + "/admin/endpoints/drain", content=b"notjson", headers=ADMIN, timeout=10)
        err = raw.json()["error"]                     # plain words, not vLLM's pydantic-shaped envelope
        assert raw.status_code == 400 and "one JSON object" in err["message"] and "{'type'" not in err["message"]
        # a field the API lacks is refused, not ignored (``dp_rank`` would have drained every rank of the URL)
        r = admin(proxy.url, "POST", {"url": d1.url, "role": "decode", "dp_rank": 0}, path="/admin/endpoints/drain")
        assert r.status_code == 400 and "dp_rank" in r.json()["error"]["message"], r.text
        for path, extra in (("/admin/endpoints/drain", {"models": ["other"]}), ("/admin/endpoints/drain", {"force": True}),
                            ("/admin/endpoints/undrain", {"migrate": True})):   # another route's field
            r = admin(proxy.url, "POST", {"url": d1.url, "role": "decode", **extra}, path=path)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == next(iter(extra)) and "not a field" in err["message"]
        r = admin(proxy.url, "DELETE", {"url": d1.url, "role": "decode", "force": "yes"})   # JSON types only
        assert r.status_code == 400 and "force" in r.json()["error"]["message"], r.text
        assert d1.url in names(proxy.url)
        # the name GET lists for one internal-DP rank is answered with the URL to give
        r = admin(proxy.url, "POST", {"url": d1.url + "#dp0", "role": "decode"}, path="/admin/endpoints/drain")
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "url" and f"give {d1.url}" in err["message"], r.text
        assert not names(proxy.url)[d1.url]["draining"]
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_an_endpoint_removed_while_its_first_probe_runs(fleet4: Fleet4) -> None:
    """A forced remove while the add's first probe waits on the engine: the add answers in the admin API's words
    (409), not pdproxy's 500 (its answer described an endpoint no longer in the pool: KeyError)."""
    from tests.stand_in import StandInEngine, StandInHandler

    probed, go_on = threading.Event(), threading.Event()

    class SlowHealth(StandInEngine):
        def __init__(self) -> None:
            super().__init__(model="sim-model")
            engine = self

            def do_get(handler: StandInHandler) -> None:
                if handler.path == "/health":
                    probed.set()
                    go_on.wait(10)
                StandInHandler.do_GET(handler)
            self.server.RequestHandlerClass = type("Slow", (self.server.RequestHandlerClass,),
                                                   {"do_GET": do_get, "engine": engine})

    proxy = fleet4.proxy(admin_key="admin-secret")
    try:
        with SlowHealth().running() as slow:
            added: list[httpx.Response] = []
            adder = threading.Thread(target=lambda: added.append(admin(proxy.url, "POST", {"url": slow.url,
                                                                                         "role": "decode"})))
            adder.start()
            assert probed.wait(10)
            gone = admin(proxy.url, "DELETE", {"url": slow.url, "role": "decode", "force": True})
            assert gone.status_code == 200, gone.text
            go_on.set()
            adder.join(15)
            assert added and added[0].status_code == 409, added[0].text if added else "no answer"
            assert "removed" in added[0].json()["error"]["message"]
            assert slow.url not in names(proxy.url)
            complete(proxy.url)
    finally:
        proxy.stop()


def test_a_removed_prefiller_leaves_nothing_in_prefix_routing(fleet4: Fleet4) -> None:
    """Removing an endpoint drops what prefix routing knew of it: its approximate index entries and their
    ``pdproxy_prefix_index_approx_entries`` series (each engine that ever came and went kept one, and a later
    engine at the same address inherited its predictions), its KV pool bound."""
    p0, p1 = fleet4.prefillers
    proxy = fleet4.proxy(admin_key="admin-secret", prefill=[p0.url], prefix_routing="approximate")
    try:
        assert admin(proxy.url, "POST", {"url": p1.url, "role": "prefill"}).status_code == 201
        approx = proxy.state.prefix_cache.approx
        for i in range(40):                                         # prompts of their own: spread over both
            long_chat = {**CHAT, "stream": False, "stream_options": None,
                         "messages": [{"role": "user", "content": f"prompt {i}: " + "long enough to be keyed " * 40}]}
            r = httpx.post(proxy.url + "/v1/chat/completions", json=long_chat, timeout=10)
            assert r.status_code == 200, r.text
            if p1.url in approx.endpoints():
                break
        assert approx.entries(p1.url) > 0, "a prompt was recorded for the added prefiller"
        assert admin(proxy.url, "DELETE", {"url": p1.url, "role": "prefill", "force": True}).status_code == 200
        metrics = httpx.get(proxy.url + "/metrics").text
        assert f'endpoint="{p1.url}"' not in metrics
        assert p1.url not in approx.endpoints() and p1.url not in approx._capacity
        complete(proxy.url)
    finally:
        proxy.stop()


def test_a_pdproxy_given_as_an_engine_is_refused_and_never_healthy(fleet4: Fleet4,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """Its own URL through the admin API: 409 naming it a pdproxy, nothing kept (old code: 201 and a "healthy"
    prefiller whose legs ran a second PD pass, half the requests 502).  Another pdproxy in the configuration: never
    healthy, and why is said (its /health answers pdproxy's probe — ``Via: 1.1 pdproxy`` — 508)."""
    from pdproxy.endpoints import Role
    from pdproxy.engines.control import LOOP_FAILURE
    from tests.support import ProxyThread

    proxy = fleet4.proxy(admin_key="admin-secret")
    try:
        before = names(proxy.url)
        caplog.set_level(logging.INFO, logger="pdproxy.admin")
        r = admin(proxy.url, "POST", {"url": proxy.url, "role": "prefill"})
        assert r.status_code == 409 and "is a pdproxy" in r.json()["error"]["message"], r.text
        assert names(proxy.url) == before
        audit = [x.action for x in caplog.records if getattr(x, "event", None) == "admin_change"]   # type: ignore
        assert audit == ["add", "remove"], audit          # the audit trail says it did not stay
        complete(proxy.url)
        assert httpx.get(proxy.url + "/health").status_code == 200            # a client's probe: as before
        looped = httpx.get(proxy.url + "/health", headers={"via": "1.0 envoy, 1.1 pdproxy"})
        assert looped.status_code == 508 and looped.json()["error"]["type"] == "LoopDetected"
        outer = ProxyThread(prefill=[fleet4.prefillers[0].url], decode=[proxy.url])
        outer.thread.start()
        try:
            wait_until(lambda: outer.server.started and outer.state is not None, 15, 0.02, "outer proxy started")
            (inner,) = outer.state.pool.endpoints(Role.DECODE)
            wait_until(lambda: outer.state.engines.health_failure(inner) == LOOP_FAILURE, 15, 0.05,
                       "the inner pdproxy judged no engine")
            assert not outer.state.pool.load(inner).healthy
        finally:
            outer.stop()
    finally:
        proxy.stop()
