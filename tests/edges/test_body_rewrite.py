"""The decode leg's body: the client's bytes, byte-faithful, minus the members only the proxy may set, plus the
prefiller's handle — never a second member of one name (``kv_transfer.decode_body_bytes``).

Bodies are generated with arbitrary whitespace, escaped member names (``"kv_transfer_param\\u0073"`` is
``kv_transfer_params``), nested values full of quotes, backslashes and brackets, and client-sent proxy-owned
members (once or several times).  A client's own duplicate members (legal JSON; vLLM's ``json.loads`` and
pdproxy's orjson both read the last one) are the client's bytes and stay as sent."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.apis import kv_transfer

pytestmark = pytest.mark.timeout(120)

WS = st.sampled_from(["", " ", "\n  ", "\t", " \r\n "])
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**15, 10**15),
                    st.floats(allow_nan=False, allow_infinity=False, width=32),
                    st.text(alphabet=st.sampled_from('ab"\\/{}[],: \u00e9\u2603\n'), max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(alphabet="ab\"\\{", max_size=4), inner, max_size=4)),
    max_leaves=12)
NAMES = st.one_of(st.sampled_from(["model", "prompt", "max_tokens", "stream", "messages"]),
                  st.text(alphabet='xyz"\\_', min_size=1, max_size=6))
OWNED = st.sampled_from(sorted(kv_transfer.PROXY_OWNED))
PARAMS = st.one_of(st.none(), st.fixed_dictionaries(
    {"do_remote_prefill": st.just(True), "remote_block_ids": st.lists(st.lists(st.integers(0, 99), max_size=3),
                                                                        max_size=2)}))


def encode_name(name: str, escape: bool) -> str:
    """A member name as JSON, optionally with every letter written as a \\u escape."""
    if not escape:
        return json.dumps(name)
    return '"' + "".join(f"\\u{ord(c):04x}" if c.isalpha() else json.dumps(c)[1:-1] for c in name) + '"'


@st.composite
def bodies(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, Any]]]:
    """Raw JSON object bytes and its members in order (duplicates possible, as a client may send them)."""
    members: list[tuple[str, Any]] = draw(st.lists(st.tuples(NAMES, VALUES), min_size=1, max_size=6))
    for _ in range(draw(st.integers(0, 3))):
        members.insert(draw(st.integers(0, len(members))), (draw(OWNED), draw(VALUES)))
    parts = []
    for name, value in members:
        text = json.dumps(value, ensure_ascii=draw(st.booleans()), separators=draw(st.sampled_from(
            [(",", ":"), (", ", ": "), (" , ", " :  ")])))
        parts.append(draw(WS) + encode_name(name, draw(st.booleans())) + draw(WS) + ":" + draw(WS) + text + draw(WS))
    raw = "{" + ",".join(parts) + "}" + draw(WS)
    return raw.encode(), members


def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    names = [k for k, _ in pairs]
    assert len(names) == len(set(names)), f"duplicate members {names}"
    return dict(pairs)


@settings(max_examples=400, deadline=None)
@given(bodies(), PARAMS)
def test_decode_body_keeps_every_other_byte_and_owns_the_handle(body: tuple[bytes, list[tuple[str, Any]]],
                                                                params: dict[str, Any] | None) -> None:
    raw, members = body
    parsed = orjson.loads(raw)
    out = kv_transfer.decode_body_bytes(raw, None if params is None else kv_transfer.KVHandle.of(params), parsed)

    names_in = [name for name, _, _ in kv_transfer.top_level_members(raw)]
    names_out = [name for name, _, _ in kv_transfer.top_level_members(out)]
    assert names_out == [n for n in names_in if n not in kv_transfer.PROXY_OWNED] + (
        ["kv_transfer_params"] if params is not None else [])    # pdproxy adds one member, never a second one
    if len(set(names_in)) == len(names_in):
        json.loads(out, object_pairs_hook=no_duplicates)        # strict JSON whenever the client's was
    expected = {k: v for k, v in parsed.items() if k not in kv_transfer.PROXY_OWNED}
    if params is not None:
        expected["kv_transfer_params"] = params
    assert orjson.loads(out) == expected
    kept_in = [raw[s:e] for name, s, e in kv_transfer.top_level_members(raw) if name not in kv_transfer.PROXY_OWNED]
    kept_out = [out[s:e] for name, s, e in kv_transfer.top_level_members(out) if name not in kv_transfer.PROXY_OWNED]
    assert kept_out == kept_in                                  # each kept member exactly as sent, in order
    if params is None and not any(name in kv_transfer.PROXY_OWNED for name, _ in members):
        assert out is raw


@settings(max_examples=200, deadline=None)
@given(bodies())
def test_top_level_members_splits_the_object_as_a_json_parser_does(body: tuple[bytes, list[tuple[str, Any]]]) -> None:
    raw, members = body
    found = kv_transfer.top_level_members(raw)
    assert [name for name, _, _ in found] == [name for name, _ in members]
    for (name, start, end), (_, value) in zip(found, members, strict=True):
        assert orjson.loads(b"{" + raw[start:end] + b"}") == {name: value}


def test_the_common_case_is_one_append() -> None:
    raw = b'{"model": "m", "prompt": "x", "max_tokens": 5}\n'
    out = kv_transfer.decode_body_bytes(raw, kv_transfer.KVHandle.of({"a": 1}), orjson.loads(raw))
    assert out == b'{"model": "m", "prompt": "x", "max_tokens": 5,"kv_transfer_params":{"a":1}}'


def test_only_proxy_owned_members_go_even_when_escaped_or_repeated() -> None:
    raw = (b'{ "kv_transfer_params" : {"remote_host": "evil"},"prompt":"say \\"kv_transfer_params\\": 1",'
           b'"kv_transfer_param\\u0073": [1], "ec_transfer_params": {}, "n": 1 }')
    out = kv_transfer.decode_body_bytes(raw, None, orjson.loads(raw))
    assert out == b'{ "prompt":"say \\"kv_transfer_params\\": 1","n": 1 }'
    assert kv_transfer.decode_body_bytes(b'{"kv_transfer_params": 1}', None) == b"{}"
    assert kv_transfer.decode_body_bytes(b'{"kv_transfer_params": 1}', kv_transfer.KVHandle.of({"b": 2})) == b'{"kv_transfer_params":{"b":2}}'
