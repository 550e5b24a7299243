"""The simulated KV-cache block pool with automatic prefix caching (vLLM V1 ``BlockPool`` / ``KVCacheManager``).

Model (``vllm/v1/core/block_pool.py``, ``vllm/v1/core/kv_cache_utils.py``):

* ``num_blocks`` blocks of ``block_size`` tokens, block 0 kept as vLLM's null block (never allocated:
  ``vllm/v1/core/block_pool.py``, ``null_block``), so requests share ``num_blocks − 1``. A request holds
  ``ceil(tokens / block_size)`` blocks.
* Each *full* prompt block has a chained hash ``h_i = hash((h_{i-1}, tokens of block i))``. A finished
  request's blocks return to the free queue but keep their hash, so a later request with the same prefix
  reuses them (a "hit") until they are evicted. Eviction takes the least recently freed block first.
* ``usage = 1 - free / total``. Cached-but-free blocks count as free, as in vLLM's ``kv_cache_usage_perc``.
* KV events (``--kv-events-config``): with an ``event_sink``, the pool reports what vLLM's ``BlockPool`` queues
  for its publisher: ``BlockStored`` for each run of newly cached blocks (parent = the hash of the block before
  the run, token ids of the run's blocks), ``BlockRemoved`` for cached blocks evicted on reuse, and
  ``AllBlocksCleared`` on a prefix-cache reset. Hashes are published as unsigned 64-bit ints (vLLM's default,
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

HASH_MASK = (1 << 64) - 1


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a partial last block gets no hash)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


class BlockPool:
    """A pool of ``num_blocks`` KV blocks with reference counts and a prefix-cache hash index.

    Block ids are ints in ``[1, num_blocks)`` (0 is the null block). ``allocate`` raises ``MemoryError`` when too
    few blocks are free.
    Callers check ``can_allocate`` first.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._ref = [0] * num_blocks
        self._hash_of: dict[int, int] = {}
        self._block_of_hash: dict[int, int] = {}
        self.event_sink: Callable[[str, dict[str, Any]], None] | None = None
        """Called with ``("BlockStored" | "BlockRemoved" | "AllBlocksCleared", fields)`` (see the module doc)."""

    @property
    def num_free(self) -> int:
        """Free blocks, including cached blocks no request holds."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one request (or pin)."""
        return max(0, self.num_blocks - 1 - len(self._free))

    @property
    def usage(self) -> float:
        """Fraction of the pool held (0–1), vLLM's ``kv_cache_usage_perc``."""
        return self.num_used / (self.num_blocks - 1) if self.num_blocks > 1 else 0.0

    def cached_prefix(self, hashes: Sequence[int], max_tokens: int) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` that covers at most ``max_tokens`` tokens."""
        if not self.enable_prefix_caching:
            return []
        found: list[int] = []
        limit = max_tokens // self.block_size
        for h in hashes[:limit]:
            block = self._block_of_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def can_allocate(self, num_new: int, cached: Sequence[int] = ()) -> bool:
        """Whether ``num_new`` fresh blocks can be taken after touching the ``cached`` blocks."""
        touched_free = sum(1 for b in cached if self._ref[b] == 0)
        return num_new <= len(self._free) - touched_free

    def allocate(self, num_new: int, cached: Sequence[int] = ()) -> list[int]:
        """Take references on ``cached`` blocks and ``num_new`` fresh blocks; return all ids, cached first."""
        if not self.can_allocate(num_new, cached):
            raise MemoryError(f"need {num_new} KV blocks, {self.num_free} free")
        for b in cached:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1
        fresh: list[int] = []
        evicted: list[int] = []
        for _ in range(num_new):
            b, _none = self._free.popitem(last=False)
            old = self._hash_of.pop(b, None)
            if old is not None and self._block_of_hash.get(old) == b:
                del self._block_of_hash[old]
                evicted.append(old & HASH_MASK)
            self._ref[b] = 1
            fresh.append(b)
        if evicted and self.event_sink is not None:
            self.event_sink("BlockRemoved", {"block_hashes": evicted})
        return [*cached, *fresh]

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[int],
                     token_ids: Sequence[int] | None = None, *, announce: bool = True) -> list[int]:
        """Register ``hashes[i]`` for ``blocks[i]`` (full prompt blocks whose KV is computed, or is being computed
        in the step that allocated them: vLLM caches blocks at allocation, ``vllm/v1/core/kv_cache_manager.py::
        allocate_slots`` → ``cache_blocks``, so a request scheduled later in the same step hits them).  Returns the
        indices newly registered.

        ``token_ids``: the request's tokens (from its first), for the ``BlockStored`` events of the event sink;
        ``announce=False`` leaves the events to :meth:`announce` (vLLM publishes a step's events after it ran)."""
        if not self.enable_prefix_caching:
            return []
        new: list[int] = []
        for i, (b, h) in enumerate(zip(blocks, hashes, strict=False)):
            if b not in self._hash_of and h not in self._block_of_hash:
                self._hash_of[b] = h
                self._block_of_hash[h] = b
                new.append(i)
        if announce:
            self.announce(new, hashes, token_ids)
        return new

    def announce(self, new: Sequence[int], hashes: Sequence[int], token_ids: Sequence[int] | None) -> None:
        """The ``BlockStored`` events of the blocks :meth:`cache_blocks` registered at indices ``new``."""
        if new and self.event_sink is not None and token_ids is not None:
            self._stored_events(list(new), hashes, token_ids)

    def _stored_events(self, new: list[int], hashes: Sequence[int], token_ids: Sequence[int]) -> None:
        """One ``BlockStored`` per run of consecutive newly cached block indices ``new``."""
        assert self.event_sink is not None
        bs = self.block_size
        run_start = prev = new[0]
        for i in [*new[1:], -1]:
            if i == prev + 1:
                prev = i
                continue
            self.event_sink("BlockStored", {
                "block_hashes": [h & HASH_MASK for h in hashes[run_start:prev + 1]],
                "parent_block_hash": hashes[run_start - 1] & HASH_MASK if run_start > 0 else None,
                "token_ids": list(token_ids[run_start * bs:(prev + 1) * bs]),
                "block_size": bs})
            run_start = prev = i

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block. Blocks reaching zero go to the free queue, tail blocks first,
        so the prompt's first blocks are evicted last."""
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def reset_prefix_cache(self) -> None:
        """Forget every hash (blocks in use stay allocated), like vLLM's ``/reset_prefix_cache``."""
        self._hash_of.clear()
        self._block_of_hash.clear()
        if self.event_sink is not None:
            self.event_sink("AllBlocksCleared", {})
