"""Streams survive a decoder (docs/stream-continuation.md): a chat or text completions stream cut after its first
event (reset, end of body without ``[DONE]``, vLLM's in-band error event, a silence far above its inter-token
time) continues on another P→D pair, and the client's stream is the
uninterrupted one — same text, one role chunk, one id, usage of the original prompt and every delivered token."""

from __future__ import annotations

from typing import Any

import pytest

from tests.reliability.harness import Fleet4, Result, run

pytestmark = pytest.mark.timeout(60)

MAX = 24
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "Tell me about continuation."}],
        "max_tokens": MAX, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
COMPLETIONS = {"model": "sim-model", "prompt": "Once upon a time in a data center", "max_tokens": MAX,
               "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
ON = {"stream_continuation": True, "stream_continuation_max": 3, "stream_continuation_stall_min_s": 0.3}


def one(url: str, body: dict[str, Any], path: str) -> Result:
    return run(url, body, n=1, concurrency=1, path=path)[0]


def roles(r: Result) -> int:
    return sum(1 for e in r.events for c in e.get("choices") or [] if "role" in (c.get("delta") or {}))


def usage(r: Result) -> dict[str, Any]:
    found = [e["usage"] for e in r.events if e.get("usage")]
    assert len(found) == 1, found
    return dict(found[0])


@pytest.mark.parametrize("kind", ["reset_after_events", "close_without_done", "error_after_events",
                                  "stall_after_events"])
@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETIONS)],
                         ids=["chat", "completions"])
def test_cut_stream_continues_token_exact(fleet5: Fleet4, kind: str, path: str, body: dict[str, Any]) -> None:
    """Every decoder cuts its first stream after 5 events; the client's stream still equals the uninterrupted
    run (text, finish, usage), with one id and one role chunk, and the continuation legs carry the token ids."""
    proxy = fleet5.proxy(**ON)
    try:
        base = one(proxy.url, body, path)
        assert base.status == 200 and not base.errors and base.done == 1
        for sim in fleet5.decoders:
            sim.faults({"kind": kind, "events": 5, "times": 1})
        cut = one(proxy.url, body, path)
        assert cut.status == 200 and not cut.errors, cut.body[-400:]
        assert cut.done == 1
        assert cut.text == base.text and len(cut.text.split()) == MAX
        assert roles(cut) == roles(base) == (1 if "chat" in path else 0)
        assert len({e["id"] for e in cut.events}) == 1
        assert usage(cut)["completion_tokens"] == MAX
        assert usage(cut)["prompt_tokens"] == usage(base)["prompt_tokens"]
        assert [c["finish_reason"] for e in cut.events for c in e["choices"] if c.get("finish_reason")] == ["length"]
        assert all(c.get("token_ids") is None and c.get("prompt_token_ids") is None and e.get("prompt_token_ids")
                   is None for e in cut.events for c in e["choices"])  # the ids were for the proxy only
        legs = [r["body"] for s in fleet5.decoders for r in s.received()
                if r["path"] == "/v1/completions" and isinstance(r["body"].get("prompt"), list)]
        assert legs, "no continuation leg reached a decoder"
        assert all(b["return_token_ids"] is True and b["max_tokens"] < MAX for b in legs)
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


def test_off_or_ineligible_gets_the_error_event(fleet5: Fleet4) -> None:
    """With continuation off, and for an ineligible stream (stop strings) with it on, a cut stream ends with the
    typed error event + [DONE] as before, and no continuation leg is sent."""
    for settings, body in (({}, CHAT), (ON, {**CHAT, "stop": ["never-said"]})):
        proxy = fleet5.proxy(**settings)
        try:
            fleet5.reset()
            for sim in fleet5.decoders:
                sim.faults({"kind": "reset_after_events", "events": 5, "times": 1})
            cut = one(proxy.url, body, "/v1/chat/completions")
            assert cut.status == 200 and len(cut.errors) == 1 and cut.done == 1
            assert not any(isinstance(r["body"].get("prompt"), list) for s in fleet5.decoders for r in s.received())
            fleet5.assert_clean(proxy)
        finally:
            proxy.stop()
