"""Smoke test of the benchmark harness: a tiny run (seconds) must produce the documented JSON shape.

Never asserts speed (benchmarks are not timed tests): it checks that every target served the workload without
errors, that the engines saw real PD traffic through pdproxy, and that the figures are present.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from loadtest import report

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(90)
def test_quick_bench_prints_the_documented_json() -> None:
    proc = subprocess.run([sys.executable, "-m", "loadtest.bench", "--profile", "quick", "--no-other",
                           "--only", "latency", "cpu", "streams"], cwd=ROOT, capture_output=True, timeout=80)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    doc = orjson.loads(proc.stdout)
    assert {"machine", "pinning", "profile", "figures", "targets_met", "scenarios", "elapsed_s"} <= doc.keys()
    assert doc["machine"]["cpus"] >= 1
    scen = doc["scenarios"]
    for name in ("idle", "poisson_10"):
        assert set(scen[name]) == {"direct", "client_pd", "pdproxy"}
        for target, summary in scen[name].items():
            assert summary["errors"] == 0, (name, target, summary["error_samples"])
            assert summary["ttft_ms_p50"] is not None
    for name in ("cpu_paced", "cpu_full_speed", "cpu_per_request"):
        summary = scen[name]["pdproxy"]
        assert summary["errors"] == 0, summary["error_samples"]
        assert summary["events_per_s"] > 0
        assert summary["proxy_us_per_event"] > 0
    fig = doc["figures"]["pdproxy"]
    for key in ("added_ttft_ms_idle_p50", "at_10", "cpu_us_per_event_paced", "events_per_cpu_s_full_speed",
                "cpu_us_per_pd_request", "max_streams_no_stall"):
        assert fig[key] is not None, key
    levels = doc["scenarios"]["streams"]["pdproxy"]["levels"]
    assert levels[0]["streams"] == 20 and levels[0]["errors"] == 0
    # the figure is the largest level held (a loaded CI machine may stall a stream for > 1 s: then none held)
    assert fig["max_streams_no_stall"] == max((lv["streams"] for lv in levels if lv["held"]), default=0)
    assert levels[0]["held"] is (levels[0]["stalls"] == 0 and levels[0]["concurrency_mean"] >= 0.95 * 20)
    assert {"added_ttft_ms_p50", "added_ttft_ms_p99", "gap_p99_ratio", "e2e_ratio_p50"} <= fig["at_10"].keys()


def _window(events: int, cpu: float, ttft: float) -> dict:
    pct = {"p50": ttft, "p90": ttft, "p99": ttft, "p999": ttft, "max": ttft, "mean": ttft, "n": 1}
    return {"wall_s": 1.0, "requests": 10, "errors": 0, "error_samples": [], "events": events,
            "events_per_s": float(events), "requests_per_s": 10.0, "ttft_ms": pct, "gap_ms": pct, "e2e_ms": pct,
            "stalls": 0, "concurrency": {"mean": 5.0, "max": 6}, "cpu_s": {"proxy": cpu, "engines": 0.01},
            "loadgen_cpu_s": 0.1, "rss_bytes": {"proxy": 1000}}


def test_summary_is_the_median_of_windows_and_ratios_use_the_floor() -> None:
    proxy = report.summarize([_window(1000, 0.03, 5.0), _window(1000, 0.05, 9.0), _window(1000, 0.04, 7.0)])
    assert proxy["proxy_us_per_event"] == 40.0
    assert proxy["ttft_ms_p50"] == 7.0
    floor = report.summarize([_window(1000, 0.0, 5.0)], proxy=None)
    vs = report.versus(proxy, floor)
    assert vs["added_ttft_ms_p50"] == 2.0
    assert vs["e2e_ratio_p50"] == 1.4
    assert report.check_targets({"cpu_us_per_event_paced": 40.0}, None)["paced_event_cpu_le_50us"] is True
