"""``load_json``'s nesting limit (pdproxy/apis/request.py) at its edge, for small bodies and for bodies of
hundreds of KB (the agent and long-prompt sizes): exactly ``max_depth`` levels parse to orjson's own value, one
more is vLLM's 400 ``json_invalid``, many shallow brackets are not depth, and what is not one JSON value stays a
400 — whichever of the two paths (bracket bound or padded parse) the body takes."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.apis.request import BadRequest, _brackets_at_most, json_items, load_json

pytestmark = pytest.mark.timeout(60)

LIMIT = 40
BIG = "word " * 60_000           # 300 KB of prompt text: a body far above 64 KiB


def body(depth: int, pad: str = "", siblings: int = 0) -> bytes:
    """An object whose ``x`` nests ``depth - 1`` arrays (``depth`` levels with the object), ``siblings`` empty
    arrays beside it (shallow brackets), ``pad`` as a long string member."""
    return (b'{"content": ' + orjson.dumps(pad) + b', "s": [' + b",".join([b"[]"] * siblings) + b'], "x": '
            + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}")


@pytest.mark.parametrize("pad", ["", BIG], ids=["small", "300KB"])
@pytest.mark.parametrize("siblings", [0, 3 * LIMIT], ids=["few-brackets", "many-brackets"])
def test_exactly_the_limit_parses_and_one_more_is_refused(pad: str, siblings: int) -> None:
    ok = body(LIMIT, pad, siblings)
    assert load_json(ok, LIMIT) == orjson.loads(ok)
    with pytest.raises(BadRequest) as refused:
        load_json(body(LIMIT + 1, pad, siblings), LIMIT)
    assert "json_invalid" in refused.value.message and "max_json_depth" in refused.value.message


@pytest.mark.parametrize("raw", [b"1, 2", b"[1] [2]", b"", b'{"a": 1', b"[" * 5000])
@pytest.mark.parametrize("pad", [b"", b" " * 70_000], ids=["small", "70KB"])
def test_what_is_not_one_json_value_is_a_400(raw: bytes, pad: bytes) -> None:
    with pytest.raises(BadRequest):
        load_json(pad + raw, LIMIT)


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.integers(-(2**63), 2**63 - 1) | st.text(alphabet="[]{}ab", max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner,
                                                                                 max_size=4), max_leaves=60),
       st.booleans())
def test_any_value_parses_iff_it_fits(value: object, big: bool) -> None:
    """Brackets inside strings count toward the bound but never toward the depth."""
    raw = orjson.dumps([value, BIG] if big else value)

    def depth(v: object) -> int:
        if isinstance(v, list):
            return 1 + max((depth(x) for x in v), default=0)
        if isinstance(v, dict):
            return 1 + max((depth(x) for x in v.values()), default=0)
        return 0

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


def test_a_body_of_too_many_items_is_a_400_before_any_parse() -> None:
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
