"""Text keys' loop (pdproxy/prefix/index.py ``text_keys``): the compiled one (pdproxy/prefix/_textkeys.c) is built and
in use, and it cuts the same chunks and chains the same keys as the Python one (``py_chunk_keys``) — for any parts
(marks anywhere, chunks inside a part or spanning several), chunk size and growth — and refuses bad arguments with
Python errors, never a crash."""

from __future__ import annotations

import os
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from pdproxy.prefix import index
from pdproxy.prefix.index import MESSAGE_MARK, TEXT_GROWTH, py_chunk_keys, text_keys
from pdproxy.prefix.routing import render_parts

try:
    from pdproxy.prefix import _textkeys
except ImportError:  # pragma: no cover - the assertion below says why this fails
    _textkeys = None  # type: ignore[assignment]

pytestmark = pytest.mark.timeout(60)
MARK = MESSAGE_MARK[0]


def test_the_compiled_loop_is_built_and_in_use() -> None:
    """`pip install` (make install / make test) builds pdproxy/prefix/_textkeys.c; without it a 65 KB agent body's
    keys cost ~24 µs more (loadtest/request_cost_bench.py)."""
    if os.environ.get("PDPROXY_NO_EXTENSIONS"):
        assert index.CHUNK_KEYS is py_chunk_keys
        return
    assert _textkeys is not None, "pdproxy/prefix/_textkeys.c was not built: run `make install` (needs a C compiler)"
    assert index.CHUNK_KEYS is _textkeys.chunk_keys


PART = st.binary(min_size=1, max_size=300).map(lambda b: bytes(b"ab\x1e\xc3"[x % 4] for x in b))
"""Parts of letters, marks and a non-ASCII byte."""


@pytest.mark.skipif(_textkeys is None, reason="the compiled loop is not built")
@settings(max_examples=400, deadline=None)
@given(st.lists(PART, min_size=1, max_size=12) | st.just([b""]), st.integers(1, 40), st.integers(1, 9),
       st.integers(0, 2**64 - 1))
@example(parts=[b"a" * 10, b"\x1e" + b"b" * 40, b"c" * 3, b"d" * 200], chunk=8, growth=2, seed=7)
@example(parts=[b"a" * 7], chunk=8, growth=8, seed=0)                # shorter than one chunk: no key
def test_the_compiled_loop_gives_the_python_loops_chunks_and_keys(parts: list[bytes], chunk: int, growth: int,
                                                                   seed: int) -> None:
    want = py_chunk_keys(parts, chunk, growth, MARK, seed, xxh3_64_intdigest)
    assert _textkeys.chunk_keys(parts, chunk, growth, MARK, seed, xxh3_64_intdigest) == want
    joined = b"".join(parts)                                           # and the keys are the joined bytes'
    assert _textkeys.chunk_keys([joined], chunk, growth, MARK, seed, xxh3_64_intdigest) == want


@pytest.mark.skipif(_textkeys is None, reason="the compiled loop is not built")
def test_a_long_chat_and_an_agent_body_key_alike_both_ways(monkeypatch: pytest.MonkeyPatch) -> None:
    words = "the quick brown fox jumps over the lazy dog " * 6000
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {"type": "object"}}} for i in range(16)]
    agent: dict[str, Any] = {"tools": tools, "messages": [{"role": "system", "content": words[:24_000]}]}
    for turn in range(12):
        agent["messages"] += [
            {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{turn}", "type": "function",
                                                                    "function": {"name": "t1", "arguments": "{}"}}]},
            {"role": "tool", "content": words[turn * 100:turn * 100 + 6000]}]
    chat = {"messages": [{"role": "user", "content": "0f3a " + words}]}
    for body in (agent, chat):
        parts = render_parts(orjson.loads(orjson.dumps(body)), True)
        compiled = text_keys(parts, namespace="m")
        monkeypatch.setattr(index, "CHUNK_KEYS", py_chunk_keys)
        assert text_keys(parts, namespace="m") == compiled
        assert text_keys(b"".join(parts), namespace="m") == compiled
        monkeypatch.undo()
        assert len(compiled.keys) > 30


@pytest.mark.skipif(_textkeys is None, reason="the compiled loop is not built")
def test_bad_arguments_are_python_errors() -> None:
    chunk_keys = _textkeys.chunk_keys
    with pytest.raises(TypeError):
        chunk_keys((b"ab",), 4, 8, MARK, 0, xxh3_64_intdigest)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        chunk_keys([b"ab", "cd"], 4, 8, MARK, 0, xxh3_64_intdigest)  # type: ignore[list-item]
    with pytest.raises(TypeError):
        chunk_keys([b"ab"], 4, 8, MARK, 0)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        chunk_keys([b"ab"], 0, 8, MARK, 0, xxh3_64_intdigest)
    with pytest.raises(ValueError):
        chunk_keys([b"ab"], 4, 8, 256, 0, xxh3_64_intdigest)

    def refuses(chunk: object, seed: int) -> int:
        raise RuntimeError("digest failed")

    with pytest.raises(RuntimeError, match="digest failed"):
        chunk_keys([b"a" * 100], 4, 8, MARK, 0, refuses)
    assert chunk_keys([], 4, 8, MARK, 0, xxh3_64_intdigest) == ([], [])


def test_text_keys_grow_as_documented() -> None:
    """Whichever loop runs: 8 chunks of ``chunk_chars``, then each 1/TEXT_GROWTH of the bytes before it."""
    keys = text_keys(b"x" * 10_000, chunk_chars=256)
    assert keys.ends[:TEXT_GROWTH] == [256 * (i + 1) for i in range(TEXT_GROWTH)]
    assert keys.ends[TEXT_GROWTH] == 2048 + 2048 // TEXT_GROWTH and keys.ends[-1] == 10_000


@pytest.mark.skipif(_textkeys is None, reason="the compiled loop is not built")
@pytest.mark.parametrize("change", ["clear", "replace", "append", "shrink"])
def test_a_digest_that_changes_the_parts_list_changes_nothing_under_the_loop(change: str) -> None:
    """The loop reads the parts it was given: a digest that empties, rewrites or grows the caller's list (dropping
    the only references to its bytes) neither crashes it nor changes its keys."""
    def fresh() -> list[bytes]:
        return [bytes(range(65, 91)) * (i + 3) + (b"\x1e" if i % 3 else b"") for i in range(12)]

    want = py_chunk_keys(fresh(), 8, 2, MARK, 5, xxh3_64_intdigest)
    parts = fresh()

    def digest(chunk: Any, seed: int) -> int:
        key = xxh3_64_intdigest(chunk, seed)
        if change == "clear":
            parts.clear()
        elif change == "replace":
            parts[:] = ["not bytes"] * len(parts)
        elif change == "append":
            parts.extend([b"\x1e" * 1000] * 50)
        elif parts:
            parts.pop()
        return key

    assert _textkeys.chunk_keys(parts, 8, 2, MARK, 5, digest) == want


@pytest.mark.skipif(_textkeys is None, reason="the compiled loop is not built")
def test_a_chunk_the_digest_keeps_holds_its_part() -> None:
    """A chunk passed as a view of a part keeps that part alive (as the Python loop's memoryview does): a digest
    that keeps it reads the same bytes after the caller has let the parts go."""
    kept: list[Any] = []

    def digest(chunk: Any, seed: int) -> int:
        kept.append(chunk)
        return xxh3_64_intdigest(chunk, seed)

    part = bytes(range(256)) * 40
    _, ends = _textkeys.chunk_keys([part], 64, 8, MARK, 0, digest)
    assert all(isinstance(c, memoryview) and c.obj is part for c in kept)
    starts = [0, *ends[:-1]]
    del part
    assert [bytes(c) for c in kept] == [(bytes(range(256)) * 40)[s:e] for s, e in zip(starts, ends, strict=True)]


@pytest.mark.skipif(_textkeys is None, reason="the compiled loop is not built")
@pytest.mark.parametrize(("chunk", "growth"), [(4, 2**62), (2**62, 8), (2**63 - 1, 1), (2**61, 2**61)])
def test_huge_chunk_sizes_and_growth_key_as_the_python_loop(chunk: int, growth: int) -> None:
    parts = [b"a" * 50, b"\x1e" + b"b" * 50]
    want = py_chunk_keys(parts, chunk, growth, MARK, 3, xxh3_64_intdigest)
    assert _textkeys.chunk_keys(parts, chunk, growth, MARK, 3, xxh3_64_intdigest) == want
