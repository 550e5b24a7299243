"""A non-streamed request gives the prefiller's lease back when the decoder starts answering (its status line),
not when the whole body has arrived: the prefill queue's count of KV pinned on the prefiller drops while the
decoder is still producing the body."""

from __future__ import annotations

import threading

import httpx
import pytest

from tests.conftest import SIM_ARGS
from tests.core.fake_decoder import HeadersFirstDecoder
from tests.support import ProxyThread, SimProcess, running, wait_until

pytestmark = pytest.mark.timeout(60)

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "what is disaggregated prefill?"}],
        "max_tokens": 4}


def test_prefill_lease_released_at_the_decoders_status_line() -> None:
    decoder = HeadersFirstDecoder()
    with running(SimProcess("prefill", *SIM_ARGS)) as (prefiller,), decoder.running():
        proxy = ProxyThread(prefill=[prefiller.url], decode=[decoder.url]).start()
        try:
            key = f"prefill:{prefiller.url}"
            answer: list[httpx.Response] = []
            client = threading.Thread(target=lambda: answer.append(
                httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=30)))
            client.start()
            wait_until(lambda: decoder.headers_sent == 1, 20, 0.01, "the decoder's status line")
            assert decoder.received[0]["kv_transfer_params"]["do_remote_prefill"]    # a real PD handoff
            wait_until(lambda: proxy.load()[key] == (0, 0), 5, 0.01, "the prefill lease given back")
            assert not answer                                     # … while the body is still being produced
            assert proxy.load()[f"decode:{decoder.url}"][0] == 1  # the decoder's own lease is still held
            ledger = proxy.state.ledger
            assert ledger.kv_held_tokens(proxy.state.pool.endpoints()[0]) == 0
            decoder.release.set()
            client.join(timeout=20)
            assert answer[0].status_code == 200 and answer[0].json()["choices"][0]["message"]["content"] == "done"
            proxy.wait_idle()
        finally:
            proxy.stop()
