"""Stream continuation's metrics and time budget (docs/stream-continuation.md): a real continuation moves
``pdproxy_continuations_total`` by its cause, counts its re-prefill apart from the client's usage and
``pdproxy_prompt_tokens_total``, and observes the client-visible gap; a stream that is not continued is counted by
reason; a continuation whose decoders never answer ends in the typed error event once
``stream_continuation_timeout_s`` has passed, with every counter back to zero."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.continuation.test_continuation import CHAT, MAX, ON, logged, one, usage
from tests.ops.promtext import Samples, scrape
from tests.reliability.harness import Fleet4, parse_sse

pytestmark = pytest.mark.timeout(60)

CAUSES = {"reset_after_events": "reset", "close_without_done": "no_end", "error_after_events": "error_event",
          "stall_after_events": "stall"}


def test_metrics_count_each_cause_the_reprefill_and_the_gap(fleet5: Fleet4) -> None:
    """One cut chat stream per loss kind, then a cut stream that may not continue (stop strings): each cause is
    counted once, the re-prefilled prompt tokens equal the continuation legs' token-id prompts, the usage and
    ``pdproxy_prompt_tokens_total`` hold only the original prompts, one gap per continuation."""
    proxy = fleet5.proxy(**ON)
    try:
        prompts = 0
        for kind in CAUSES:
            for sim in fleet5.decoders:
                sim.reset()
                sim.faults({"kind": kind, "events": 5, "times": 1, "path": "/v1/chat/completions"})
            cut = one(proxy.url, CHAT, "/v1/chat/completions")
            assert cut.status == 200 and not cut.errors and cut.done == 1, cut.body[-300:]
            assert usage(cut)["completion_tokens"] == MAX
            prompts += usage(cut)["prompt_tokens"]
        legs = [len(r["body"]["prompt"]) for s in fleet5.decoders for r in s.received()
                if r["path"] == "/v1/completions" and isinstance(r["body"].get("prompt"), list)]
        assert len(legs) == 1, legs       # received() is per reset: the last kind's leg
        for sim in fleet5.decoders:
            sim.reset()
            sim.faults({"kind": "reset_after_events", "events": 5, "times": 1})
        refused = one(proxy.url, {**CHAT, "stop": ["never-said"]}, "/v1/chat/completions")
        assert len(refused.errors) == 1 and refused.done == 1
        proxy.wait_idle()
        m = scrape(proxy.url)
        for cause in CAUSES.values():
            assert m.value("pdproxy_continuations_total", cause=cause, api="chat") == 1, (cause, m.text)
        assert m.total("pdproxy_continuations_total") == len(CAUSES)
        assert m.value("pdproxy_continuations_refused_total", reason="ineligible", api="chat") == 1
        assert m.total("pdproxy_continuations_refused_total") == 1
        assert m.value("pdproxy_continuation_gap_seconds_count", api="chat") == len(CAUSES)
        reprefill = m.value("pdproxy_continuation_prefill_tokens_total", api="chat")
        # each leg re-prefills the prompt + the tokens delivered before the cut (the same cut point every time)
        assert reprefill == len(CAUSES) * legs[0]
        # the same prompt each time, the refused stream's included; the re-prefills are not in it
        assert m.value("pdproxy_prompt_tokens_total", api="chat") == prompts // len(CAUSES) * (len(CAUSES) + 1)
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


def test_a_continuation_that_never_answers_ends_within_the_budget(fleet5: Fleet4) -> None:
    """The first leg is reset after 5 events; every decoder then runs the continuation (pulls its KV) but never
    sends an event.  With a 1 s budget and a 60 s first-event timeout the client gets the typed error event + [DONE]
    long before the first-event timeout, the refusal is counted as ``timeout``, and the engines, pinned KV and the
    proxy's load are back to zero."""
    budget = 1.0
    proxy = fleet5.proxy(**ON, stream_continuation_timeout_s=budget, decode_first_byte_timeout_s=60.0)
    try:
        for sim in fleet5.decoders:
            sim.faults({"kind": "reset_after_events", "events": 5, "times": 1, "path": "/v1/chat/completions"},
                       {"kind": "stall_after_events", "events": 0, "path": "/v1/completions"})
        stamps: list[tuple[float, bytes]] = []
        with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, timeout=30) as resp:
            assert resp.status_code == 200
            for chunk in resp.iter_raw():
                stamps.append((time.monotonic(), chunk))
        body = b"".join(c for _, c in stamps)
        events, done, errors = parse_sse(body)
        assert done == 1 and len(errors) == 1, body[-400:]
        assert "stream_continuation_timeout_s" in errors[0]["error"]["message"]
        assert events and sum(1 for e in events for c in e["choices"] if c.get("delta", {}).get("content")) >= 3
        error_at = next(t for t, c in stamps if b'"error"' in c)
        last_content = max(t for t, c in stamps if b'"content"' in c and t <= error_at)
        assert error_at - last_content < 60.0 / 4, "the budget, not the first-event timeout, ended the stream"
        conts = [r for s in fleet5.decoders for r in s.received() if isinstance(r["body"].get("prompt"), list)]
        assert conts, "no continuation leg reached a decoder"
        proxy.wait_idle()
        m: Samples = scrape(proxy.url)
        assert m.value("pdproxy_continuations_refused_total", reason="timeout", api="chat") == 1
        assert m.total("pdproxy_continuations_total") == 0       # it never went on: refused, not continued too
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


def test_a_continuation_waits_within_the_budget_for_a_decoder_to_take_it(fleet5: Fleet4) -> None:
    """One decoder, whose breaker opens on its first failure for 0.5 s: it resets the stream after 5 events, so at
    the loss no decoder can take the continuation (the lost one excluded, its breaker open).  The continuation waits
    (within the 20 s budget) and runs on the same decoder once its breaker lets a trial through; the client gets
    the uninterrupted text, one continuation is counted and none refused."""
    decoder = fleet5.decoders[0]
    proxy = fleet5.proxy(**ON, decode=[decoder.url], breaker_failures=1, breaker_open_s=0.5)
    try:
        base = one(proxy.url, CHAT, "/v1/chat/completions")
        assert base.status == 200 and not base.errors and base.done == 1
        decoder.faults({"kind": "reset_after_events", "events": 5, "times": 1, "path": "/v1/chat/completions"})
        cut = one(proxy.url, CHAT, "/v1/chat/completions")
        assert cut.status == 200 and not cut.errors and cut.done == 1, cut.body[-400:]
        assert cut.text == base.text and usage(cut)["completion_tokens"] == MAX
        legs = [r for r in decoder.received() if isinstance(r["body"].get("prompt"), list)]
        assert len(legs) == 1, "the continuation ran on the decoder it lost, once its breaker let a trial through"
        proxy.wait_idle()
        m = scrape(proxy.url)
        assert m.value("pdproxy_continuations_total", cause="reset", api="chat") == 1
        assert m.total("pdproxy_continuations_refused_total") == 0
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


def test_a_continuation_no_decoder_takes_within_the_budget_ends_with_the_reason(fleet5: Fleet4) -> None:
    """The same single decoder, its breaker open for 30 s after the loss (its ``/health`` failing) and a 1 s budget:
    the client gets the
    typed error event + ``[DONE]`` about a second after the loss, naming the budget and why no decoder took it;
    the refusal is counted as ``timeout`` and nothing stays pinned or loaded."""
    decoder = fleet5.decoders[0]
    proxy = fleet5.proxy(**ON, decode=[decoder.url], breaker_failures=1, breaker_open_s=30.0,
                         stream_continuation_timeout_s=1.0)
    try:
        decoder.faults({"kind": "reset_after_events", "events": 5, "times": 1, "path": "/v1/chat/completions"},
                       {"kind": "status", "status": 503, "path": "/health"})    # the probe after the loss fails
        cut = one(proxy.url, CHAT, "/v1/chat/completions")
        assert cut.status == 200 and cut.done == 1 and len(cut.errors) == 1, cut.body[-400:]
        message = cut.errors[0]["error"]["message"]
        assert "stream_continuation_timeout_s (1 s)" in message and "No healthy decode endpoint" in message, message
        assert not [r for r in decoder.received() if isinstance(r["body"].get("prompt"), list)]
        proxy.wait_idle()
        m = scrape(proxy.url)
        assert m.value("pdproxy_continuations_refused_total", reason="timeout", api="chat") == 1
        assert m.total("pdproxy_continuations_total") == 0
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


def test_a_continuation_whose_legs_fail_says_so_and_is_counted_once(fleet5: Fleet4, tmp_path: Path) -> None:
    """The stream's decoder resets it after 5 events and every continuation leg's prefill is refused (the prefiller
    answers 503): the client's error event says the decoder was lost and its continuation failed, the loss is
    counted once (``failed``) and not as continued, and the log line names the lost decoder."""
    log_path = tmp_path / "requests.jsonl"
    proxy = fleet5.proxy(**ON, prefill_attempts=1, request_log_path=str(log_path))
    try:
        for sim in fleet5.decoders:
            sim.faults({"kind": "reset_after_events", "events": 5, "times": 1, "path": "/v1/chat/completions"})
        for sim in fleet5.prefillers:                       # the continuation's prefill is a /v1/completions
            sim.faults({"kind": "status", "status": 400, "path": "/v1/completions"})
        cut = one(proxy.url, CHAT, "/v1/chat/completions")
        assert cut.status == 200 and cut.done == 1 and len(cut.errors) == 1, cut.body[-400:]
        message = cut.errors[0]["error"]["message"]
        assert "was lost mid-stream and its continuation failed: " in message, message
        assert message.endswith("Service Unavailable (sim fault); the response is incomplete"), message
        proxy.wait_idle()
        line = logged(log_path, 1)[-1]
        assert line["lost_decoders"] == [line["decoder"]] and len(line["continued_as"]) == 1, line
        m = scrape(proxy.url)
        assert m.value("pdproxy_continuations_refused_total", reason="failed", api="chat") == 1, m.text
        assert m.total("pdproxy_continuations_total") == 0
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()
