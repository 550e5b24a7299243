# Stub of the compiled pdproxy/pd/_splice.c: the same interface as pdproxy.pd.splice.PySpliceBase.
from collections.abc import Callable
from typing import Any

class SpliceBase:
    write: Callable[[bytes], None]
    feed: Callable[[bytes, bytes], bytes]
    trigger: bytes
    prev: bytes
    tail: bytes | bytearray
    out: Any
    gaps: Any
    bounds: tuple[float, ...]
    counts: list[int]
    clock: Callable[[], float]
    done_len: int
    writes: int
    last: float
    done_mark: int
    def data(self, chunk: bytes) -> None: ...
