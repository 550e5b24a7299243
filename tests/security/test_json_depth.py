"""``load_json``'s nesting limit (pdproxy/apis/request.py) at its edge, for small bodies and for bodies of
hundreds of KB (the agent and long-prompt sizes): exactly ``max_depth`` levels parse to orjson's own value, one
more is vLLM's 400 ``json_invalid``, many shallow brackets are not depth, and what is not one JSON value stays a
400 — whichever path the body takes (the compiled depth scan of pdproxy/apis/_jsonscan.c, or without it the bracket
bound or the padded parse); and the compiled scan finds a JSON text's depth exactly, whatever its strings hold."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdproxy.apis import request as api_request
from pdproxy.apis.request import BadRequest, _brackets_at_most, json_items, load_json

try:
    from pdproxy.apis import _jsonscan
except ImportError:  # pragma: no cover - test_the_compiled_scan_is_built_and_in_use says why this fails
    _jsonscan = None  # type: ignore[assignment]

pytestmark = pytest.mark.timeout(60)

PATHS = ["python"] + (["compiled"] if _jsonscan is not None else [])


@pytest.fixture(params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each load_json test runs with the compiled scan and with the Python bound and padded parse."""
    if request.param == "python":
        monkeypatch.setattr(api_request, "NESTS_WITHIN", None)
    else:
        monkeypatch.setattr(api_request, "NESTS_WITHIN", _jsonscan.nests_within)
    return str(request.param)


def test_the_compiled_scan_is_built_and_in_use() -> None:
    """`pip install` (make install / make test) builds pdproxy/apis/_jsonscan.c; without it an agent body of 400
    brackets costs ~100 µs more to parse (loadtest/request_cost_bench.py)."""
    import os

    if os.environ.get("PDPROXY_NO_EXTENSIONS"):
        assert api_request.NESTS_WITHIN is None
        return
    assert _jsonscan is not None, "pdproxy/apis/_jsonscan.c was not built: run `make install` (needs a C compiler)"
    assert api_request.NESTS_WITHIN is _jsonscan.nests_within

LIMIT = 40
BIG = "word " * 60_000           # 300 KB of prompt text: a body far above 64 KiB


def depth(v: object) -> int:
    """A parsed value's nesting depth (``[[1]]`` is 2 deep; a scalar 0)."""
    if isinstance(v, list):
        return 1 + max((depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((depth(x) for x in v.values()), default=0)
    return 0


def body(depth: int, pad: str = "", siblings: int = 0) -> bytes:
    """An object whose ``x`` nests ``depth - 1`` arrays (``depth`` levels with the object), ``siblings`` empty
    arrays beside it (shallow brackets), ``pad`` as a long string member."""
    return (b'{"content": ' + orjson.dumps(pad) + b', "s": [' + b",".join([b"[]"] * siblings) + b'], "x": '
            + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}")


@pytest.mark.parametrize("pad", ["", BIG], ids=["small", "300KB"])
@pytest.mark.parametrize("siblings", [0, 3 * LIMIT], ids=["few-brackets", "many-brackets"])
def test_exactly_the_limit_parses_and_one_more_is_refused(pad: str, siblings: int, path: str) -> None:
    ok = body(LIMIT, pad, siblings)
    assert load_json(ok, LIMIT) == orjson.loads(ok)
    with pytest.raises(BadRequest) as refused:
        load_json(body(LIMIT + 1, pad, siblings), LIMIT)
    assert "json_invalid" in refused.value.message and "max_json_depth" in refused.value.message


@pytest.mark.parametrize("raw", [b"1, 2", b"[1] [2]", b"", b'{"a": 1', b"[" * 5000])
@pytest.mark.parametrize("pad", [b"", b" " * 70_000], ids=["small", "70KB"])
def test_what_is_not_one_json_value_is_a_400(raw: bytes, pad: bytes, path: str) -> None:
    with pytest.raises(BadRequest):
        load_json(pad + raw, LIMIT)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.recursive(st.none() | st.integers(-(2**63), 2**63 - 1) | st.text(alphabet="[]{}ab", max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                                 max_size=4), max_leaves=60),
       st.booleans())
def test_any_value_parses_iff_it_fits(path: str, value: object, big: bool) -> None:
    """Brackets inside strings count toward the bound but never toward the depth."""
    raw = orjson.dumps([value, BIG] if big else value)

    limit = 6
    if depth(orjson.loads(raw)) <= limit:
        assert load_json(raw, limit) == orjson.loads(raw)
    else:
        with pytest.raises(BadRequest):
            load_json(raw, limit)


def test_the_bracket_bound_counts_both_openers_and_stops_past_the_limit() -> None:
    """The cheap path (no padded parse) is taken exactly when the body has at most ``limit`` opening brackets —
    a 300 KB one-message chat takes it; brackets inside strings count (never toward depth, only toward the bound)."""
    assert _brackets_at_most(b'{"a": ["[", {"b": 1}]}', 4)
    assert not _brackets_at_most(b'{"a": ["[", {"b": 1}]}', 3)
    assert _brackets_at_most(b"no brackets at all", 0)
    assert not _brackets_at_most(b"[" * 10_000, 200)
    chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": BIG}], "max_tokens": 32})
    assert len(chat) > 300_000 and _brackets_at_most(chat, 200)


def reference_depth(raw: bytes) -> int:
    """The deepest bracket of ``raw`` outside its strings, byte by byte (a backslash in a string escapes the next
    byte): what ``nests_within`` answers against a limit."""
    depth = deepest = i = 0
    inside = False
    while i < len(raw):
        c = raw[i]
        if inside:
            if c == 0x5C:
                i += 1
            elif c == 0x22:
                inside = False
        elif c == 0x22:
            inside = True
        elif c in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif c in (0x5D, 0x7D) and depth:
            depth -= 1
        i += 1
    return deepest


TRICKY = st.text(alphabet='[]{}"\\ab\u00e9', max_size=10)
"""Strings of brackets, quotes and backslashes (JSON writes them escaped), and a non-ASCII letter."""


@pytest.mark.skipif(_jsonscan is None, reason="the compiled scan is not built (its own test fails)")
@settings(max_examples=500, deadline=None)
@given(st.recursive(st.none() | st.integers() .filter(lambda i: abs(i) < 2**63) | TRICKY,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY, inner, max_size=4),
                    max_leaves=60),
       st.integers(0, 12), st.sampled_from([orjson.OPT_NON_STR_KEYS, orjson.OPT_INDENT_2]))
@example(value={"a": ['\\"[[[', ['"]]]}}\\']]}, limit=2, option=0)
def test_the_scan_finds_a_json_texts_depth_exactly(value: object, limit: int, option: int) -> None:
    """For JSON the scan's answer is the value's nesting depth against the limit: brackets, quotes and
    backslashes inside strings never count (``[[1]]`` is 2 deep)."""
    raw = orjson.dumps(value, option=option)

    assert _jsonscan.nests_within(raw, limit) is (depth(value) <= limit)
    assert _jsonscan.nests_within(bytearray(raw), limit) is (depth(value) <= limit)


@pytest.mark.skipif(_jsonscan is None, reason="the compiled scan is not built (its own test fails)")
@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400).map(lambda b: bytes(b'[]{}"\\a'[x % 7] for x in b)), st.integers(0, 4))
def test_the_scan_of_any_bytes_is_the_byte_by_byte_answer(raw: bytes, limit: int) -> None:
    """Bytes that are not JSON (unclosed strings and brackets, stray closers, a trailing backslash) get the
    byte-by-byte scanner's answer: no error, no read past the end."""
    assert _jsonscan.nests_within(raw, limit) is (reference_depth(raw) <= limit)


@pytest.mark.skipif(_jsonscan is None, reason="the compiled scan is not built (its own test fails)")
def test_the_scan_refuses_bad_arguments_with_python_errors() -> None:
    with pytest.raises(TypeError):
        _jsonscan.nests_within("text", 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _jsonscan.nests_within(b"[]")  # type: ignore[call-arg]
    assert _jsonscan.nests_within(memoryview(b"[[1]]"), 2) is True
    assert _jsonscan.nests_within(b"[[1]]", 1) is False
    assert _jsonscan.nests_within(b"", 0) is True


@pytest.mark.skipif(_jsonscan is None, reason="the compiled scan is not built (its own test fails)")
@settings(max_examples=500, deadline=None)
@given(st.recursive(st.none() | st.integers().filter(lambda i: abs(i) < 2**63) | TRICKY,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TRICKY, inner, max_size=4),
                    max_leaves=60).filter(lambda v: isinstance(v, list | dict)),
       st.sampled_from([0, orjson.OPT_INDENT_2]), st.sampled_from([b"", b" ", b',"x":1}']))
def test_the_compiled_container_end_is_the_python_ones(value: object, option: int, after: bytes) -> None:
    """``container_end`` (kv_transfer's cut of proxy-owned members, pdproxy/apis/_jsonscan.c) ends every object
    and array where its Python twin does — brackets, quotes and backslashes inside strings never count — at any
    offset, whatever follows; neither reads past a container nothing closes (ValueError)."""
    from pdproxy.apis import kv_transfer

    body = orjson.dumps(value, option=option)
    raw = b'{"k":' + body + after
    assert _jsonscan.container_end(raw, 5) == kv_transfer.py_container_end(raw, 5) == 5 + len(body)
    assert _jsonscan.container_end(bytearray(body), 0) == len(body)
    for cut in (body[:-1], b"[" + body):
        with pytest.raises(ValueError):
            _jsonscan.container_end(cut, 0)
        with pytest.raises(ValueError):
            kv_transfer.py_container_end(cut, 0)


@pytest.mark.skipif(_jsonscan is None, reason="the compiled scan is not built (its own test fails)")
def test_container_end_refuses_what_opens_no_container() -> None:
    for raw, start in ((b'"a"', 0), (b"[]", 2), (b"[]", -1), (b"", 0)):
        with pytest.raises(ValueError):
            _jsonscan.container_end(raw, start)
    with pytest.raises(TypeError):
        _jsonscan.container_end("[]", 0)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ max_json_items
@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=3000).map(lambda b: bytes(b"{[,a"[x % 4] for x in b)), limit=st.integers(0, 2000))
def test_json_items_counts_exactly_up_to_the_limit(raw: bytes, limit: int) -> None:
    true = sum(raw.count(c) for c in (b"{", b"[", b","))
    got = json_items(raw, limit)
    assert got == true if true <= limit else limit < got <= true


def test_json_items_stops_soon_after_the_limit() -> None:
    """A dense body is counted a chunk at a time, so the work stops past the limit (bounded whatever the body)."""
    raw = b"{}," * 3_000_000                                   # 9 MB: 6M items
    assert 1_000 < json_items(raw, 1_000) < 2_000_000


def test_a_body_of_too_many_items_is_a_400_before_any_parse(path: str) -> None:
    limit = 10_000
    small = b'{"x": [' + b",".join([b"{}"] * (limit // 4)) + b"]}"          # ~limit / 2 items: parsed
    assert load_json(small, max_items=limit) == orjson.loads(small)
    many = b'{"x": [' + b",".join([b"{}"] * limit) + b"]}"                  # ~2 × limit items
    with pytest.raises(BadRequest) as refused:
        load_json(many, max_items=limit)
    assert "json_invalid" in refused.value.message and "max_json_items" in refused.value.message
    text = orjson.dumps({"content": "a, b, " * limit})                       # commas in a string count too
    assert len(text) * 2 > limit * 3
    with pytest.raises(BadRequest):
        load_json(text, max_items=limit)


def wide(value: object) -> bool:
    """Whether a JSON-like value holds an int outside [-2**63, 2**64 - 1] (keys are strings: never)."""
    if isinstance(value, dict):
        return any(wide(v) for v in value.values())
    if isinstance(value, list):
        return any(wide(v) for v in value)
    return type(value) is int and not -(2**63) <= value <= 2**64 - 1


EDGE_INTS = st.sampled_from([2**64 - 1, 2**64, -(2**63), -(2**63) - 1, 10**19, 10**20, -(10**19), 10**30, 0, -1])
NUMBERS = st.integers(-(2**70), 2**70) | EDGE_INTS | st.floats(allow_nan=False, allow_infinity=False)
DIGIT_TEXT = st.text(alphabet='0123456789-.e"\\ ', max_size=30)
"""Strings of digits, signs, quotes and backslashes: a long run of digits inside a string is not a number."""


@pytest.mark.parametrize("scan", ["python"] + (["compiled"] if _jsonscan is not None else []))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.recursive(st.none() | NUMBERS | DIGIT_TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(DIGIT_TEXT, inner, max_size=4),
                    max_leaves=30), st.booleans())
def test_the_wide_integer_scan_finds_exactly_the_integers_past_64_bits(scan: str, value: object,
                                                                         indent: bool) -> None:
    """``wide_integer`` (C, and its Python twin ``py_wide_integer``) answers whether a JSON text holds an integer
    outside int64/uint64 — digits inside strings and floats with many digits never count."""
    import json

    fn = _jsonscan.wide_integer if scan == "compiled" else api_request.py_wide_integer
    raw = json.dumps(value, indent=2 if indent else None).encode()   # Python's json writes any int exactly
    assert fn(raw) is wide(value)


def test_a_body_with_an_integer_past_64_bits_is_a_400_on_either_path(path: str) -> None:
    """orjson 3.13 reads ``18446744073709551616`` as a float: a body holding one is refused (the legs pdproxy
    writes again would carry another number than the client sent), ``2**64 - 1`` and ``-2**63`` are kept exact."""
    for raw in (b'{"tools": [{"maximum": 123456789012345678901234567890}]}', b'{"seed": 18446744073709551616}',
                b'{"a": [-9223372036854775809]}'):
        with pytest.raises(BadRequest) as refused:
            load_json(raw)
        assert "integers within 64 bits" in refused.value.message and refused.value.param == "body"
    assert load_json(b'{"a": [18446744073709551615, -9223372036854775808, 1.8446744073709551616e19], '
                     b'"b": "123456789012345678901234567890"}') == {
        "a": [2**64 - 1, -(2**63), 1.8446744073709552e19], "b": "123456789012345678901234567890"}
