"""The per-read record of a continuable stream (pdproxy/pd/record.py): the compiled ``RecordBase``
(pdproxy/pd/_record.c) is the one in use, and it gives what the Python one gives — the client's bytes, the record,
the ring, which blocks go the slow way — on generated blocks: vLLM's token chunks, their ids, texts holding the
key's bytes, unsafe words, and arbitrary bytes around them."""

from __future__ import annotations

import gc
import os
import sys
import weakref
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdproxy.pd import record

try:
    from pdproxy.pd import _record
except ImportError:  # pragma: no cover - the assertion below says why this fails
    _record = None  # type: ignore[assignment]

IMPLEMENTATIONS = [record.PyRecordBase] + ([_record.RecordBase] if _record is not None else [])


def test_the_compiled_record_is_built_and_in_use() -> None:
    """`pip install` (make install / make test) builds pdproxy/pd/_record.c; without it every relayed event of a
    continuable stream costs a Python call more (docs/stream-continuation.md, "The record in compiled code")."""
    if os.environ.get("PDPROXY_NO_EXTENSIONS"):
        assert record.RecordBase is record.PyRecordBase
        return
    assert _record is not None, "pdproxy/pd/_record.c was not built: run `make install` (needs a C compiler)"
    assert record.RecordBase is _record.RecordBase


def _make(base: type, *, fast: bool = True, keep: bool = False, unsafe: tuple[bytes, ...] = ()) -> Any:
    class Probe(base):  # type: ignore[misc, valid-type]
        __slots__ = ("__weakref__", "ring", "slow_calls")

        def _slow(self, block: bytes, prev: bytes) -> bytes:
            self.slow_calls.append((block, prev))
            return b"slow:" + block

    p = Probe()
    p.blocks, p.ring, p.slow_calls = [], [], []
    p.tail = p.ring.append
    p.unsafe, p.fast, p.keep = unsafe, fast, keep
    return p


def _chunk(text: str, ids: list[int], chat: bool = True, sep: bytes = b", ") -> bytes:
    body = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": text}}]} if chat else \
        {"id": "cmpl-1", "choices": [{"index": 0, "text": text}]}
    head = orjson.dumps(body)[:-3]  # without the closing "}]}": token_ids goes last, as vLLM writes it
    return b"data: " + head + b',"token_ids":[' + sep.join(str(i).encode() for i in ids) + b"]}]}\n\n"


_TRICKY = st.sampled_from(['token_ids":[', "]", "[", "1,2", "\n", '"reasoning', '"tool_calls"', "\\", "é", " "])
_TEXT = st.lists(st.one_of(st.text(max_size=8), _TRICKY), max_size=6).map("".join)
_IDS = st.lists(st.integers(0, 200_000), max_size=5)
_EVENT = st.one_of(
    st.builds(_chunk, _TEXT, _IDS, st.booleans(), st.sampled_from([b",", b", ", b" ,\n"])),
    st.builds(lambda t: b'data: {"choices":[{"delta":{"content":' + orjson.dumps(t) + b"}}]}\n\n", _TEXT),
    st.binary(max_size=40),
    st.sampled_from([b'token_ids":[1,2]', b'token_ids":[x]', b'"prompt_token_ids":[7,8],', b"]}]}\n\n", b"data: [DONE]\n\n"]),
)
_BLOCK = st.lists(_EVENT, min_size=1, max_size=5).map(b"".join)
# a read of many events (full speed, or after the client paused): over record.TAIL_BYTES, so the ring trims it
_BIG = st.tuples(st.lists(_EVENT, max_size=3).map(b"".join), st.integers(20, 80), _BLOCK).map(
    lambda t: t[0] + _chunk(" w", [7, 8]) * t[1] + t[2])


@pytest.mark.skipif(len(IMPLEMENTATIONS) < 2, reason="the compiled record is not built (see the test above)")
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(blocks=[b'token_ids":[]' + _chunk("", [0], False, b",")], fast=True, keep=False, unsafe=())  # one event, two arrays
@example(blocks=[b"0123456789[123]}]}\n\n"], fast=True, keep=False, unsafe=())  # an array without the key
@given(blocks=st.lists(st.one_of(_BLOCK, _BLOCK, _BIG), min_size=1, max_size=4), fast=st.booleans(), keep=st.booleans(),
       unsafe=st.sampled_from([(), (b'"reasoning',), (b'"reasoning', b'"tool_calls"'), (b"",)]))
def test_compiled_and_python_records_agree(blocks: list[bytes], fast: bool, keep: bool,
                                           unsafe: tuple[bytes, ...]) -> None:
    py, c = (_make(base, fast=fast, keep=keep, unsafe=unsafe) for base in IMPLEMENTATIONS)
    prev = b""
    for block in blocks:
        assert c.feed(block, prev) == py.feed(block, prev)
        prev = block
    assert c.blocks == py.blocks
    assert c.ring == py.ring
    assert c.slow_calls == py.slow_calls


@pytest.mark.skipif(_record is None, reason="the compiled record is not built (see the first test)")
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(block=b"".join(b'x token_ids":[%d] ' % i for i in range(40)))   # more arrays than the C scan stores
@example(block=b'token_ids":[]token_ids":[\x0b\x0c]token_ids":[\x1c]')    # "[]" grows to "null"; \s bytes only
@given(block=st.one_of(_BLOCK, st.lists(_BLOCK, max_size=40).map(b"".join)))
def test_compiled_null_ids_is_the_expression(block: bytes) -> None:
    """The general path's rewrite (a first block with the prompt's ids, a usage block, any block the fast path
    does not take): the compiled ``null_ids`` gives what ``IDS_RE.sub(NULL_IDS, …)`` gives."""
    assert _record.null_ids(block) == record.py_null_ids(block) == record.IDS_RE.sub(record.NULL_IDS, block)
    assert record.null_ids is (record.py_null_ids if os.environ.get("PDPROXY_NO_EXTENSIONS") else _record.null_ids)


@pytest.mark.skipif(_record is None, reason="the compiled record is not built (see the first test)")
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(block=b"x" * 5000)                                     # no event boundary at all
@example(block=b"\n\n" + b"x" * 5000 + b"\n\n")                   # one event longer than the window
@example(block=b"\n\n\n" * 3000)
@example(block=b"A" * 10 + b"\n\n" + b"B" * 4078 + b"\n\n" + b"CCC\n\n")   # 4,097 bytes: the window starts at 1
@given(block=st.one_of(_BIG, _BIG.map(lambda b: b[:-1]), st.binary(min_size=4000, max_size=6000)))
def test_compiled_last_events_is_the_python_one(block: bytes) -> None:
    """What the ring keeps of a large read: the compiled and Python ``last_events`` agree, and it is whole events
    from the block's end — at most ``TAIL_BYTES`` of them, or the last event alone."""
    kept = _record.last_events(block)
    assert kept == record.py_last_events(block) and block.endswith(kept)
    start = len(block) - len(kept)
    assert start == 0 or block[start - 2:start] == b"\n\n"
    assert len(kept) <= record.TAIL_BYTES or block[start:-2].find(b"\n\n") < 0


@pytest.mark.parametrize("last_events", [record.py_last_events] + ([_record.last_events] if _record else []))
def test_the_ring_keeps_the_events_that_start_in_a_large_reads_last_4_kib(last_events: Any) -> None:
    """Of a read just over ``TAIL_BYTES`` (4,097 bytes: the window starts one byte in) the events that start in
    the window are kept — not only the last one (a search start of -1 counts from the end in Python, and reads the
    byte before the buffer in C)."""
    block = b"A" * 10 + b"\n\n" + b"B" * 4078 + b"\n\n" + b"CCC\n\n"
    assert len(block) == record.TAIL_BYTES + 1
    assert last_events(block) == block[12:]
    assert last_events(block + b"D\n\n") == block[12:] + b"D\n\n"                  # 4,101 bytes
    assert last_events(b"x" * 5000 + b"\n\nE\n\n") == b"E\n\n"
    assert last_events(b"E\n\n" + b"x" * 5000 + b"\n\n") == b"x" * 5000 + b"\n\n"   # one long event: whole


def test_a_prompts_ids_are_nulled_in_one_pass() -> None:
    """A 64K-token prompt's ids (≈ 400 KB in the first chunk) come out as ``null`` with the rest byte for byte."""
    ids = b",".join(b"%d" % (i * 7919 % 150_000) for i in range(65_536))
    head = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"Hi","token_ids":[9906],"prompt_token_ids":['
    out = record.null_ids(head + ids + b"]}]}\n\n")
    assert out == head.replace(b"[9906]", b"null")[:-1] + b"null}]}\n\n"


@pytest.mark.parametrize("base", IMPLEMENTATIONS, ids=lambda b: b.__module__)
def test_token_chunks_are_recorded_and_given_with_null_ids(base: type) -> None:
    p = _make(base)
    one = _chunk("Hel", [9906])
    two = _chunk("lo", [385, 11]) + _chunk(" wor", [1917])
    assert p.feed(one) == one.replace(b"[9906]", b"null")
    assert p.feed(two, one) == two.replace(b"[385, 11]", b"null").replace(b"[1917]", b"null")
    assert p.blocks == [b"9906,385, 11,1917"]  # one bytearray for the token blocks in a row, extended in place
    assert type(p.blocks[0]) is bytearray
    p.blocks.append(b"data: a block kept whole\n\n")
    assert p.feed(one) == one.replace(b"[9906]", b"null")
    assert p.blocks[1:] == [b"data: a block kept whole\n\n", b"9906"] and type(p.blocks[2]) is bytearray
    assert p.ring == [one, two, one]
    assert p.slow_calls == []
    # the end of the stream, a block without ids, a block with an unsafe word, the fast path off: the slow way
    done = b"data: [DONE]\n\n"
    assert p.feed(done, two) == b"slow:" + done
    p.unsafe = (b'"reasoning',)
    odd = _chunk('"reasoning', [5])
    assert p.feed(odd) == b"slow:" + odd
    p.unsafe, p.fast = (), False
    assert p.feed(one) == b"slow:" + one
    assert p.slow_calls == [(done, two), (odd, b""), (one, b"")]
    p.fast, p.keep = True, True
    assert p.feed(one) is one and p.blocks[-1] is one and p.ring[-1] is one


@pytest.mark.skipif(len(IMPLEMENTATIONS) < 2, reason="the compiled record is not built (see the first test)")
def test_a_full_speed_read_of_many_chunks_agrees() -> None:
    """A decoder ahead of the proxy: one read holds dozens of chunks (more than the compiled scan keeps)."""
    ids = [[i, i + 1] if i % 3 else [i] for i in range(100)]
    chunks = [_chunk(f"w{i}", ids[i], i % 2 == 0, sep=b",") for i in range(100)]
    expected = b"".join(ch[:ch.rindex(b"[")] + b"null}]}\n\n" for ch in chunks)
    py, c = (_make(base) for base in IMPLEMENTATIONS)
    assert c.feed(b"".join(chunks)) == expected
    assert py.feed(b"".join(chunks)) == expected
    assert c.blocks == py.blocks == [",".join(str(x) for row in ids for x in row).encode()]


@pytest.mark.parametrize("base", IMPLEMENTATIONS, ids=lambda b: b.__module__)
def test_no_reference_is_leaked_or_kept(base: type) -> None:
    """Reference counts of what goes in and out are what the record holds, no more (a C extension's risk), and a
    record in a reference cycle is collected (its members are traversed)."""
    p = _make(base)
    block = _chunk("x", [1, 2]) + _chunk("y", [3])
    before = sys.getrefcount(block)
    for _ in range(1000):
        out = p.feed(block)
    assert sys.getrefcount(block) == before + 1000  # the ring's 1,000 references, nothing else
    assert sys.getrefcount(out) == 2  # `out` and getrefcount's argument
    ids = p.blocks[-1]
    assert sys.getrefcount(ids) == 3  # the record's list, `ids`, getrefcount's argument
    p.ring.clear()
    assert sys.getrefcount(block) == before
    p.blocks.append(p)  # a cycle through the record's own list
    dead = weakref.ref(p)
    del p
    gc.collect()
    assert dead() is None


@pytest.mark.parametrize("base", IMPLEMENTATIONS, ids=lambda b: b.__module__)
def test_feed_takes_its_arguments_by_position_or_name(base: type) -> None:
    p = _make(base)
    block = _chunk("x", [1])
    assert p.feed(block, b"") == p.feed(block, prev=b"") == p.feed(block=block) == block.replace(b"[1]", b"null")
    for bad in ((), (block, b"", b""), ):
        with pytest.raises(TypeError):
            p.feed(*bad)
    with pytest.raises(TypeError):
        p.feed(block, other=b"")


@pytest.mark.parametrize("base", IMPLEMENTATIONS, ids=lambda b: b.__module__)
def test_errors_in_the_record_propagate(base: type) -> None:
    p = _make(base)

    def full(block: bytes) -> None:
        raise MemoryError("ring")

    p.tail = full
    with pytest.raises(MemoryError, match="ring"):
        p.feed(_chunk("x", [1]))
