"""The simulator's prefix cache as vLLM 0.32's: a request's blocks are cached when a step allocates them
(``vllm/v1/core/kv_cache_manager.py::allocate_slots`` → ``cache_blocks``), so a request admitted later in the same
step hits them — what prefix routing counts on when it sends a prompt where an identical one is in flight — and
their ``BlockStored`` events go out once the step ran."""

from __future__ import annotations

import pytest

from pdproxy.sim.config import SimConfig
from pdproxy.sim.scheduler import EngineCore, EngineRequest

pytestmark = pytest.mark.timeout(30)


def test_a_request_admitted_in_the_same_step_hits_the_blocks_being_computed() -> None:
    events: list[tuple[str, dict[str, object]]] = []
    core = EngineCore(SimConfig(prefill_tokens_per_s=1000, block_size=16))
    core.pool.event_sink = lambda kind, fields: events.append((kind, fields))
    system = list(range(160))
    a, b = (EngineRequest(rid, system + tail, 1, 0.0) for rid, tail in (("a", [7] * 8), ("b", [9] * 8)))
    core.add_request(a)
    core.add_request(b)
    plan = core.schedule(0.0)
    assert [r.request_id for r, _n in plan.scheduled] == ["a", "b"]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 160)       # b found a's ten blocks
    assert plan.prefill_tokens == 168 + 8                              # only b's own tail computed
    assert events == []                                                # announced when the step completes
    core.complete(plan, plan.duration_s)
    stored = [f for kind, f in events if kind == "BlockStored"]
    assert len(stored) == 1 and len(stored[0]["block_hashes"]) == 10   # a's blocks, once
