"""No head-of-line blocking, end to end on the admission benchmark's engine model (sim: 10K prefill tokens/s,
8,192-token chunks): a 2-token request is answered while a 120K-token prefill runs; large prompts wait in pdproxy's
queue, smaller ones go first; a full queue answers 429.  Orderings and counters, never milliseconds."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import orjson
import pytest

from pdproxy.tokens import sim_prompt
from tests.admission.conftest import Pair
from tests.support import wait_until

pytestmark = pytest.mark.timeout(60)


@contextmanager
def open_request(port: int, body: dict[str, Any]) -> Iterator[socket.socket]:
    """Send a completion request on a raw socket and keep the connection open; leaving the block disconnects
    (the proxy must cancel everything the request holds)."""
    raw = orjson.dumps({"model": "sim-model", **body})
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pdproxy\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
        yield sock
    finally:
        sock.close()


def prefills(pair: Pair) -> list[int]:
    """Sizes (words = sim tokens) of the prompts the prefiller received, in arrival order."""
    return [len(r["body"]["prompt"].split()) for r in pair.prefiller.completions_received()]


def test_two_token_request_is_answered_while_a_120k_prefill_runs(pair_of: Any) -> None:
    pair: Pair = pair_of("flow")
    proxy = pair.proxy(tokenizer="sim")
    try:
        big = {"prompt": sim_prompt(120_000, unique=True, seed=11), "max_tokens": 4, "stream": True}
        with open_request(proxy.port, big) as sock:
            wait_until(lambda: prefills(pair) == [120_000], 20, what="the big prefill reached the prefiller")
            hello = httpx.post(proxy.url + "/v1/completions", timeout=20,
                               json={"model": "sim-model", "prompt": " hello there", "max_tokens": 2})
            assert hello.status_code == 200 and hello.json()["usage"]["completion_tokens"] == 2
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)                                  # the big request has not got a byte yet
            assert prefills(pair) == [120_000]                # the small one skipped the busy prefiller …
            (small,) = pair.decoder.completions_received()    # … and the decoder prefilled it itself
            assert small["body"]["prompt"] == " hello there" and "kv_transfer_params" not in small["body"]
            assert proxy.state.admission.stats.decode_only_total == {"prefillers_busy": 1}
        wait_until(lambda: pair.prefiller.state()["running"] == 0, 10, what="the prefiller aborted the big prefill")
        proxy.wait_idle()
        assert proxy.state.admission.queue.idle()
    finally:
        proxy.stop()


def test_large_prompts_wait_in_the_queue_smaller_go_first_and_a_full_queue_answers_429(pair_of: Any) -> None:
    pair: Pair = pair_of("flow")
    proxy = pair.proxy(tokenizer="sim", decode_only_busy_max_prompt_tokens=0, prefill_budget_tokens=16384, prefill_budget_s=0,
                       prefill_queue_aging_tokens_per_s=0, prefill_queue_max=2)
    queue = proxy.state.admission.queue
    try:
        with ExitStack() as stack:
            def send(n: int, seed: int) -> None:
                stack.enter_context(open_request(proxy.port, {"prompt": sim_prompt(n, unique=True, seed=seed),
                                                              "max_tokens": 1}))
            send(20_000, 1)                                    # 2 s of prefill on an idle prefiller
            wait_until(lambda: prefills(pair) == [20_000], 20, what="first prefill dispatched")
            send(30_000, 2)
            wait_until(lambda: queue.depth == 1, 10, what="30K prompt queued")
            send(3_000, 3)
            wait_until(lambda: queue.depth == 2, 10, what="3K prompt queued")
            full = httpx.post(proxy.url + "/v1/completions", timeout=10,
                              json={"model": "sim-model", "prompt": sim_prompt(3_000, unique=True, seed=4)})
            assert full.status_code == 429 and full.headers["retry-after"]
            assert full.json()["error"]["type"] == "RateLimitError"
            assert prefills(pair) == [20_000]                  # the engine never saw the queued prompts
            wait_until(lambda: len(prefills(pair)) == 2, 20, what="next prefill after the first finished")
            assert prefills(pair) == [20_000, 3_000]           # the smaller one went ahead of the older 30K
            assert queue.depth == 1
        wait_until(lambda: pair.prefiller.state()["running"] == 0, 10, what="prefiller aborted")
        proxy.wait_idle()
        wait_until(queue.idle, 5, what="queue empty")
        assert queue.stats.rejected_full_total == 1
    finally:
        proxy.stop()


def test_short_prompts_can_always_skip_the_prefiller(pair_of: Any) -> None:
    pair: Pair = pair_of("sim512")
    proxy = pair.proxy(decode_only_max_prompt_tokens=16)
    try:
        for prompt in (" hello there", sim_prompt(100)):
            resp = httpx.post(proxy.url + "/v1/completions", timeout=20,
                              json={"model": "sim-model", "prompt": prompt, "max_tokens": 3, "stream": True})
            assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
        assert [r["body"]["prompt"] for r in pair.prefiller.completions_received()] == [sim_prompt(100)]
        short, long = pair.decoder.completions_received()
        assert short["body"]["prompt"] == " hello there" and "kv_transfer_params" not in short["body"]
        assert long["body"]["kv_transfer_params"]["do_remote_prefill"] is True
        stats = proxy.state.admission.stats
        assert stats.decode_only_total == {"short_prompt": 1} and stats.disaggregated_total == 1
        proxy.wait_idle()
    finally:
        proxy.stop()
