"""The per-read step of the relay's splice (pdproxy/pd/relay.py, "The splice"), split as the continuation's
record is (:mod:`pdproxy.pd.record`).

:class:`SpliceBase` is the base of :class:`pdproxy.pd.relay._Splice`.  Its ``data(chunk)`` handles the common
read — whole events framed as vLLM frames them (bytes ending in a blank line, no ``\\r`` anywhere), no tail held,
the transform's ``trigger`` absent (a non-empty one), not a keep-alive comment, not a block whose third-last byte is
the end event's (``done_mark``, when at least ``done_len`` long) — by counting the gap since the last write
(``clock()``: monotonic seconds) into the stream's ITL buckets (:class:`pdproxy.timeline.GapCounts`), keeping the
block as ``prev`` and calling ``write(chunk)``; once the client's response has ended (``out.ended``) it drops the
read.  A read so framed that holds the trigger (or any read, when the trigger is ``b""``: a continuable stream's
record) goes through ``feed(chunk, prev)`` in the same call, and the block it returns is written the same way — or,
when it is a comment, the end or not bytes, given to the subclass's ``_emit(block)`` (nothing, when it is empty).
Every other read goes to the subclass's ``_slow(chunk)``, the whole step in Python, which tests the read again from
the start.

Two implementations with the same results: the compiled ``pdproxy.pd._splice`` (``pdproxy/pd/_splice.c``, built by
``pip install``; per read one C call instead of the step's ~60 bytecodes, whose cost grows when 1,000 streams'
objects keep each other out of the CPU's caches: ``loadtest/RESULTS.md``) and :class:`PySpliceBase` below (every
read to ``_slow``), used when the extension is not built or ``PDPROXY_NO_EXTENSIONS`` is set.
``tests/relay/test_splice_compiled.py`` checks that the two agree on generated reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pdproxy.compiled import compiled_or
from pdproxy.pd.responder import Responder
from pdproxy.timeline import GapCounts


class PySpliceBase:
    """The Python form: the fields the compiled one keeps, and ``data`` = ``_slow``."""

    __slots__ = ("bounds", "clock", "counts", "done_len", "done_mark", "feed", "gaps", "last", "out", "prev", "tail", "trigger",
                 "write", "writes")

    write: Callable[[bytes], None]
    feed: Callable[[bytes, bytes], bytes]
    trigger: bytes
    prev: bytes
    tail: bytes | bytearray
    out: Responder
    gaps: GapCounts
    bounds: tuple[float, ...]
    counts: list[int]
    clock: Callable[[], float]
    done_len: int
    writes: int
    last: float
    done_mark: int

    def data(self, chunk: bytes) -> None:
        """One decoder read's body (see the module docstring)."""
        self._slow(chunk)

    def _slow(self, chunk: bytes) -> None:
        """The whole per-read step in Python, for any read (the subclass's; see the module docstring)."""
        raise NotImplementedError

    def _emit(self, chunk: bytes) -> None:
        """Write a block ``feed`` returned that the common path does not: a comment, the stream's end, or not bytes
        (the subclass's)."""
        raise NotImplementedError


# The compiled SpliceBase (pdproxy/pd/_splice.c) when it is built and not disabled, else PySpliceBase (the same
# interface and writes); a base class, so mypy is told its twin by name
if TYPE_CHECKING:
    SpliceBase = PySpliceBase
else:
    SpliceBase = compiled_or("pdproxy.pd._splice", "SpliceBase", PySpliceBase)
