"""vLLM's KV event batches encoded as vLLM's publisher writes them (``vllm/distributed/kv_events.py``:
``msgspec.msgpack.Encoder().encode(KVEventBatch)``), in the map encoding (newer vLLM) or the array encoding
(vLLM ≤ 0.23): what ``pdproxy sim`` publishes and the tests send.  Its structs mirror vLLM's own layout, apart from
the laxer ones pdproxy decodes with (:mod:`pdproxy.prefix.kv_events`), so a misreading of the wire format there is
not repeated here (``tests/kv_events/test_captures.py`` reads real vLLM's bytes).
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdproxy.prefix.kv_events import (
    ENCODINGS,
    ArrayBlockRemoved,
    ArrayBlockStored,
    Encoding,
    KVEvent,
    MapBlockRemoved,
    MapBlockStored,
)


class _VllmMapStored(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockStored"):
    """vLLM's own map layout: ``lora_id``, ``medium``, ``lora_name`` have no default there, so they are always
    written (``None`` included); the decoding structs (pdproxy/prefix/kv_events.py) are laxer."""

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


class _VllmMapRemoved(msgspec.Struct, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class _VllmArrayStored(_VllmMapStored, array_like=True, omit_defaults=True):
    """The same fields as vLLM ≤ 0.23 writes them: a positional array after the tag."""


class _VllmArrayRemoved(_VllmMapRemoved, array_like=True, omit_defaults=True):
    """The same fields as vLLM ≤ 0.23 writes them: a positional array after the tag."""


class _VllmBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _wire(event: KVEvent, encoding: Encoding) -> Any:
    if isinstance(event, MapBlockStored | ArrayBlockStored):
        cls_s = _VllmMapStored if encoding == "map" else _VllmArrayStored
        return cls_s(event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size,
                     event.lora_id, event.medium, event.lora_name, event.extra_keys, event.group_idx,
                     event.kv_cache_spec_kind)
    if isinstance(event, MapBlockRemoved | ArrayBlockRemoved):
        cls_r = _VllmMapRemoved if encoding == "map" else _VllmArrayRemoved
        return cls_r(event.block_hashes, event.medium, event.group_idx)
    return {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]


class BatchEncoder:
    """Encodes batches as vLLM's publisher does (``msgspec.msgpack.Encoder().encode(KVEventBatch)``), in the
    map encoding (newer vLLM) or the array encoding (vLLM ≤ 0.23)."""

    def __init__(self, encoding: Encoding = "map") -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown KV event encoding {encoding!r} (map | array)")
        self.encoding: Encoding = encoding
        self._enc = msgspec.msgpack.Encoder()

    def encode(self, ts: float, events: list[KVEvent], data_parallel_rank: int | None = None) -> bytes:
        """msgpack bytes of ``[ts, [event, …], data_parallel_rank]`` (rank omitted when None)."""
        return self._enc.encode(_VllmBatch(ts, [_wire(e, self.encoding) for e in events], data_parallel_rank))
