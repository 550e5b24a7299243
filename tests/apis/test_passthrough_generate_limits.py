"""``/inference/v1/generate`` runs whole on one engine (pdproxy/app/passthrough.py), without the PD routes'
admission — and an engine whose KV pool is below ``max_model_len`` (docs/field-reports.md) waits forever for a
request that outgrows its pool, holding every request queued behind it.  Before: one generate request of 2,000
token ids, which the PD routes refuse in milliseconds, froze the decoder (a chat sent next waited past its 30 s
timeout).  Now it is vLLM's 400 before any engine is contacted, and an output limit the pool cannot hold is lowered
to the pool's room, as the decode leg's is.  Engines: simulated, pool 64 blocks × 16 (1,008 usable tokens) under
``max_model_len`` 8,192, head-of-line blocking on."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.support import ProxyThread, SimProcess, running

pytestmark = pytest.mark.timeout(90)

SEED000 = ("--served-model-name", "m", "--max-model-len", "8192", "--num-gpu-blocks-override", "64",
           "--block-size", "16", "--hol-blocking", "on", "--prefill-tokens-per-s", "0", "--decode-tokens-per-s", "0")
POOL = 63 * 16
"""Tokens one request can hold: the pool less vLLM's null block."""


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[SimProcess, SimProcess]]:
    with running(SimProcess("prefill", *SEED000), SimProcess("decode", *SEED000)) as sims:
        yield sims[0], sims[1]


@pytest.fixture
def proxy(engines: tuple[SimProcess, SimProcess]) -> Iterator[ProxyThread]:
    for s in engines:
        s.reset()
    p = ProxyThread(prefill=[engines[0].url], decode=[engines[1].url], decode_first_byte_timeout_s=5).start()
    try:
        yield p
        p.wait_idle()
    finally:
        p.stop()


def generated(engines: tuple[SimProcess, SimProcess]) -> list[dict[str, object]]:
    return [r["body"] for s in engines for r in s.received() if r.get("path") == "/inference/v1/generate"]


def test_a_generate_prompt_over_every_pool_is_refused_and_the_engines_keep_serving(
        proxy: ProxyThread, engines: tuple[SimProcess, SimProcess]) -> None:
    r = httpx.post(proxy.url + "/inference/v1/generate", timeout=30,
                   json={"model": "m", "token_ids": list(range(1, 2001)), "sampling_params": {"max_tokens": 4}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "maximum context length" in error["message"] and "2000" in error["message"]
    assert generated(engines) == []                                    # no engine was contacted
    chat = httpx.post(proxy.url + "/v1/chat/completions", timeout=30,
                      json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text


@pytest.mark.parametrize(("sampling", "sent"), [
    ({"max_tokens": None}, POOL - 900),          # null: max_model_len's room, more than the pool holds
    ({"max_tokens": 5000, "min_tokens": 3000}, POOL - 900),
    ({"max_tokens": 4000, "n": 2, "temperature": 1}, (POOL - 900) // 2),
    ({"max_tokens": "5000"}, POOL - 900),        # vLLM's pydantic reads "5000" (and 5000.0) as 5000: so does the cap
    ({"max_tokens": 5000.0, "min_tokens": "3000"}, POOL - 900),
    ({"max_tokens": 100, "n": "2", "temperature": 1}, (POOL - 900) // 2),
])
def test_a_generate_output_limit_the_pool_cannot_hold_is_lowered_to_its_room(
        proxy: ProxyThread, engines: tuple[SimProcess, SimProcess], sampling: dict[str, object], sent: int) -> None:
    r = httpx.post(proxy.url + "/inference/v1/generate", timeout=30,
                   json={"model": "m", "token_ids": list(range(1, 901)), "sampling_params": sampling})
    assert r.status_code == 200, r.text
    (body,) = generated(engines)
    params = body["sampling_params"]
    assert isinstance(params, dict) and params["max_tokens"] == sent
    assert params.get("min_tokens", 0) <= sent
    assert all(len(c["token_ids"]) <= sent for c in r.json()["choices"])


def test_a_generate_request_that_fits_is_sent_byte_for_byte(proxy: ProxyThread,
                                                             engines: tuple[SimProcess, SimProcess]) -> None:
    raw = orjson.dumps({"model": "m", "token_ids": list(range(1, 501)), "sampling_params": {"temperature": 0.1}})
    r = httpx.post(proxy.url + "/inference/v1/generate", content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    (body,) = generated(engines)
    assert body == orjson.loads(raw)                                   # vLLM's default 16 fits: nothing changed


def test_a_generate_prompt_of_the_whole_pool_is_refused_on_a_prefiller_too(
        proxy: ProxyThread, engines: tuple[SimProcess, SimProcess]) -> None:
    """A generate request runs prompt and output on the one engine it picks, so a prefiller's limit for it is a
    decoder's (prompt + 1 output token in the pool), not a prefill leg's (the prompt alone): a prompt of exactly
    the pool passed the prefiller's check, went there with ``max_tokens`` lowered to 1, and waited forever."""
    r = httpx.post(proxy.url + "/inference/v1/generate", timeout=30,
                   json={"model": "m", "token_ids": list(range(1, POOL + 1)), "sampling_params": {"max_tokens": 4}})
    assert r.status_code == 400, r.text
    assert "maximum context length" in r.json()["error"]["message"]
    assert generated(engines) == []
    fits = httpx.post(proxy.url + "/inference/v1/generate", timeout=30,
                      json={"model": "m", "token_ids": list(range(1, POOL)), "sampling_params": {"max_tokens": 4}})
    assert fits.status_code == 200, fits.text
    (body,) = generated(engines)
    assert body["sampling_params"] == {"max_tokens": 1}                # the one token the pool still holds


@pytest.mark.parametrize("asked", [50.0, True, "8"])
def test_a_non_integer_output_limit_is_the_engines_to_judge_never_raised(
        proxy: ProxyThread, engines: tuple[SimProcess, SimProcess], asked: object) -> None:
    """``max_tokens`` that is not an integer (nor null) is sent as the client wrote it — vLLM judges it — not read
    as null and replaced by the pool's room (908 here: more than the 50 asked)."""
    httpx.post(proxy.url + "/inference/v1/generate", timeout=30,
               json={"model": "m", "token_ids": list(range(1, 101)), "sampling_params": {"max_tokens": asked}})
    (body,) = generated(engines)
    assert body["sampling_params"] == {"max_tokens": asked}
