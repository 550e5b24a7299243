"""The users' bench report (loadtest/users_bench.py): medians, ratios against the router and targets, from
synthetic runs (the runs themselves are benchmarks, not tests)."""

from __future__ import annotations

from typing import Any

from loadtest.users_bench import FULL, figures, render


def window(cpu_s: float | None, events: int, ttft_p99: float, *, errors: int = 0, stalls: int = 0,
           rss: int = 0, idle: int = 0) -> dict[str, Any]:
    pct = {"p50": 1.0, "p90": 2.0, "p99": ttft_p99, "p999": ttft_p99, "max": ttft_p99, "mean": 1.0, "n": 10}
    return {"cpu_s": {} if cpu_s is None else {"proxy": cpu_s}, "events": events, "wall_s": 10.0,
            "ttft_ms": pct, "gap_ms": pct, "errors": errors, "stalls": stalls, "error_samples": [],
            "rss_bytes": {} if cpu_s is None else {"proxy": rss}, "rss_idle_bytes": {"proxy": idle},
            "concurrency": {"mean": 1.0, "max": 1}, "others_cpu_frac": 0.1}


def test_headline_ratios_medians_and_targets() -> None:
    data = {
        "paced_1000": {"pdproxy": [window(2.0, 100_000, 15.0), window(3.0, 100_000, 25.0), window(9.0, 100_000, 5.0)],
                       "vllm-router": [window(2.5, 100_000, 9.0)] * 3,
                       "client_pd": [window(None, 100_000, 4.0)] * 3},
        "full_100": {"pdproxy": [window(1.0, 500_000, 1.0)], "vllm-router": [window(2.0, 500_000, 1.0)]},
        "paced_3000": {"pdproxy": [window(1.0, 1, 1.0, rss=3000 * 10240, idle=0)],
                       "vllm-router": [window(1.0, 1, 1.0, stalls=4, rss=3000 * 20480, idle=0)]},
        "slow_readers_1000": {"pdproxy": [window(1.0, 1, 1.0, rss=1000 * 8192)],
                              "vllm-router": [window(1.0, 1, 1.0, rss=1000 * 512 * 1024)]},
    }
    doc = figures(data, FULL)
    rows = {r["key"]: r for r in doc["headline"]}
    assert rows["cpu_paced"]["pdproxy"] == 30.0 and rows["cpu_paced"]["vllm-router"] == 25.0  # medians, µs/event
    assert rows["cpu_paced"]["ratio"] == 1.2 and rows["cpu_paced"]["met"] is False
    assert rows["cpu_full"]["ratio"] == 0.5 and rows["cpu_full"]["met"] is True
    assert rows["added_ttft_p99"]["pdproxy"] == 11.0 and rows["added_ttft_p99"]["met"] is True  # 15 − 4
    assert rows["faults_paced_3000"]["pdproxy"] == 0 and rows["faults_paced_3000"]["vllm-router"] == 4
    assert rows["rss_per_stream"]["pdproxy"] == 10.0 and rows["rss_per_stream"]["met"] is True
    assert rows["rss_per_slow_reader"]["pdproxy"] == 8.0 and rows["rss_per_slow_reader"]["met"] is True
    text = render(doc)
    assert "CPU µs per event, 1,000 paced streams" in text and "1.20" in text and "NO" in text
