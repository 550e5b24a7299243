"""Stream continuation at the stream's end (docs/stream-continuation.md): a decoder lost between its usage chunk
and ``data: [DONE]``, or one that sends vLLM's in-band error event right after ``[DONE]`` (in the same read), leaves
the client one stream with exactly one usage chunk and one ``[DONE]`` — nothing is sent twice, and nothing is
continued after the stream's end."""

from __future__ import annotations

from typing import Any

import pytest

from tests.continuation.test_continuation import CHAT, COMPLETIONS, ON, one
from tests.reliability.harness import Fleet4, Result

pytestmark = pytest.mark.timeout(60)

MAX = 6
APIS = {"completions": ("/v1/completions", {**COMPLETIONS, "max_tokens": MAX}),
        "chat": ("/v1/chat/completions", {**CHAT, "max_tokens": MAX})}


def usages(r: Result) -> int:
    return sum(1 for e in r.events if e.get("usage"))


def continuation_legs(fleet: Fleet4) -> list[dict[str, Any]]:
    return [r["body"] for s in fleet.decoders for r in s.received()
            if r["path"] == "/v1/completions" and isinstance(r["body"].get("prompt"), list)]


def events_before_usage(api: str) -> int:
    """The decoder's events before its usage chunk: chat's role chunk, then one event per token."""
    return MAX + (1 if api == "chat" else 0)


@pytest.mark.parametrize("kind", ["reset_after_events", "close_without_done", "error_after_events",
                                  "stall_after_events"])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_a_decoder_lost_after_its_usage_chunk_ends_the_stream_with_done_only(fleet5: Fleet4, api: str,
                                                                             kind: str) -> None:
    """The decoder is lost right after the usage chunk reached the client: the stream ends with ``[DONE]`` — one
    usage chunk, the uninterrupted text, no error, no continuation leg."""
    path, body = APIS[api]
    proxy = fleet5.proxy(**ON)
    try:
        base = one(proxy.url, body, path)
        assert base.status == 200 and base.done == 1 and usages(base) == 1
        for sim in fleet5.decoders:
            sim.faults({"kind": kind, "events": events_before_usage(api) + 1, "times": 1})
        cut = one(proxy.url, body, path)
        assert cut.status == 200 and not cut.errors, cut.body[-400:]
        assert cut.done == 1 and usages(cut) == 1, cut.body[-600:]
        assert cut.text == base.text
        assert [e["usage"] for e in cut.events if e.get("usage")] == [e["usage"] for e in base.events
                                                                       if e.get("usage")]
        assert not continuation_legs(fleet5)
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


@pytest.mark.parametrize("include_usage", [True, False], ids=["usage", "no-usage"])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_an_error_event_after_done_changes_nothing(fleet5: Fleet4, api: str, include_usage: bool) -> None:
    """vLLM's in-band error event arrives right after ``[DONE]``, in the same read: the client's stream is complete
    and stays as it was — one ``[DONE]``, at most one usage chunk, no error event, no continuation leg."""
    path, body = APIS[api]
    if not include_usage:
        body = {k: v for k, v in body.items() if k != "stream_options"}
    proxy = fleet5.proxy(**ON)
    try:
        base = one(proxy.url, body, path)
        assert base.status == 200 and base.done == 1
        done_index = events_before_usage(api) + (2 if include_usage else 1)
        for sim in fleet5.decoders:
            sim.faults({"kind": "error_after_events", "events": done_index, "times": 1})
        cut = one(proxy.url, body, path)
        assert cut.status == 200 and not cut.errors, cut.body[-400:]
        assert cut.done == 1 and cut.body.endswith(b"data: [DONE]\n\n"), cut.body[-600:]
        assert usages(cut) == (1 if include_usage else 0)
        assert cut.text == base.text
        assert not continuation_legs(fleet5)
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()
