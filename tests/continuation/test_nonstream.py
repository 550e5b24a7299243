"""Non-streamed requests survive a decoder, invisibly (docs/stream-continuation.md, "Non-streamed requests"): a
chat or text completions request whose decoder had the request, pulled its KV and generated, then reset the
connection mid-body, closed it early, answered vLLM's failure or stalled mid-body, is generated again on a new
P→D pair: the client gets one 200 answer with the content and usage of an uninterrupted greedy run, the lost
decoder's breaker is told, and nothing stays pinned or in flight."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.reliability.harness import Fleet4

pytestmark = pytest.mark.timeout(60)

KINDS = ("reset_after_events", "close_without_done", "error_after_events", "stall_after_events")
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "A plain answer, please."}],
        "max_tokens": 24, "temperature": 0}
COMPLETIONS = {"model": "sim-model", "prompt": "Once upon a time in a data center", "max_tokens": 24,
               "temperature": 0}


def content(api: str, answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if api == "chat" else choice["text"])


@pytest.mark.parametrize(("api", "path", "body"), [("chat", "/v1/chat/completions", CHAT),
                                                   ("completions", "/v1/completions", COMPLETIONS)])
def test_non_streamed_answer_survives_a_lost_decoder(fleet5: Fleet4, api: str, path: str,
                                                     body: dict[str, Any]) -> None:
    victim, *others = fleet5.decoders
    # the stall is detected by decode_nonstream_timeout_s: short, yet far above a healthy answer's time (24 tokens
    # at 400 tokens/s) on a loaded machine, so that only the victim ever times out
    proxy = fleet5.proxy(stream_continuation=True, decode_nonstream_timeout_s=2.5, breaker_failures=5)
    try:
        base = httpx.post(proxy.url + path, json=body, timeout=20)
        assert base.status_code == 200, base.text
        endpoint = next(e for e in proxy.state.pool.endpoints() if e.url == victim.url)
        for kind in KINDS:
            victim.faults({"kind": kind, "times": 1, "path": path})
            for _ in range(60):            # until the scheduler sends one to the victim (1 in 3 per try)
                for sim in fleet5.decoders:
                    if sim is not victim:
                        sim.reset()
                r = httpx.post(proxy.url + path, json=body, timeout=20)
                assert r.status_code == 200, (kind, r.text)
                assert content(api, r.json()) == content(api, base.json()), kind
                assert r.json()["usage"] == base.json()["usage"] or (
                    {k: v for k, v in r.json()["usage"].items() if k != "prompt_tokens_details"}
                    == {k: v for k, v in base.json()["usage"].items() if k != "prompt_tokens_details"}), kind
                if not httpx.get(victim.url + "/sim/faults", timeout=5).json()["faults"]:
                    break                  # the fault fired on this request
            else:
                pytest.fail(f"{kind}: the victim decoder was never picked")
            snap = proxy.state.health.snapshot(endpoint)
            assert snap.consecutive_failures == 1, (kind, snap)       # the lost decoder's breaker was told
            again = [r["path"] for s in others for r in s.received()]
            assert len(again) == 1, (kind, again)                          # generated again on another decoder
            # the victim wins again and its failure count returns to zero before the next kind
            proxy.state.health.record_success(endpoint)
            victim.reset()
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


def test_a_non_streamed_answer_not_done_in_time_is_replaced_without_a_verdict_on_its_decoder(fleet5: Fleet4) -> None:
    """vLLM sends a non-streamed answer's status line when the generation is done, so a decoder silent past
    ``decode_nonstream_timeout_s`` may be generating a long answer, not hung: the request goes to another decoder,
    as before, but the silent one's breaker is not told — judged a failure, a client's few long non-streamed
    requests opened every decoder's breaker and every other client got 503."""
    victim, *_others = fleet5.decoders
    proxy = fleet5.proxy(decode_nonstream_timeout_s=1.5, breaker_failures=1)
    try:
        endpoint = next(e for e in proxy.state.pool.endpoints() if e.url == victim.url)
        victim.faults({"kind": "hang", "times": 1, "path": "/v1/chat/completions"})
        for _ in range(60):                # until the scheduler sends one to the victim
            r = httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=20)
            assert r.status_code == 200, r.text
            if not httpx.get(victim.url + "/sim/faults", timeout=5).json()["faults"]:
                break                      # the fault fired on this request: it waited, then went elsewhere
        else:
            pytest.fail("the victim decoder was never picked")
        snap = proxy.state.health.snapshot(endpoint)
        assert snap.consecutive_failures == 0 and snap.breaker == "closed", snap   # breaker_failures=1: one would open it
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()
