"""The P→D contract: prefill body rules, decode body byte-faithfulness, params extraction."""

from __future__ import annotations

import copy

import orjson
import pytest

from pdproxy.apis import kv_transfer
from pdproxy.apis.request import Api


def test_prefill_body_rules_and_no_mutation() -> None:
    original = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": 300, "max_completion_tokens": 200,
                "min_tokens": 5, "ignore_eos": True, "min_p": 0.05}
    before = copy.deepcopy(original)
    body = kv_transfer.prefill_body(original)
    assert original == before
    assert body["stream"] is False
    assert body["max_tokens"] == 1 and body["max_completion_tokens"] == 1
    assert "stream_options" not in body
    assert body["min_tokens"] == 1
    assert body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False,
                                          "remote_engine_id": None, "remote_block_ids": None,
                                          "remote_host": None, "remote_port": None}
    assert body["ignore_eos"] is True and body["min_p"] == 0.05


def test_prefill_body_adds_max_completion_tokens_only_if_present() -> None:
    body = kv_transfer.prefill_body({"prompt": "x", "max_tokens": 50})
    assert "max_completion_tokens" not in body and body["max_tokens"] == 1


def test_decode_body_bytes_keep_the_client_bytes_and_append_params() -> None:
    raw = b'{"prompt": "x", "temperature": 0.10000000000000000555, "seed": 12345678901234567890 , "n": 1}  '
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e_dp0"}
    out = kv_transfer.decode_body_bytes(raw, kv_transfer.KVHandle.of(params))
    assert out.startswith(raw.rstrip()[:-1].rstrip())  # every client byte before the closing brace, verbatim
    assert orjson.loads(out.replace(b"12345678901234567890", b"1"))["kv_transfer_params"] == params


def test_decode_body_replaces_a_client_sent_handle_without_a_duplicate() -> None:
    import json

    raw = b'{"prompt": "x", "kv_transfer_params": {"evil": 1}}'
    out = kv_transfer.decode_body_bytes(raw, kv_transfer.KVHandle.of({"do_remote_prefill": True}))
    assert out == b'{"prompt": "x","kv_transfer_params":{"do_remote_prefill":true}}'
    assert json.loads(out, object_pairs_hook=lambda pairs: dict(pairs))["kv_transfer_params"] == {
        "do_remote_prefill": True}


def test_decode_body_without_params_strips_client_handle() -> None:
    raw = b'{"prompt": "x"}'
    assert kv_transfer.decode_body_bytes(raw, None) is raw
    out = kv_transfer.decode_body_bytes(b'{"prompt": "x", "kv_transfer_params": {"a": 1}}', None)
    assert "kv_transfer_params" not in orjson.loads(out)


@pytest.mark.parametrize("raw", [b"[]", b'"x"', b"3"])
def test_decode_body_rejects_non_objects(raw: bytes) -> None:
    with pytest.raises(ValueError):
        kv_transfer.decode_body_bytes(raw, kv_transfer.KVHandle.of({"a": 1}))


def test_extract_params_and_cached_tokens() -> None:
    reply = {"kv_transfer_params": {"remote_block_ids": [[1]]},
             "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 4}}}
    assert kv_transfer.extract_params(reply) == kv_transfer.KVHandle(b'{"remote_block_ids":[[1]]}')
    assert kv_transfer.extract_params({"kv_transfer_params": {}}) is None
    assert kv_transfer.prefill_cached_tokens(reply) == 4
    assert kv_transfer.extract_params({"kv_transfer_params": None}) is None
    assert kv_transfer.extract_params({}) is None
    assert kv_transfer.prefill_cached_tokens({"usage": {"prompt_tokens_details": None}}) is None


def test_the_release_leg_is_the_prefill_overrides_with_the_prefillers_handle() -> None:
    """The release leg (pdproxy/pd/kv_release.py): the client's body with the one-token limits, not streamed,
    no stream options, the client's own handle gone and the prefiller's in its place."""
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e1",
              "remote_block_ids": [1, 2], "remote_request_id": "r1"}
    original = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 300,
                "stream_options": {"include_usage": True}, "kv_transfer_params": {"remote_host": "10.9.9.9"},
                "temperature": 0.5}
    body = orjson.loads(kv_transfer.release_body(original, kv_transfer.KVHandle.of(params)))  # type: ignore[arg-type]
    assert body == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False,
                    "max_tokens": 1, "min_tokens": 1, "temperature": 0.5, "kv_transfer_params": params}
    completions = orjson.loads(kv_transfer.release_body({"model": "m", "prompt": "x", "max_tokens": 9},
                                                        kv_transfer.KVHandle.of(params),
                                                        Api.COMPLETIONS))   # type: ignore[arg-type]
    assert completions["max_tokens"] == 1 and completions["stream"] is False
    assert completions["kv_transfer_params"] == params


def test_a_request_vllm_refuses_keeps_no_client_handle_whatever_its_type() -> None:
    """The prefill leg of a request vLLM will refuse (``engine_judges``) carries the client's own values except
    the proxy-owned fields' content: an object becomes ``{}``, an array as many nulls (vLLM's error quotes both
    by size), a scalar stays for vLLM to refuse."""
    evil = {"remote_host": "10.9.9.9", "remote_block_ids": [[1]], "remote_engine_id": "EVIL"}
    for value, sent in [(evil, {}), ([evil, evil], [None, None]), ("10.9.9.9", "10.9.9.9"), (None, None)]:
        body = kv_transfer.prefill_body({"prompt": "x", "max_tokens": -1, "kv_transfer_params": value,
                                         "ec_transfer_params": value}, engine_judges=True)
        assert body == {"prompt": "x", "max_tokens": -1, "kv_transfer_params": sent, "ec_transfer_params": sent}
