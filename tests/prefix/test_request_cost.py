"""In process: the per-request shortcuts of prefix routing and admission give what the plain computations gave.

Text keys (XXH3-chained chunks that grow along the prompt) keep a shared prefix's keys and only its keys; the
approximate index's bulk record, the in-flight counts' bulk add and take, and the tools' size from orjson's
rendering, and the usage figure searched from a block's end, each equal the one-at-a-time (or whole-scan)
reference they replaced (property tests)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdproxy.admission.bounds import LAYOUT_WALK_CONTAINERS, ToolsBytes, indented_json_bytes, prompt_bounds, utf8_len
from pdproxy.apis.request import completion_tokens_in
from pdproxy.prefix.index import TEXT_GROWTH, ApproxPrefixIndex, BlockKeys, key_bytes, text_keys
from pdproxy.prefix.routing import InflightPrefixes

pytestmark = pytest.mark.timeout(60)

E, F = "http://e:1", "http://f:1"


def test_text_chunks_grow_with_their_offset_and_stay_few() -> None:
    keys = text_keys("word " * 55_000, chunk_chars=256)                    # 275 KB
    sizes = [b - a for a, b in zip([0, *keys.ends], keys.ends, strict=False)]
    assert sizes[:TEXT_GROWTH] == [256] * TEXT_GROWTH
    assert all(size == start // TEXT_GROWTH for start, size in zip(keys.ends[:-2], sizes[1:-1], strict=True)
               if start >= 256 * TEXT_GROWTH)
    assert 0 < sizes[-1] <= keys.ends[-2] // TEXT_GROWTH                  # the last chunk ends at the text's end
    assert len(keys.keys) <= 52 and keys.ends[-1] == keys.num_chars == 275_000
    assert text_keys("é" * 100, chunk_chars=64).num_chars == 200                # bytes, not characters
    assert text_keys("x" * 255, chunk_chars=256).keys == []      # shorter than a chunk: no key (no routing key)
    assert text_keys("x" * 300, chunk_chars=256).ends == [256, 300]


def test_a_message_mark_half_a_chunk_or_more_into_a_chunk_ends_it() -> None:
    text = "\x1esystem\x1f" + "a" * 5000 + "\x1euser\x1f" + "b" * 100 + "\x1eassistant\x1f" + "c" * 3000
    marks = [i for i, c in enumerate(text) if c == "\x1e"]
    keys = text_keys(text, chunk_chars=256)
    starts = [0, *keys.ends[:-1]]
    for start, end in zip(starts, keys.ends, strict=True):
        step = start // TEXT_GROWTH if start >= 256 * TEXT_GROWTH else 256
        assert not [m for m in marks if start + max(256, step // 2) <= m < end]   # none skipped that far in
        assert end in marks or end == len(text) or end - start == step
    assert 5000 < marks[1] in keys.ends and marks[2] not in keys.ends    # the user's 100 bytes: < one chunk


@pytest.mark.parametrize("text", ["\x1e" * 250_000, ("\x1euser\x1f" + "b" * 114) * 2000,
                                  ("\x1euser\x1f" + "b" * 44) * 5000, "word " * 50_000])
def test_a_client_writing_message_marks_cannot_multiply_the_keys(text: str) -> None:
    """Marks end a chunk only half a step or more into it: 250 KB has at most ~90 keys however many marks it
    holds (49 with none); every mark past the first chunk would have given ~1,000."""
    assert len(text_keys(text[:250_000], chunk_chars=256).keys) <= 90
    assert len(text_keys(text[:250_000], chunk_chars=1).keys) <= 200


def test_text_keys_do_not_depend_on_the_process() -> None:
    code = "from pdproxy.prefix.index import text_keys; print(text_keys('abc ' * 2000, namespace='x').keys)"
    outs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, check=True).stdout for seed in ("0", "1")}
    assert len(outs) == 1 and outs.pop().strip() == str(text_keys("abc " * 2000, namespace="x").keys)


@settings(max_examples=150, deadline=None)
@given(shared=st.text(min_size=0, max_size=6000), a=st.text(min_size=1, max_size=3000),
       b=st.text(min_size=1, max_size=3000), chunk=st.sampled_from([1, 7, 64, 256]))
@example(shared="000\x80\x80\x80\x80\x80\U00010000", a="\x1e", b="0", chunk=1)   # a mark right after the shared bytes
def test_text_keys_share_exactly_the_chunks_of_a_shared_prefix(shared: str, a: str, b: str, chunk: int) -> None:
    if a[0] == b[0]:
        b = chr((ord(a[0]) + 1) % 0xD800) + b[1:]
    ka, kb = text_keys(shared + a, chunk_chars=chunk), text_keys(shared + b, chunk_chars=chunk)
    da, db = ((shared + x).encode("utf-8", "surrogatepass") for x in (a, b))
    common = next((i for i, (x, y) in enumerate(zip(da, db, strict=False)) if x != y), min(len(da), len(db)))
    # chunks ending before the first different byte are the same; one ending at it may not be in the other (a
    # message mark there ends a chunk: the byte after a chunk decides that, as a conversation's next turn wants)
    inside = sum(1 for end in ka.ends if end < common)
    assert ka.keys[:inside] == kb.keys[:inside] and ka.ends[:inside] == kb.ends[:inside]
    diverged = min(len(ka.keys), len(kb.keys))
    holding = next((i for i in range(inside, diverged) if ka.ends[i] > common), diverged)
    if holding < diverged and ka.ends[:holding + 1] == kb.ends[:holding + 1]:
        assert ka.keys[holding] != kb.keys[holding]               # the chunk holding the first different byte
    assert text_keys(shared + a, chunk_chars=chunk, namespace="lora").keys[:1] != ka.keys[:1] or not ka.keys


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.binary(min_size=0, max_size=700) | st.sampled_from([b"\x1e", b"\x1euser\x1f", b"\x1e\x1e"]),
                      max_size=12), chunk=st.sampled_from([1, 5, 16, 64]), namespace=st.sampled_from(["", "lora"]))
@example(parts=[b"a" * 20, b"\x1e", b"b" * 30], chunk=4, namespace="")     # a chunk spanning three parts, a mark in one
def test_text_keys_of_parts_are_those_of_their_concatenation(parts: list[bytes], chunk: int, namespace: str) -> None:
    # the rendering's parts are hashed unjoined (chunks inside a part from a view, across parts by XXH3's
    # streaming state, the marks searched part by part): the keys and chunk ends must be the joined bytes'
    joined = text_keys(b"".join(parts), chunk_chars=chunk, namespace=namespace, num_tokens=7)
    assert text_keys(parts, chunk_chars=chunk, namespace=namespace, num_tokens=7) == joined


@settings(max_examples=100, deadline=None)
@given(size=st.integers(0, 300_000), tokens=st.integers(1, 100_000))
def test_text_cached_tokens_and_blocks_within_are_inverse(size: int, tokens: int) -> None:
    keys = text_keys("x" * size, num_tokens=tokens)
    for blocks in range(len(keys.keys) + 1):
        cached = keys.cached_tokens(blocks)
        assert cached <= max(tokens - 1, 0)
        if cached < tokens - 1:                                  # the most blocks that cover no more than it
            within = keys.blocks_within(cached)
            assert within >= blocks and keys.cached_tokens(within) == cached
            assert within == len(keys.keys) or keys.cached_tokens(within + 1) > cached


def test_key_bytes_are_the_signed_bytes_of_a_signed_key() -> None:
    for key in (0, 1, -1, -(1 << 63), (1 << 63) - 1, 123456789):
        assert key_bytes(key) == key.to_bytes(8, "big", signed=True)
    assert key_bytes((1 << 64) - 1) == b"\xff" * 8


# ---------------------------------------------------------------------------------------------- bulk = one by one
def reference_record(sent: dict[int, float], chain: list[int], now: float, cap: int) -> None:
    """The approximate index's record, one key at a time: each key of ``chain``, tail first, becomes the most
    recent (its head last), then the oldest keys leave down to ``cap``."""
    for key in reversed(chain):
        sent.pop(key, None)
        sent[key] = now
    while len(sent) > cap:
        del sent[next(iter(sent))]


def reference_expire(sent: dict[int, float], limit: float) -> None:
    """The approximate index's expiry, one key at a time: keys sent before ``limit`` leave, oldest first."""
    while sent and next(iter(sent.values())) < limit:
        del sent[next(iter(sent))]


def reference_match(sent: dict[str, dict[int, float]], chain: list[int], block_size: int = 4) -> dict[str, int]:
    """Per endpoint, the cached tokens of the leading run of ``chain`` held in its ``sent`` (one key at a time)."""
    keys = BlockKeys(chain, block_size, block_size * len(chain) + 1)
    out = {}
    for endpoint, held in sent.items():
        n = 0
        while n < len(chain) and chain[n] in held:
            n += 1
        out[endpoint] = keys.cached_tokens(n)
    return out


chains = st.lists(st.integers(0, 40), min_size=1, max_size=12, unique=True)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from([E, F]), chains), min_size=1, max_size=12),
       cap=st.integers(3, 30), queries=st.lists(chains, min_size=1, max_size=4))
def test_bulk_record_equals_one_key_at_a_time(ops: list[tuple[str, list[int]]], cap: int,
                                              queries: list[list[int]]) -> None:
    """Same keys in the same LRU order per endpoint, and every query answers what the one-at-a-time record holds
    (a prompt recorded on both endpoints, a conversation's next turn re-sending its earlier keys)."""
    approx = ApproxPrefixIndex(default_capacity_blocks=cap, ttl_s=1e9, clock=lambda: 5.0)
    sent: dict[str, dict[int, float]] = {}
    for endpoint, chain in ops:
        approx.record(endpoint, BlockKeys(chain, 4, 4 * len(chain) + 1))
        reference_record(sent.setdefault(endpoint, {}), chain, 5.0, cap)
        assert list(approx._loc(endpoint, "tokens", 4).sent) == list(sent[endpoint])   # same keys, same LRU order
        for chain_q in [chain, *queries]:
            assert approx.match(BlockKeys(chain_q, 4, 4 * len(chain_q) + 1)) == reference_match(sent, chain_q)
            assert approx.match(BlockKeys(chain_q, 4, 4 * len(chain_q) + 1), [E, F]) == {
                E: 0, F: 0, **reference_match(sent, chain_q)}


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from([E, F]), chains, st.integers(0, 3)), min_size=1, max_size=20),
       cap=st.integers(3, 12))
def test_a_churned_index_keeps_lru_and_ttl_order(ops: list[tuple[str, list[int], int]], cap: int) -> None:
    """Past capacity (every record deletes at the head) and with time moving on (expiry deletes at the head too),
    the index keeps the reference's keys in the reference's order, and ``sent``'s head is an O(1) read (an
    ``OrderedDict``: a plain dict walks every deleted slot before its first live key)."""
    clock = [0.0]
    approx = ApproxPrefixIndex(default_capacity_blocks=cap, ttl_s=4.0, clock=lambda: clock[0])
    sent: dict[str, dict[int, float]] = {}
    for endpoint, chain, step in ops:
        clock[0] += step
        approx.record(endpoint, BlockKeys(chain, 4, 4 * len(chain) + 1))
        loc = approx._loc(endpoint, "tokens", 4)
        held = sent.setdefault(endpoint, {})
        reference_record(held, chain, clock[0], 10**9)
        reference_expire(held, clock[0] - 4.0)
        reference_record(held, [], clock[0], cap)
        assert isinstance(loc.sent, OrderedDict)
        assert list(loc.sent.items()) == list(held.items())
    clock[0] += 5.0
    assert approx.match(BlockKeys([1], 4, 5)) == dict.fromkeys(sent, 0)   # a query expires every location
    assert approx.entries() == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "fail", "answer", "drop"]), st.sampled_from([E, F]), chains),
                    min_size=1, max_size=16))
def test_inflight_counts_equal_one_key_at_a_time(ops: list[tuple[str, str, list[int]]]) -> None:
    clock = [0.0]
    flying = InflightPrefixes(settle_s=100.0, clock=lambda: clock[0])
    counts: dict[str, dict[int, int]] = {E: {}, F: {}}
    added: list[tuple[str, BlockKeys]] = []
    settling: list[tuple[str, list[int]]] = []

    def take(endpoint: str, keys: list[int]) -> None:
        for k in keys:
            counts[endpoint][k] -= 1
            if not counts[endpoint][k]:
                del counts[endpoint][k]

    for op, endpoint, chain in ops:
        keys = BlockKeys(chain, 4, 4 * len(chain) + 1)
        if op == "add":
            flying.add(endpoint, keys)
            added.append((endpoint, keys))
            for k in chain:
                counts[endpoint][k] = counts[endpoint].get(k, 0) + 1
        elif op in ("fail", "answer") and added:
            endpoint, keys = added.pop(0)
            flying.remove(endpoint, keys, answered=op == "answer")
            if op == "fail":
                take(endpoint, keys.keys)
            else:
                settling.append((endpoint, list(keys.keys)))
        elif op == "drop":
            flying.drop(endpoint, frozenset(chain))
            kept = []
            for name, held in settling:
                cut = next((i for i, k in enumerate(held) if k in chain), len(held)) if name == endpoint else len(held)
                take(name, held[cut:])
                if cut:
                    kept.append((name, held[:cut]))
            settling = kept
        clock[0] += 1.0
        assert flying._held == {e: c for e, c in counts.items() if c}          # the same counts, key by key
    clock[0] += 1000.0                                             # every answered prompt settled and gone
    while added:
        endpoint, keys = added.pop()
        flying.remove(endpoint, keys)
    assert flying.match(BlockKeys([1, 2, 3], 4, 13), E) == 0 and not flying._held and len(flying) == 0


# ---------------------------------------------------------------------------------------------- admission bounds
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(value=json_values)
def test_tools_size_is_pythons_indented_json(value: Any) -> None:
    assert indented_json_bytes(value) == utf8_len(json.dumps(value, indent=4, ensure_ascii=False))


@settings(max_examples=100, deadline=None)
@given(value=st.recursive(st.integers() | st.text(max_size=4),
                          lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                     max_size=3), max_leaves=12))
def test_tools_size_beyond_64_bit_integers_is_pythons_too(value: Any) -> None:
    """Integers orjson does not encode are measured from Python's compact JSON, with the same layout count."""
    assert indented_json_bytes(value) == utf8_len(json.dumps(value, indent=4, ensure_ascii=False))


def test_tools_size_is_counted_without_rendering_the_layout() -> None:
    """A schema nested deep over a long list: rendering it indented grows with depth × members (the old code: a
    1.8 MB list 195 levels deep rendered to 712 MB, 1 s of the event loop); counted, the same figure as Python's
    rendering in a small fraction of its memory.  Past LAYOUT_WALK_CONTAINERS containers the figure is a bound
    above the exact one, still without rendering."""
    import tracemalloc

    value = json.loads('{"a":' * 150 + "[" + ",".join(["12"] * 20_000) + "]" + "}" * 150)
    exact = utf8_len(json.dumps(value, indent=4, ensure_ascii=False))         # ~12 MB rendered
    tracemalloc.start()
    try:
        assert indented_json_bytes(value) == exact
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < exact // 2                # old code: 23.6 MB (the rendering and its lines); now 4 MB (orjson's)
    many = [{"k": [i]} for i in range(LAYOUT_WALK_CONTAINERS)]                 # 2 × the walk's containers
    assert indented_json_bytes(many) >= utf8_len(json.dumps(many, indent=4, ensure_ascii=False))
    few = many[: LAYOUT_WALK_CONTAINERS // 2 - 1]                               # 9,999 containers: counted exactly
    assert indented_json_bytes(few) == utf8_len(json.dumps(few, indent=4, ensure_ascii=False))


@settings(max_examples=50, deadline=None)
@given(value=st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=6))
def test_tools_size_with_floats_is_an_upper_bound(value: list[float]) -> None:
    assert indented_json_bytes(value) >= utf8_len(json.dumps(value, indent=4, ensure_ascii=False)) - 2 * len(value)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(json_values, min_size=1, max_size=6))
def test_remembered_tools_sizes_are_each_lists_own(values: list[Any]) -> None:
    """Admission's cache of tools sizes (two entries, so it also forgets): every answer, first or remembered, is
    the list's own :func:`indented_json_bytes` — lists of other sizes never share an answer."""
    sizes = ToolsBytes(entries=2)
    for value in values + values[::-1] + values:
        assert sizes(value) == indented_json_bytes(value)
    assert len(sizes._sizes) <= 2


def test_an_agents_tools_are_measured_once_per_list(monkeypatch: pytest.MonkeyPatch) -> None:
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {"x": {"type": "string"}}}}
             for i in range(16)]
    measured: list[int] = []

    def counted(value: Any, compact: bytes | None = None) -> int:
        measured.append(1)
        return indented_json_bytes(value, compact)

    monkeypatch.setattr("pdproxy.admission.bounds.indented_json_bytes", counted)   # what ToolsBytes measures with
    sizes = ToolsBytes()
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
    first = prompt_bounds(body, True, template_overhead=64, tools_bytes=sizes)
    for _ in range(5):                       # each turn parses a new, equal list
        again = prompt_bounds(json.loads(json.dumps(body)), True, template_overhead=64, tools_bytes=sizes)
        assert again.upper == first.upper
    assert len(measured) == 1 and len(sizes._sizes) == 1         # measured on the first turn only
    changed = json.loads(json.dumps(body))
    changed["tools"][3]["function"]["name"] = "a_longer_name"
    assert prompt_bounds(changed, True, template_overhead=64, tools_bytes=sizes).upper == first.upper + 11  # +11 bytes
    assert len(measured) == 2 and len(sizes._sizes) == 2


def test_the_upper_bound_needs_no_word_count() -> None:
    body: dict[str, Any] = {"messages": [{"role": "system", "content": "be brief " * 500},
                                         {"role": "user", "content": "a b c d e f"}],
                            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"x": [1.5]}}}]}
    full, cheap = prompt_bounds(body, True, template_overhead=64), prompt_bounds(body, True, template_overhead=64,
                                                                                 lower=False)
    assert cheap.upper == full.upper and cheap.lower == 0 < full.lower
    assert cheap.text_bytes == full.text_bytes


# ----------------------------------------------------------------------- usage figure, searched from the end
usage_piece = st.sampled_from([b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n', b'"completion_tokens": 7',
                               b'"completion_tokens":12}', b'"completion_tokens": null', b'"completion_tokens"',
                               b'"completion_tokens" :  345', b'data: [DONE]\n\n', b':', b' ', b'9', b'9' * 14])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(usage_piece, max_size=10))
def test_completion_tokens_from_the_end_equal_the_last_of_a_whole_scan(pieces: list[bytes]) -> None:
    """The figure searched from the end is the last a whole scan finds; a figure of more than 15 digits is none
    (an engine's: ``int()`` of thousands of digits raises, a metric of it overflows)."""
    data = b"".join(pieces)
    found = re.findall(rb'"completion_tokens"\s*:\s*(\d{1,15})(?!\d)', data)
    assert completion_tokens_in(data) == (int(found[-1]) if found else None)


def test_an_engines_figure_of_thousands_of_digits_is_no_count() -> None:
    from pdproxy.apis.streams import output_tokens_in

    huge = b"9" * 5000
    two = b'{"usage": {"completion_tokens": 3}} {"usage": {"completion_tokens": ' + huge + b"}}"
    assert completion_tokens_in(two) == 3                       # the earlier figure: the huge one is none
    assert completion_tokens_in(b'"completion_tokens": ' + b"1" * 16) is None
    assert completion_tokens_in(b'"completion_tokens": ' + b"1" * 15) == int(b"1" * 15)
    assert output_tokens_in(b'"output_tokens": ' + huge) is None and output_tokens_in(b'"output_tokens": 4') == 4
