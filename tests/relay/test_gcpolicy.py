"""The GC policy (pdproxy/ops/gcpolicy.py): no automatic full collection while serving, one on its timer."""

from __future__ import annotations

import asyncio
import gc

import pytest

from pdproxy.ops.gcpolicy import GcPolicy

pytestmark = pytest.mark.timeout(20)


def test_full_collections_run_on_the_timer_and_the_policy_is_restored() -> None:
    async def main() -> None:
        full: list[int] = []

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "stop" and info["generation"] == 2:
                full.append(1)

        before = gc.get_threshold()
        policy = GcPolicy(0.05)
        policy.start()
        gc.callbacks.append(on_gc)
        try:
            assert gc.get_threshold()[:2] == before[:2] and gc.get_threshold()[2] > 10**6
            assert gc.get_freeze_count() > 0  # start-up objects are out of every later scan
            while policy.full_collections < 2:
                junk = [[] for _ in range(1000)]  # young collections still run as usual
                del junk
                await asyncio.sleep(0.01)
            assert len(full) >= 2  # the full collections came from the timer, not from growth
        finally:
            gc.callbacks.remove(on_gc)
            policy.stop()
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0

    asyncio.run(main())


def test_interval_zero_leaves_cpython_alone() -> None:
    async def main() -> None:
        before = gc.get_threshold()
        policy = GcPolicy(0)
        policy.start()
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
        policy.stop()

    asyncio.run(main())
