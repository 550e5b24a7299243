"""Engine addresses are taken out of client-facing errors (``pdproxy.errors.public_message``) in one pass over the
message, whatever client text it holds: a model name of 100,000 characters is answered at once, not after the
minutes a backtracking pattern would spend (one did: ``"a-" * 20000`` froze the event loop for 20 s)."""

from __future__ import annotations

import httpx
import pytest

from pdproxy.errors import BadRequest, ModelNotFound, UpstreamUnavailable, public_message
from pdproxy.http.client import H1Pool, PoolTimeout
from pdproxy.http.errors import transport_error
from tests.conftest import Fleet
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(("message", "public"), [
    ("Cannot connect to host d0.internal:9100 ssl:default [Connection refused]",
     "Cannot connect to host ssl:default [Connection refused]"),
    ("[Errno 111] Connect call failed ('10.0.0.5', 8100)", "[Errno 111] Connect call failed"),
    ("[Errno 111] Connect call failed ('fd00::5', 8100, 0, 0)", "[Errno 111] Connect call failed"),
    ("decoder http://10.0.0.5:8200#dp1 failed", "decoder failed"),
    ("prefiller https://[::1]:8100/v1 (boom)", "prefiller (boom)"),
    ("cut at [fd00::5]:8100 mid-stream", "cut at mid-stream"),
    ("prefiller 10.0.0.5:8100.", "prefiller."),
    ("no address in these words: a-b.c d:e", "no address in these words: a-b.c d:e"),
])
def test_addresses_leave_and_the_words_stay(message: str, public: str) -> None:
    assert public_message(message) == public


@pytest.mark.anyio
@pytest.mark.parametrize("host", ["fd00::5", "10.0.0.5", "d0.internal"])
async def test_a_pool_timeout_names_no_part_of_the_engines_address(host: str) -> None:
    """A client that keeps an engine's connections busy gets the pool's time-out as a 504 whose message went
    through :func:`public_message`: it named an IPv6 engine unbracketed, and ``fd00::`` was left in it."""
    pool = H1Pool(connect_timeout_s=1.0, keepalive_s=5.0, max_per_endpoint=1, wait_s=0.0)
    key = (host, 8100)
    pool.open[key] = 1                                 # the one connection allowed is taken
    with pytest.raises(PoolTimeout) as raised:
        await pool.acquire(key)
    url = f"http://[{host}]:8100" if ":" in host else f"http://{host}:8100"
    message = transport_error(raised.value, f"decoder {url}", url).message
    public = public_message(message)
    assert host not in public and "fd00" not in public and "8100" not in public
    assert public.startswith("decoder") and "all 1 connections to stayed busy" in public, public


@pytest.mark.parametrize("text", [
    "a-" * 200_000,                       # a URL's scheme or a host at every letter, for a backtracking pattern
    "a" * 400_000,
    "a." * 200_000 + ":",
    "a.-" * 130_000 + ":1",
    "[" + ":" * 400_000,                  # a bracketed IPv6 address that never closes
    " " * 400_000 + "x() at http://d0:1",  # an address, so empty brackets are looked for after the spaces
    "(" + " " * 400_000 + "'",
], ids=["dashes", "letters", "dots", "mixed", "colons", "spaces", "tuple"])
def test_a_long_message_is_read_once(text: str) -> None:
    """Each of these took minutes where the cost grew with the square of the length (the pytest timeout fails it
    then); linear, each is milliseconds."""
    out = public_message(f"The model `{text}` does not exist.")
    assert out.startswith("The model `") and out.endswith("does not exist.") and "d0:1" not in out


def test_a_model_name_of_100k_characters_gets_its_404_at_once(sims: Fleet) -> None:
    """End to end: vLLM's 404 naming the model, in the time of a request; other clients are answered meanwhile."""
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders]).start()
    try:
        model = "a-" * 50_000
        with httpx.Client(timeout=10) as client:
            r = client.post(proxy.url + "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            assert r.status_code == 404, r.text[:300]
            assert r.json()["error"]["message"] == ModelNotFound(model, "decode", ["sim-model"]).message
            assert client.get(proxy.url + "/health").status_code == 200
            r = client.post(proxy.url + "/v1/messages", json={
                "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 404 and r.json()["type"] == "error", r.text[:300]
        proxy.wait_idle()
    finally:
        proxy.stop()


@pytest.mark.anyio
async def test_a_refused_engine_connection_reads_whole_without_its_address() -> None:
    """The client's connect error names the engine for the log and reads as a sentence once the address is taken
    out (it read "connect to failed" before)."""
    import socket

    from pdproxy.http.client import ConnectError, H1Pool

    with socket.socket() as held:                      # bound, never listening: connects are refused, and no
        held.bind(("127.0.0.1", 0))                    # other process can take the port while it is held
        port = held.getsockname()[1]
        pool = H1Pool(connect_timeout_s=2.0, keepalive_s=1.0)
        with pytest.raises(ConnectError) as refused:
            await pool.connect(("127.0.0.1", port))
    full = str(refused.value)
    assert f"127.0.0.1:{port}" in full
    assert public_message(full).startswith("connect failed: [Errno 111]"), public_message(full)
    if socket.has_ipv6:                                # an IPv6 engine's address leaves whole, too
        with socket.socket(socket.AF_INET6) as held6:
            try:
                held6.bind(("::1", 0))
            except OSError:
                return                                 # no IPv6 loopback here
            port6 = held6.getsockname()[1]
            with pytest.raises(ConnectError) as refused6:
                await pool.connect(("::1", port6))
        assert public_message(str(refused6.value)).startswith("connect failed: "), str(refused6.value)
        assert "::1" not in public_message(str(refused6.value))


@pytest.mark.parametrize("model", ["http://x/y", "evil\n2026-12-06 10:00:00,000 INFO", "10.0.0.5:8100"])
def test_the_clients_own_input_is_quoted_as_written(model: str) -> None:
    """The address filter is for engine failures; an error about the client's own input quotes it as vLLM does —
    a model named ``http://x/y`` came back as "The model `` does not exist", a ``10:00`` in it lost its hour."""
    body = ModelNotFound(model, "decode", ["sim-model"]).body()["error"]
    assert body["message"].startswith(f"The model `{model}` does not exist.")
    bad = BadRequest(f"messages.0.role must be 'user', 'assistant' or 'system', got {model!r}", param="messages.0.role")
    assert bad.body()["error"]["message"].endswith(repr(model))
    assert "10.0.0.5" not in UpstreamUnavailable(f"decoder http://10.0.0.5:8100 failed: {model}").body()["error"][
        "message"]                                                  # an engine failure is still filtered


def test_a_kv_pool_400_names_no_engine() -> None:
    """The KV-pool 400 names the engine whose pool it is in the log; the client's copy is filtered, as it was
    before client-input errors were quoted as written."""
    from pdproxy.endpoints import Role
    from pdproxy.engines.limits import EngineLimits, Violation
    lim = EngineLimits(max_model_len=8192, kv_pool_tokens=1024, num_gpu_blocks=64, block_size=16)
    err = Violation(Role.DECODE, "http://10.0.0.5:8100", "kv_pool", 1008, 1, lim).error(2000, exact=True)
    assert "10.0.0.5" in err.message
    message = err.body()["error"]["message"]
    assert "10.0.0.5" not in message and "8100" not in message and "holds only 1008 tokens" in message
