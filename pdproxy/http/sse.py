"""SSE framing for the relay: find event boundaries in a byte stream without decoding it.

An event ends at a blank line: ``\\n\\n``, ``\\r\\n\\r\\n`` or ``\\r\\r`` (WHATWG HTML "server-sent events"
parsing; vLLM itself writes ``data: <json>\\n\\n``, ``vllm/entrypoints/openai/chat_completion/serving.py``).
The relay forwards, per upstream read, every complete event it now holds as one write, and keeps the incomplete
tail — so events split across reads are reassembled, events merged in one read stay one write, and multi-byte
UTF-8 characters split across reads are never cut (bytes are not decoded).
"""

from __future__ import annotations

DONE_EVENT = b"data: [DONE]\n\n"
_BOUNDARIES = (b"\n\n", b"\r\n\r\n", b"\r\r")


def last_boundary(data: bytes, start: int = 0) -> int:
    """Index just past the last event boundary in ``data[start - 3:]`` (0 if none).  Pure; O(len(data))."""
    lo = max(0, start - 3)
    end = 0
    for sep in _BOUNDARIES:
        i = data.rfind(sep, lo)
        if i >= 0 and i + len(sep) > end:
            end = i + len(sep)
    return end


class EventFramer:
    """Incremental splitter: ``feed(chunk)`` returns the bytes of all events completed so far (maybe ``b""``).

    ``pending`` holds the incomplete tail (bytes).  Not thread-safe; one per upstream stream.
    """

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> bytes:
        """Add ``chunk`` (bytes) and return the bytes of every event it completed (``b""`` if none); the rest
        stays in :attr:`pending`."""
        if self._buf:
            start = len(self._buf)
            data = self._buf + chunk
        else:
            start = 0
            data = chunk
        end = last_boundary(data, start)
        if end == 0:
            self._buf = data
            return b""
        if end == len(data):
            self._buf = b""
            return data
        self._buf = data[end:]
        return data[:end]

    @property
    def pending(self) -> bytes:
        """The incomplete tail not returned yet (bytes)."""
        return self._buf


def split_events(block: bytes) -> list[bytes]:
    """Split a block of complete events into single events, each keeping its terminator.

    O(len(block)): a block without ``\r`` (vLLM's framing) is split in one pass; otherwise each separator is
    searched for again only once the scan has passed its last match."""
    if block.find(b"\r") < 0:  # .find: ``bytes in bytes`` formats and drops a TypeError first (CPython)
        parts = block.split(b"\n\n")
        last = parts.pop()
        events = [p + b"\n\n" for p in parts]
        if last:
            events.append(last)
        return events
    out: list[bytes] = []
    pos = 0
    n = len(block)
    found = {sep: -2 for sep in _BOUNDARIES}  # next match per separator (-2: not searched yet, -1: none left)
    while pos < n:
        best = -1
        best_len = 0
        for sep in _BOUNDARIES:
            i = found[sep]
            if i == -2 or 0 <= i < pos:
                i = found[sep] = block.find(sep, pos)
            if i >= 0 and (best < 0 or i < best):
                best, best_len = i, len(sep)
        if best < 0:
            out.append(block[pos:])
            break
        out.append(block[pos:best + best_len])
        pos = best + best_len
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
