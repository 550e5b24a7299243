"""The users' bench report (loadtest/users_bench.py): medians, ratios against the router and targets, from
synthetic runs (the runs themselves are benchmarks, not tests)."""

from __future__ import annotations

from typing import Any

from loadtest.users_bench import FULL, OPEN_LOOP, PER_REQUEST, figures, render, targets, top_frames


def window(cpu_s: float | None, events: int, ttft_p99: float, *, errors: int = 0, stalls: int = 0,
           rss: int = 0, idle: int = 0) -> dict[str, Any]:
    pct = {"p50": 1.0, "p90": 2.0, "p99": ttft_p99, "p999": ttft_p99, "max": ttft_p99, "mean": 1.0, "n": 10}
    return {"cpu_s": {} if cpu_s is None else {"proxy": cpu_s}, "events": events, "requests": 10, "wall_s": 10.0,
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


def per_request_window(cpu_s: float | None, requests: int, ttft_p50: float) -> dict[str, Any]:
    w = window(cpu_s, requests * 32, ttft_p50)
    w["ttft_ms"] = {**w["ttft_ms"], "p50": ttft_p50, "p99": ttft_p50 * 2}
    w["requests"] = requests
    return w


def test_per_request_rows_against_round_robin_and_cache_aware() -> None:
    long16 = {"pdproxy": [per_request_window(0.4, 400, 20.0), per_request_window(0.8, 400, 30.0),
                          per_request_window(0.5, 400, 25.0)],
              "pdproxy_noprefix": [per_request_window(0.3, 400, 15.0)],
              "vllm-router": [per_request_window(0.5, 400, 22.0)],
              "vllm-router_cache_aware": [per_request_window(1.2, 400, 40.0)],
              "client_pd": [per_request_window(None, 400, 10.0)]}
    data = {"long_16": long16,
            "full_100": {"pdproxy": [window(1.0, 500_000, 1.0)], "pdproxy_continuation": [window(1.1, 500_000, 1.0)],
                         "vllm-router": [window(2.0, 500_000, 1.0)]}}
    doc = figures(data, FULL)
    rows = {r["key"]: r for r in doc["headline"]}
    req = rows["cpu_req_long_16"]
    assert (req["pdproxy"], req["vllm-router"], req["met"]) == (1.25, 1.25, True)  # median 0.5 s / 400 requests
    ttft = rows["ttft_p50_long_16"]  # added over client-side PD's p50: 25 − 10 against 22 − 10
    assert (ttft["pdproxy"], ttft["vllm-router"], ttft["met"], ttft["ratio"]) == (15.0, 12.0, True, None)
    ca = rows["cpu_req_long_16_cache_aware"]
    assert (ca["vllm-router"], ca["ratio"], ca["met"], ca["reference"]) == (3.0, 0.417, True, "cache_aware")
    cont = rows["continuation_full_100"]
    assert (cont["ratio"], cont["met"]) == (1.1, False)  # 2.2 µs with continuation against 2.0 without
    per = doc["per_request"]["long_16"]
    assert per["pdproxy_noprefix"]["added_ttft_ms_p99"] == 10.0 and per["client_pd"]["added_ttft_ms_p50"] is None
    assert "cpu_req_short_100" not in rows  # a scenario not run has no rows
    text = render(doc)
    assert "long_16" in text and "vllm-router_cache_aware" in text and "≤ 0.5× cache_aware" in text
    assert per["pdproxy"]["busiest_thread_cpu_frac"] is None  # windows without ``sched`` (older runs): no figure


def test_per_request_rows_carry_the_proxy_s_scheduling_figures() -> None:
    def sched(busiest: float, runq: float) -> dict[str, Any]:
        w = per_request_window(0.3, 2000, 60.0)
        w["sched"] = {"proxy": {"busiest_thread_cpu_frac": busiest, "run_queue_wait_frac": runq}}
        return w

    data = {"short_100": {"pdproxy": [sched(0.95, 0.03), sched(0.97, 0.01), sched(0.99, 0.02)],
                          "vllm-router": [sched(0.45, 0.8)] * 3, "client_pd": [per_request_window(None, 2000, 15.0)]}}
    per = figures(data, FULL)["per_request"]["short_100"]
    assert (per["pdproxy"]["busiest_thread_cpu_frac"], per["pdproxy"]["run_queue_wait_frac"]) == (0.97, 0.02)  # medians
    assert (per["vllm-router"]["busiest_thread_cpu_frac"], per["vllm-router"]["run_queue_wait_frac"]) == (0.45, 0.8)
    lines = render(figures(data, FULL)).splitlines()
    head = next(line for line in lines if line.startswith("short_100")).split()
    row = next(line for line in lines if line.startswith("vllm-router ")).split()
    assert head[-2:] == ["busiest", "runq"] and row[-2:] == ["0.45", "0.80"]


def test_open_loop_rows_are_reported_beside_the_done_when_rows() -> None:
    data = {"short_open": {"pdproxy": [per_request_window(0.6, 7200, 1.4)] * 3,
                           "vllm-router": [per_request_window(0.7, 7200, 1.0)] * 3,
                           "client_pd": [per_request_window(None, 7200, 0.5)] * 3}}
    doc = figures(data, FULL)
    rows = {r["key"]: r for r in doc["headline"]}
    ttft = rows["ttft_p50_short_open"]          # 1.4 − 0.5 against 1.0 − 0.5: reported, no verdict and no ratio
    assert (ttft["pdproxy"], ttft["vllm-router"], ttft["met"], ttft["ratio"]) == (0.9, 0.5, None, None)
    p99 = rows["ttft_p99_short_open"]           # 2.8 − 1.0 against 2.0 − 1.0
    assert (p99["pdproxy"], p99["vllm-router"], p99["met"]) == (1.8, 1.0, None)
    assert "(800/s)" in ttft["figure"]          # 7,200 requests over 9 s
    assert "cpu_req_short_open" not in rows                   # the open loop is not a CPU target
    assert doc["per_request"]["short_open"]["pdproxy"]["cpu_ms_per_request"] == round(0.6 / 7200 * 1e3, 3)
    assert "short_open" in render(doc)


def test_the_per_request_scenarios_are_the_documented_ones() -> None:
    sc = {s.name: s for s in FULL}
    short, long_ = sc["short_open"], sc["long_open"]
    assert (short.streams, short.ramp_s, short.concurrency, short.tokens, short.api) == (7200, 9.0, 0, 64, "completions")
    assert (long_.streams, long_.ramp_s, long_.concurrency, long_.api, long_.prompt_bytes) == (1800, 6.0, 0, "chat",
                                                                                               250_000)
    assert all(targets(sc[n]) == ["pdproxy", "vllm-router", "client_pd"] for n in OPEN_LOOP)
    assert [(sc[n].streams, sc[n].concurrency) for n in PER_REQUEST] == [(6000, 100), (1200, 16), (1200, 16)]
    assert "client_pd" in targets(sc["short_100"]) and sc["agent_16"].agent


def test_every_proxy_runs_with_the_logging_it_ships_with() -> None:
    """Users run pdproxy at its default INFO, one request line per request; the bench must pay for it too."""
    from loadtest.users_bench import COMMANDS, USERS_PDPROXY
    assert all("--log-level" not in cmd for cmd in COMMANDS.values())
    assert COMMANDS["pdproxy"] == USERS_PDPROXY and "--request-log" not in USERS_PDPROXY


def test_top_frames_counts_a_function_once_per_stack() -> None:
    collapsed = ("main (a/cli.py:1);serve (a/app.py:5);keys (prefix/index.py:10) 6\n"
                 "main (a/cli.py:1);serve (a/app.py:7);serve (a/app.py:9) 3\n"
                 "main (a/cli.py:1);relay (pd/relay.py:3) 1\n")
    text = top_frames(collapsed)
    assert "10 busy samples" in text
    inclusive, self_ = text.split("self %")
    assert "100.0  main (a/cli.py)" in inclusive and "90.0  serve (a/app.py)" in inclusive
    assert "60.0  keys (prefix/index.py)" in self_ and "30.0  serve (a/app.py)" in self_
