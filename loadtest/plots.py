"""PNG plots of one benchmark run (the JSON document of ``python -m loadtest.bench``): ``make bench`` writes them.

Run: ``python -m loadtest.plots RESULTS.json [--out DIR]`` (default: the JSON's directory).  Writes

- ``latency.png`` — client-visible latency against concurrency, one line per target (``direct``, ``client_pd``,
  ``pdproxy``, ``vllm-router``, any ``--other``): TTFT p50 and p99 over the ``idle`` (1 stream) and
  ``poisson_*`` scenarios (x = the measured mean concurrency), and the inter-event gap p99 over the ``streams``
  levels (x = concurrent streams at 10 tokens/s);
- ``cpu.png`` — the proxies' CPU against concurrency: µs of proxy CPU per relayed event over the same scenarios
  (streams levels: ``proxy_cpu_frac`` / ``events_per_s``), and the three CPU figures side by side (paced event,
  full-speed event, PD request).

Tolerant of missing fields: a scenario, target or figure absent from the JSON (a ``--only`` run, an older
document) is left out of its plot, and a plot with nothing to show says so.  Needs matplotlib (the ``bench`` and
``test`` extras).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import orjson

COLORS = {"direct": "#7f7f7f", "client_pd": "#2ca02c", "pdproxy": "#1f77b4", "vllm-router": "#d62728"}
STYLE = {"direct": ":", "client_pd": "--"}
Series = dict[str, list[tuple[float, float]]]  # target → [(x, y)], sorted by x


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _concurrency(name: str, summary: Mapping[str, Any]) -> float | None:
    c = _num(summary.get("concurrency_mean"))
    if c is not None and c > 0:
        return c
    if name == "idle":
        return 1.0
    tail = name.rsplit("_", 1)[-1]
    return float(tail) if tail.isdigit() else None


def _latency_scenarios(scenarios: Mapping[str, Any]) -> list[str]:
    return [n for n in scenarios if n == "idle" or n.startswith("poisson_")]


def scenario_series(doc: Mapping[str, Any], key: str) -> Series:
    """``key`` (e.g. ``ttft_ms_p50``, ``proxy_us_per_event``) per target against concurrency, over the
    ``idle`` and ``poisson_*`` scenarios."""
    scenarios = _dict(doc.get("scenarios"))
    out: Series = {}
    for name in _latency_scenarios(scenarios):
        for target, summary in _dict(scenarios.get(name)).items():
            summary = _dict(summary)
            x, y = _concurrency(name, summary), _num(summary.get(key))
            if x is not None and y is not None:
                out.setdefault(target, []).append((x, y))
    return {t: sorted(v) for t, v in out.items()}


def streams_series(doc: Mapping[str, Any], key: str) -> Series:
    """Per target, ``key`` of each ``streams`` level against its stream count; ``key == "proxy_us_per_event"``
    is derived as ``proxy_cpu_frac × 10⁶ / events_per_s``."""
    out: Series = {}
    for target, result in _dict(_dict(doc.get("scenarios")).get("streams")).items():
        for level in _dict(result).get("levels") or []:
            level = _dict(level)
            x = _num(level.get("streams"))
            if key == "proxy_us_per_event":
                frac, rate = _num(level.get("proxy_cpu_frac")), _num(level.get("events_per_s"))
                y = frac * 1e6 / rate if frac is not None and rate else None
            else:
                y = _num(level.get(key))
            if x is not None and y is not None:
                out.setdefault(target, []).append((x, y))
    return {t: sorted(v) for t, v in out.items()}


CPU_FIGURES = (("cpu_us_per_event_paced", "per relayed event,\npaced (µs)"),
               ("cpu_us_per_event_full_speed", "per relayed event,\nfull speed (µs)"),
               ("cpu_us_per_pd_request", "per PD request\n(µs)"))


def cpu_figures(doc: Mapping[str, Any]) -> dict[str, dict[str, float]]:
    """``{target: {figure: µs}}`` for the proxies' CPU figures present in ``doc["figures"]``."""
    out: dict[str, dict[str, float]] = {}
    for target, figs in _dict(doc.get("figures")).items():
        for key, _ in CPU_FIGURES:
            v = _num(_dict(figs).get(key))
            if v is not None:
                out.setdefault(target, {})[key] = v
    return out


def _title(doc: Mapping[str, Any]) -> str:
    machine = _dict(doc.get("machine"))
    cpus = machine.get("cpus")
    profile = _dict(doc.get("profile")).get("name")
    bits = [f"{cpus} vCPU" if cpus else None, f"profile {profile}" if profile else None]
    return "pdproxy benchmark" + (f" ({', '.join(b for b in bits if b)})" if any(bits) else "")


def _lines(ax: Any, series: Series, title: str, xlabel: str, ylabel: str, *, logx: bool = True) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if not series:
        ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", transform=ax.transAxes, color="#888")
        return
    for label, points in series.items():
        xs, ys = zip(*points, strict=True)
        target, _, note = label.partition(" (")
        ax.plot(xs, ys, marker="o" if not note else "s", label=label, color=COLORS.get(target),
                linestyle="--" if note else STYLE.get(target, "-"))
    if logx and max(x for pts in series.values() for x, _ in pts) > 10:
        ax.set_xscale("log")
    ax.legend(fontsize=8)


def plot_latency(doc: Mapping[str, Any], path: Path) -> Path:
    """Write ``latency.png`` (see module docstring) to ``path``; returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    _lines(axes[0], scenario_series(doc, "ttft_ms_p50"), "time to first token, p50", "concurrent streams", "ms")
    _lines(axes[1], scenario_series(doc, "ttft_ms_p99"), "time to first token, p99", "concurrent streams", "ms")
    _lines(axes[2], streams_series(doc, "gap_ms_p99"), "inter-event gap p99, streams at 10 tokens/s",
           "concurrent streams", "ms")
    fig.suptitle(_title(doc) + ": latency against concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_cpu(doc: Mapping[str, Any], path: Path) -> Path:
    """Write ``cpu.png`` (see module docstring) to ``path``; returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    series = {t: v for t, v in scenario_series(doc, "proxy_us_per_event").items() if t not in ("direct", "client_pd")}
    for target, points in streams_series(doc, "proxy_us_per_event").items():
        series[f"{target} (10 tok/s streams)"] = points
    _lines(axes[0], series, "proxy CPU per relayed event (idle/Poisson: short streams, so per-request cost shows)",
           "concurrent streams", "µs of proxy CPU per event")
    ax = axes[1]
    figs = cpu_figures(doc)
    ax.set_title("proxy CPU figures (lower is better)", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    if not figs:
        ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", transform=ax.transAxes, color="#888")
    else:
        width = 0.8 / len(figs)
        for i, (target, values) in enumerate(figs.items()):
            xs = [k + i * width for k in range(len(CPU_FIGURES))]
            ys = [values.get(key, 0.0) for key, _ in CPU_FIGURES]
            bars = ax.bar(xs, ys, width, label=target, color=COLORS.get(target))
            for bar, (key, _) in zip(bars, CPU_FIGURES, strict=True):
                if key in values:
                    ax.annotate(f"{values[key]:.0f}" if values[key] >= 10 else f"{values[key]:.1f}",
                                (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                                fontsize=8)
        ax.set_xticks([k + width * (len(figs) - 1) / 2 for k in range(len(CPU_FIGURES))],
                      [label for _, label in CPU_FIGURES], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("µs of proxy CPU")
        ax.legend(fontsize=8)
    fig.suptitle(_title(doc) + ": CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(doc: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """Both PNGs into ``out_dir`` (created if needed); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return [plot_latency(doc, out_dir / "latency.png"), plot_cpu(doc, out_dir / "cpu.png")]


def main(argv: list[str] | None = None) -> int:
    """``python -m loadtest.plots RESULTS.json [--out DIR]``; exit 2 when the file is missing or not JSON."""
    ap = argparse.ArgumentParser(prog="python -m loadtest.plots", description=__doc__.splitlines()[0])
    ap.add_argument("results", type=Path, help="a JSON document written by python -m loadtest.bench --out")
    ap.add_argument("--out", type=Path, default=None, help="directory for the PNGs (default: the JSON's)")
    args = ap.parse_args(argv)
    try:
        doc = orjson.loads(args.results.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        print(f"loadtest.plots: {args.results}: {exc}", file=sys.stderr)
        return 2
    for path in write_plots(_dict(doc), args.out or args.results.parent):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
