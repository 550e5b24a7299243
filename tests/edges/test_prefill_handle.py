"""The prefiller's ``kv_transfer_params`` travel as bytes (``kv_transfer.load_prefill_answer``, ``KVHandle``): the
decoder gets the object byte for byte as the prefiller sent it, the rest of the answer reads as orjson reads it,
and whatever orjson refuses is still refused — never forwarded half-checked."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.apis import kv_transfer
from pdproxy.apis.request import Api, parse_request
from pdproxy.errors import UpstreamUnavailable
from pdproxy.pd import prefill_answer
from pdproxy.timeline import RequestContext

JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.floats(
    allow_nan=False, allow_infinity=False)
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
HANDLES = st.dictionaries(st.text(max_size=12), JSON_VALUES, min_size=1, max_size=6)


def answer(handle: Any = None, **extra: Any) -> dict[str, Any]:
    out = {"id": "chatcmpl-1", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 64000, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 16}},
        **extra}
    if handle is not None:
        out["kv_transfer_params"] = handle
    return out


@settings(max_examples=300, deadline=None)
@given(HANDLES, st.dictionaries(st.text(max_size=6).filter(lambda k: k != "kv_transfer_params"), JSON_VALUES,
                                max_size=4))
def test_the_answer_reads_as_orjson_reads_it_with_the_handle_as_its_bytes(handle: dict[str, Any],
                                                                          extra: dict[str, Any]) -> None:
    data = orjson.dumps({**extra, "kv_transfer_params": handle})
    read = kv_transfer.load_prefill_answer(data)
    plain = orjson.loads(data)
    got = kv_transfer.extract_params(read)
    assert got is not None and got.params() == plain["kv_transfer_params"] == handle
    assert {k: v for k, v in read.items() if k != "kv_transfer_params"} == {
        k: v for k, v in plain.items() if k != "kv_transfer_params"}


@pytest.mark.parametrize("pad", [0, 2000], ids=["handle_most_of_the_answer", "handle_a_small_part"])
def test_the_decoder_gets_the_handle_byte_for_byte(pad: int) -> None:
    """Numbers orjson would round (a 30-digit id, a float past double precision), key order, spacing
    and escapes reach the decoder as the prefiller wrote them, after the client's own bytes — whether the rest of
    the answer is read member by member or whole."""
    handle = (b'{ "remote_block_ids" : [[7, 123456789012345678901234567890]], "remote_engine_id":"e\\u00e9_dp0",'
              b'\n "tp_size": 1.00000000000000000001, "do_remote_prefill" :true }')
    data = (b'{"id":"chatcmpl-1","choices":[{"finish_reason":"length","text":"' + b"x" * pad + b'"}],'
            b'"kv_transfer_params":' + handle + b',"usage":{"prompt_tokens":3}}')
    read = kv_transfer.load_prefill_answer(data)
    assert read["usage"] == {"prompt_tokens": 3} and kv_transfer.finish_reason(read) == "length"
    assert read["choices"][0]["text"] == "x" * pad
    params = kv_transfer.extract_params(read)
    assert params == kv_transfer.KVHandle(handle)
    client = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true}'
    leg = kv_transfer.decode_leg_body(Api.CHAT, client, orjson.loads(client), params)
    assert leg == client[:-1] + b',"kv_transfer_params":' + handle + b"}"
    assert not kv_transfer.ended_on_prefill(read)


def test_the_last_handle_of_two_is_the_one_orjson_keeps() -> None:
    data = b'{"kv_transfer_params": {"a": 1}, "choices": [], "kv_transfer_params": {"b": 2}}'
    assert orjson.loads(data)["kv_transfer_params"] == {"b": 2}
    assert kv_transfer.extract_params(kv_transfer.load_prefill_answer(data)) == kv_transfer.KVHandle(b'{"b": 2}')


@pytest.mark.parametrize("value", [b"null", b"{}", b"{ \n}", b"[1, 2]", b'"x"', b"0"])
def test_no_handle_reads_as_orjson_reads_it(value: bytes) -> None:
    data = b'{"choices": [{"finish_reason": "stop"}], "kv_transfer_params": ' + value + b"}"
    read = kv_transfer.load_prefill_answer(data)
    assert read == orjson.loads(data)
    assert kv_transfer.extract_params(read) is None
    assert kv_transfer.ended_on_prefill(read)          # no handle and a stop: the prefiller's answer is the answer


@pytest.mark.parametrize("data", [
    b'{"kv_transfer_params": {"remote_host": "\xff\xfe"}}',            # not UTF-8: msgspec skims strings unchecked
    b'{"kv_transfer_params": {"a": [1, 2,]}}',                           # not JSON
    b'{"kv_transfer_params": {"a": 1}, "usage": {"x": 1e999}}',          # a member orjson refuses
    b'{"kv_transfer_params": {"a": 1}, "usage": {"x": NaN}}',
    b'{"kv_transfer_params": ' + b"[" * 5000 + b"]" * 5000 + b"}",       # past msgspec's recursion limit
    b'{"kv_transfer_params": {"a": ' + b"[" * 2000 + b"]" * 2000 + b"}}",   # past orjson's depth limit
    b'\xef\xbb\xbf{"kv_transfer_params": {"a": 1}}',
    b'{"kv_transfer_params": {"a": 1}',
    b"",
])
def test_what_orjson_refuses_is_still_refused(data: bytes) -> None:
    with pytest.raises(orjson.JSONDecodeError):
        kv_transfer.load_prefill_answer(data)


def test_a_real_sized_nixl_handle_is_never_built_into_python_objects() -> None:
    """~4,000 block ids (a 64K-token prompt at block_size 16): the answer's other members are read, the handle
    stays the prefiller's bytes, and the release leg carries the same bytes."""
    ids = list(range(90_000, 94_000))
    handle = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [ids],
              "remote_engine_id": "e_dp0", "remote_request_id": "chatcmpl-1-0-ab", "remote_host": "10.0.0.5",
              "remote_port": 5600, "tp_size": 1}
    data = orjson.dumps(answer(handle))
    read = kv_transfer.load_prefill_answer(data)
    params = read["kv_transfer_params"]
    assert isinstance(params, kv_transfer.KVHandle) and params.raw == orjson.dumps(handle)
    assert kv_transfer.prefill_cached_tokens(read) == 16 and kv_transfer.prefill_prompt_tokens(read) == 64000
    release = kv_transfer.release_body({"model": "m", "prompt": "x", "stream": True}, params, Api.COMPLETIONS)
    assert release.endswith(b'"kv_transfer_params":' + params.raw + b"}")
    assert orjson.loads(release)["kv_transfer_params"]["remote_block_ids"] == [ids]


def test_a_handle_nested_past_what_msgspec_skims_is_refused_not_a_type_error() -> None:
    """orjson reads 1,023 levels and writes 254; msgspec skims ~1,000 (fewer down a deep stack): a handle between
    is one no decoder reads, refused like an unreadable answer rather than failing the leg with ``TypeError``
    when :meth:`KVHandle.of` serialises it again."""
    data = b'{"choices": [{"finish_reason": "length"}], "kv_transfer_params": {"a": ' + b"[" * 1010 + b"]" * 1010 + b"}}"
    assert orjson.loads(data)["kv_transfer_params"]
    with pytest.raises(orjson.JSONDecodeError):
        kv_transfer.extract_params(kv_transfer.load_prefill_answer(data))


def test_a_number_past_a_double_in_a_large_handle_is_forwarded_as_written() -> None:
    """The handle's numbers are checked for syntax, not range (``load_prefill_answer``): the decoder's reader
    judges ``1e999`` (Python's ``json`` reads it as infinity)."""
    handle = b'{"remote_engine_id": "' + b"x" * 200 + b'", "remote_block_ids": [[1, 1e999]]}'
    data = b'{"choices": [{"finish_reason": "length"}], "kv_transfer_params": ' + handle + b"}"
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(data)
    assert kv_transfer.extract_params(kv_transfer.load_prefill_answer(data)) == kv_transfer.KVHandle(handle)


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_finished_prefill_answer_nested_too_deep_to_relay_is_a_502_with_nothing_sent(stream: bool) -> None:
    """An answer without a handle (the prefiller finished the request) is re-serialised for the client; one nested
    past what orjson writes (254 levels) is the prefiller's broken answer — a 502 naming it, nothing sent — rather
    than a ``TypeError`` from inside the relay."""
    class Out:
        def __init__(self) -> None:
            self.sent: list[Any] = []

        async def json(self, *args: Any) -> None:
            self.sent.append(args)

        async def start(self, *args: Any) -> None:
            self.sent.append(args)

        async def end(self, *args: Any) -> None:
            self.sent.append(args)

    req = parse_request(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "stream": stream}), Api.CHAT)
    ctx = RequestContext(request_id="r", client_request_id=None, api_label="chat", prefiller="p0")
    reply = orjson.loads(b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}, "logprobs": '
                         + b"[" * 300 + b"]" * 300 + b', "finish_reason": "stop"}]}')
    out = Out()
    with pytest.raises(UpstreamUnavailable) as refused:
        await prefill_answer.send(req, ctx, out, reply, [])     # type: ignore[arg-type]
    assert refused.value.status_code == 502 and "p0" in refused.value.message and out.sent == []
    reply["choices"][0]["logprobs"] = None
    await prefill_answer.send(req, ctx, out, reply, [])         # type: ignore[arg-type]
    assert out.sent
