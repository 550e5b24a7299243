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


def test_bounded_rolling_drain_with_migrate() -> None:
    """The drain mode bounded (``python -m loadtest.fault_bench --drain`` runs 200 live streams with a process
    restart per decoder): 48 live streams mixed across the four APIs while each of 3 decoders in turn is drained
    with ``migrate`` and undrained; no stream breaks, each equals its uninterrupted greedy run with one opening and
    exact usage, and every drain moved live streams."""
    args = fault_bench.parse_args(["--drain", "--requests", "48", "--concurrency", "48", "--no-restart",
                                   "--drain-tokens", "60", "80", "100", "--drain-pause-s", "0.2"])
    r = asyncio.run(fault_bench.drain_async(args))
    print(fault_bench.drain_table(r))
    assert r["broken_reference"] == 0
    assert r["broken"] == 0, r["broken_details"]
    assert r["differ"] == 0, r["differ_details"]
    assert r["usage_ok"] == r["one_opening"] == r["streams"] >= 48, r
    assert len(r["steps"]) == 3 and all(s["migrated"] > 0 for s in r["steps"]), r["steps"]
    assert r["continued_after_drain"] == r["migrated"] and r["refused"] == 0   # every stream moved continued
