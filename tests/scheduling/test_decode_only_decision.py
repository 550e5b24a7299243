"""The PD decision (pdproxy/scheduling/decider.py) through real processes: a burst of short prompts keeps the
prefill leg — many small prefills in flight are not "long work", however many tokens they add up to — while a
small prompt arriving behind a long prefill goes straight to the decoder and is answered before the long one.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from pdproxy.endpoints import Role
from pdproxy.tokens import sim_prompt
from tests.support import ProxyThread, SimProcess, running, wait_until

pytestmark = pytest.mark.timeout(60)

BURST = 120
SHORT_TOKENS = 300           # 120 × 300 = 36,000 prompt tokens: far past prefill_busy_tokens (8,192) in flight
SIM = ("--served-model-name", "sim-model", "--max-model-len", "131072", "--decode-tokens-per-s", "0")


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[SimProcess, SimProcess]]:
    # 20,000 prompt tokens/s: the burst's prefills overlap on the prefiller; a 60,000-token prompt takes 3 s
    with running(SimProcess("prefill", *SIM, "--prefill-tokens-per-s", "20000"),
                 SimProcess("decode", *SIM, "--prefill-tokens-per-s", "0")) as sims:
        yield sims[0], sims[1]


async def burst(url: str, n: int) -> list[int]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        async def one(i: int) -> int:
            body = {"model": "sim-model", "max_tokens": 2,
                    "messages": [{"role": "user", "content": sim_prompt(SHORT_TOKENS, unique=True, seed=i)}]}
            return (await client.post(url + "/v1/chat/completions", json=body)).status_code
        return list(await asyncio.gather(*(one(i) for i in range(n))))


def test_a_burst_of_short_prompts_keeps_the_prefill_leg(pair: tuple[SimProcess, SimProcess]) -> None:
    prefiller, decoder = pair
    for s in pair:
        s.reset()
    proxy = ProxyThread(prefill=[prefiller.url], decode=[decoder.url], tokenizer="sim").start()
    try:
        inflight: list[int] = []
        ledger = proxy.state.admission.queue.ledger
        (p,) = proxy.state.pool.endpoints(Role.PREFILL)
        ledger.add_listener(lambda: inflight.append(ledger.inflight_tokens(p)))   # each prefill's end, after it
        statuses = asyncio.run(burst(proxy.url, BURST))
        assert statuses == [200] * BURST
        stats = proxy.state.admission.stats
        # the burst had prefill_busy_tokens in flight (the old rule sent the rest of it to the decoder)
        assert max(inflight) + SHORT_TOKENS >= 8192, max(inflight)
        assert stats.decode_only_total == {} and stats.disaggregated_total == BURST
        assert len(prefiller.completions_received()) == BURST
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_a_small_prompt_behind_a_long_prefill_goes_to_the_decoder(pair: tuple[SimProcess, SimProcess]) -> None:
    prefiller, decoder = pair
    for s in pair:
        s.reset()
    proxy = ProxyThread(prefill=[prefiller.url], decode=[decoder.url], tokenizer="sim").start()
    try:
        big = orjson.dumps({"model": "sim-model", "prompt": sim_prompt(60_000, unique=True, seed=7),
                            "max_tokens": 2, "stream": True})
        with socket.create_connection(("127.0.0.1", proxy.port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(big) + big)
            wait_until(lambda: prefiller.state()["running"] == 1, 20, what="the long prefill runs")
            hello: dict[str, Any] = {"model": "sim-model", "prompt": " hello there", "max_tokens": 2}
            answer = httpx.post(proxy.url + "/v1/completions", json=hello, timeout=20)
            assert answer.status_code == 200
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)                                   # answered before the long one got a byte
            sock.setblocking(True)
            sock.settimeout(20)
            assert sock.recv(1)                                # the long one completes as well
        assert proxy.state.admission.stats.decode_only_total == {"prefillers_busy": 1}
        (small,) = decoder.completions_received()[:1]
        assert small["body"]["prompt"] == " hello there" and "kv_transfer_params" not in small["body"]
        wait_until(lambda: proxy.state.pool.idle(), 20, what="proxy idle")
    finally:
        proxy.stop()
