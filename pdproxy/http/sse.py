"""SSE framing for the relay: find event boundaries in a byte stream without decoding it.

A line ends with ``\n``, ``\r\n`` or ``\r``, mixed freely in one stream, and an event ends at a blank line: a
line ending right after another (``\n\n``, ``\r\n\r\n``, ``\r\r``, ``\n\r\n``, ``\r\n\n``… — WHATWG HTML
"server-sent events", interpreting an event stream).  A ``\r`` that ends the data read so far ends its line: the
``\n`` that may follow in the next read is the rest of a ``\r\n``, an empty line at the start of the next event,
which a parser ignores.  vLLM itself writes ``data: <json>\n\n``
(``vllm/entrypoints/openai/chat_completion/serving.py``): that is the fast path, searched with one ``rfind`` and
forwarded byte for byte.  Events framed any other way are rewritten with ``\n`` endings (the same events for any
SSE parser), so the transforms and the end-marker test see one framing.  The relay forwards, per upstream read,
every complete event it now holds as one write, and keeps the incomplete tail — so events split across reads are
reassembled, events merged in one read stay one write, and multi-byte UTF-8 characters split across reads are
never cut (bytes are not decoded).
"""

from __future__ import annotations

import re
from typing import Final

from pdproxy.http.client import ProtocolError

DONE_EVENT = b"data: [DONE]\n\n"
DONE_EVENT_NO_SPACE = b"data:[DONE]\n\n"
"""The same end event without the optional space after ``data:`` (a parser strips one leading space): valid SSE,
written by some servers other than vLLM; the relay ends a stream on it too and sends the client
:data:`DONE_EVENT` instead."""
MAX_EVENT_BYTES: Final = 128 << 20
"""The longest incomplete event held while its rest arrives (bytes): past it the stream is broken
(:class:`EventTooLarge`).  vLLM's largest events are a lagging client's merged deltas (a whole answer with its
logprobs: tens of MB at the extreme); a stream that never ends an event would otherwise grow without bound."""


class EventTooLarge(ProtocolError):
    """An upstream event grew past :data:`MAX_EVENT_BYTES` without ending: the engine's stream is not acceptable
    (a :class:`~pdproxy.http.client.ProtocolError`, so the relay breaks the engine's connection and the client
    gets the stream's error event, whose sentence says this: ``public``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.public = message


_BLANK_LINE = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")
"""A line ending followed by another: an event's end.  A first ``\r`` followed by ``\n`` is one ``\r\n``."""
_LINE_ENDS = b"\r\n"
_CR, _LF = 13, 10


def last_boundary(data: bytes, start: int = 0) -> int:
    """Index just past the last event boundary of ``data`` that ends after ``start - 3`` (0 if none).  ``data``
    starts at a line start.  Pure; O(len(data)): one ``rfind`` when ``data`` has no ``\r``."""
    lo = max(0, start - 3)
    if data.find(b"\r", lo) < 0:
        i = data.rfind(b"\n\n", lo)
        return i + 2 if i >= 0 else 0
    end = 0
    for m in _BLANK_LINE.finditer(data, lo):
        end = m.end()
    return end


def event_start(block: bytes, end: int) -> int:
    """Index where the event holding ``block[end - 1]`` starts: just past the last ``\n\n`` boundary that ends at
    or before ``end`` (0 if none).  ``block``: whole events framed with ``\n`` line endings (:func:`frame`'s
    output); ``end`` a byte index.  One ``rfind`` from ``end`` back: walking a block's last events from its end
    costs those events' bytes, not the block's."""
    i = block.rfind(b"\n\n", 0, end)
    return i + 2 if i >= 0 else 0


def normalize(block: bytes) -> bytes:
    """``block`` with every line ending (``\r\n``, ``\r``) written as ``\n``; the same object when it has no
    ``\r``."""
    if block.find(b"\r") < 0:
        return block
    return block.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def frame(data: bytes, start: int = 0) -> tuple[bytes, bytes]:
    """``(events, rest)``: the complete events of ``data`` (which starts at a line start; bytes up to ``start``
    were seen before and held no boundary) with ``\n`` line endings, and the incomplete rest, to be prefixed to
    the next read.  Empty lines before an event (no-ops for any parser; the ``\n`` of a ``\r\n`` split across
    reads) are dropped.  Data framed as vLLM frames it comes back as the same object."""
    if data and data[0] in _LINE_ENDS:
        data = data.lstrip(_LINE_ENDS)
        start = 0
    end = last_boundary(data, start)
    if end == 0:
        return b"", data
    if end == len(data):
        return normalize(data), b""
    rest = data[end:]
    if rest[0] in _LINE_ENDS:
        rest = rest.lstrip(_LINE_ENDS)
    return normalize(data[:end]), rest


def reassemble(tail: bytes | bytearray, chunk: bytes, limit: int | None = None) -> tuple[bytes, bytes | bytearray]:
    """:func:`frame` of ``tail + chunk`` (``tail``: the incomplete event held from earlier reads, maybe empty) as
    ``(events, rest)``, without copying a held tail on every read: when no boundary lies in the tail's last three
    bytes and ``chunk`` (a blank line is at most four bytes, and the tail holds none), ``chunk`` is appended to
    the tail, turned into a ``bytearray`` (amortised growth) — O(len(chunk)) a read, where re-joining the tail each
    time made a 100 MB event cost O(n²) of the event loop (17 s, other clients stalled 7 s).  Raises
    :class:`EventTooLarge` once the rest is over ``limit`` bytes (default :data:`MAX_EVENT_BYTES`), holding none of
    those bytes (its traceback keeps this frame alive as long as the error is: a caller must drop its own ``tail``,
    which may be the very buffer, :meth:`EventFramer.feed`)."""
    rest: bytes | bytearray
    if not tail:
        events, rest = frame(chunk)
    elif last_boundary(bytes(tail[-3:]) + chunk) == 0:
        events, rest = b"", tail if isinstance(tail, bytearray) else bytearray(tail)
        rest += chunk
    else:
        events, rest = frame(bytes(tail) + chunk, len(tail))
    if limit is None:
        limit = MAX_EVENT_BYTES
    if len(rest) > limit:
        del rest, tail       # the frame outlives the call in the error's traceback: not with ``limit`` bytes in it
        raise EventTooLarge(f"an event of more than {limit} bytes without its end")
    return events, rest


class EventFramer:
    """Incremental splitter: ``feed(chunk)`` returns the bytes of all events completed so far (maybe ``b""``),
    with ``\n`` line endings (:func:`frame`).

    ``pending`` holds the incomplete tail (bytes).  Not thread-safe; one per upstream stream.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf: bytes | bytearray = b""

    def feed(self, chunk: bytes) -> bytes:
        """Add ``chunk`` (bytes) and return the bytes of every event it completed (``b""`` if none); the rest
        stays in :attr:`pending`.  Raises :class:`EventTooLarge` (:func:`reassemble`), the held bytes dropped (an
        error kept by whoever handles it must not keep ``MAX_EVENT_BYTES`` alive through this framer)."""
        try:
            events, self._buf = reassemble(self._buf, chunk)
        except EventTooLarge:
            self._buf = b""
            raise
        return events

    @property
    def pending(self) -> bytes:
        """The incomplete tail not returned yet (bytes)."""
        buf = self._buf
        return bytes(buf) if isinstance(buf, bytearray) else buf


def only_comments(block: bytes) -> bool:
    """Whether complete events ``block`` (``\n`` line endings, :func:`frame`'s output) hold nothing but comment
    lines (``: keep-alive``): no-ops for every SSE parser, and no sign that the engine is generating."""
    return all(not line or line[0] == 58 for line in block.split(b"\n"))


def no_data(block: bytes, end: int | None = None) -> bool:
    """Whether ``block[:end]`` (whole events, ``\n`` line endings: :func:`frame`'s output) holds no data: only
    blank lines, comment lines (``: keep-alive``) and empty ``data:`` lines.  Line by line, stopping at the first
    line with data: O(1) for a stream's usual first block, however long."""
    i, end = 0, len(block) if end is None else end
    while i < end:
        j = block.find(b"\n", i, end)
        j = end if j < 0 else j
        if j > i and block[i] != 58 and block[i:j] not in (b"data:", b"data: "):
            return False
        i = j + 1
    return True


DONE_TAIL_BYTES = 32
"""How many of an SSE body's last bytes a :class:`DoneWatch` carries from one piece to the next (a ``data:
[DONE]`` line, its line end and the line end before it, CRLF, cut anywhere)."""


def holds_done(window: bytes, line_start: bool = True) -> bool:
    """Whether ``window`` (some bytes of an SSE body) holds the line ``data: [DONE]`` (the space optional) with
    its line end: what vLLM's streams end with.  Bytes after it (blank lines, a comment) do not undo it.
    ``line_start``: ``window``'s first byte starts a line (the body's start; not a window cut from its middle)."""
    i = window.find(b"[DONE]")
    while i >= 0:
        end = i + 6
        if end < len(window) and window[end] in (10, 13):
            start = i - 6 if window.endswith(b"data: ", 0, i) else i - 5 if window.endswith(b"data:", 0, i) else -1
            if (start == 0 and line_start) or (start > 0 and window[start - 1] in (10, 13)):
                return True
        i = window.find(b"[DONE]", end)
    return False


class DoneWatch:
    """Whether an SSE body fed piece by piece (:meth:`feed`, any cuts) has held its ``data: [DONE]`` line
    (:func:`holds_done`); :attr:`seen` once it has.  Keeps :data:`DONE_TAIL_BYTES` bytes between pieces."""

    __slots__ = ("_carry", "_start", "seen")

    def __init__(self) -> None:
        self.seen = False
        self._carry = b""
        self._start = True          # the carry is the body's start (no byte of it dropped yet)

    def feed(self, piece: bytes) -> None:
        if self.seen or not piece:
            return
        window = self._carry + piece
        self.seen = holds_done(window, self._start)
        self._start = self._start and len(window) <= DONE_TAIL_BYTES
        self._carry = window[-DONE_TAIL_BYTES:]


def ends_before_content(block: bytes, end_event: bytes) -> bool:
    """Whether ``block`` (whole events, ``\n`` line endings) ends with ``end_event`` (for :data:`DONE_EVENT`, or
    :data:`DONE_EVENT_NO_SPACE`) and nothing before it carries data (:func:`no_data`): a stream that ended before
    its first token (vLLM always sends a chunk first)."""
    if end_event == DONE_EVENT and block.endswith(DONE_EVENT_NO_SPACE):
        end_event = DONE_EVENT_NO_SPACE
    return block.endswith(end_event) and no_data(block, len(block) - len(end_event))


def split_events(block: bytes) -> list[bytes]:
    """Split a block of complete events into single events, each keeping its terminator.

    O(len(block)): a block without ``\r`` (vLLM's framing) is split in one pass; otherwise one regular-expression
    scan finds every blank line, whatever the line endings."""
    if block.find(b"\r") < 0:  # .find: ``bytes in bytes`` formats and drops a TypeError first (CPython)
        parts = block.split(b"\n\n")
        last = parts.pop()
        events = [p + b"\n\n" for p in parts]
        if last:
            events.append(last)
        return events
    out: list[bytes] = []
    pos = 0
    for m in _BLANK_LINE.finditer(block):
        out.append(block[pos:m.end()])
        pos = m.end()
    if pos < len(block):
        out.append(block[pos:])
    return out


def event_data(event: bytes) -> bytes | None:
    """The ``data`` field of one event (several ``data:`` lines joined by ``\\n``), or None if it has none.

    Fast path for vLLM's framing (one ``data: <json>`` line, ``\\n`` endings): a slice, no line splitting."""
    if event.startswith(b"data: ") and event.find(b"\r") < 0 and event.count(b"\n") <= 2:
        data = event[6:].rstrip(b"\n")
        if data.find(b"\n") < 0:
            return data
    lines = event.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    parts = []
    for line in lines:
        if line.startswith(b"data:"):
            value = line[5:]
            parts.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(parts) if parts else None


def data_event(payload: bytes) -> bytes:
    """Frame one JSON payload as an SSE event the way vLLM does: ``data: <payload>\\n\\n``."""
    return b"data: " + payload + b"\n\n"
