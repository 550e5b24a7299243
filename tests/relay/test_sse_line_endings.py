"""SSE line endings (pdproxy/http/sse.py, the relay's reframing in pdproxy/pd/relay.py): every line ending the
SSE spec allows — ``\\n``, ``\\r\\n``, ``\\r`` and any mixture — frames events and finds the end marker, whatever
the split points of the reads.

A property test checks the incremental framer against a reference parser written from the spec (WHATWG HTML,
"server-sent events", interpreting an event stream): the events the framer emits, read by that parser, are the
stream's events, each emitted by the read that completed it (nothing held back), never one cut in two.  Then
through real processes: a simulated decoder whose events end in ``\\r\\n`` split across writes, and one whose
events end in ``\\n\\r\\n``; the client gets every event and ``[DONE]`` exactly once."""

from __future__ import annotations

import itertools

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.http import sse
from tests.conftest import Fleet
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(60)

Event = tuple[str, str]   # (event type, data)


class ReferenceParser:
    """The spec's event-stream interpretation, fed one character at a time (only ``event`` and ``data``: the
    fields the relay reads).  A ``\\r`` ends a line at once; a ``\\n`` right after it is part of the same line
    ending."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.line = ""
        self.after_cr = False
        self.data: list[str] = []
        self.type = ""

    def feed(self, text: str) -> None:
        for ch in text:
            if ch == "\n" and self.after_cr:
                self.after_cr = False
                continue
            self.after_cr = ch == "\r"
            if ch in "\r\n":
                self._line(self.line)
                self.line = ""
            else:
                self.line += ch

    def _line(self, line: str) -> None:
        if not line:
            if self.data:
                self.events.append((self.type or "message", "\n".join(self.data)))
            self.data, self.type = [], ""
            return
        if line.startswith(":"):
            return
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self.data.append(value)
        elif name == "event":
            self.type = value


def parse(text: str) -> list[Event]:
    p = ReferenceParser()
    p.feed(text)
    return p.events


ENDINGS = st.sampled_from(["\n", "\r\n", "\r"])
VALUE = st.text(alphabet="ab {}:\"é[]DONE", max_size=12)


@st.composite
def streams(draw: st.DrawFn) -> tuple[str, list[Event]]:
    """A stream of events with a random line ending after every line (and between events), and its events."""
    out: list[str] = []
    events: list[Event] = []

    def end() -> str:
        """A line ending that cannot merge with the previous one (``\r`` then ``\n`` would be one ``\r\n``)."""
        ending = draw(ENDINGS)
        return "\r\n" if ending == "\n" and out and out[-1].endswith("\r") else ending
    for _ in range(draw(st.integers(1, 6))):
        name = draw(st.sampled_from(["", "delta", "message_stop"]))
        lines = [f"data: {draw(VALUE)}" for _ in range(draw(st.integers(1, 3)))]
        if name:
            lines.insert(0, f"event: {name}")
        if draw(st.booleans()):
            lines.insert(0, ": comment")
        for line in lines:
            out.append(line)
            out.append(end())
        out.append(end())                               # the blank line that ends the event
        events.append((name or "message", "\n".join(ln[6:] for ln in lines if ln.startswith("data: "))))
    return "".join(out), events


@settings(max_examples=200, deadline=None)
@given(streams(), st.lists(st.integers(0, 400), max_size=8))
def test_the_framer_emits_each_event_once_as_soon_as_it_is_complete(stream: tuple[str, list[Event]],
                                                                      cuts: list[int]) -> None:
    text, events = stream
    raw = text.encode()
    assert parse(text) == events                        # the generator and the reference agree
    points = sorted({min(c, len(raw)) for c in cuts} | {0, len(raw)})
    framer = sse.EventFramer()
    emitted: list[Event] = []
    for a, b in itertools.pairwise(points):
        block = framer.feed(raw[a:b])
        if block:
            assert b"\r" not in block                 # one framing downstream of the framer
            emitted += parse(block.decode())          # whole events only: parsed on their own
        seen = raw[:b].decode(errors="ignore")
        assert emitted == parse(seen)[:len(emitted)]
        assert len(emitted) == len(parse(seen)), (raw[:b], framer.pending)   # nothing held back
    assert emitted == events and not framer.pending.strip(b"\r\n")


@settings(max_examples=150, deadline=None)
@given(streams())
def test_split_events_and_last_boundary_agree_with_the_reference(stream: tuple[str, list[Event]]) -> None:
    raw = stream[0].encode()
    parts = sse.split_events(raw)
    assert b"".join(parts) == raw
    assert [e for p in parts for e in parse(p.decode())] == stream[1]
    assert sse.last_boundary(raw) == len(raw) or raw[sse.last_boundary(raw):].strip(b"\r\n") == b""


def test_the_plain_framing_is_passed_through_as_the_same_object() -> None:
    block = b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    assert sse.frame(block) == (block, b"") and sse.frame(block)[0] is block
    assert sse.EventFramer().feed(block) is block


CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
        "stream": True}


@pytest.mark.parametrize("mode", ["crlf", "byte"])
def test_a_decoder_with_other_line_endings_streams_every_event_and_one_done(proxy: ProxyThread, sims: Fleet,
                                                                            mode: str) -> None:
    for d in sims.decoders:
        d.faults({"kind": "slice", "mode": mode})
    with httpx.stream("POST", proxy.url + "/v1/chat/completions", json=CHAT, timeout=20) as r:
        assert r.status_code == 200
        body = r.read().decode()
    events = parse(body)
    assert [d for _t, d in events].count("[DONE]") == 1 and events[-1] == ("message", "[DONE]"), body
    assert any('"finish_reason":"length"' in d for _t, d in events) and "error" not in body, body
