"""A stream cut right after a token whose text the decoder held back (vLLM's detokenizer holds back a token that
ends inside a UTF-8 character and sends the character with the token that completes it; the simulator's
``--held-back``): the continuation starts before the held token, so the client's text equals the uninterrupted
run's — without that, the held word's text is lost (docs/stream-continuation.md, "What 'the same stream'
means").  Both shapes of the cut: an event of one token with empty text, and an event of several tokens
(``--stream-interval``) whose text stops before its held last token (found with the engine's ``/detokenize``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pdproxy.sim.outputs import TokenTable
from pdproxy.tokens import SimTokenizer
from tests.continuation.conftest import ARGS
from tests.ops.promtext import scrape
from tests.reliability.harness import Fleet4, Result, run
from tests.support import SimProcess, running

pytestmark = pytest.mark.timeout(60)

MAX = 24
MERGED_MAX = 30
"""Long enough that both prompts' outputs hold an event ending with one held word and one ending with two."""


@pytest.fixture(scope="module")
def held_fleet() -> Iterator[Fleet4]:
    """1 prefiller + 2 decoders whose greedy outputs hold back the text of their non-ASCII words."""
    with running(SimProcess("prefill", *ARGS, "--held-back"),
                 *(SimProcess("decode", *ARGS, "--held-back") for _ in range(2))) as sims:
        yield Fleet4(prefillers=list(sims[:1]), decoders=list(sims[1:]))


@pytest.fixture(scope="module")
def merged_fleet() -> Iterator[Fleet4]:
    """As :func:`held_fleet`, streaming as vLLM with ``--stream-interval 3``: the first token alone, then 3 tokens
    per event."""
    args = (*ARGS, "--held-back", "--stream-interval", "3")
    with running(SimProcess("prefill", *args), *(SimProcess("decode", *args) for _ in range(2))) as sims:
        yield Fleet4(prefillers=list(sims[:1]), decoders=list(sims[1:]))


def _token_events(r: Result) -> list[tuple[str, list[int]]]:
    """Each token event's ``(text, token_ids)`` (the chat role chunk and the finish-only / usage chunks left out)."""
    return [((c.get("delta") or {}).get("content") or c.get("text") or "", c.get("token_ids") or [])
            for e in r.events for c in e.get("choices") or []
            if "role" not in (c.get("delta") or {}) and c.get("finish_reason") is None]


def _cut(fleet: Fleet4, proxy_url: str, req: dict[str, Any], path: str, events: int) -> tuple[Result, int]:
    """Run ``req`` with every decoder resetting its first stream after ``events`` events: the client's result,
    asserted complete (200, one ``[DONE]``, no error event, one usage chunk counting every token of
    ``max_tokens``), and the length of the first continuation's token-id prompt (the shortest a decoder received:
    a continuation may be cut too)."""
    for sim in fleet.decoders:
        sim.reset()
        sim.faults({"kind": "reset_after_events", "events": events, "times": 1})
    got = run(proxy_url, req, n=1, concurrency=1, path=path)[0]
    assert got.status == 200 and got.done == 1 and not got.errors, got.body[-400:]
    usage = [e["usage"] for e in got.events if e.get("usage")]
    assert len(usage) == 1 and usage[0]["completion_tokens"] == req["max_tokens"], usage
    prompts = [r["body"]["prompt"] for s in fleet.decoders for r in s.received()
               if r["path"] == "/v1/completions" and isinstance(r["body"].get("prompt"), list)]
    return got, min(map(len, prompts))


def _texts(r: Result) -> list[str]:
    """Each token event's text (:func:`_token_events`)."""
    return [text for text, _ids in _token_events(r)]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Once upon a time in a data center"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about continuation."}]}),
], ids=["completions", "chat"])
def test_a_cut_right_after_a_held_back_token_continues_with_whole_text(held_fleet: Fleet4, path: str,
                                                                      body: dict[str, Any]) -> None:
    """Cut after the first token event of empty text (a reset): the text, the finish and ``completion_tokens``
    equal the uninterrupted run's, and the continuation's prompt ends before the held token."""
    req = {"model": "sim-model", **body, "max_tokens": MAX, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}}
    proxy = held_fleet.proxy(stream_continuation=True)
    try:
        base = run(proxy.url, req, n=1, concurrency=1, path=path)[0]
        assert base.status == 200 and base.done == 1 and not base.errors
        texts = _texts(base)
        held = texts.index("")                       # the first token whose text was held back
        assert texts[held + 1] and held + 1 < MAX    # …sent with the next token
        skip = 1 if "chat" in path else 0            # the chat role chunk
        cut, first = _cut(held_fleet, proxy.url, req, path, skip + held + 1)
        assert cut.text == base.text
        base_usage = next(e["usage"] for e in base.events if e.get("usage"))
        # the first continuation (the shortest: each decoder cuts its first stream, so a continuation may be cut
        # too): the original prompt + the `held` ids before the held-back one
        assert first == base_usage["prompt_tokens"] + held, (first, base_usage, held)
        held_fleet.assert_clean(proxy)
    finally:
        proxy.stop()


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Once upon a time in a data center"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me about continuation."}]}),
], ids=["completions", "chat"])
@pytest.mark.parametrize("held", [1, 2], ids=["one_held", "two_held"])
def test_a_cut_after_an_event_whose_last_token_is_held_back_continues_with_whole_text(
        merged_fleet: Fleet4, path: str, body: dict[str, Any], held: int) -> None:
    """Cut after the first event of three tokens that has text but whose last ``held`` tokens are held back
    (their text is in a later event; two: the simulator's two adjacent non-ASCII words): the client's text,
    finish and ``completion_tokens`` equal the uninterrupted run's, and the continuation's prompt ends before the
    held tokens (the engine's ``/detokenize`` said where the character starts).  Without the check the
    continuation is primed after the held tokens and their words are lost."""
    req = {"model": "sim-model", **body, "max_tokens": MERGED_MAX, "temperature": 0, "stream": True,
           "stream_options": {"include_usage": True}}
    held_ids = TokenTable(SimTokenizer(), held_back=True).held_ids
    proxy = merged_fleet.proxy(stream_continuation=True)
    try:
        with_ids = run(proxy.url, {**req, "return_token_ids": True}, n=1, concurrency=1, path=path)[0]
        events = _token_events(with_ids)
        sizes = [len(ids) for _, ids in events]           # vLLM's order: the first token alone, then 3 at a time
        assert sizes[0] == 1 and set(sizes[1:]) == {3}, events       # (the last event, with the finish, left out)

        def trailing(ids: list[int]) -> int:            # the held ids ending an event (all but its first at most)
            return next((k for k in range(len(ids) - 1) if ids[-k - 1] not in held_ids), len(ids) - 1)

        cut = next(i for i, (text, ids) in enumerate(events[:-1]) if text and trailing(ids) == held)
        base = run(proxy.url, req, n=1, concurrency=1, path=path)[0]
        assert base.status == 200 and base.done == 1 and not base.errors and base.text == with_ids.text
        skip = 1 if "chat" in path else 0            # the chat role chunk
        got, first = _cut(merged_fleet, proxy.url, req, path, skip + cut + 1)
        assert got.text == base.text
        base_usage = next(e["usage"] for e in base.events if e.get("usage"))
        # the first continuation: the original prompt + the delivered ids less the held ones at the cut
        delivered = sum(sizes[:cut + 1])
        assert first == base_usage["prompt_tokens"] + delivered - held, (first, cut)
        merged_fleet.assert_clean(proxy)
    finally:
        proxy.stop()


def test_an_engine_that_never_answers_detokenize_holds_a_continuation_a_quarter_of_its_budget(
        merged_fleet: Fleet4) -> None:
    """The prefiller's ``/detokenize`` hangs: the check gives up after a quarter of
    ``stream_continuation_timeout_s`` and the stream continues from the cut as it was (the held word's text is then
    lost, as before the check), within the budget counted from the loss's detection — no error event, usage of
    every token, nothing left behind on the engines."""
    req = {"model": "sim-model", "prompt": "Once upon a time in a data center", "max_tokens": MERGED_MAX,
           "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    held_ids = TokenTable(SimTokenizer(), held_back=True).held_ids
    proxy = merged_fleet.proxy(stream_continuation=True, stream_continuation_timeout_s=4.0)
    try:
        path = "/v1/completions"
        events = _token_events(run(proxy.url, {**req, "return_token_ids": True}, n=1, concurrency=1, path=path)[0])
        cut = next(i for i, (text, ids) in enumerate(events[:-1]) if text and len(ids) > 1 and ids[-1] in held_ids)
        merged_fleet.prefillers[0].reset()
        merged_fleet.prefillers[0].faults({"kind": "hang", "path": "/detokenize"})
        got, first = _cut(merged_fleet, proxy.url, req, path, cut + 1)
        assert got.elapsed_s >= 1.0                   # it waited for the hung /detokenize: a quarter of 4 s
        m = scrape(proxy.url)       # the client's gaps (the continuation may be cut too): each under the budget
        losses = m.value("pdproxy_continuation_gap_seconds_count", api="completions")
        assert losses >= 1 and 1.0 <= m.value("pdproxy_continuation_gap_seconds_sum", api="completions") < 4.0 * losses
        usage = next(e["usage"] for e in got.events if e.get("usage"))
        delivered = sum(len(ids) for _, ids in events[:cut + 1])
        assert first == usage["prompt_tokens"] + delivered     # the cut as it was
        merged_fleet.prefillers[0].reset()            # the hung /detokenize connection is closed by pdproxy
        merged_fleet.assert_clean(proxy)
    finally:
        for sim in merged_fleet.all:
            sim.reset()
        proxy.stop()
