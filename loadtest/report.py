"""Reduce load-generator windows to figures: medians over windows, then ratios against the client-side PD floor.

Definitions (the headline figures):

- **added TTFT** (ms) = TTFT through the proxy − TTFT of the client-side PD floor (the generator itself calls
  prefill then decode), at p50 and p99, each the median over windows;
- **inter-event gap p99 ratio** = proxy gap p99 / floor gap p99 (gaps as the client sees them);
- **E2E ratio** = proxy E2E p50 / floor E2E p50 (and the same for the mean);
- **µs of proxy CPU per relayed event** = proxy process CPU seconds (``/proc``) in a window / events the client
  received in it (``data:`` events incl. the usage chunk, excl. ``[DONE]``) × 10⁶; per PD request likewise with
  completed requests (1-token streams);
- **stall**: an inter-event gap longer than the scenario's ``stall_gap_s``, or any failed request.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

Window = dict[str, Any]


def _median(windows: list[Window], f: Callable[[Window], float | None]) -> float | None:
    values = []
    for w in windows:
        try:
            v = f(w)
        except (KeyError, TypeError, ZeroDivisionError):
            v = None
        if v is not None:
            values.append(v)
    return round(statistics.median(values), 3) if values else None


def summarize(windows: list[Window], proxy: str | None = "proxy") -> dict[str, Any]:
    """Median-over-windows summary of one (scenario, target) run."""
    out: dict[str, Any] = {
        "windows": len(windows),
        "requests_per_s": _median(windows, lambda w: w["requests_per_s"]),
        "events_per_s": _median(windows, lambda w: w["events_per_s"]),
        "errors": sum(w["errors"] for w in windows),
        "error_samples": next((w["error_samples"] for w in windows if w["error_samples"]), []),
        "stalls": sum(w["stalls"] for w in windows),
        "concurrency_mean": _median(windows, lambda w: w["concurrency"]["mean"]),
        "ttft_ms_p50": _median(windows, lambda w: w["ttft_ms"]["p50"]),
        "ttft_ms_p99": _median(windows, lambda w: w["ttft_ms"]["p99"]),
        "gap_ms_p50": _median(windows, lambda w: w["gap_ms"]["p50"]),
        "gap_ms_p99": _median(windows, lambda w: w["gap_ms"]["p99"]),
        "gap_ms_max": max((w["gap_ms"]["max"] or 0.0 for w in windows), default=None),
        "e2e_ms_p50": _median(windows, lambda w: w["e2e_ms"]["p50"]),
        "e2e_ms_mean": _median(windows, lambda w: w["e2e_ms"]["mean"]),
        "loadgen_cpu_frac": _median(windows, lambda w: w["loadgen_cpu_s"] / w["wall_s"]),
        "others_cpu_frac": _median(windows, lambda w: w.get("others_cpu_frac")),
        "engines_us_per_event": _median(windows, lambda w: w["cpu_s"]["engines"] / w["events"] * 1e6),
    }
    if proxy:
        out.update({
            "proxy_cpu_frac": _median(windows, lambda w: w["cpu_s"][proxy] / w["wall_s"]),
            "proxy_us_per_event": _median(windows, lambda w: w["cpu_s"][proxy] / w["events"] * 1e6),
            "proxy_us_per_request": _median(windows, lambda w: w["cpu_s"][proxy] / w["requests"] * 1e6),
            "proxy_rss_bytes": windows[-1]["rss_bytes"].get(proxy) if windows else None,
        })
    return out


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 4)


def versus(proxy: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    """Added TTFT and ratios of a proxy run against the floor run of the same workload."""
    return {
        "added_ttft_ms_p50": _sub(proxy.get("ttft_ms_p50"), floor.get("ttft_ms_p50")),
        "added_ttft_ms_p99": _sub(proxy.get("ttft_ms_p99"), floor.get("ttft_ms_p99")),
        "gap_p99_ratio": _ratio(proxy.get("gap_ms_p99"), floor.get("gap_ms_p99")),
        "e2e_ratio_p50": _ratio(proxy.get("e2e_ms_p50"), floor.get("e2e_ms_p50")),
        "e2e_ratio_mean": _ratio(proxy.get("e2e_ms_mean"), floor.get("e2e_ms_mean")),
        "streams": proxy.get("concurrency_mean"),
        "errors": proxy.get("errors"),
    }


def check_targets(fig: dict[str, Any], router: dict[str, Any] | None) -> dict[str, bool | None]:
    """The overhead targets that one run can decide (None = not measured)."""
    def le(v: float | None, limit: float) -> bool | None:
        return None if v is None else v <= limit

    def ge(v: float | None, limit: float) -> bool | None:
        return None if v is None else v >= limit

    at100 = fig.get("at_100") or {}
    out = {
        "paced_event_cpu_le_50us": le(fig.get("cpu_us_per_event_paced"), 50),
        "paced_event_cpu_le_30us_stretch": le(fig.get("cpu_us_per_event_paced"), 30),
        "full_speed_ge_65k_events_per_cpu_s": ge(fig.get("events_per_cpu_s_full_speed"), 65_000),
        "pd_request_cpu_le_400us": le(fig.get("cpu_us_per_pd_request"), 400),
        "added_ttft_idle_le_1_5ms": le(fig.get("added_ttft_ms_idle_p50"), 1.5),
        "added_ttft_100_p50_le_3ms": le(at100.get("added_ttft_ms_p50"), 3),
        "added_ttft_100_p99_le_15ms": le(at100.get("added_ttft_ms_p99"), 15),
        "e2e_ratio_100_le_1_01": le(at100.get("e2e_ratio_p50"), 1.01),
        "streams_no_stall_ge_2000": ge(fig.get("max_streams_no_stall"), 2000),
        "workers_2_ge_1_7x": ge(fig.get("workers_2_capacity_ratio"), 1.7),
    }
    if router:
        mine, theirs = fig.get("cpu_us_per_event_paced"), router.get("cpu_us_per_event_paced")
        out["paced_event_cpu_within_1_5x_of_router"] = (None if mine is None or not theirs
                                                        else mine <= 1.5 * theirs)
    return out
