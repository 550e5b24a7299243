# Stub of the compiled pdproxy/pd/_record.c: the same interface as pdproxy.pd.record.PyRecordBase.
from collections.abc import Callable

class RecordBase:
    blocks: list[bytes | bytearray]
    tail: Callable[[bytes], object]
    unsafe: tuple[bytes, ...]
    fast: bool
    keep: bool
    def feed(self, block: bytes, prev: bytes = b"") -> bytes: ...

def null_ids(block: bytes) -> bytes: ...
def last_events(block: bytes) -> bytes: ...
