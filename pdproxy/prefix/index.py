"""Which engine holds how much of a prompt's prefix: pdproxy's own block keys, the precise index fed by the
engines' KV events, and the approximate index fed by pdproxy's own routing decisions.

**Keys.** A prompt of ``n`` tokens is cut as the engine cuts it: full blocks of ``block_size`` tokens only (a
partial last block is never cached). Block ``i``'s key chains its tokens with the key before it::

    key[-1] = root(namespace)          # blake2b of the namespace: "" = the base model, else the LoRA adapter name
    key[i]  = hash((key[i - 1], tuple(tokens of block i)))

``hash`` of a tuple of ints is CPython's tuple hash, which, unlike ``hash(str)`` / ``hash(bytes)``, takes no
``PYTHONHASHSEED`` salt: every pdproxy process (and replica) computes the same keys. vLLM's own block hashes are
never used as keys (they depend on the engine's hash algorithm and seed); the precise index only keeps, per cache,
an engine-hash → key map so that ``BlockRemoved`` (hashes only) can evict.

**Precise index** (:class:`PrefixIndex`): per *location* = (endpoint name, medium) — an endpoint name is
``Endpoint.name``, so an internal-DP rank (``url#dpN``) is a location of its own — the blocks its engine reported
stored and not yet removed. One dict maps each key to a bitmask of the locations holding it, so a query costs one
dict lookup per block, whatever the number of engines.

**Approximate index** (:class:`ApproxPrefixIndex`): for engines that publish no events, where pdproxy sent each
request's block chain, per endpoint, bounded (the engine's KV pool in blocks, or a default) and aged (LRU, plus a
time to live), with the same query.

**Query** (both): :meth:`PrefixIndex.match` takes :class:`BlockKeys` and answers, per endpoint, the tokens the
engine will report as ``cached_tokens``: the longest run of leading blocks held, capped as vLLM caps a hit (the
last prompt token is always computed: at most ``(n - 1) // block_size`` blocks). Memory and cost figures:
``docs/kv-events.md`` (measured by ``python -m loadtest.prefix_index_bench``).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import msgspec
from xxhash import xxh3_64, xxh3_64_intdigest

from pdproxy.compiled import compiled_or
from pdproxy.prefix.kv_events import (
    ArrayBlockRemoved,
    ArrayBlockStored,
    EngineHash,
    KVEvent,
    MapBlockRemoved,
    MapBlockStored,
    StoredFields,
)

KEY_VERSION = "pdproxy-prefix-v1"
DEFAULT_MEDIUM = "GPU"
DEFAULT_TEXT_CHUNK_CHARS = 256
DEFAULT_CHARS_PER_TOKEN = 4.0
_MISSING: Any = object()
KEY_MASK = (1 << 64) - 1
TEXT_GROWTH = 8
"""Text keys: past ``TEXT_GROWTH`` chunks, each chunk is 1/TEXT_GROWTH of the bytes before it (:func:`text_keys`)."""
MESSAGE_MARK = b"\x1e"
"""Text keys: the byte :func:`~pdproxy.prefix.routing.render_bytes` writes before each message (ASCII's record
separator); a chunk ends at one (:func:`text_keys`)."""
_NO_MARK = 1 << 62
MAX_MEDIUMS = 8
"""Precise index: the most mediums (locations) one endpoint may have.  ``medium`` is a string the publisher sends
(vLLM's ``"GPU"``, ``"CPU"``, ``"STORAGE"``); a ``BlockStored`` naming one more is ignored (``medium``), so a
publisher's names cannot grow the locations, every key's holder mask or the metric series without bound."""
MAX_MEDIUM_CHARS = 64
"""Precise index: a longer ``medium`` name is ignored (``medium``), as it becomes a metric label value."""


DropListener = Callable[[str, frozenset[int] | None], None]
"""``(endpoint name, block keys or None = all)``: what :attr:`PrefixIndex.on_drop` is told."""


@functools.lru_cache(maxsize=4096)
def namespace_root(namespace: str = "", kind: str = "tokens") -> int:
    """The key every chain of ``namespace`` starts from (a signed 64-bit int).

    ``namespace``: ``""`` for the base model, else the LoRA adapter name (vLLM's ``lora_name``); ``kind``:
    ``"tokens"`` or ``"text"`` so text-chunk keys never equal token-block keys.
    """
    digest = hashlib.blake2b(f"{KEY_VERSION}\0{kind}\0{namespace}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def chain_keys(parent: int, token_ids: Sequence[int], block_size: int, num_blocks: int | None = None,
               extra: Sequence[int | None] | None = None) -> list[int]:
    """Keys of the first ``num_blocks`` full blocks of ``token_ids`` (default: all full blocks), chained from
    ``parent``.  ``extra[i]`` (a list that may be shorter than the blocks), when not None, is mixed into block ``i``'s
    key: blocks whose cache identity has more than tokens — an image (engine-side only, so no plain request matches
    them) or a request's ``cache_salt`` (:func:`block_keys`)."""
    n = len(token_ids) // block_size if num_blocks is None else num_blocks
    keys: list[int] = []
    append = keys.append
    h = hash
    ids = token_ids if isinstance(token_ids, list | tuple) else list(token_ids)
    start = 0
    for i in range(n):
        end = start + block_size
        block = tuple(ids[start:end])
        x = extra[i] if extra is not None and i < len(extra) else None
        parent = h((parent, block)) if x is None else h((parent, block, x))
        append(parent)
        start = end
    return keys


@dataclass(frozen=True, slots=True)
class BlockKeys:
    """A request's prefix keys: ``keys[i]`` for block ``i`` (token keys: full blocks only; text keys: the chunks
    of :func:`text_keys`, the last one ending at the text's end), ``block_size`` (tokens per block, or
    ``chunk_chars`` for ``kind="text"``), ``num_tokens`` (the prompt's length in tokens: exact for token
    keys, estimated for text), ``namespace`` and ``kind``.  Build with :func:`block_keys` or :func:`text_keys`."""

    keys: list[int]
    block_size: int
    num_tokens: int
    namespace: str = ""
    kind: Literal["tokens", "text"] = "tokens"
    num_chars: int = 0
    """Text keys: the rendered prompt's length in UTF-8 bytes."""
    ends: Sequence[int] = ()
    """Text keys: ``ends[i]`` = the bytes of the prompt that ``keys[: i + 1]`` cover (chunks grow along the
    prompt, :func:`text_keys`)."""

    def cached_tokens(self, blocks: int) -> int:
        """Tokens an engine reports cached when it holds the first ``blocks`` blocks: vLLM always computes the
        last prompt token, so a hit covers at most ``(num_tokens - 1) // block_size`` blocks."""
        if self.kind == "tokens":
            limit = max(self.num_tokens - 1, 0) // self.block_size
            return min(blocks, limit) * self.block_size
        if blocks <= 0 or not self.num_chars:
            return 0
        covered = self.ends[min(blocks, len(self.ends)) - 1]
        return min(int(covered * self.num_tokens / self.num_chars), max(self.num_tokens - 1, 0))

    def blocks_within(self, tokens: int) -> int:
        """How many leading blocks ``tokens`` cached tokens cover (the inverse of :meth:`cached_tokens`)."""
        if self.kind == "tokens":
            return tokens // self.block_size
        if not self.num_tokens or not self.num_chars:
            return 0
        return bisect.bisect_left(self.ends, (tokens + 1) * self.num_chars / self.num_tokens)


def extra_key(entry: Sequence[Any]) -> int:
    """The int mixed into a block's key for its extra keys ``entry`` (as a KV event lists them, the LoRA name
    left out): a stable 64-bit digest of their msgpack encoding."""
    digest = hashlib.blake2b(msgspec.msgpack.encode(list(entry)), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


def block_keys(token_ids: Sequence[int], block_size: int, namespace: str = "",
               cache_salt: str | None = None) -> BlockKeys:
    """The prefix keys of a tokenized prompt (the engine's chunking: full blocks of ``block_size`` tokens).

    ``namespace``: ``""`` for the base model, the LoRA adapter's name for a LoRA request.  ``cache_salt``: the
    request's ``cache_salt``; vLLM mixes it into the first block's hash only, as that block's extra keys
    (``vllm/v1/core/kv_cache_utils.py::generate_block_hash_extra_keys``; its KV events list it as that block's
    ``extra_keys`` entry), so the whole chain of a salted prompt matches only blocks stored by requests with the
    same salt.  Cost: one tuple hash per block, ~1.2 ms for a 128K-token prompt at ``block_size`` 128, ~7 ms at 16
    (``docs/kv-events.md``).  Raises ``ValueError`` when ``block_size`` < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    extra = [extra_key((cache_salt,))] if cache_salt else None
    keys = chain_keys(namespace_root(namespace), token_ids, block_size, None, extra)
    return BlockKeys(keys, block_size, len(token_ids), namespace, "tokens")


def _find_mark(parts: Sequence[bytes], starts: Sequence[int], low: int, mark: bytes = MESSAGE_MARK) -> int:
    """The offset in the concatenation of ``parts`` (part ``i`` at offset ``starts[i]``) of the first ``mark``
    at or after ``low``, or -1."""
    i = bisect.bisect_right(starts, low) - 1
    offset = low - starts[i]
    while i < len(parts):
        j = parts[i].find(mark, offset)
        if j >= 0:
            return starts[i] + j
        i += 1
        offset = 0
    return -1


ChunkKeys = Callable[[list[bytes], int, int, int, int, Callable[[Any, int], int]], tuple[list[int], list[int]]]
"""``(parts, chunk_chars, growth, mark, seed, digest) -> (keys, ends)``: the chunks and chained keys of
:func:`text_keys` (:func:`py_chunk_keys`, or the compiled ``pdproxy/prefix/_textkeys.c``)."""


def py_chunk_keys(parts: list[bytes], chunk_chars: int, growth: int, mark_byte: int, seed: int,
                  digest: Callable[[Any, int], int]) -> tuple[list[int], list[int]]:
    """:func:`text_keys`' chunks of the concatenation of ``parts`` (non-empty bytes, or one ``b""``) and their keys,
    each ``digest(chunk bytes, previous key)`` from ``seed`` on: ``(keys, ends)``, ``ends[i]`` the bytes the first
    ``i + 1`` chunks cover.  ``growth``: :data:`TEXT_GROWTH`; ``mark_byte``: :data:`MESSAGE_MARK`'s byte.  The
    Python loop; ``pdproxy/prefix/_textkeys.c`` runs the same one in C (~0.5 µs a chunk less)."""
    mark_bytes = bytes((mark_byte,))
    starts = list(itertools.accumulate((len(p) for p in parts[:-1]), initial=0))
    size = starts[-1] + len(parts[-1])
    keys: list[int] = []
    ends: list[int] = []
    i, at, part_end, view = 0, 0, len(parts[0]), memoryview(parts[0])   # the part holding ``start``: bytes [at, part_end)
    start, step, floor = 0, chunk_chars, chunk_chars * growth
    mark = -1                        # the first mark at or after some earlier ``low``: searched again once passed
    while start < size:
        end = start + step
        if mark < end:               # (the usual chunk has no mark before its end: one comparison)
            half = step >> 1
            low = start + (half if half > chunk_chars else chunk_chars)   # grows every chunk
            if mark < low:
                mark = parts[0].find(mark_bytes, low) if len(parts) == 1 else _find_mark(parts, starts, low,
                                                                                          mark_bytes)
                if mark == -1:
                    mark = _NO_MARK
            if mark < end:
                end = mark
        if end > size:
            if not start:            # shorter than one chunk: no key (a prompt shorter than a block has none)
                break
            end = size
        if end <= part_end:          # inside one part (always, for one part): hashed from a view, no copy
            seed = digest(view[start - at:end - at], seed)
        else:                        # across parts: XXH3's streaming state gives the one-shot digest of the bytes
            h = xxh3_64(seed=seed)
            h.update(view[start - at:])
            while end > part_end:
                i += 1
                at, part_end, view = part_end, part_end + len(parts[i]), memoryview(parts[i])
                h.update(view[:end - at])
            seed = h.intdigest()
        keys.append(seed)
        ends.append(end)
        start = end
        if start == part_end and i + 1 < len(parts):   # the next chunk starts in the next part
            i += 1
            at, part_end, view = part_end, part_end + len(parts[i]), memoryview(parts[i])
        step = end // growth if end >= floor else chunk_chars
    return keys, ends


CHUNK_KEYS: Final[ChunkKeys] = compiled_or("pdproxy.prefix._textkeys", "chunk_keys", py_chunk_keys)
""":func:`text_keys`' loop: ``chunk_keys`` of the compiled ``pdproxy/prefix/_textkeys.c`` when it is built and
``PDPROXY_NO_EXTENSIONS`` is not set, else :func:`py_chunk_keys` (the same keys)."""


def text_keys(text: str | bytes | Sequence[bytes], *, chunk_chars: int = DEFAULT_TEXT_CHUNK_CHARS,
              namespace: str = "", num_tokens: int | None = None, chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
              tokens_per_byte: float | None = None) -> BlockKeys:
    """Fallback keys when no tokenizer is at hand: chunks of the rendered prompt's UTF-8 encoding, chained with
    XXH3-64 (each chunk hashed with the previous key as its seed; stable across processes and replicas), as
    unsigned 64-bit ints.  Only the approximate index can use them (engines report token blocks).

    ``text``: the rendered prompt, as text, as its UTF-8 encoding, or as a list of byte strings whose
    concatenation is that encoding (what :func:`render_parts <pdproxy.prefix.routing.render_parts>` gives: the
    keys are those of the joined bytes, computed without joining them — a 250 KB prompt is not copied once more).

    Chunks: ``chunk_chars`` bytes each for the first :data:`TEXT_GROWTH` chunks, then each one 1/TEXT_GROWTH of
    the bytes before it, so a prompt of ``n`` bytes with few messages has about ``8 + 8.5 ln(n / 2048)`` keys at
    the default sizes (49 for 250 KB, where fixed chunks had 1,000): hashing, the index's record and query cost that many dict
    operations.  Two more bounds: a message boundary (:data:`MESSAGE_MARK`, which :func:`render_bytes
    <pdproxy.prefix.routing.render_bytes>` writes before each message) at least half the chunk's length (and
    ``chunk_chars``) into a chunk ends it there — so every chunk is at least half its step and the count stays
    logarithmic, however many marks a client writes (≤ 90 for 250 KB of marks alone) — and the text's end ends
    the last chunk (a text shorter than ``chunk_chars`` has no key, as a
    prompt shorter than a block has none: its routing key stays None, :meth:`PrefixRouter._routing_key
    <pdproxy.prefix.routing.PrefixRouter._routing_key>`).  Every bound depends only on the bytes before it, so
    prompts that share a prefix share its chunks; and a conversation's next turn, which is this turn's text with
    new messages after it, holds a chunk ending exactly where this turn's text ended unless that lies less than
    half a step into a chunk: its whole prefix is credited but less than ``max(chunk_chars, prefix / 16)``
    bytes.  Elsewhere a chunk boundary is not a block boundary, so a shared prefix is credited to the last
    chunk it covers whole: up to ``chunk_chars`` bytes, or 1/(TEXT_GROWTH + 1) of the prefix, less than the
    engine's hit.  Cost: one pass of XXH3 and one of ``memchr`` over the bytes plus, per chunk, one call of
    ``xxh3_64_intdigest`` from the compiled loop (:data:`CHUNK_KEYS`, ``pdproxy/prefix/_textkeys.c``: ~20 µs for a
    250 KB chat of 49 chunks, ~16 µs for a 65 KB agent body of 18 parts and 38 chunks) or ~0.5 µs more per chunk
    from the Python one (:func:`py_chunk_keys`; ``loadtest/request_cost_bench.py``).

    ``num_tokens``: the prompt's token count if known, else ``bytes / chars_per_token``; ``tokens_per_byte``,
    when given, sets it to ``bytes × tokens_per_byte`` (at least 1) instead (the engine's ratio, learnt from its
    answers).
    """
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
    if isinstance(text, str):
        parts = [text.encode("utf-8", "surrogatepass")]
    elif isinstance(text, bytes):
        parts = [text]
    else:
        parts = [p for p in text if p] or [b""]
    size = sum(map(len, parts))
    seed = namespace_root(namespace, "text") & KEY_MASK
    keys, ends = CHUNK_KEYS(parts, chunk_chars, TEXT_GROWTH, MESSAGE_MARK[0], seed, xxh3_64_intdigest)
    if tokens_per_byte:
        estimate = max(1, round(size * tokens_per_byte))
    else:
        estimate = num_tokens if num_tokens is not None else int(size / chars_per_token)
    return BlockKeys(keys, chunk_chars, estimate, namespace, "text", size, ends)


def key_bytes(key: int) -> bytes:
    """A block key (signed, as token keys are, or unsigned, as text keys are) as 8 big-endian bytes: the
    two's complement of a negative key, so a signed key gives the bytes ``to_bytes(8, "big", signed=True)``
    gives."""
    return (key & KEY_MASK).to_bytes(8, "big")


# ---------------------------------------------------------------------------------------------------- tables
def _endpoint_names(locations: Mapping[tuple[str, str], object]) -> list[str]:
    """The endpoints of a ``(endpoint, medium) → location`` table, sorted, each once."""
    return sorted({e for e, _m in locations})


@dataclass(slots=True, eq=False)
class _Location:
    endpoint: str
    medium: str
    bit: int
    block_size: int | None = None
    engine: dict[EngineHash, int | None] = field(default_factory=dict)
    """Precise: engine hash → own key (None: an orphan, whose parent chain is unknown), in store order."""
    sent: OrderedDict[int, float] = field(default_factory=OrderedDict)
    """Approximate: own key → last time sent, oldest first.  An ``OrderedDict`` because the index reads it from
    the head (expiry, eviction) after deleting there: a plain dict leaves a deleted entry's slot in place until it
    resizes, so its first live item sits behind every key deleted since (up to the whole capacity, ms per walk);
    the ``OrderedDict``'s linked list reaches it in O(1) (``loadtest/request_cost_bench.py --full-index``)."""


class _MaskTable:
    """Locations with one bit each, and key → bitmask of the locations holding it."""

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._locations: dict[tuple[str, str], _Location] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0

    def _location(self, endpoint: str, medium: str = DEFAULT_MEDIUM) -> _Location:
        loc = self._locations.get((endpoint, medium))
        if loc is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit, self._next_bit = 1 << self._next_bit, self._next_bit + 1
            loc = self._locations[(endpoint, medium)] = _Location(endpoint, medium, bit)
        return loc

    def _hold(self, key: int, bit: int) -> None:
        holders = self._holders
        holders[key] = holders.get(key, 0) | bit

    def _release(self, key: int, bit: int) -> None:
        holders = self._holders
        mask = holders.get(key, 0) & ~bit
        if mask:
            holders[key] = mask
        else:
            holders.pop(key, None)

    def _match_blocks(self, keys: Sequence[int], candidates: list[_Location]) -> dict[_Location, int]:
        """Leading blocks of ``keys`` each candidate holds (one dict lookup per block until none is left)."""
        live = 0
        for loc in candidates:
            live |= loc.bit
        out: dict[_Location, int] = {}
        by_bit = {loc.bit: loc for loc in candidates}
        get = self._holders.get
        n = 0
        for key in keys:
            held = get(key, 0) & live
            if held != live:
                dropped = live & ~held
                for bit, loc in by_bit.items():
                    if dropped & bit:
                        out[loc] = n
                live = held
                if not live:
                    break
            n += 1
        for bit, loc in by_bit.items():
            if live & bit:
                out[loc] = n
        return out

    def _per_endpoint(self, keys: BlockKeys, candidates: list[_Location],
                      endpoints: Iterable[str] | None) -> dict[str, int]:
        wanted = None if endpoints is None else set(endpoints)
        chosen = [c for c in candidates if wanted is None or c.endpoint in wanted]
        result: dict[str, int] = dict.fromkeys(wanted or (), 0) if wanted is not None else {}
        for loc, blocks in self._match_blocks(keys.keys, chosen).items():
            tokens = keys.cached_tokens(blocks)
            if tokens > result.get(loc.endpoint, -1):
                result[loc.endpoint] = tokens
        return result

    def _drop_location(self, loc: _Location, keys: Iterable[int | None]) -> int:
        n = 0
        for key in keys:
            if key is not None:
                self._release(key, loc.bit)
            n += 1
        return n

    def endpoints(self) -> list[str]:
        """Endpoints that have (or had) a location here."""
        return _endpoint_names(self._locations)

    @property
    def distinct_keys(self) -> int:
        """Distinct block keys held anywhere."""
        return len(self._holders)


@dataclass(slots=True)
class IndexStats:
    """Counters of a :class:`PrefixIndex` (monotonic, except the gauges ``entries`` / ``distinct_keys``)."""

    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0
    orphan_blocks: int = 0
    ignored_events: dict[str, int] = field(default_factory=dict)
    evicted_blocks: int = 0

    def ignore(self, reason: str) -> None:
        self.ignored_events[reason] = self.ignored_events.get(reason, 0) + 1


class PrefixIndex(_MaskTable):
    """The precise index: what each engine's KV events say it holds (see the module docstring).

    ``max_blocks``: bound on block entries over all locations (memory ~ ``docs/kv-events.md``'s bytes per entry ×
    this); past it, the oldest entries of the largest location are dropped (as if evicted; a later hit there is
    then under-predicted, never over-predicted).  Not thread-safe: one event loop owns it (the subscriber writes,
    routing reads).
    """

    def __init__(self, *, max_blocks: int = 2_000_000) -> None:
        super().__init__()
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.max_blocks = max_blocks
        self.stats = IndexStats()
        self._entries = 0
        self._roots: dict[str, int] = {}
        self._block_sizes: dict[str, int] = {}
        self._removed: set[str] = set()
        """Endpoints taken out (:meth:`remove_endpoint`) whose publisher may still be followed: their events are
        ignored (``removed``) until :meth:`restore`."""
        self.on_drop: DropListener | None = None
        """Told when the engine's word drops blocks: ``(endpoint, None)`` when everything it held went
        (``AllBlocksCleared``, a restart, a gap or silence: :meth:`forget`), ``(endpoint, keys)`` with the keys of
        the blocks a ``BlockRemoved`` evicted (hashes the index never learnt have no key and are left out)."""

    # ---- configuration
    def set_block_size(self, endpoint: str, block_size: int | None) -> None:
        """The engine's block size in tokens (``vllm:cache_config_info``, ``EngineInfo.block_size``).  Events
        with another ``block_size`` for this endpoint are ignored (counted as ``block_size``); a change drops
        what the endpoint held.  Unset, the first ``BlockStored`` decides."""
        if block_size is None or block_size < 1:
            return
        if self._block_sizes.get(endpoint) != block_size:
            if endpoint in self._block_sizes:
                self.forget(endpoint)
            self._block_sizes[endpoint] = block_size
            for (e, _m), loc in self._locations.items():
                if e == endpoint:
                    loc.block_size = block_size

    def block_size(self, endpoint: str) -> int | None:
        """The block size known for ``endpoint`` (None before any event or configuration)."""
        return self._block_sizes.get(endpoint)

    # ---- events
    def apply(self, endpoint: str, events: Iterable[KVEvent]) -> None:
        """Apply one batch's events of ``endpoint``'s engine, in order.  Never raises on odd events: they are
        ignored and counted in ``stats.ignored_events`` by reason (``removed``: the whole batch of an endpoint
        taken out of the pool, whose publisher is still followed)."""
        if endpoint in self._removed:
            self.stats.ignore("removed")
            return
        for event in events:
            if isinstance(event, MapBlockStored | ArrayBlockStored):
                self._store(endpoint, event)
            elif isinstance(event, MapBlockRemoved | ArrayBlockRemoved):
                self._remove(endpoint, event.block_hashes, event.medium, event.group_idx)
            else:
                self.stats.cleared += 1
                self.forget(endpoint)

    def _root(self, namespace: str) -> int:
        root = self._roots.get(namespace)
        if root is None:
            if len(self._roots) > 4096:
                self._roots.clear()
            root = self._roots[namespace] = namespace_root(namespace)
        return root

    def _store(self, endpoint: str, ev: StoredFields) -> None:
        stats = self.stats
        if ev.group_idx not in (None, 0):
            stats.ignore("kv_cache_group")
            return
        bs = ev.block_size
        known = self._block_sizes.get(endpoint)
        if known is None:
            if bs < 1:
                stats.ignore("block_size")
                return
            self._block_sizes[endpoint] = known = bs
        if bs != known:
            stats.ignore("block_size")
            return
        hashes = ev.block_hashes
        n = len(hashes)
        if len(ev.token_ids) != n * bs:
            stats.ignore("token_count")
            return
        medium = ev.medium or DEFAULT_MEDIUM
        loc = self._locations.get((endpoint, medium))
        if loc is None:
            if (len(medium) > MAX_MEDIUM_CHARS
                    or sum(e == endpoint for e, _m in self._locations) >= MAX_MEDIUMS):
                stats.ignore("medium")
                return
            loc = self._location(endpoint, medium)
        loc.block_size = bs
        namespace = ev.lora_name or (f"#lora-id-{ev.lora_id}" if ev.lora_id is not None else "")
        engine = loc.engine
        before = len(engine)
        if ev.parent_block_hash is None:
            parent: int | None = self._root(namespace)
        else:
            parent = engine.get(ev.parent_block_hash, None)
        if parent is None:  # chain unknown here (joined mid-stream, or the parent was dropped): never matchable
            for h in hashes:
                old = engine.pop(h, _MISSING)
                if old is not _MISSING and old is not None:
                    self._release(old, loc.bit)
                engine[h] = None
            stats.orphan_blocks += n
        else:
            extra = _extra_keys(ev.extra_keys, ev.lora_name, n)
            keys = chain_keys(parent, ev.token_ids, bs, n, extra)
            bit = loc.bit
            holders = self._holders
            for h, key in zip(hashes, keys, strict=True):
                old = engine.pop(h, _MISSING)
                if old is not _MISSING and old is not None and old != key:
                    self._release(old, bit)
                engine[h] = key
                holders[key] = holders.get(key, 0) | bit
        stats.stored_blocks += n
        self._entries += len(engine) - before
        if self._entries > self.max_blocks:
            self._shrink()

    def _remove(self, endpoint: str, hashes: Sequence[EngineHash], medium: str | None, group_idx: int | None) -> None:
        if group_idx not in (None, 0):
            self.stats.ignore("kv_cache_group")
            return
        loc = self._locations.get((endpoint, medium or DEFAULT_MEDIUM))
        if loc is None:
            self.stats.ignore("unknown_block")
            return
        engine = loc.engine
        gone: list[int] = []
        for h in hashes:
            key = engine.pop(h, _MISSING)
            if key is _MISSING:
                self.stats.ignore("unknown_block")
                continue
            self._entries -= 1
            self.stats.removed_blocks += 1
            if key is not None:
                self._release(key, loc.bit)
                gone.append(key)
        if gone and self.on_drop is not None:
            self.on_drop(endpoint, frozenset(gone))

    def _shrink(self) -> None:
        """Over ``max_blocks``: drop the oldest eighth of the largest location."""
        while self._entries > self.max_blocks:
            loc = max(self._locations.values(), key=lambda x: len(x.engine))
            engine = loc.engine
            drop = max(len(engine) // 8, self._entries - self.max_blocks, 1)
            victims = [h for _i, h in zip(range(drop), engine, strict=False)]
            for h in victims:
                key = engine.pop(h)
                if key is not None:
                    self._release(key, loc.bit)
            self._entries -= len(victims)
            self.stats.evicted_blocks += len(victims)

    def forget(self, endpoint: str) -> int:
        """Drop everything ``endpoint`` holds (every medium): a gap without replay, a restart, a silent publisher,
        ``AllBlocksCleared``.  Returns the number of block entries dropped."""
        dropped = 0
        for (e, _m), loc in list(self._locations.items()):
            if e != endpoint:
                continue
            dropped += self._drop_location(loc, loc.engine.values())
            loc.engine.clear()
        self._entries -= dropped
        if self.on_drop is not None:
            self.on_drop(endpoint, None)
        return dropped

    def remove_endpoint(self, endpoint: str) -> None:
        """Forget ``endpoint`` and free its locations (it left the configuration); its events are ignored from now
        on (its publisher, still followed, would otherwise fill its locations again) until :meth:`restore`."""
        self.forget(endpoint)
        for key in [k for k in self._locations if k[0] == endpoint]:
            self._free_bits.append(self._locations.pop(key).bit)
        self._block_sizes.pop(endpoint, None)
        self._removed.add(endpoint)

    def restore(self, endpoint: str) -> None:
        """``endpoint`` is in the pool (again): its events count (from the next one on: what it held meanwhile is
        unknown, an under-prediction)."""
        self._removed.discard(endpoint)

    # ---- queries
    def match(self, keys: BlockKeys, endpoints: Iterable[str] | None = None) -> dict[str, int]:
        """Per endpoint, the tokens of ``keys``' prompt its engine holds as a cached prefix (what it will report
        as ``cached_tokens``; the best medium when it has several).  ``endpoints``: only these (each present in
        the answer, 0 when unknown); default every endpoint whose block size is ``keys.block_size``.  Text keys
        never match (engines report token blocks).  Cost: one dict lookup per leading block held anywhere."""
        if keys.kind != "tokens":
            return dict.fromkeys(endpoints or (), 0)
        candidates = [loc for loc in self._locations.values() if loc.block_size == keys.block_size]
        return self._per_endpoint(keys, candidates, endpoints)

    def entries(self, endpoint: str | None = None) -> int:
        """Block entries held (of ``endpoint``, or all), orphans included."""
        if endpoint is None:
            return self._entries
        return sum(len(loc.engine) for (e, _m), loc in self._locations.items() if e == endpoint)

    def locations(self) -> Iterator[tuple[str, str, int]]:
        """``(endpoint, medium, block entries)`` of every location."""
        for (endpoint, medium), loc in sorted(self._locations.items()):
            yield endpoint, medium, len(loc.engine)


def _extra_keys(extra: list[Any] | None, lora_name: str | None, n: int) -> list[int | None] | None:
    """Per block, a stable int for the extra keys of that block that are not just its LoRA name (images,
    ``cache_salt``, prompt embeddings), or None: vLLM lists, per block, the LoRA name first when ``lora_name`` is
    set (``vllm/v1/core/kv_cache_utils.py::to_event_extra_keys``)."""
    if not extra:
        return None
    out: list[int | None] = []
    any_extra = False
    for i in range(n):
        entry = extra[i] if i < len(extra) else None
        if entry and lora_name is not None and entry[0] == lora_name:
            entry = entry[1:]
        if entry:
            out.append(extra_key(entry))
            any_extra = True
        else:
            out.append(None)
    return out if any_extra else None


@dataclass(slots=True)
class ApproxStats:
    """Counters of an :class:`ApproxPrefixIndex`."""

    recorded_blocks: int = 0
    evicted_blocks: int = 0
    expired_blocks: int = 0


class ApproxPrefixIndex:
    """Where pdproxy sent each request's block chain, for engines without KV events (see the module docstring).

    Per endpoint at most ``capacity_blocks`` keys (:meth:`set_capacity` with the engine's ``num_gpu_blocks``
    when known, else ``default_capacity_blocks``), least recently sent dropped first, and none older than
    ``ttl_s`` seconds (``clock``: monotonic seconds).  The same :meth:`match` as :class:`PrefixIndex`; token and
    text keys both work (each only matches its own kind).

    One table per location (endpoint, key kind and block size): its ``sent`` keys in LRU order.  Unlike the
    precise index there is no key → holders table: a query asks each location's ``sent`` (a prefiller or a few
    here, not the dozens of DP ranks the precise index serves), so a record touches one table, not two.  At a
    few hundred thousand keys every dict operation is a cache miss (≈ 0.25 µs each), and a record of a 64K-token
    prompt (49 text keys) at capacity inserts and evicts 49: a second table doubled that
    (``loadtest/request_cost_bench.py``).
    """

    def __init__(self, *, default_capacity_blocks: int = 65536, ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if default_capacity_blocks < 1 or ttl_s <= 0:
            raise ValueError("default_capacity_blocks must be >= 1 and ttl_s > 0")
        self.default_capacity_blocks = default_capacity_blocks
        self.ttl_s = ttl_s
        self.stats = ApproxStats()
        self._clock = clock
        self._capacity: dict[str, int] = {}
        self._locations: dict[tuple[str, str], _Location] = {}

    def set_capacity(self, endpoint: str, blocks: int | None) -> None:
        """Bound ``endpoint``'s entries to ``blocks`` (its KV pool, ``num_gpu_blocks``); None = the default."""
        if blocks is None or blocks < 1:
            self._capacity.pop(endpoint, None)
        else:
            self._capacity[endpoint] = blocks

    def _loc(self, endpoint: str, kind: str, block_size: int) -> _Location:
        medium = f"{kind}:{block_size}"
        loc = self._locations.get((endpoint, medium))
        if loc is None:
            loc = self._locations[(endpoint, medium)] = _Location(endpoint, medium, 0, block_size)
        return loc

    def record(self, endpoint: str, keys: BlockKeys) -> None:
        """``keys``' request was sent to ``endpoint``: after its prefill the engine holds those blocks."""
        chain = keys.keys
        if not chain:
            return
        now = self._clock()
        loc = self._loc(endpoint, keys.kind, keys.block_size)
        sent = loc.sent
        before = len(sent)
        # C loops only: the chain goes in tail first, so its head is the most recent key (the engine frees a
        # prompt's tail first); keys sent here before (a conversation's earlier turns) are moved to that end too
        sent.update(dict.fromkeys(reversed(chain), now))
        if len(sent) - before != len(chain):
            deque(map(sent.move_to_end, reversed(chain)), maxlen=0)
        self.stats.recorded_blocks += len(chain)
        self._expire(loc, now)
        cap = self._capacity.get(endpoint, self.default_capacity_blocks)
        if len(sent) > cap:
            drop = list(itertools.islice(sent, len(sent) - cap))
            deque(map(sent.__delitem__, drop), maxlen=0)
            self.stats.evicted_blocks += len(drop)

    def _expire(self, loc: _Location, now: float) -> None:
        sent = loc.sent
        limit = now - self.ttl_s
        old: list[int] = []
        for key, at in sent.items():
            if at >= limit:
                break
            old.append(key)
        deque(map(sent.__delitem__, old), maxlen=0)
        self.stats.expired_blocks += len(old)

    def match(self, keys: BlockKeys, endpoints: Iterable[str] | None = None) -> dict[str, int]:
        """Per endpoint, the cached tokens to expect from what was sent there (see :meth:`PrefixIndex.match`):
        every endpoint of ``endpoints`` (0 when nothing was sent there), or with None every endpoint something of
        ``keys``' kind and block size was sent to."""
        now = self._clock()
        medium = f"{keys.kind}:{keys.block_size}"
        wanted = None if endpoints is None else set(endpoints)
        result: dict[str, int] = dict.fromkeys(wanted, 0) if wanted is not None else {}
        chain = keys.keys
        for (endpoint, m), loc in self._locations.items():
            if m != medium:
                continue
            self._expire(loc, now)                  # every location of the medium (its entries gauge stays true)
            if wanted is not None and endpoint not in wanted:
                continue
            blocks = len(list(itertools.takewhile(loc.sent.__contains__, chain)))  # the leading run held
            tokens = keys.cached_tokens(blocks)
            if tokens > result.get(endpoint, -1):
                result[endpoint] = tokens
        return result

    def forget(self, endpoint: str) -> int:
        """Drop what was recorded for ``endpoint`` (its engine restarted or left).  Returns entries dropped."""
        dropped = 0
        for (e, _m), loc in self._locations.items():
            if e == endpoint:
                dropped += len(loc.sent)
                loc.sent.clear()
        return dropped

    def remove_endpoint(self, endpoint: str) -> None:
        """Drop ``endpoint``'s locations and capacity (it left the configuration)."""
        for key in [k for k in self._locations if k[0] == endpoint]:
            del self._locations[key]
        self._capacity.pop(endpoint, None)

    def endpoints(self) -> list[str]:
        """Endpoints that have (or had) a location here."""
        return _endpoint_names(self._locations)

    def entries(self, endpoint: str | None = None) -> int:
        """Keys held (of ``endpoint``, or all)."""
        return sum(len(loc.sent) for (e, _m), loc in self._locations.items() if endpoint is None or e == endpoint)
