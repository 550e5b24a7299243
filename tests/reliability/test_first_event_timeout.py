"""The decoder's first event is waited for with ``decode_first_byte_timeout_s``, the next ones with
``decode_idle_timeout_s``: an inter-event timeout shorter than a slow first token must not cut the request.

The decoders run the simulator's ``slow`` fault (pdproxy/sim/faults.py): every gap before a token event, the first
one included, is stretched to ``min_gap_s * (factor - 1)`` seconds (0.6 s here).  On ``/v1/completions`` there is
no role chunk (vLLM sends none for completions), so the first event waits that long; with ``max_tokens: 1`` no
other gap is stretched, with ``max_tokens: 3`` the gaps after the first event are too.
"""

from __future__ import annotations

import pytest

from tests.reliability.harness import Fleet4, Result, run

pytestmark = pytest.mark.timeout(30)

SLOW_FIRST = {"kind": "slow", "factor": 13, "min_gap_s": 0.05}  # 0.6 s before each token event
TIMEOUTS = {"decode_first_byte_timeout_s": 5.0, "decode_idle_timeout_s": 0.25, "request_timeout_s": 10.0}


def completion(max_tokens: int) -> dict[str, object]:
    return {"model": "sim-model", "prompt": "Tell me about disaggregated serving.", "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}


def finishes(r: Result) -> list[str]:
    return [c["finish_reason"] for e in r.events for c in e.get("choices") or [] if c.get("finish_reason")]


def test_slow_first_token_is_not_cut_by_the_idle_timeout(fleet4: Fleet4) -> None:
    proxy = fleet4.proxy(**TIMEOUTS)
    try:
        for d in fleet4.decoders:
            d.faults(SLOW_FIRST)
        results = run(proxy.url, completion(1), n=2, concurrency=2, path="/v1/completions")
        for r in results:
            assert (r.status, r.errors, r.done, finishes(r)) == (200, [], 1, ["length"]), r.body[:300]
            assert r.elapsed_s >= 0.5  # the first token really was slower than decode_idle_timeout_s
        assert sum(len(d.completions_received()) for d in fleet4.decoders) == 2  # no failover, no retry
        fleet4.assert_clean(proxy)
    finally:
        proxy.stop()


def test_idle_timeout_still_cuts_slow_gaps_after_the_first_event(fleet4: Fleet4) -> None:
    proxy = fleet4.proxy(**TIMEOUTS)
    try:
        for d in fleet4.decoders:
            d.faults(SLOW_FIRST)
        [r] = run(proxy.url, completion(3), n=1, concurrency=1, path="/v1/completions")
        assert r.status == 200 and r.events and r.done == 1 and finishes(r) == []
        assert len(r.errors) == 1 and "timed out mid-stream" in r.errors[0]["error"]["message"]
        assert r.body.rstrip().endswith(b"data: [DONE]")
        fleet4.assert_clean(proxy)
    finally:
        proxy.stop()
