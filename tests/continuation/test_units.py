"""Pure pieces of stream continuation: the simulator's exact greedy continuation (ids or text), the relay's
id stripping on vLLM-shaped chunks, a drain's count of the streams that move, a loss's cause, and the count of
ids whose text vLLM held back at the end of an event of several tokens."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

import orjson
import pytest

from pdproxy.apis.request import Api, parse_request
from pdproxy.errors import UpstreamUnavailable
from pdproxy.pd.continuation import LiveStreams, LossCause, RecordIds, Reframe, Resume, StreamLost, held_in_text
from pdproxy.pd.record import TAIL_BYTES
from pdproxy.sim.continuation import greedy_offset
from pdproxy.sim.outputs import WORDS, TokenTable
from pdproxy.timeline import RequestContext
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


def _nothing(name: str) -> None:
    """A stub leg's default hook: does nothing."""


@dataclass(eq=False)
class _StubLeg:
    """A continuable leg as ``LiveStreams`` sees it: ``move`` calls ``on_move`` and answers ``movable``;
    ``check_lost`` calls ``on_check`` (which may raise, as a leg's stall check can)."""

    name: str
    movable: bool = True
    on_move: Callable[[str], None] = _nothing
    on_check: Callable[[str], None] = _nothing

    def move(self) -> bool:
        self.on_move(self.name)
        return self.movable

    def check_lost(self, now: float) -> None:
        self.on_check(self.name)


class _Usage:
    trigger = b'"usage"'
    recomputed = False

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        return block

    def ending(self, block: bytes, prev: bytes) -> bytes:
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


@pytest.mark.anyio
async def test_a_drain_counts_only_the_streams_that_move() -> None:
    """``migrated`` is the streams that move now: one still waiting for its first event (its move answers False)
    finishes on the drained decoder and is not counted; the registry forgets a stream whose block ended."""
    live = LiveStreams()
    moved: list[str] = []
    with (live.track("d0", _StubLeg("a", True, moved.append)), live.track("d0", _StubLeg("b", False, moved.append)),
          live.track("d1", _StubLeg("c", True, moved.append))):
        assert live.count("d0") == 2 and live.count("d0", movable=True) == 1
        assert live.migrate("d0") == 1 and sorted(moved) == ["a", "b"]
    assert live.count("d0") == live.count("d1") == live.migrate("d0") == 0


@pytest.mark.anyio
async def test_one_sweep_checks_every_tracked_leg_and_stops_when_none_is_left() -> None:
    """The stall check is one timer for all continuable streams (``LiveStreams.sweep``), not one per stream: each
    tracked leg is asked once per sweep, the sweep re-arms itself while a leg is tracked, and no timer is left
    once the last leg is gone."""
    live = LiveStreams(check_interval_s=0.01)
    asked: list[str] = []
    swept = asyncio.Event()

    def ask(name: str) -> None:
        asked.append(name)
        if len(asked) >= 9:
            swept.set()

    assert not live.sweeping
    with (live.track("d0", _StubLeg("a", on_check=ask)), live.track("d0", _StubLeg("b", on_check=ask)),
          live.track("d1", _StubLeg("c", on_check=ask))):
        assert live.sweeping
        async with asyncio.timeout(5):
            await swept.wait()                               # three sweeps at least
        assert sorted(asked[:3]) == ["a", "b", "c"] and sorted(asked[3:6]) == ["a", "b", "c"]
        assert live.sweeping
    n = len(asked)
    live.sweep()                                             # the sweep due next: nobody to ask, not re-armed
    assert len(asked) == n and not live.sweeping


@pytest.mark.anyio
async def test_a_leg_whose_check_fails_stops_no_other_legs_check(caplog: pytest.LogCaptureFixture) -> None:
    """One sweep for all streams must not die with one of them: a leg whose check raises is logged, the others
    are still asked, in this sweep and the next ones."""
    live = LiveStreams(check_interval_s=0.01)
    asked: list[str] = []
    twice = asyncio.Event()

    def ask(name: str) -> None:
        if name == "bad":
            raise RuntimeError("Event loop is closed")
        asked.append(name)
        if len(asked) >= 3:
            twice.set()

    with live.track("d0", _StubLeg("bad", on_check=ask)), live.track("d0", _StubLeg("good", on_check=ask)):
        async with asyncio.timeout(5):
            await twice.wait()                               # three sweeps asked the good leg
        assert live.sweeping
    assert "stall check of a continuable stream failed" in caplog.text


def test_a_drain_is_the_cause_of_a_planned_loss() -> None:
    err = UpstreamUnavailable("gone", endpoint="d0")
    assert StreamLost(err, planned=True, cause=LossCause.RESET).cause is LossCause.DRAIN
    assert StreamLost(err, cause=LossCause.STALL, last_write=1.0).cause is LossCause.STALL


def _chunk(text: str, ids: list[int], finish: str | None = None) -> bytes:
    return b"data: " + orjson.dumps({"id": "c", "object": "text_completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "token_ids": ids}]}) + b"\n\n"


def _lost_after(*events: bytes) -> Resume:
    """A completions stream's state read on loss after ``events`` (its first chunk carries the prompt's ids)."""
    req = parse_request(orjson.dumps({"model": "m", "prompt": "hi", "stream": True, "max_tokens": 50}),
                        Api.COMPLETIONS)
    resume = Resume.of(req, True)
    assert resume is not None
    t = RecordIds(resume, _Usage())
    first = (b'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
             b'"text":"","logprobs":null,"finish_reason":null,"prompt_token_ids":[5,6],"token_ids":[]}]}\n\n')
    t.feed(first)
    for event in events:
        t.feed(event)
    resume.read_transcript()
    return resume


def test_a_large_read_keeps_only_its_last_events_and_the_held_tail_is_still_read() -> None:
    """A read of many token events (a stream at full speed, or one its client paused: tens of KiB) is kept in the
    ring as its last events only (``TAIL_BYTES``: ~4 KiB), so eight of them cost a stream no more than ~36 KiB
    however large the reads; the loss's reading still finds the ids whose events carried no text at the end."""
    big = b"".join(_chunk(" w", [100 + i]) for i in range(600)) + _chunk("", [901]) + _chunk("", [902])
    assert len(big) > 16 * TAIL_BYTES
    resume = _lost_after(big, big)
    assert resume.generated == [100 + i for i in range(600)] + [901, 902] + [100 + i for i in range(600)] + [901, 902]
    assert resume.held == 2 and resume.texted == 1 and not resume.finish
    req = parse_request(orjson.dumps({"model": "m", "prompt": "hi", "stream": True}), Api.COMPLETIONS)
    kept = Resume.of(req, True)
    assert kept is not None
    t = RecordIds(kept, _Usage())
    for block in [_chunk("", [1])] + [big] * 20:
        t.feed(block)
    assert len(kept.tail) == 8 and sum(map(len, kept.tail)) <= 8 * (TAIL_BYTES + len(_chunk(" w", [700])))


class _Engine:
    """``/detokenize`` of a byte-level tokenizer: ids >= 900 are the leading bytes of a character (the decoded text
    ends with U+FFFD while they end it); None: the engine does not answer."""

    def __init__(self, answers: bool = True) -> None:
        self.asked: list[list[int]] = []
        self.answers = answers

    async def __call__(self, ids: list[int]) -> str | None:
        self.asked.append(ids)
        if not self.answers:
            return None
        return "x" * len(ids) + ("\ufffd" if ids and ids[-1] >= 900 else "")


def _held_in_text(resume: Resume, engine: _Engine) -> None:
    asyncio.run(held_in_text(resume, engine))


def test_the_held_back_end_of_an_event_of_several_tokens_is_counted_and_regenerated() -> None:
    # the last event carried 4 ids: text for the first two, the last two (a character's leading bytes) held back
    resume = _lost_after(_chunk(" a", [10]), _chunk(" b c", [11, 12, 901, 902]))
    engine = _Engine()
    _held_in_text(resume, engine)
    assert engine.asked == [[10, 11, 12, 901, 902], [10, 11, 12, 901], [10, 11, 12]]
    assert resume.held == 2
    leg = resume.next_leg()
    assert leg is not None
    assert leg.body["prompt"] == [5, 6, 10, 11, 12] and leg.body["max_tokens"] == 47   # regenerates 901, 902


def test_an_event_of_several_tokens_ending_on_a_whole_character_costs_one_question() -> None:
    resume = _lost_after(_chunk(" a b", [10, 11]))
    engine = _Engine()
    _held_in_text(resume, engine)
    assert engine.asked == [[10, 11]] and resume.held == 0
    leg = resume.next_leg()
    assert leg is not None and leg.body["prompt"] == [5, 6, 10, 11]


def test_held_text_before_an_empty_text_event_adds_to_its_run() -> None:
    # [12, 901] sent " c" (901 held), then [902] with empty text (still inside the character): both are regenerated
    resume = _lost_after(_chunk(" c", [12, 901]), _chunk("", [902]))
    assert resume.held == 1
    engine = _Engine()
    _held_in_text(resume, engine)
    assert engine.asked == [[12, 901], [12]] and resume.held == 2
    leg = resume.next_leg()
    assert leg is not None and leg.body["prompt"] == [5, 6, 12]


def test_no_question_for_one_id_events_a_finish_or_an_engine_that_does_not_answer() -> None:
    one = _lost_after(_chunk(" a", [10]), _chunk(" b", [901]))     # one id with text: that id's text was sent
    engine = _Engine()
    _held_in_text(one, engine)
    assert engine.asked == [] and one.held == 0
    finished = _lost_after(_chunk(" a b", [10, 901], "length"))
    _held_in_text(finished, engine)
    assert engine.asked == [] and finished.held == 0
    silent = _lost_after(_chunk(" a b", [10, 901]))
    mute = _Engine(answers=False)
    _held_in_text(silent, mute)
    assert mute.asked == [[10, 901]] and silent.held == 0        # the continuation starts at the cut, as before
    leg = silent.next_leg()
    assert leg is not None and leg.body["prompt"] == [5, 6, 10, 901]


def lost_after_two_ids(resume: Resume) -> None:
    """``resume``'s chat stream (prompt ids 5, 6, 7) delivered " a b" (ids 42, 43), then its decoder was lost."""
    t = RecordIds(resume, _Usage())
    t.feed(b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
           b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
           b'"prompt_token_ids":[5,6,7],"prompt_text":null}\n\n')
    t.feed(b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
           b'"delta":{"content":" a b"},"logprobs":null,"finish_reason":null,"token_ids":[42,43]}]}\n\n')
    resume.read_transcript()


def test_a_chat_without_an_output_limit_continues_to_the_end_of_the_context() -> None:
    """A chat that set no ``max_tokens`` continues as a completion whose ``max_tokens`` is the room the decoders'
    ``max_model_len`` leaves after prompt + delivered ids — not null, which vLLM reads as 16 on a completion (the
    answer would end 16 tokens after the loss, "length"); with the room gone it ends where it is."""
    req = parse_request(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "stream": True}), Api.CHAT)
    assert req.max_output_tokens is None

    def lost() -> Resume:
        resume = Resume.of(req, True)
        assert resume is not None
        lost_after_two_ids(resume)
        return resume

    leg = lost().next_leg(4096)
    assert leg is not None and leg.api is Api.COMPLETIONS
    assert leg.body["prompt"] == [5, 6, 7, 42, 43] and leg.body["max_tokens"] == 4096 - 5
    assert lost().next_leg(6) is not None                                      # one token of room
    full = lost()
    assert full.next_leg(5) is None and full.finish_reason == "length"         # none: it ends as vLLM's would,
    end = full.ending(include_usage=True).split(b"\n\n")                      # with the finish chunk it lacked
    chunks = [orjson.loads(e[6:]) for e in end if e.startswith(b"data: {")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 2 and end[-2] == b"data: [DONE]"
    unknown = lost().next_leg(None)
    assert unknown is not None and unknown.body["max_tokens"] is None          # no known limit: as the client sent


def test_a_truncated_prompt_is_not_truncated_again_with_the_delivered_ids() -> None:
    """``truncate_prompt_tokens: k`` keeps a prompt's last k tokens, and the ids the decoder sends are that truncated
    prompt; the continuation's prompt is those + the delivered ids, complete as it is. Copied onto the continuation,
    vLLM cut that to its last k ids: the original prompt gone (greedy: not the uninterrupted output)."""
    req = parse_request(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi there you"}],
                                      "stream": True, "max_tokens": 50, "truncate_prompt_tokens": 3,
                                      "temperature": 0, "cache_salt": "s"}), Api.CHAT)
    resume = Resume.of(req, True)
    assert resume is not None
    lost_after_two_ids(resume)
    leg = resume.next_leg(4096)
    assert leg is not None and leg.body["prompt"] == [5, 6, 7, 42, 43]
    assert "truncate_prompt_tokens" not in leg.body
    assert leg.body["temperature"] == 0 and leg.body["cache_salt"] == "s"    # the sampling fields still copied


def test_a_continued_stream_keeps_its_uncallable_tools_in_the_prompt_and_never_calls_one() -> None:
    """A Messages stream whose tools the model may not call (``tool_choice: {"type": "none"}``) is continued (a
    callable tool is not: ``ineligible_reason``); its continuation chat renders the same tools into the prompt and
    says ``tool_choice: "none"`` — without it vLLM reads tools as ``auto``, and the continuation could call a tool
    the original could not."""
    req = parse_request(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "stream": True, "max_tokens": 50, "tool_choice": {"type": "none"},
                                      "tools": [{"name": "f", "input_schema": {"type": "object"}}]}), Api.MESSAGES)
    resume = Resume.of(req, True)
    assert resume is not None
    resume.text.append("Hello")
    leg = resume.next_leg(4096)
    assert leg is not None and leg.api is Api.CHAT
    assert leg.body["tool_choice"] == "none" and [t["function"]["name"] for t in leg.body["tools"]] == ["f"]
    assert leg.body["messages"][-1] == {"role": "assistant", "content": "Hello"}
    callable_tools = parse_request(orjson.dumps({**req.body, "tool_choice": {"type": "auto"}}), Api.MESSAGES)
    assert Resume.of(callable_tools, True) is None


@pytest.mark.parametrize("ids", [b'["a"]', b"[null]", b"[1.5]", b"[1000000000000000000000000000000]", b"[{}]",
                                 b"[true]", b"[-1]"])
@pytest.mark.parametrize("where", ["prompt_token_ids", "token_ids"])
def test_ids_that_are_no_token_ids_refuse_the_continuation_and_never_raise(ids: bytes, where: str) -> None:
    """A lost decoder's recorded ids are read into the continuation's prompt: ids that are none (``"a"``, null,
    1.5, a 31-digit number, a boolean, a negative one) raised out of ``read_transcript`` — the client's error event
    said "internal error in pdproxy" — or were cut (1.5 became 1, a wrong token in the prompt).  Found with a
    decoder sending ``"token_ids": ["a"]`` and dying.  Now the stream is not continued, and says why."""
    req = parse_request(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "stream": True}), Api.CHAT)
    resume = Resume.of(req, True)
    assert resume is not None
    t = RecordIds(resume, _Usage())
    prompt = ids if where == "prompt_token_ids" else b"[5,6,7]"
    out = ids if where == "token_ids" else b"[42]"
    first = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
             b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
             b'"prompt_token_ids":' + prompt + b',"prompt_text":null}\n\n')
    token = (b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
             b'"delta":{"content":" a"},"logprobs":null,"finish_reason":null,"token_ids":' + out + b'}]}\n\n')
    t.feed(first)
    t.feed(token)
    resume.read_transcript()
    why = resume.refusal(2)
    assert why is not None and "not token ids" in why[1], why


@pytest.mark.parametrize(("api", "event"), [
    (Api.MESSAGES, b'event: content_block_start\ndata: {"type": "content_block_start", "index": 0, '
                   b'"content_block": "text"}\n\n'),
    (Api.MESSAGES, b'event: content_block_start\ndata: {"type": "content_block_start", "index": "a", '
                   b'"content_block": {"type": "text", "text": ""}}\n\n'),
    (Api.MESSAGES, b'event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, '
                   b'"delta": "hi"}\n\n'),
    (Api.RESPONSES, b'event: response.output_item.added\ndata: {"type": "response.output_item.added", '
                    b'"output_index": 0, "item": "message"}\n\n'),
    (Api.RESPONSES, b'event: response.content_part.added\ndata: {"type": "response.content_part.added", '
                    b'"content_index": [0]}\n\n'),
    # an index that is no index: 1e30 was kept as a 31-digit integer the continuation's events could not be
    # written with (orjson writes 64 bits: the relay's transform raised), -1.5 was read as -1
    (Api.RESPONSES, b'event: response.output_item.added\ndata: {"type": "response.output_item.added", '
                    b'"output_index": 1e30, "item": {"type": "message", "id": "m"}}\n\n'),
    (Api.RESPONSES, b'event: response.content_part.added\ndata: {"type": "response.content_part.added", '
                    b'"content_index": -1.5}\n\n'),
    (Api.MESSAGES, b'event: content_block_start\ndata: {"type": "content_block_start", "index": 1e30, '
                   b'"content_block": {"type": "text", "text": ""}}\n\n'),
    (Api.RESPONSES, b'event: response.in_progress\ndata: {"type": "response.in_progress", '
                    b'"sequence_number": 18446744073709551615}\n\n'),
])
def test_a_first_leg_event_of_a_shape_vllm_never_sends_refuses_the_continuation_and_never_raises(
        api: Api, event: bytes) -> None:
    """A lost Responses / Messages stream's recorded events are read to rebuild where it stood: an event whose
    member is of another type (``"content_block": "text"``, ``"index": "a"``, ``"item": "message"``) raised
    ``AttributeError`` / ``ValueError`` out of ``read_transcript`` — the client's error event said "internal error
    in pdproxy".  Found reading the first leg's event reader after the token-id one.  Now the stream is not
    continued (``unreadable``), and says why."""
    body = ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stream": True}
            if api is Api.MESSAGES else {"model": "m", "input": "hi", "max_output_tokens": 30, "stream": True})
    resume = Resume.of(parse_request(orjson.dumps(body), api), True)
    assert resume is not None
    resume.blocks.append(event)
    resume.read_transcript()
    why = resume.refusal(2)
    assert why is not None and "could not read" in why[1], why


class _Responder:
    api_stream = None


@pytest.mark.parametrize("ids", [b'["a"]', b"[null]", b"[1.5]", b"[-1]", b"[true]"])
@pytest.mark.parametrize("where", ["prompt_token_ids", "token_ids"])
def test_a_continuation_legs_ids_that_are_no_token_ids_refuse_the_next_continuation_and_never_raise(
        ids: bytes, where: str) -> None:
    """A continuation leg's own chunks are read as the first leg's are (``Reframe.chunk``): its ids go into the
    next continuation's prompt.  Ids that are none raised out of the relay's transform ("a", null) or were cut (1.5
    became 1, a wrong token in the next prompt), where the first leg's are checked (:func:`token_ids`).  Now the
    text still reaches the client and a further loss is refused, saying why."""
    req = parse_request(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 30, "stream": True}),
                        Api.MESSAGES if where == "prompt_token_ids" else Api.CHAT)
    resume = Resume.of(req, True)
    assert resume is not None
    if where == "token_ids":
        lost_after_two_ids(resume)
    ctx = RequestContext(request_id="t", client_request_id=None, api_label="chat")
    chunk = (b'data: {"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
             b'"text":" c","logprobs":null,"finish_reason":null,"token_ids":' + (ids if where == "token_ids" else b"[44]")
             + b'}],"prompt_token_ids":' + (ids if where == "prompt_token_ids" else b"[5,6,7,42,43]") + b'}\n\n')
    out = Reframe(resume, ctx, _Responder()).feed(chunk)  # type: ignore[arg-type]
    assert b" c" in out
    assert all(type(i) is int and i >= 0 for i in [*(resume.prompt_ids or []), *resume.generated])
    why = resume.refusal(3)
    assert why is not None and "not token ids" in why[1], why
