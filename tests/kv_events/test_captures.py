"""Real vLLM 0.32 KV event traffic (``tests/real_vllm/captures/kv_events_map.json``, recorded by
``tests/real_vllm/kv_capture.py``) and its positional re-encoding (``kv_events_array.json``, vLLM <= 0.23's
layout): both decode, and the index fed with them predicts the ``cached_tokens`` the engine reported."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pdproxy.prefix.index import PrefixIndex, block_keys
from pdproxy.prefix.kv_events import (
    ArrayBlockRemoved,
    ArrayBlockStored,
    BatchDecoder,
    MapBlockRemoved,
    MapBlockStored,
    parse_frames,
)

CAPTURES = Path(__file__).resolve().parents[1] / "real_vllm" / "captures"
ENGINE = "http://prefill:8100"


def load(name: str) -> dict[str, Any]:
    return dict(json.loads((CAPTURES / name).read_text()))


def frames(message: list[str]) -> list[bytes]:
    return [base64.b64decode(part) for part in message]


@pytest.mark.parametrize(("name", "encoding", "stored_cls", "removed_cls"), [
    ("kv_events_map.json", "map", MapBlockStored, MapBlockRemoved),
    ("kv_events_array.json", "array", ArrayBlockStored, ArrayBlockRemoved),
])
def test_capture_decodes_and_predicts_cached_tokens(name: str, encoding: str, stored_cls: type,
                                                    removed_cls: type) -> None:
    capture = load(name)
    messages, requests = capture["messages"], capture["requests"]
    assert len(messages) == len(requests)            # one batch per request (each request is one engine step)
    decoder = BatchDecoder()
    index = PrefixIndex()
    index.set_block_size(ENGINE, capture["engine"]["block_size"])
    kinds: set[str] = set()
    for i, (message, request) in enumerate(zip(messages, requests, strict=True)):
        keys = block_keys(request["token_ids"], capture["engine"]["block_size"])
        predicted = index.match(keys)[ENGINE] if i else 0
        assert predicted == request["usage"]["prompt_tokens_details"]["cached_tokens"], request["name"]
        frame = parse_frames(frames(message))
        assert (frame.topic, frame.seq) == (capture["topic"].encode(), i)
        batch = decoder.decode(frame.payload)
        assert batch.encoding == encoding and batch.bad_events == 0 and batch.data_parallel_rank == 0
        for event in batch.events:
            assert isinstance(event, stored_cls | removed_cls)
            kinds.add(type(event).__name__)
            if isinstance(event, stored_cls):
                assert event.block_size == 128 and event.medium == "GPU" and event.lora_name is None
                assert len(event.token_ids) == 128 * len(event.block_hashes)
                assert all(isinstance(h, int) for h in event.block_hashes)   # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES
        index.apply(ENGINE, batch.events)
    assert len(kinds) == 2                           # stores and evictions (18-block pool)
    assert index.stats.ignored_events == {} and index.stats.orphan_blocks == 0
    # after the last batch the engine holds A's four blocks again (two re-stored under block 1's hash)
    assert index.match(block_keys(requests[0]["token_ids"] + [0], 128))[ENGINE] == 512


def test_replay_answers_of_the_real_engine() -> None:
    capture = load("kv_events_map.json")
    answers = [frames(m) for m in capture["replay_from_0"]]
    assert all(a[0] == b"" for a in answers)         # the DEALER's empty delimiter
    parsed = [parse_frames(a[1:]) for a in answers]
    assert [f.seq for f in parsed] == [*range(len(capture["messages"])), -1]
    assert all(f.topic == b"kv-events" for f in parsed[:-1])            # vLLM 0.32 replays carry the topic
    assert [f.payload for f in parsed[:-1]] == [frames(m)[2] for m in capture["messages"]]
    assert parsed[-1].payload == b""


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM <= 0.23's event base (``array_like=True``), for an independent check of the derived fixture."""


class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class OldBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class OldAllBlocksCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]
    data_parallel_rank: int | None = None


def test_array_fixture_is_what_the_old_structs_decode() -> None:
    old = msgspec.msgpack.Decoder(OldBatch)
    new = load("kv_events_map.json")["messages"]
    for derived, original in zip(load("kv_events_array.json")["messages"], new, strict=True):
        batch = old.decode(frames(derived)[2])
        source = msgspec.msgpack.decode(frames(original)[2])
        assert batch.ts == source[0] and len(batch.events) == len(source[1])
        for event, raw in zip(batch.events, source[1], strict=True):
            assert type(event).__name__ == "Old" + raw["type"]
            assert event.block_hashes == raw["block_hashes"]
        assert msgspec.msgpack.decode(frames(derived)[2])[1][0][0] in ("BlockStored", "BlockRemoved")
