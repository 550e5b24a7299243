"""Inbound TLS on ``pdproxy serve`` (``--ssl-certfile`` / ``--ssl-keyfile`` / ``--ssl-ca-certs`` /
``--ssl-cert-reqs``, vLLM's flag names), one process and ``--workers 2``: the real ``openai`` client verifies the
certificate (made in the test by a throwaway CA) and streams a chat completion; a client that does not trust
the CA is refused; with ``--ssl-cert-reqs 2`` only clients holding a certificate from ``--ssl-ca-certs`` get in.
Bad TLS settings stop start-up with a message naming the flag."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import trustme

from tests.conftest import Fleet
from tests.ops.serveproc import ServeProcess

pytestmark = pytest.mark.timeout(90)


@dataclass
class Certs:
    ca: Path
    cert: Path
    key: Path
    client: Path  # client certificate + key, issued by the same CA
    other_ca: trustme.CA


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    server.private_key_pem.write_to_path(str(d / "key.pem"))
    (d / "cert.pem").write_bytes(b"".join(p.bytes() for p in server.cert_chain_pems))
    ca.issue_cert("client@example.test").private_key_and_cert_chain_pem.write_to_path(str(d / "client.pem"))
    return Certs(ca=d / "ca.pem", cert=d / "cert.pem", key=d / "key.pem", client=d / "client.pem",
                 other_ca=trustme.CA())


def trusting(certs: Certs, *, client_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    if client_cert:
        ctx.load_cert_chain(str(certs.client))
    return ctx


def engine_args(sims: Fleet) -> list[str]:
    return ["--prefill", *(s.url for s in sims.prefillers), "--decode", *(s.url for s in sims.decoders)]


@pytest.fixture
def serve(sims: Fleet, certs: Certs, tmp_path: Path) -> Iterator[callable]:  # type: ignore[valid-type]
    started: list[ServeProcess] = []

    def start(*extra: str, cert: bool = False) -> ServeProcess:
        p = ServeProcess(tmp_path / f"serve{len(started)}.log", *engine_args(sims), "--ssl-certfile", str(certs.cert),
                         "--ssl-keyfile", str(certs.key), *extra, scheme="https")
        started.append(p)
        return p.start(verify=trusting(certs, client_cert=cert))

    try:
        yield start
    finally:
        for p in started:
            p.stop()


def stream_chat(url: str, ctx: ssl.SSLContext) -> str:
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                       http_client=openai.DefaultHttpxClient(verify=ctx, timeout=20.0)) as client:
        chunks = client.chat.completions.create(model="sim-model", stream=True, max_tokens=8,
                                                messages=[{"role": "user", "content": "Hello over TLS"}])
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def assert_served(sims: Fleet, n: int) -> None:
    legs = sims.prefillers[0].completions_received()
    assert len(legs) == n and all(r["body"]["max_tokens"] == 1 for r in legs)  # real PD legs behind TLS


def test_https_single_process_openai_client_verifies_and_streams(serve, certs: Certs, sims: Fleet) -> None:  # type: ignore[no-untyped-def]
    p = serve()
    assert stream_chat(p.url, trusting(certs))  # text arrived through a verified TLS stream
    assert_served(sims, 1)
    assert httpx.get(p.url + "/health", verify=trusting(certs)).status_code == 200
    untrusting = ssl.create_default_context()
    certs.other_ca.configure_trust(untrusting)
    with pytest.raises(openai.APIConnectionError):
        stream_chat(p.url, untrusting)
    with pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError)):  # plain HTTP to the TLS port: no answer
        httpx.get(p.url.replace("https", "http") + "/health", timeout=5).raise_for_status()
    assert "listening on https://127.0.0.1:" in p.text()
    assert_served(sims, 1)  # the refused clients never reached an engine


def test_https_with_two_workers(serve, certs: Certs, sims: Fleet) -> None:  # type: ignore[no-untyped-def]
    p = serve("--workers", "2")
    ctx = trusting(certs)
    for _ in range(4):
        assert stream_chat(p.url, ctx)
    assert httpx.get(p.url + "/health", verify=ctx).status_code == 200
    assert_served(sims, 4)
    assert "2 worker(s)" in p.text()


def test_client_certificate_required(serve, certs: Certs, sims: Fleet) -> None:  # type: ignore[no-untyped-def]
    p = serve("--ssl-ca-certs", str(certs.ca), "--ssl-cert-reqs", "2", cert=True)
    assert stream_chat(p.url, trusting(certs, client_cert=True))
    with pytest.raises(openai.APIConnectionError):  # verifies the server, but holds no client certificate
        stream_chat(p.url, trusting(certs))
    assert_served(sims, 1)
    assert "client certificates required" in p.text()


def test_client_certificate_optional(serve, certs: Certs, sims: Fleet) -> None:  # type: ignore[no-untyped-def]
    p = serve("--ssl-ca-certs", str(certs.ca), "--ssl-cert-reqs", "1")
    assert stream_chat(p.url, trusting(certs))  # no certificate: allowed
    assert stream_chat(p.url, trusting(certs, client_cert=True))
    assert_served(sims, 2)


@pytest.mark.parametrize(("flags", "message"), [
    (["--ssl-keyfile", "KEY"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-certfile", "CERT", "--ssl-keyfile", "KEY", "--ssl-cert-reqs", "2"], "give --ssl-ca-certs"),
    (["--ssl-certfile", "/nonexistent/cert.pem"], "--ssl-certfile /nonexistent/cert.pem: no such file"),
    (["--ssl-certfile", "CERT", "--ssl-keyfile", "/nonexistent/key.pem"],
     "--ssl-keyfile /nonexistent/key.pem: no such file"),
    (["--ssl-certfile", "CERT", "--ssl-keyfile", "KEY", "--ssl-ca-certs", "/nonexistent/ca.pem"],
     "--ssl-ca-certs /nonexistent/ca.pem: no such file"),
    (["--ssl-certfile", "CERT", "--ssl-keyfile", "CA"], "cannot load the certificate and key"),
    (["--ssl-certfile", "CA"], "holds no private key: give its key with --ssl-keyfile"),   # no key given
    (["--ssl-certfile", "CERT"], "holds no private key: give its key with --ssl-keyfile"),
])
def test_bad_tls_settings_stop_start_up(certs: Certs, flags: list[str], message: str) -> None:
    paths = {"KEY": str(certs.key), "CERT": str(certs.cert), "CA": str(certs.ca)}
    done = subprocess.run([sys.executable, "-m", "pdproxy", "serve", "--prefill", "http://127.0.0.1:9",
                           "--decode", "http://127.0.0.1:10", *(paths.get(f, f) for f in flags)],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and message in done.stderr and "None" not in done.stderr, done.stderr


def test_a_client_silent_in_its_tls_handshake_is_closed_at_the_head_timeout(  # type: ignore[no-untyped-def]
        serve, certs: Certs) -> None:
    """A connection still in its TLS handshake is not yet one of ``max_client_connections``, so asyncio's 60 s
    handshake timeout let silent clients hold descriptors a minute each (an attacker ran the process out of them);
    the handshake now has ``request_headers_timeout_s`` (2 s here), as a request head does."""
    p = serve("--request-headers-timeout-s", "2")
    port = int(p.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as silent:
        began = time.monotonic()
        try:
            closed = silent.recv(1) == b""
        except ConnectionResetError:
            closed = True
        took = time.monotonic() - began
    assert closed and took < 15, took                      # the server ended it (asyncio's default: 60 s)
    assert httpx.get(p.url + "/health", verify=trusting(certs)).status_code == 200
