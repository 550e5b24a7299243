"""A stream cut right after a token whose text the decoder held back (vLLM's detokenizer holds back a token that
ends inside a UTF-8 character and sends the character with the token that completes it; the simulator's
``--held-back``): the continuation starts before the held token, so the client's text equals the uninterrupted
run's — without that, the held word's text is lost (docs/stream-continuation.md, "What 'the same stream'
means")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.continuation.conftest import ARGS
from tests.reliability.harness import Fleet4, Result, run
from tests.support import SimProcess, running

pytestmark = pytest.mark.timeout(60)

MAX = 24


@pytest.fixture(scope="module")
def held_fleet() -> Iterator[Fleet4]:
    """1 prefiller + 2 decoders whose greedy outputs hold back the text of their non-ASCII words."""
    with running(SimProcess("prefill", *ARGS, "--held-back"),
                 *(SimProcess("decode", *ARGS, "--held-back") for _ in range(2))) as sims:
        yield Fleet4(prefillers=list(sims[:1]), decoders=list(sims[1:]))


def _texts(r: Result) -> list[str]:
    """Each token event's text (the chat role chunk and the finish-only / usage chunks left out)."""
    return [(c.get("delta") or {}).get("content") or c.get("text") or "" for e in r.events
            for c in e.get("choices") or [] if "role" not in (c.get("delta") or {}) and c.get("finish_reason") is None]


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
        for sim in held_fleet.decoders:
            sim.reset()
            sim.faults({"kind": "reset_after_events", "events": skip + held + 1, "times": 1})
        cut = run(proxy.url, req, n=1, concurrency=1, path=path)[0]
        assert cut.status == 200 and cut.done == 1 and not cut.errors, cut.body[-400:]
        assert cut.text == base.text
        usage = [e["usage"] for e in cut.events if e.get("usage")]
        assert len(usage) == 1 and usage[0]["completion_tokens"] == MAX
        prompts = [r["body"]["prompt"] for s in held_fleet.decoders for r in s.received()
                   if r["path"] == "/v1/completions" and isinstance(r["body"].get("prompt"), list)]
        base_usage = next(e["usage"] for e in base.events if e.get("usage"))
        # the first continuation (the shortest: each decoder cuts its first stream, so a continuation may be cut
        # too): the original prompt + the `held` ids before the held-back one
        assert min(map(len, prompts)) == base_usage["prompt_tokens"] + held, (prompts, base_usage, held)
        held_fleet.assert_clean(proxy)
    finally:
        proxy.stop()
