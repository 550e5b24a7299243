"""The prefix index on its own: pdproxy's keys (stable across processes, namespaced by LoRA), the engine-hash →
key map, the memory bound, and the approximate index (bounded, aged)."""

from __future__ import annotations

import os
import subprocess
import sys

from pdproxy.prefix.index import ApproxPrefixIndex, PrefixIndex, block_keys, text_keys
from pdproxy.prefix.kv_events import cleared, removed, stored

E, F = "http://e:1", "http://f:1"
TOKS = list(range(1, 41))                     # 10 blocks of 4


def test_keys_do_not_depend_on_the_process_or_pythonhashseed() -> None:
    code = "from pdproxy.prefix.index import block_keys; print(block_keys(list(range(1, 41)), 4, 'lora-a').keys)"
    outs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                           capture_output=True, text=True, check=True).stdout for seed in ("0", "1", "random")}
    assert len(outs) == 1 and outs.pop().strip() == str(block_keys(TOKS, 4, "lora-a").keys)


def test_keys_are_full_blocks_chained() -> None:
    keys = block_keys(TOKS + [99, 98], 4)
    assert len(keys.keys) == 10 and keys.num_tokens == 42
    assert block_keys(TOKS[:8], 4).keys == keys.keys[:2]        # a prefix has the same leading keys
    assert block_keys([0] + TOKS[1:], 4).keys[1] != keys.keys[1]  # a change upstream changes everything after
    assert block_keys(TOKS, 8).keys != keys.keys[:5]


def feed(index: PrefixIndex, endpoint: str, tokens: list[int], base: int, **kw: object) -> None:
    n = len(tokens) // 4
    index.apply(endpoint, [stored(list(range(base, base + n)), None, tokens, 4, **kw)])  # type: ignore[arg-type]


def test_match_is_the_leading_run_capped_like_vllm() -> None:
    index = PrefixIndex()
    feed(index, E, TOKS[:24], 100)                                # 6 blocks
    assert index.match(block_keys(TOKS, 4)) == {E: 24}
    assert index.match(block_keys(TOKS[:24], 4)) == {E: 20}       # the last prompt token is always computed
    assert index.match(block_keys(TOKS[:25], 4)) == {E: 24}
    index.apply(E, [removed([102])])                              # the third block goes: the run stops there
    assert index.match(block_keys(TOKS, 4)) == {E: 8}
    assert index.match(block_keys(TOKS, 4), [E, F]) == {E: 8, F: 0}
    index.apply(E, [cleared()])
    assert index.match(block_keys(TOKS, 4)) == {E: 0} and index.entries() == 0


def test_engine_hashes_are_opaque_and_chains_follow_parents() -> None:
    index = PrefixIndex()
    index.apply(E, [stored([b"\x01" * 32, b"\x02" * 32], None, TOKS[:8], 4)])          # bytes hashes
    index.apply(E, [stored([b"\x03" * 32], b"\x02" * 32, TOKS[8:12], 4)])              # continues the chain
    index.apply(F, [stored([7], 12345, TOKS[8:12], 4)])           # parent unknown here: an orphan, never matched
    assert index.match(block_keys(TOKS, 4)) == {E: 12, F: 0}
    assert index.stats.orphan_blocks == 1
    index.apply(F, [removed([7])])
    assert index.entries(F) == 0


def test_lora_and_extra_keys_never_match_plain_requests() -> None:
    index = PrefixIndex()
    feed(index, E, TOKS[:16], 100, lora_name="adapter-a", lora_id=1, extra_keys=[("adapter-a",)] * 4)
    feed(index, F, TOKS[:16], 200, extra_keys=[("image-1", 0), None, None, None])   # an image in block 0
    assert index.match(block_keys(TOKS, 4)) == {E: 0, F: 0}
    assert index.match(block_keys(TOKS, 4, "adapter-a")) == {E: 16, F: 0}


def test_kv_cache_groups_and_block_sizes_other_than_the_engines_are_ignored() -> None:
    index = PrefixIndex()
    index.set_block_size(E, 4)
    index.apply(E, [stored([1, 2], None, TOKS[:16], 8)])          # block size 8 on a 4-token engine
    index.apply(E, [stored([3], None, TOKS[:4], 4, group_idx=1)])  # another KV cache group
    index.apply(E, [stored([4, 5], None, TOKS[:4], 4)])           # token count does not fit the hashes
    assert index.entries() == 0
    assert index.stats.ignored_events == {"block_size": 1, "kv_cache_group": 1, "token_count": 1}


def test_memory_bound_drops_the_oldest_entries_of_the_largest_engine() -> None:
    index = PrefixIndex(max_blocks=12)
    feed(index, E, TOKS, 100)                                     # 10 blocks
    feed(index, F, TOKS[:16], 200)                                # +4 = 14 > 12
    assert index.entries() <= 12 and index.stats.evicted_blocks >= 2
    assert index.match(block_keys(TOKS, 4))[E] == 0               # E lost its first blocks: no prefix left
    assert index.match(block_keys(TOKS, 4))[F] == 16


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_approximate_index_is_bounded_and_aged() -> None:
    clock = Clock()
    approx = ApproxPrefixIndex(default_capacity_blocks=8, ttl_s=60, clock=clock)
    a, b = block_keys(TOKS, 4), block_keys([t + 100 for t in TOKS], 4)
    approx.record(E, a)
    assert approx.match(a) == {E: 32} and approx.entries(E) == 8     # capacity 8 of 10: the tail goes
    approx.set_capacity(E, 100)
    approx.set_capacity(F, 100)
    approx.record(E, a)
    assert approx.match(a) == {E: 36}
    clock.now += 30
    approx.record(F, b)
    assert approx.match(b, [E, F]) == {E: 0, F: 36}
    clock.now += 31                                                # a was sent 61 s ago: expired
    assert approx.match(a) == {E: 0, F: 0} and approx.entries(E) == 0
    assert approx.match(b)[F] == 36
    assert approx.stats.expired_blocks == 10 and approx.stats.evicted_blocks == 2
    approx.forget(F)
    assert approx.entries() == 0
    approx.record(E, a)
    approx.record(F, a)
    clock.now += 61
    assert approx.match(a, [F]) == {F: 0}
    assert approx.entries(E) == 0 and approx.entries() == 0       # a query expires every location of its kind


def test_approximate_index_with_text_keys() -> None:
    approx = ApproxPrefixIndex()
    system = "You are a careful assistant. " * 40
    first = text_keys(system + "User: hello", chunk_chars=64, num_tokens=300)
    approx.record(E, first)
    later = text_keys(system + "User: something else entirely", chunk_chars=64, num_tokens=310)
    got = approx.match(later)[E]
    assert 0 < got <= 310 and approx.match(block_keys(TOKS, 4)) == {}   # token keys never meet text keys




def test_a_publishers_medium_names_are_a_bounded_set() -> None:
    # ``medium`` is a string the publisher sends ("GPU", "CPU", "STORAGE"): every new one was a location of its own
    # (a bit in every key's holder mask, one more table each query walks, one pdproxy_prefix_index_entries series)
    index = PrefixIndex()
    feed(index, E, TOKS[:8], 1)
    for i in range(5_000):
        feed(index, E, TOKS[:8], 10 + 2 * i, medium=f"m{i}")
    feed(index, E, TOKS[:8], 1, medium="x" * 100_000)       # one huge name: not a label value either
    mediums = [m for e, m, _n in index.locations() if e == E]
    assert "GPU" in mediums and len(mediums) <= 8 and all(len(m) <= 64 for m in mediums)
    assert index.stats.ignored_events.get("medium", 0) >= 5_000 - 8
    assert index.match(block_keys(TOKS, 4)) == {E: 8}             # the GPU blocks still count
    index.remove_endpoint(E)
    feed(index, F, TOKS[:8], 1, medium="CPU")                    # another endpoint has its own mediums
    assert [m for _e, m, _n in index.locations()] == ["CPU"]


def test_a_removed_endpoints_events_are_ignored_until_it_is_back() -> None:
    # an endpoint removed through the admin API may still have its publisher followed (a configured KV-event
    # source): its next BlockStored filled its locations again — entries counted against max_blocks, evicting the
    # pool's engines', and its pdproxy_prefix_index_entries series back
    index = PrefixIndex()
    feed(index, E, TOKS[:8], 1)
    index.remove_endpoint(E)
    feed(index, E, TOKS[:8], 100)
    assert [e for e, _m, _n in index.locations()] == [] and index.entries() == 0
    assert index.stats.ignored_events.get("removed") == 1
    index.restore(E)                                            # added again: followed from its next event
    feed(index, E, TOKS[:8], 200)
    assert index.match(block_keys(TOKS, 4)) == {E: 8}
