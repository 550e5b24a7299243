"""The operator surfaces on an open port: ``/debug/*``, ``/docs`` and ``/openapi.json`` behind the admin key (or
off) once pdproxy listens beyond loopback or enforces client keys; ``POST /debug/prefix`` reads bounded bodies
and never answers "is this prompt cached" across ``cache_salt``; the admin API adds engines only where the
operator allows, and sends nothing (not the engine key) anywhere else; the start-up warning for an open door."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from pdproxy.ops.logs import log_banner
from pdproxy.settings import load_settings
from pdproxy.tokens import sim_prompt
from tests.conftest import Fleet
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(60)

ADMIN = {"authorization": "Bearer admin-secret"}


def urls(sims: Fleet) -> dict[str, list[str]]:
    return {"prefill": [s.url for s in sims.prefillers], "decode": [s.url for s in sims.decoders]}


@contextlib.contextmanager
def proxy_with(sims: Fleet, **settings: object) -> Iterator[ProxyThread]:
    proxy = ProxyThread(**urls(sims), **settings).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def status(proxy: ProxyThread, method: str, path: str, headers: dict[str, str] | None = None) -> int:
    body = {"prompt": "hello", "model": "sim-model"} if method == "POST" else None
    return httpx.request(method, proxy.url + path, json=body, headers=headers, timeout=10,
                         params={"prompt": "hello"} if method == "GET" else None).status_code


SURFACES = [("GET", "/debug/load"), ("GET", "/debug/prefix"), ("POST", "/debug/prefix"), ("GET", "/docs"),
            ("GET", "/openapi.json")]


def test_operator_surfaces_follow_the_admin_key_beyond_loopback(sims: Fleet) -> None:
    """``host: 0.0.0.0`` (the socket here is still loopback's): no admin key → refused; with one → only with it;
    ``debug_routes: open`` → open; on loopback without client keys → open, as before."""
    with proxy_with(sims, host="0.0.0.0") as exposed:
        assert [status(exposed, m, p) for m, p in SURFACES] == [403] * len(SURFACES)
    with proxy_with(sims, host="0.0.0.0", admin_key="admin-secret") as keyed:   # a missing key: 401
        assert [status(keyed, m, p) for m, p in SURFACES] == [401] * len(SURFACES)
        assert [status(keyed, m, p, ADMIN) for m, p in SURFACES] == [200] * len(SURFACES)
    with proxy_with(sims, host="0.0.0.0", debug_routes="open") as opened:
        assert [status(opened, m, p) for m, p in SURFACES] == [200] * len(SURFACES)
    with proxy_with(sims) as local:
        assert [status(local, m, p) for m, p in SURFACES] == [200] * len(SURFACES)
    with proxy_with(sims, debug_routes="off", admin_key="admin-secret") as off:
        assert [status(off, m, p, ADMIN) for m, p in SURFACES] == [403] * len(SURFACES)


def test_docs_follow_the_admin_key_when_clients_need_keys(sims: Fleet) -> None:
    with proxy_with(sims, api_keys=["sk-client"], admin_key="admin-secret") as proxy:
        client = {"authorization": "Bearer sk-client"}
        for path in ("/docs", "/openapi.json"):
            assert status(proxy, "GET", path) == 401 and status(proxy, "GET", path, client) == 401
        spec = httpx.get(proxy.url + "/openapi.json", headers=ADMIN, timeout=10)
        assert spec.status_code == 200 and "/admin/endpoints" in spec.json()["paths"]


def test_debug_prefix_reads_bounded_bodies(sims: Fleet) -> None:
    with proxy_with(sims, max_body_bytes=4096) as proxy:
        big = {"model": "sim-model", "prompt": "x" * 8000}
        r = httpx.post(proxy.url + "/debug/prefix", json=big, timeout=10)
        assert r.status_code == 413, r.text

        def stream() -> Iterator[bytes]:                        # no Content-Length: counted as it arrives
            yield b'{"model": "sim-model", "prompt": "'
            for _ in range(8):
                yield b"y" * 1000
            yield b'"}'

        r = httpx.post(proxy.url + "/debug/prefix", content=stream(), timeout=10)
        assert r.status_code == 413, r.text


def test_the_prefix_oracle_never_answers_across_cache_salts(sims: Fleet) -> None:
    """A prompt sent with ``cache_salt`` is held for that salt only: asked without it, or with another salt,
    ``/debug/prefix`` says nothing is cached (as the engine would compute it all again)."""
    prompt = sim_prompt(300, unique=True, seed=1801)
    with proxy_with(sims, prefix_routing="approximate") as proxy:
        sent = httpx.post(proxy.url + "/v1/completions", timeout=30, json={
            "model": "sim-model", "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"})
        assert sent.status_code == 200, sent.text

        def cached(**salt: str) -> int:
            r = httpx.post(proxy.url + "/debug/prefix", timeout=10,
                           json={"model": "sim-model", "prompt": prompt + " and more", **salt})
            assert r.status_code == 200, r.text
            return max(e["cached_tokens"] or 0 for e in r.json()["endpoints"] if e["role"] == "prefill")

        wait_until(lambda: cached(cache_salt="tenant-a") > 0, 10, what="the salted prompt is recorded")
        assert cached() == 0 and cached(cache_salt="tenant-b") == 0
        proxy.wait_idle()


class Listener:
    """A TCP listener on ``host`` recording every byte any connection sends it (its own thread)."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket()
        self.sock.bind((host, 0))
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.data = bytearray()
        self.connections = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            with conn:
                conn.settimeout(1)
                with contextlib.suppress(OSError):
                    self.data += conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def test_the_admin_api_adds_engines_only_where_allowed_and_sends_nothing_elsewhere(sims: Fleet) -> None:
    """The engines are on 127.0.0.1: 127.0.1.1 (another service on this host) and a cloud metadata address are
    outside their /24 — refused before any byte (the engine key) is sent; allowed by ``admin_endpoint_allow``,
    the same URL is probed with the engine key as any engine."""
    other = Listener("127.0.1.1")
    try:
        with proxy_with(sims, admin_key="admin-secret", engine_api_key="engine-secret") as proxy:
            for url in (other.url, "http://169.254.169.254:80", "http://metadata.google.internal:80"):
                r = httpx.post(proxy.url + "/admin/endpoints", json={"url": url, "role": "decode"}, headers=ADMIN,
                               timeout=10)
                assert r.status_code == 403 and r.json()["error"]["param"] == "url", r.text
            listed = httpx.get(proxy.url + "/admin/endpoints", headers=ADMIN, timeout=10).json()["endpoints"]
            assert {e["url"] for e in listed} == {s.url for s in sims.all}
            assert other.connections == 0 and not other.data
        with proxy_with(sims, admin_key="admin-secret", engine_api_key="engine-secret",
                        admin_endpoint_allow="127.0.1.0/24") as proxy:
            r = httpx.post(proxy.url + "/admin/endpoints", json={"url": other.url, "role": "decode"}, headers=ADMIN,
                           timeout=10)
            assert r.status_code == 201, r.text
            wait_until(lambda: b"engine-secret" in other.data, 10, what="the allowed engine is probed")
    finally:
        other.close()


def test_an_open_door_is_logged_at_start(caplog: pytest.LogCaptureFixture) -> None:
    listen = ["http://0.0.0.0:8000"]
    with caplog.at_level(logging.INFO, logger="pdproxy"):
        for settings in (dict(host="0.0.0.0", admin_key="k"), dict(host="0.0.0.0", debug_routes="open"),
                         dict(host="127.0.0.1", admin_key="k"), dict(host="0.0.0.0", admin_key="k", api_keys=["c"]),
                         dict(host="0.0.0.0")):
            caplog.clear()
            log_banner(load_settings(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:10"], **settings),
                       listen)
            warned = [r for r in caplog.records if r.levelno == logging.WARNING]
            expected = settings["host"] == "0.0.0.0" and "api_keys" not in settings and len(settings) > 1
            assert bool(warned) == expected, (settings, [r.getMessage() for r in warned])
            if warned:
                assert "beyond loopback" in warned[0].getMessage() and "docs/threat-model.md" in warned[0].getMessage()


def test_an_engine_key_without_client_keys_is_warned_at_start(caplog: pytest.LogCaptureFixture) -> None:
    """vllm-router's --api-key (accepted by pdproxy serve) is the engines' key; vLLM's is the clients'.  Given alone
    it leaves clients unauthenticated: said once at start, naming the setting that would ask them (new-operator
    round: `serve ... --api-key secret` answered an unauthenticated client 200)."""
    with caplog.at_level(logging.INFO, logger="pdproxy"):
        mtls = dict(ssl_certfile="cert.pem", ssl_keyfile="key.pem")     # never opened: the warning reads settings
        for settings, expected in ((dict(engine_api_key="e"), True), (dict(engine_api_key="e", api_keys=["c"]), False),
                                   (dict(), False), (dict(api_keys=["c"]), False),
                                   (dict(engine_api_key="e", **mtls, ssl_cert_reqs=2), False),   # certificates asked
                                   (dict(engine_api_key="e", **mtls, ssl_cert_reqs=1), True)):   # optional: not
            caplog.clear()
            log_banner(load_settings(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"],
                                     host="127.0.0.1", **settings), ["http://127.0.0.1:8000"])
            warned = [r for r in caplog.records if getattr(r, "event", None) == "clients_unauthenticated"]
            assert bool(warned) == expected, settings
            if warned:
                assert "api_keys (--api-keys)" in warned[0].getMessage() and warned[0].levelno == logging.WARNING
