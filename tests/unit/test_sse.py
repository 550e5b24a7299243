"""SSE framing under hostile chunking: 1 byte per read, everything in one read, split \\r\\n, split UTF-8."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.http import sse
from pdproxy.http.sse import EventFramer, event_data, split_events

EVENTS = [
    b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    'data: {"choices":[{"index":0,"delta":{"content":"h\u00e9llo \u4e16\u754c \U0001f600"}}]}\n\n'.encode(),
    b'data: {"choices":[],"usage":{"prompt_tokens":5}}\n\n',
    b"data: [DONE]\n\n",
]
STREAM = b"".join(EVENTS)


def relay(chunks: list[bytes]) -> list[bytes]:
    framer = EventFramer()
    writes = [w for w in (framer.feed(c) for c in chunks) if w]
    assert framer.pending == b""
    return writes


def test_one_byte_per_read_reassembles_every_event() -> None:
    writes = relay([STREAM[i:i + 1] for i in range(len(STREAM))])
    assert writes == EVENTS  # each event written once, whole, in order


def test_all_events_in_one_read_stay_one_write() -> None:
    assert relay([STREAM]) == [STREAM]


def test_split_inside_multibyte_utf8_is_never_cut() -> None:
    cut = STREAM.index("\u4e16".encode()) + 1  # inside a 3-byte character
    writes = relay([STREAM[:cut], STREAM[cut:]])
    assert b"".join(writes) == STREAM
    for w in writes:
        w.decode("utf-8")  # every write is valid UTF-8 on its own


def test_crlf_line_endings_split_inside_the_terminator() -> None:
    crlf = STREAM.replace(b"\n\n", b"\r\n\r\n")
    for cut in range(1, len(crlf)):
        writes = relay([crlf[:cut], crlf[cut:]])
        assert b"".join(writes) == STREAM                  # the same events, written with \n line endings
        assert all(w.endswith(b"\n\n") for w in writes)


def test_incomplete_tail_is_held_back() -> None:
    framer = EventFramer()
    assert framer.feed(b'data: {"a": 1}\n\ndata: {"b"') == b'data: {"a": 1}\n\n'
    assert framer.pending == b'data: {"b"'
    assert framer.feed(b": 2}\n\n") == b'data: {"b": 2}\n\n'


def test_split_events_and_event_data() -> None:
    events = split_events(STREAM)
    assert events == EVENTS
    assert orjson.loads(event_data(events[2]) or b"") == {"choices": [], "usage": {"prompt_tokens": 5}}
    assert event_data(b": comment\n\n") is None
    assert event_data(b"data: a\r\ndata: b\r\n\r\n") == b"a\nb"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_any_chunking_gives_the_same_bytes_and_whole_events(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    chunks = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    writes = relay([c for c in chunks if c])
    assert b"".join(writes) == STREAM
    for w in writes:
        assert w.endswith(b"\n\n")
        assert all(e in EVENTS for e in split_events(w))


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n", b"\r\r"])
def test_every_blank_line_form_ends_an_event(sep: bytes) -> None:
    assert EventFramer().feed(b"data: x" + sep) == b"data: x\n\n"


def test_an_event_over_the_limit_leaves_no_bytes_held_by_the_framer_or_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that never ends an event breaks the stream at MAX_EVENT_BYTES (EventTooLarge); the bytes held for
    it go at once — neither the framer nor the error's traceback (a handler may keep the error: its frames stay
    alive with it) holds them, so a hostile engine's stream does not stay in memory until a full collection."""
    monkeypatch.setattr(sse, "MAX_EVENT_BYTES", 64 * 1024)
    framer = EventFramer()
    with pytest.raises(sse.EventTooLarge) as caught:
        for _ in range(100):
            framer.feed(b"data: " + b"x" * 8000)      # never a blank line
    assert framer.pending == b""
    tb, held = caught.value.__traceback__, []
    while tb is not None:
        held += [len(v) for v in tb.tb_frame.f_locals.values() if isinstance(v, bytes | bytearray)]
        tb = tb.tb_next
    assert held and max(held) <= 8006                 # the last read at most, never the event's 64 KiB


@pytest.mark.parametrize(("block", "empty"), [
    (b"data: [DONE]\n\n", True), (b": ping\n\ndata: [DONE]\n\n", True), (b"data: \n\ndata: [DONE]\n\n", True),
    (b": a\n\ndata:\n\ndata: [DONE]\n\n", True), (b'data: {"x":1}\n\ndata: [DONE]\n\n', False),
    (b': a\n\ndata: {}\n\ndata: [DONE]\n\n', False), (b"data: {}\n\n", False), (b"", False)])
def test_a_stream_ending_before_any_content_is_told_apart(block: bytes, empty: bool) -> None:
    """The relay's rule for a decoder's first block (pdproxy/pd/relay.py): an end with only keep-alive comments or
    empty data before it is a stream that never ran (vLLM sends a chunk first)."""
    assert sse.ends_before_content(block, sse.DONE_EVENT) is empty
