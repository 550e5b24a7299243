"""The vLLM-Ascend ``recomputed`` continuation stops after ``recompute_max_attempts`` continuations.

A decoder that ends a request with ``stop_reason "recomputed"`` (it preempted it) has the director continue it on
a new prefill → decode pair (pdproxy/pd/director.py ``continuation``, pdproxy/apis/recompute.py).  A decoder that
does so every time must not be followed forever: with ``recompute_max_attempts = N`` the request gets exactly
``N + 1`` decode legs (the first and N continuations), then the client gets the error — a 502 before the response
started, an SSE error event (then ``[DONE]``) after.  Driven on the real director with fake engines in process
(tests/middle/rig.py), whose ``close`` also asserts that every counter is back to zero."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.middle.fake_upstream import Answer, Outcome, Stream, chat_chunk, completion
from tests.middle.rig import DECODERS, Rig, chat_body

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]

LEGS_SCRIPTED = 12
"""Far more recomputed answers than the cap allows: what stops the request is the cap, not the script."""


def recomputed_answer() -> dict[str, Any]:
    body = completion(" part", finish="stop", completion_tokens=1)
    body["choices"][0]["stop_reason"] = "recomputed"
    return body


def recomputed_stream() -> Stream:
    end = chat_chunk("", finish="stop")
    obj = orjson.loads(end[6:])
    obj["choices"][0]["stop_reason"] = "recomputed"
    return Stream(events=[chat_chunk(" part"), b"data: " + orjson.dumps(obj) + b"\n\n"])


@pytest.mark.parametrize("limit", [0, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_decoder_that_always_recomputes_is_continued_exactly_the_cap_then_the_client_gets_the_error(
        stream: bool, limit: int) -> None:
    async with Rig(decode=DECODERS[:1], recompute_continuation=True, recompute_decoders=["*"],
                   recompute_max_attempts=limit) as rig:
        legs: list[Outcome] = [recomputed_stream() if stream else Answer(body=recomputed_answer())
                               for _ in range(LEGS_SCRIPTED)]
        rig.fake.script_endpoint(DECODERS[0], "decode", *legs)
        sent = rig.send("r", body=chat_body("r", stream=stream, max_tokens=200))
        client = await sent.done()

    decodes = [c for c in rig.fake.of("decode") if c.key == "r"]
    assert len(decodes) == limit + 1, [repr(c) for c in decodes]
    assert len(rig.fake.of("prefill", "r")) == limit + 1               # each continuation is a new P→D pair
    if stream:
        assert client.status == 200
        events = client.events()
        assert events[-1] == b"[DONE]"
        error = orjson.loads(events[-2])["error"]
        assert error["code"] == 502 and "recomputed" in error["message"]
        assert all(b"recomputed" not in e for e in events[:-2])       # the recomputed endings never reached it
    else:
        assert client.status == 502, client.text
        assert "recomputed" in client.json()["error"]["message"]
