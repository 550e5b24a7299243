# Stub of the compiled pdproxy/prefix/_textkeys.c (pdproxy.prefix.index.py_chunk_keys holds the same in Python).
from collections.abc import Callable
from typing import Any

def chunk_keys(parts: list[bytes], chunk_chars: int, growth: int, mark: int, seed: int,
               digest: Callable[[Any, int], int], /) -> tuple[list[int], list[int]]: ...
