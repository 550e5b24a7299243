"""The relay's id stripping and recording for continuable chat / completions streams (pdproxy/pd/continuation.py
``RecordIds``, through the real splice of pdproxy/pd/relay.py): for vLLM-framed event sequences cut into reads at
arbitrary points, what the client gets equals the reference rewrite (every ``token_ids`` / ``prompt_token_ids``
array → ``null``, or untouched when the client asked for the ids; nothing from vLLM's in-band error event on), and
the transcript read on loss holds exactly the delivered ids, head, finish and reasoning state, and the
continuation's prompt leaves out the trailing ids whose events carried no text (vLLM's detokenizer held their text
back: a cut inside a UTF-8 character)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.apis.request import Api, parse_request
from pdproxy.pd.continuation import _TAIL, Reframe, Resume
from pdproxy.pd.relay import StreamRelay, _Splice
from pdproxy.timeline import RequestContext

REFERENCE = re.compile(rb'token_ids":\[[0-9,\s]*\]')   # the rewrite the client must see, over the whole stream
RECORDED: list[bytes | bytearray] = []      # the last relay()'s record, before it was read
HEAD = {"id": "chatcmpl-4f2a", "created": 1765000000, "model": "m"}
TRICKY = ['"token_ids":[1]', 'token_ids":[', "]}]}\n\n", '"reasoning', "data: {\"error\"", "[1,2]", "null}]}",
          "é中🙂", "\\", '"prompt_token_ids":[5]', '"usage"', "data: [DONE]\n\n", "", " "]


class _Conn:
    flow: Any = None
    paused = False

    def __init__(self, sent: list[bytes]) -> None:
        self.sent = sent

    def body_writer(self) -> Callable[[bytes], None]:
        return self.sent.append

    def finish(self, data: bytes) -> None:
        self.sent.append(data)


class _Out:
    def __init__(self, sent: list[bytes]) -> None:
        self.conn = _Conn(sent)
        self.ended = False
        self.done_sent = False
        self.api_stream = None

    def end_nowait(self, data: bytes = b"") -> None:
        if not self.ended:
            self.ended = True
            self.conn.finish(data)


class _Resp:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@dataclass
class Stream:
    """A vLLM-framed stream (``vllm/entrypoints/openai/chat_completion/serving.py``, ``completion/serving.py``):
    its events and what the client should have been delivered."""

    api: Api
    events: list[bytes] = field(default_factory=list)
    delivered: int = 0            # events before an error event (all when none)
    prompt: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    finish: bool = False
    unsafe: bool = False
    held: int = 0                 # trailing delivered ids whose events carried no text


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def token_chunk(api: Api, text: str, ids: list[int], finish: str | None, kind: str = "content",
                prompt: list[int] | None = None) -> bytes:
    """One choice chunk with ``return_token_ids`` (vLLM's field order, compact JSON)."""
    if api is Api.CHAT:
        delta: dict[str, Any] = {"content": text}
        if kind == "reasoning":
            delta = {"reasoning": text}
        elif kind == "empty":
            delta = {}
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = None
        choice["token_ids"] = ids
        return event({**HEAD, "object": "chat.completion.chunk", "choices": [choice]})
    return event({**HEAD, "id": "cmpl-4f2a", "object": "text_completion", "choices": [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
         "prompt_token_ids": prompt, "token_ids": ids}]})


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    api = draw(st.sampled_from([Api.CHAT, Api.COMPLETIONS]))
    s = Stream(api)
    ints = st.integers(0, 200_000)
    s.prompt = draw(st.lists(ints, min_size=1, max_size=12))
    texts = st.one_of(st.sampled_from(TRICKY), st.text(max_size=12))
    n = draw(st.integers(1, 14))
    kinds = st.sampled_from(["content"] * 6 + ["reasoning", "empty"]) if api is Api.CHAT \
        else st.just("content")
    if api is Api.CHAT:
        s.events.append(event({**HEAD, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": s.prompt, "prompt_text": None}))
    for i in range(n):
        ids = draw(st.lists(ints, min_size=1, max_size=3))
        kind = draw(kinds)
        finish = draw(st.sampled_from(["stop", "length"])) if i == n - 1 else None
        prompt = s.prompt if api is Api.COMPLETIONS and i == 0 else None
        s.events.append(token_chunk(api, draw(texts), ids, finish, kind, prompt))
    if draw(st.booleans()):   # usage
        s.events.append(event({**HEAD, "object": "x", "choices": [], "usage": {
            "prompt_tokens": len(s.prompt), "total_tokens": len(s.prompt) + n, "completion_tokens": n}}))
    s.delivered = len(s.events)
    if draw(st.booleans()):   # vLLM's in-band error event, at a random point, then [DONE]
        s.delivered = draw(st.integers(1 if api is Api.COMPLETIONS else 2, len(s.events)))
        del s.events[s.delivered:]
        s.events.append(b'data: {"error": {"message": "KV load failed", "type": "InternalServerError", '
                        b'"param": null, "code": 500}}\n\n')
    s.events.append(b"data: [DONE]\n\n")
    for ev in s.events[:s.delivered]:
        obj = orjson.loads(ev[6:])
        for c in obj.get("choices") or []:
            s.generated.extend(c.get("token_ids") or [])
            s.finish = s.finish or c.get("finish_reason") is not None
            d = c.get("delta") or {}
            s.unsafe = s.unsafe or bool(d.get("reasoning"))  # as Resume.observe reads it
            if c.get("finish_reason") is not None or c.get("text") or d.get("content") or d.get("reasoning"):
                s.held = 0
            else:
                s.held += len(c.get("token_ids") or [])
    return s


def relay(loop: asyncio.AbstractEventLoop, s: Stream, cuts: list[int], keep: bool) -> tuple[bytes, Resume]:
    """Feed ``s`` (cut into reads at ``cuts``) through a continuable stream's splice; returns the client's bytes
    and the resume state after :meth:`Resume.read_transcript` (``recorded``: the record before it)."""
    body: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": 1000}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if s.api is Api.CHAT else {"prompt": "hi"})
    if keep:
        body["return_token_ids"] = True
    resume = Resume.of(parse_request(orjson.dumps(body), s.api), True)
    assert resume is not None and resume.keep_ids is keep
    sent: list[bytes] = []
    ctx = RequestContext(request_id="t", client_request_id=None, api_label="chat")
    r = StreamRelay(_Resp(loop), _Out(sent), ctx, cached_tokens=None, first_event_timeout_s=1.0,  # type: ignore[arg-type]
                    resume=resume, lost_when=(20.0, 2.0))
    splice = _Splice(r, r.transforms(), b"", time.monotonic())
    data = b"".join(s.events)
    bounds = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    for a, b in pairwise(bounds):
        if b > a:
            splice.data(data[a:b])
    splice.eof()
    RECORDED[:] = resume.blocks
    resume.read_transcript()
    return b"".join(sent), resume


def expected(s: Stream, keep: bool) -> bytes:
    body = b"".join(s.events[:s.delivered])
    if s.delivered == len(s.events) - 1:
        body += s.events[-1]                     # no error event: [DONE] too
    return body if keep else REFERENCE.sub(b'token_ids":null', body)


@settings(max_examples=150, deadline=None)
@given(s=streams(), cuts=st.lists(st.integers(0, 10_000), max_size=12), keep=st.booleans())
def test_client_bytes_equal_the_reference_rewrite_for_any_reads(loop: asyncio.AbstractEventLoop, s: Stream,
                                                                cuts: list[int], keep: bool) -> None:
    out, resume = relay(loop, s, cuts, keep)
    assert out == expected(s, keep)
    assert resume.prompt_ids == s.prompt
    assert resume.generated == s.generated
    assert resume.finish is s.finish
    assert resume.unsafe is s.unsafe
    assert resume.head["id"] == orjson.loads(s.events[0][6:])["id"]
    # the held-back run is read from the last _TAIL reads: exact when the stream came in no more reads
    held = resume.held
    assert held == s.held if len(cuts) < _TAIL else held <= s.held
    leg = resume.next_leg()
    if s.finish:
        assert leg is None
        return
    assert leg is not None
    kept = s.generated[:len(s.generated) - held]
    assert leg.body["prompt"] == s.prompt + kept and leg.body["max_tokens"] == 1000 - len(kept)
    assert resume.tokens == len(kept) and resume.replay == (held if keep else 0)


def _completion(text: str, ids: list[int], finish: str | None = None) -> bytes:
    return token_chunk(Api.COMPLETIONS, text, ids, finish)


@pytest.mark.parametrize("keep", [False, True])
def test_ids_of_held_back_text_are_regenerated_not_delivered(loop: asyncio.AbstractEventLoop, keep: bool) -> None:
    """A cut right after two token events of empty text (vLLM holds back the bytes of an unfinished character):
    the continuation's prompt ends before them, its budget counts only the ids kept, and the continuation's
    regenerated ids complete the character; the client's usage equals every token it got, and a client that asked
    for the ids gets each id once.  A second loss inside the continuation drops its own held-back tail."""
    s = Stream(Api.COMPLETIONS, prompt=[7, 8])
    s.events = [_completion("a", [1], None).replace(b'"prompt_token_ids":null', b'"prompt_token_ids":[7,8]'),
                _completion("b", [2]), _completion("", [3]), _completion("", [4]), b"data: [DONE]\n\n"]
    s.delivered = 4
    _, resume = relay(loop, s, [len(s.events[0]), len(s.events[0]) + len(s.events[1])], keep)
    assert resume.generated == [1, 2, 3, 4] and resume.held == 2
    leg = resume.next_leg()
    assert leg is not None and leg.body["prompt"] == [7, 8, 1, 2] and leg.body["max_tokens"] == 998
    ctx = RequestContext(request_id="t", client_request_id=None, api_label="completions")
    reframe = Reframe(resume, ctx, _Out([]))  # type: ignore[arg-type]
    out = reframe.feed(_completion("", [3]) + _completion("é", [4]) + _completion("", [5]))
    texts = [orjson.loads(e[6:])["choices"][0] for e in out.split(b"\n\n") if e]
    assert [(c["text"], c["token_ids"]) for c in texts] == ([("é", []), ("", [5])] if keep else [("é", None)])
    assert resume.generated == [1, 2, 3, 4, 5] and resume.held == 1 and resume.tokens == 5
    resume.read_transcript()                       # lost again (the director reads the transcript on each loss)
    leg = resume.next_leg()                        # id 5's text is held back too
    assert leg is not None and leg.body["prompt"] == [7, 8, 1, 2, 3, 4] and leg.body["max_tokens"] == 996
    out = Reframe(resume, ctx, _Out([])).feed(_completion("ü", [5], "length"))  # type: ignore[arg-type]
    assert orjson.loads(out[6:out.index(b"\n\n")])["choices"][0]["token_ids"] == ([] if keep else None)
    assert resume.tokens == 5 and resume.usage()["completion_tokens"] == 5


def test_plain_token_reads_are_recorded_as_ids_only(loop: asyncio.AbstractEventLoop) -> None:
    """One event per read (paced) and 8 per read (full speed): after the first block, the record holds the ids,
    not the events, and the client gets vLLM's plain bytes."""
    for api in (Api.CHAT, Api.COMPLETIONS):
        s = Stream(api, prompt=[7, 8, 9])
        first = token_chunk(api, "a", [1], None, prompt=s.prompt) if api is Api.COMPLETIONS else event(
            {**HEAD, "object": "chat.completion.chunk", "choices": [], "prompt_token_ids": [7, 8, 9],
             "prompt_text": None})
        s.events = [first, *(token_chunk(api, f"w{i}", [100 + i], None) for i in range(16)), b"data: [DONE]\n\n"]
        s.delivered = len(s.events) - 1
        ends = [sum(map(len, s.events[:i])) for i in range(len(s.events) + 1)]
        cuts = [ends[1], ends[2], ends[10], ends[17]]    # first | 1 event | 8 events | 7 events | [DONE]
        out, resume = relay(loop, s, cuts, keep=False)
        assert out == expected(s, keep=False) and b"[1" not in out.replace(b'"token_ids":null', b"")
        # the token blocks' ids in one bytearray, extended per read
        assert [first, b",".join(b"%d" % i for i in range(100, 116)), b"data: [DONE]\n\n"] == RECORDED
        assert [type(b) for b in RECORDED] == [bytes, bytearray, bytes]
        assert resume.generated == [*([1] if api is Api.COMPLETIONS else []), *range(100, 116)]


def test_text_that_looks_like_ids_is_not_touched(loop: asyncio.AbstractEventLoop) -> None:
    """A delta whose text is literally ``"token_ids":[1]`` is escaped in JSON (``\\"token_ids\\":[1]``), so neither
    the fast path nor the general one can take it for the ids."""
    for api in (Api.CHAT, Api.COMPLETIONS):
        s = Stream(api, prompt=[3])
        first = token_chunk(api, "x", [1], None, prompt=[3]) if api is Api.COMPLETIONS else event(
            {**HEAD, "object": "chat.completion.chunk", "choices": [], "prompt_token_ids": [3], "prompt_text": None})
        tricky = token_chunk(api, '"token_ids":[1]}]}', [42], None)
        s.events = [first, tricky, tricky + tricky, b"data: [DONE]\n\n"]
        s.delivered = 3
        out, resume = relay(loop, s, [len(first), len(first) + len(tricky)], keep=False)
        assert out == expected(s, keep=False)
        assert out.count(b'\\"token_ids\\":[1]}]}') == 3 and b"[42]" not in out
        assert resume.generated[-3:] == [42, 42, 42]
