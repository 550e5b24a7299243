"""vLLM's KV cache events on the wire: ZMQ frames and the msgpack ``KVEventBatch``, in both encodings.

What an engine started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", …}'``
sends (``vllm/distributed/kv_events.py``; the whole format, per version, is in ``docs/kv-events.md``):

- one PUB multipart per engine step that had events: ``[topic, seq, payload]``: ``topic`` the configured topic
  (bytes, default empty), ``seq`` an 8-byte big-endian unsigned counter from 0 per publisher process, ``payload``
  a msgpack ``KVEventBatch``;
- ``KVEventBatch`` is always a positional array ``[ts, events]`` or ``[ts, events, data_parallel_rank]``
  (``ts`` float seconds, wall clock);
- each event is **either** a positional array whose first element is the tag (``["BlockStored", block_hashes,
  parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, …]``; vLLM ≤ 0.23, so vLLM-Ascend 0.23)
  **or** a map with the tag under ``"type"`` (``{"type": "BlockStored", "block_hashes": …}``; newer vLLM, e.g.
  vLLM 0.32). Trailing fields left at their default are omitted in both.

Block hashes (``ExternalBlockHash``) are ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, vLLM's default: the
low 64 bits of the hash) or bytes (the full digest); both are accepted and treated as opaque.

This module decodes (and builds the events it reads, for tests); vLLM's wire encoding is the simulator's
(:mod:`pdproxy.sim.kv_wire`, its own structs as vLLM lays them out).  :mod:`pdproxy.prefix.subscriber` owns sockets and sequence handling, and
:mod:`pdproxy.prefix.index` turns events into its own keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec

EngineHash = int | bytes
"""An engine's block hash as published (opaque; depends on the engine's hash algorithm and seed)."""
Encoding = Literal["map", "array"]
ENCODINGS: tuple[Encoding, ...] = ("map", "array")

SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
"""The replay socket's end-of-replay marker: sequence -1 with an empty payload."""


class DecodeError(ValueError):
    """A message or event that does not follow the format (wrong frames, bad msgpack, unknown shape)."""


# ---------------------------------------------------------------------------------------------------- structs
# Field names and order are vLLM's (vllm/distributed/kv_events.py). Positional (array) decoding maps elements to
# fields by position, so the order matters there; extra trailing elements (fields newer than these) are ignored
# by msgspec, missing trailing ones take the defaults below.

class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the map-encoded events (tag under ``"type"``)."""


class MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the positional events (tag as the first element)."""


class ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


MapEvent = MapBlockStored | MapBlockRemoved | MapAllBlocksCleared
ArrayEvent = ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared
BlockStored = MapBlockStored | ArrayBlockStored
BlockRemoved = MapBlockRemoved | ArrayBlockRemoved
AllBlocksCleared = MapAllBlocksCleared | ArrayAllBlocksCleared
KVEvent = MapEvent | ArrayEvent


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[MapEvent]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ArrayEvent]
    data_parallel_rank: int | None = None


class _LooseBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class StoredFields(Protocol):
    """What the index reads from a ``BlockStored`` of either encoding."""

    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None
    group_idx: int | None


@dataclass(slots=True)
class EventBatch:
    """One decoded ``KVEventBatch``: ``ts`` (engine wall clock, seconds), ``events`` in engine order,
    ``data_parallel_rank`` as stamped by the publisher (None when absent), ``encoding`` it came in, and
    ``bad_events``: events that could not be decoded and were left out (0 on the fast path)."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None
    encoding: Encoding
    bad_events: int = 0


@dataclass(frozen=True, slots=True)
class Frame:
    """One message of a publisher: ``topic`` (bytes), ``seq`` (0, 1, …; -1 = end of a replay), ``payload``."""

    topic: bytes
    seq: int
    payload: bytes


def parse_frames(frames: list[bytes]) -> Frame:
    """Split a PUB multipart ``[topic, seq, payload]`` (or a replay answer: ``[topic, seq, payload]`` in newer
    vLLM, ``[seq, payload]`` before the topic was added to replays) into a :class:`Frame`.

    Raises :class:`DecodeError` on another frame count or a sequence that is not 8 bytes.
    """
    if len(frames) == 3:
        topic, seq_b, payload = frames
    elif len(frames) == 2:
        topic, (seq_b, payload) = b"", frames
    else:
        raise DecodeError(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    if len(seq_b) != SEQ_BYTES:
        raise DecodeError(f"sequence frame has {len(seq_b)} bytes, expected {SEQ_BYTES}")
    seq = int.from_bytes(seq_b, "big", signed=seq_b == END_SEQ)
    return Frame(bytes(topic), seq, bytes(payload))


class BatchDecoder:
    """Decodes ``KVEventBatch`` payloads of either encoding; one per publisher (it remembers which encoding that
    publisher uses, so the fast typed decoder is tried first).

    :meth:`decode` never lets one bad event spoil its batch: when the typed decoders fail, the batch is decoded
    loosely and each event converted on its own; the ones that fail are counted in ``EventBatch.bad_events``.
    """

    def __init__(self) -> None:
        self._decoders: dict[Encoding, msgspec.msgpack.Decoder[Any]] = {
            "map": msgspec.msgpack.Decoder(_MapBatch), "array": msgspec.msgpack.Decoder(_ArrayBatch)}
        self._loose = msgspec.msgpack.Decoder(_LooseBatch)
        self.encoding: Encoding = "map"

    def decode(self, payload: bytes) -> EventBatch:
        """Decode one payload.  Raises :class:`DecodeError` when it is not a ``KVEventBatch`` at all (not
        msgpack, not ``[ts, events, rank?]``)."""
        first = self.encoding
        for encoding in (first, "array" if first == "map" else "map"):
            try:
                batch = self._decoders[encoding].decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            self.encoding = encoding
            return EventBatch(batch.ts, list(batch.events), batch.data_parallel_rank, encoding)
        return self._decode_loose(payload)

    def _decode_loose(self, payload: bytes) -> EventBatch:
        try:
            loose = self._loose.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise DecodeError(f"not a KVEventBatch: {exc}") from None
        events: list[KVEvent] = []
        bad = 0
        kinds = {"map": 0, "array": 0}
        for raw in loose.events:
            try:
                if isinstance(raw, dict):
                    events.append(msgspec.convert(raw, MapEvent))
                    kinds["map"] += 1
                elif isinstance(raw, list):
                    events.append(msgspec.convert(raw, ArrayEvent))
                    kinds["array"] += 1
                else:
                    bad += 1
            except (msgspec.ValidationError, TypeError):
                bad += 1
        encoding: Encoding = "array" if kinds["array"] > kinds["map"] else "map"
        return EventBatch(loose.ts, events, loose.data_parallel_rank, encoding, bad)


# ---------------------------------------------------------------------------------------------------- encoding
def stored(block_hashes: list[int | bytes], parent_block_hash: int | bytes | None, token_ids: list[int],
           block_size: int, *, encoding: Encoding = "map", lora_id: int | None = None, medium: str | None = "GPU",
           lora_name: str | None = None, extra_keys: list[Any] | None = None,
           group_idx: int | None = None, kv_cache_spec_kind: str | None = None) -> BlockStored:
    """A ``BlockStored`` event as vLLM builds it (``token_ids``: the tokens of all ``block_hashes`` blocks)."""
    cls = MapBlockStored if encoding == "map" else ArrayBlockStored
    return cls(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
               extra_keys, group_idx, kv_cache_spec_kind)


def removed(block_hashes: list[int | bytes], *, encoding: Encoding = "map", medium: str | None = "GPU",
            group_idx: int | None = None) -> BlockRemoved:
    """A ``BlockRemoved`` event (engine hashes only)."""
    cls = MapBlockRemoved if encoding == "map" else ArrayBlockRemoved
    return cls(block_hashes, medium, group_idx)


def cleared(*, encoding: Encoding = "map") -> AllBlocksCleared:
    """An ``AllBlocksCleared`` event (the engine's prefix cache was reset)."""
    return MapAllBlocksCleared() if encoding == "map" else ArrayAllBlocksCleared()


def seq_frame(seq: int) -> bytes:
    """The 8-byte big-endian sequence frame of message ``seq`` (``seq`` ≥ 0)."""
    return seq.to_bytes(SEQ_BYTES, "big")
