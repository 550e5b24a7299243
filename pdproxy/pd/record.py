"""The per-read step of a continuable stream's first decode leg: record the decoder's token ids, give the client
its bytes without them (docs/stream-continuation.md, "The record in compiled code").

:class:`RecordBase` is the base of :class:`pdproxy.pd.continuation.RecordIds`.  Its :meth:`~PyRecordBase.feed`
handles the one common block — its last event a chat / completions token chunk with ids (vLLM sends nothing else
before it in such a block: :class:`pdproxy.pd.continuation.RecordIds`), no word of ``unsafe`` in it — and hands
every other block to the subclass's ``_slow(block, prev)``.  Two implementations with the
same results: the compiled ``pdproxy.pd._record`` (``pdproxy/pd/_record.c``, built by ``pip install``; a Python
call into it costs about what one ``bytes.find`` does, which is what keeps a relayed event's cost within a few
per cent of a stream without the record) and :class:`PyRecordBase` below, used when the extension is not built or
``PDPROXY_NO_EXTENSIONS`` is set (as aiohttp's ``AIOHTTP_NO_EXTENSIONS``).  ``tests/continuation/test_record.py``
checks that the two agree on generated blocks.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdproxy.compiled import compiled_or

IDS_RE = re.compile(rb'token_ids":\[([0-9,\s]*)\]')  # "token_ids" and "prompt_token_ids"; group 1: the ids
NULL_IDS = b'token_ids":null'
TOKEN_END = b"]}]}\n\n"   # the end of a chat / completions token chunk with ids: ``"token_ids":[…]}]}`` + blank line
_IDS_KEY = b'token_ids":['
_NULL_END = b"null}]}\n\n"
TAIL_BYTES = 4096   # what the ring keeps of a larger read: its events that start in its last 4 KiB (py_last_events)


class PyRecordBase:
    """``blocks``: the record, a list of blocks kept whole (``bytes``, by ``_slow``, or every block with ``keep``)
    and, for the token blocks between them, one ``bytearray`` of their ids joined with ``,`` (``b"1,2,3"``: every
    ``token_ids`` array's ids, in order; extended in place, about 6 bytes a token); ``tail``: called with every
    recorded block's last events (the ring of the last reads: :func:`py_last_events`); ``unsafe``: byte strings
    that send a block to ``_slow``; ``fast``: the fast path is on; ``keep``: the client asked for the ids, so blocks
    are recorded and given unchanged."""

    __slots__ = ("blocks", "fast", "keep", "tail", "unsafe")
    blocks: list[bytes | bytearray]
    tail: Callable[[bytes], object]
    unsafe: tuple[bytes, ...]
    fast: bool
    keep: bool

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        """The block for the client: a fast block rewritten (``token_ids":[…]`` → ``token_ids":null``) and
        recorded; any other block: ``self._slow(block, prev)``."""
        if self.fast and block[-6:] == TOKEN_END:
            for word in self.unsafe:
                if block.find(word) >= 0:
                    return self._slow(block, prev)
            if self.keep:
                self.blocks.append(block)
                self.tail(block if len(block) <= TAIL_BYTES else py_last_events(block))
                return block
            k = block.rfind(b"[")    # one event (a paced stream's read) whose only array is its last: its ids
            if block.find(b"\n") == len(block) - 2 and 0 <= block.find(_IDS_KEY) == k - 11:
                ids = block[k + 1:-6]
                if ids.isdigit():
                    self._record(ids)
                    self.tail(block if len(block) <= TAIL_BYTES else py_last_events(block))
                    return block[:k] + _NULL_END
            parts = IDS_RE.split(block)            # [text, ids, text, ids, …, text]
            if len(parts) > 1:
                self._record(b",".join(parts[1::2]))
                self.tail(block if len(block) <= TAIL_BYTES else py_last_events(block))
                return NULL_IDS.join(parts[::2])
        return self._slow(block, prev)

    def _record(self, ids: bytes) -> None:
        """``ids`` onto the record's last ``bytearray`` (after a ``,``), or a new one after a block kept whole."""
        blocks = self.blocks
        last = blocks[-1] if blocks else None
        if type(last) is bytearray:
            last += b"," + ids
        else:
            blocks.append(bytearray(ids))

    def _slow(self, block: bytes, prev: bytes) -> bytes:
        raise NotImplementedError


def py_last_events(block: bytes) -> bytes:
    """What the ring of the last reads keeps of ``block``: all of it up to ``TAIL_BYTES``; of a larger one (a read
    of many events: a stream at full speed, or a client that paused it) the events that start in its last
    ``TAIL_BYTES`` bytes, or its last event alone when none does — so a stream's ring stays within a few tens of KiB
    whatever its reads' size (the ring is read only for a loss's last events: ``Resume.read_transcript``)."""
    n = len(block)
    if n <= TAIL_BYTES:
        return block
    start = block.find(b"\n\n", max(n - TAIL_BYTES - 2, 0)) + 2   # a negative start would count from the end
    if start <= 1 or start >= n:          # no event starts in the window: the last event alone
        start = max(block.rfind(b"\n\n", 0, n - 2) + 2, 0)
        if start == 1:
            start = 0
    return block[start:]


def py_null_ids(block: bytes) -> bytes:
    """``block`` with every ``token_ids":[…]`` array written as ``token_ids":null`` (the general path's rewrite)."""
    return IDS_RE.sub(NULL_IDS, block)


# the compiled ones when built and not disabled, else the Python ones (same results); RecordBase is a base class,
# so mypy is told its twin by name
if TYPE_CHECKING:
    RecordBase = PyRecordBase
else:
    RecordBase = compiled_or("pdproxy.pd._record", "RecordBase", PyRecordBase)
null_ids = compiled_or("pdproxy.pd._record", "null_ids", py_null_ids)
last_events = compiled_or("pdproxy.pd._record", "last_events", py_last_events)
