"""Cost of pdproxy's prefix index: memory per block entry and per-request key / query time.

    python -m loadtest.prefix_index_bench [--engines 16] [--blocks-per-engine 62500] [--json]

Memory: ``tracemalloc`` around feeding ``--engines`` engines with ``BlockStored`` events of distinct chains
(the worst case: no block shared between engines), then the same blocks on every engine (one shared system
prompt); divided by the block entries held.  Time: median of repeated runs of :func:`block_keys` on a 128K-token
prompt (block sizes 16 and 128) and of :meth:`PrefixIndex.match` on it with every engine holding the whole
prompt (the longest walk).  Prints one JSON document; ``docs/kv-events.md`` quotes a run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import tracemalloc
from typing import Any

from pdproxy.prefix.index import PrefixIndex, block_keys
from pdproxy.prefix.kv_events import stored

BS = 16
CHUNK = 64  # blocks per BlockStored event


def feed(index: PrefixIndex, endpoint: str, tokens: list[int], base_hash: int) -> None:
    n = len(tokens) // BS
    parent = None
    for start in range(0, n, CHUNK):
        count = min(CHUNK, n - start)
        hashes = [(base_hash + start + i) & ((1 << 64) - 1) for i in range(count)]
        index.apply(endpoint, [stored(hashes, parent, tokens[start * BS:(start + count) * BS], BS)])
        parent = hashes[-1]


def memory(engines: int, blocks: int, shared: bool) -> dict[str, Any]:
    rng = random.Random(7)
    base_tokens = [rng.randrange(150_000) for _ in range(blocks * BS)]
    index = PrefixIndex(max_blocks=engines * blocks + 1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for e in range(engines):
        tokens = base_tokens if shared else [(t + e * 7919) % 150_000 for t in base_tokens]
        feed(index, f"http://engine{e}:8000", tokens, (e + 1) << 40)
        del tokens
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    entries = index.entries()
    per = (after - before) / entries
    return {"engines": engines, "blocks_per_engine": blocks, "shared_prefix": shared, "entries": entries,
            "distinct_keys": index.distinct_keys, "bytes": after - before, "bytes_per_entry": round(per, 1),
            "extrapolated_16x1M_GiB": round(per * 16 * 1_000_000 / 2**30, 2)}


def timing(fn: Any, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--engines", type=int, default=16)
    p.add_argument("--blocks-per-engine", type=int, default=62_500)
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    rng = random.Random(3)
    prompt = [rng.randrange(150_000) for _ in range(131_072)]
    out: dict[str, Any] = {"memory": [memory(args.engines, args.blocks_per_engine, False),
                                      memory(args.engines, args.blocks_per_engine, True)]}
    out["keys_128k_us"] = {str(bs): round(timing(lambda bs=bs: block_keys(prompt, bs), args.repeat))
                           for bs in (16, 128)}
    index = PrefixIndex()
    for e in range(16):
        feed(index, f"http://engine{e}:8000", prompt, (e + 1) << 40)
    keys = block_keys(prompt, BS)
    assert index.match(keys)["http://engine0:8000"] == 131_072 - BS
    out["match_128k_16_engines_us"] = round(timing(lambda: index.match(keys), args.repeat))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
