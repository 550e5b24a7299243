"""Pure pieces of stream continuation: the simulator's exact greedy continuation (ids or text), the relay's
id stripping on vLLM-shaped chunks, a drain's count of the streams that move, and a loss's cause."""

from __future__ import annotations

import random
from dataclasses import dataclass

import orjson

from pdproxy.apis.request import Api, parse_request
from pdproxy.errors import UpstreamUnavailable
from pdproxy.pd.continuation import LiveStreams, LossCause, RecordIds, Resume, StreamLost
from pdproxy.sim.continuation import greedy_offset
from pdproxy.sim.outputs import WORDS, TokenTable
from pdproxy.tokens import SimTokenizer


def test_greedy_offset_continues_its_own_output_given_as_ids_or_text() -> None:
    tok = SimTokenizer()
    table = TokenTable(tok)
    n = len(WORDS)
    rng = random.Random(3)
    pool = [*table.word_ids, 1, 2, 3, 999]
    for _ in range(400):
        prompt = [rng.choice(pool) for _ in range(rng.randint(0, 10))]
        base = greedy_offset(prompt, table)
        words = [(base + i) % n for i in range(rng.randint(1, 12))]
        for k in range(1, len(words) + 1):
            as_ids = [table.word_ids[w] for w in words[:k]]
            as_text = tok.encode("".join(WORDS[w] for w in words[:k]))
            for tail in (as_ids, as_text):
                assert (greedy_offset(prompt + tail, table) - base - k) % n == 0


class _Usage:
    trigger = b'"usage"'
    recomputed = False

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        return block


def test_record_ids_keeps_blocks_and_nulls_the_ids_for_the_client() -> None:
    req = parse_request(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "stream": True}), Api.CHAT)
    resume = Resume.of(req, True)
    assert resume is not None
    t = RecordIds(resume, _Usage())
    first = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
             b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
             b'"prompt_token_ids":[5,6,7],"prompt_text":null}\n\n')
    token = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
             b'"delta":{"content":" a"},"logprobs":null,"finish_reason":null,"token_ids":[42, 43]}]}\n\n')
    out = t.feed(first + token)
    assert b"[5,6,7]" not in out and b'"prompt_token_ids":null' in out and b'"token_ids":null' in out
    assert orjson.loads(out.split(b"\n\n")[1][6:])["choices"][0]["delta"] == {"content": " a"}
    error = b'data: {"error": {"message": "KV load failed", "type": "InternalServerError", "code": 500}}\n\n'
    assert t.feed(token + error) == token.replace(b"[42, 43]", b"null") and t.recomputed
    assert t.feed(token) == b""                          # nothing after the error event is for the client
    resume.read_transcript()
    assert resume.prompt_ids == [5, 6, 7] and resume.generated == [42, 43, 42, 43] and resume.head["id"] == "c"


def test_a_drain_counts_only_the_streams_that_move() -> None:
    """``migrated`` is the streams that move now: one still waiting for its first event (its move answers False)
    finishes on the drained decoder and is not counted; the registry forgets a stream whose block ended."""
    live = LiveStreams()
    moved: list[str] = []

    @dataclass(eq=False)
    class Leg:
        name: str
        movable: bool

        def move(self) -> bool:
            moved.append(self.name)
            return self.movable

    with live.track("d0", Leg("a", True)), live.track("d0", Leg("b", False)), live.track("d1", Leg("c", True)):
        assert live.count("d0") == 2 and live.count("d0", movable=True) == 1
        assert live.migrate("d0") == 1 and sorted(moved) == ["a", "b"]
    assert live.count("d0") == live.count("d1") == live.migrate("d0") == 0


def test_a_drain_is_the_cause_of_a_planned_loss() -> None:
    err = UpstreamUnavailable("gone", endpoint="d0")
    assert StreamLost(err, planned=True, cause=LossCause.RESET).cause is LossCause.DRAIN
    assert StreamLost(err, cause=LossCause.STALL, last_write=1.0).cause is LossCause.STALL
