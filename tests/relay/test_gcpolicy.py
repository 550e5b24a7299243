"""The GC policy (pdproxy/ops/gcpolicy.py): no automatic full collection while serving, one on its timer."""

from __future__ import annotations

import asyncio
import gc
import sys

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


def test_the_young_threshold_is_raised_and_restored() -> None:
    # a collection every young_threshold net allocations of tracked objects: counted by gc.callbacks while 50,000
    # tracked objects are made and kept; the middle generation after every two young collections
    def collections(policy: GcPolicy) -> list[int]:
        seen: list[int] = []

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "stop":
                seen.append(info["generation"])

        async def main() -> None:
            policy.start()
            gc.callbacks.append(on_gc)
            try:
                keep = [[i] for i in range(50_000)]      # net allocations: each list stays until the end
                del keep
            finally:
                gc.callbacks.remove(on_gc)
                policy.stop()

        asyncio.run(main())
        return seen

    outside = gc.get_threshold()
    gc.set_threshold(700, 10, 10)                         # CPython's defaults (3.11-3.13), whatever ran before
    try:
        before = gc.get_threshold()
        raised = collections(GcPolicy(0, young_threshold=10_000))
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
        default = collections(GcPolicy(0))                # 71 collections at 700
    finally:
        gc.set_threshold(*outside)
    assert 3 <= len(raised) <= 6 and len(default) >= 4 * len(raised), (raised, default)
    if sys.version_info[:2] != (3, 14):                    # 3.14: no middle generation
        assert raised[:3] == [0, 0, 1], raised

    async def check_combined() -> None:
        policy = GcPolicy(60.0, young_threshold=5_000)
        policy.start()
        try:
            middle = before[1] if sys.version_info[:2] == (3, 14) else 1    # 3.14: no middle generation
            assert gc.get_threshold()[:2] == (5_000, middle)  # the middle generation every second young one
            assert gc.get_freeze_count() > 0
        finally:
            policy.stop()

    asyncio.run(check_combined())
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_two_policies_in_one_process_restore_the_thresholds_in_either_order() -> None:
    # two apps in one process (tests run several ProxyThreads at once): whichever stops first, the thresholds and
    # the freeze end as they were before both (a last-started policy restoring what it found used to leave the
    # process with the policy's thresholds for good)
    async def main(first_out: int) -> None:
        before = gc.get_threshold()
        policies = [GcPolicy(60.0, young_threshold=10_000), GcPolicy(60.0, young_threshold=10_000)]
        for policy in policies:
            policy.start()
        assert gc.get_threshold()[0] == 10_000
        policies[first_out].stop()
        policies[1 - first_out].stop()
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0

    for first_out in (0, 1):
        asyncio.run(main(first_out))
