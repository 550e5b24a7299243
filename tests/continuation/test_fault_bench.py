"""The fault bench (loadtest/fault_bench.py) bounded: 2 prefillers, 3 decoders, streams mixed across the four
APIs, decoders losing legs at random events (reset, end without marker, in-band error event, stall); every
eligible stream completes identical to its uninterrupted run, with one opening and exact usage."""

from __future__ import annotations

import asyncio

import pytest

from loadtest import fault_bench

pytestmark = pytest.mark.timeout(90)


def test_bounded_fault_bench() -> None:
    args = fault_bench.parse_args(["--requests", "48", "--concurrency", "16", "--fault-rate", "0.3",
                                   "--ineligible-share", "0.1", "--seed", "7"])
    r = asyncio.run(fault_bench.main_async(args))
    print(fault_bench.table(r))
    assert r["legs_lost"] > 0, "no fault fired: the bench tested nothing"
    assert r["eligible_broken"] == 0, r["broken_details"]
    assert r["differ"] == 0, r["differ_details"]
    assert r["usage_ok"] == r["eligible"] and r["one_opening"] == r["eligible"], r
    assert r["broken_reference"] == 0
    assert r["ineligible_error_s"]["max"] is None or r["ineligible_error_s"]["max"] <= 1.0 + args.stall_min_s
