"""The overhead benchmark: the same workload direct, client-side PD, through pdproxy and through another proxy.

Run: ``python -m loadtest.bench [--profile full|quick] [--other NAME=COMMAND ...] [--out FILE]`` (``make bench``).
Prints one JSON document (also written to ``--out``): the machine, the CPU pinning, per-scenario summaries
(median of ``windows`` windows) for every target, and the headline figures (``loadtest/report.py``) with the
targets they meet.

Targets: ``direct`` (client → decoder, no PD), ``client_pd`` (the generator calls prefill then decode itself: the
floor for any PD proxy), ``pdproxy`` (``python -m pdproxy serve``) and every ``--other`` proxy command (template
placeholders ``{prefill}``, ``{decode}``, ``{port}``, ``{port2}``; by default vLLM's Rust router ``vllm-router``
if installed).

Scenarios (engines: ``loadtest.fake_engine``, zero prefill cost, scripted inter-token latency):

- ``idle``: one stream at a time (closed loop, 1) — added TTFT when idle;
- ``poisson_100`` / ``poisson_300``: open-loop Poisson arrivals sized for ≈100 / ≈300 concurrent streams
  (rate = streams / stream duration) — added TTFT p50/p99, gap p99 ratio, E2E ratio;
- ``cpu_paced``: closed loop, long streams with one event per read — µs of proxy CPU per relayed event;
- ``cpu_full_speed``: closed loop, the decoder writes as fast as it can — events per proxy CPU-second;
- ``cpu_per_request``: closed loop, 1-token streams — µs of proxy CPU per PD request;
- ``streams``: closed loops of N streams at 10 tokens/s, N rising until two levels in a row stall (a gap over
  ``stall_gap_s`` or any error) — the largest N held, RSS per stream;
- ``workers``: PD-request capacity with ``--workers 2`` vs 1 (unpinned; only if the proxy forks workers);
- ``admission``: ``loadtest.admission_bench`` (over-length 400 latency for a 200K-token prompt, small-request TTFT
  while 120K-token prefills run with protection on/off; ``pdproxy sim`` engines with prefill cost), full profile.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from loadtest import fleet, procstat, report

PDPROXY = "{python} -m pdproxy serve --host 127.0.0.1 --port {port} --prefill {prefill} --decode {decode} " \
          "--log-level warning"
ROUTER = "vllm-router --vllm-pd-disaggregation --prefill {prefill} --decode {decode} --host 127.0.0.1 " \
         "--port {port} --log-level warning --disable-retries --prometheus-port {port2}"


@dataclass(frozen=True, slots=True)
class Profile:
    """Sizes and durations of one benchmark run (seconds, tokens = events per stream, streams)."""

    name: str
    warmup_s: float
    windows: int
    window_s: float
    itl_s: float = 0.02
    latency_tokens: int = 50
    latency_streams: tuple[int, ...] = (100, 300)
    paced_streams: int = 200
    paced_tokens: int = 500
    full_streams: int = 64
    full_tokens: int = 1000
    request_concurrency: int = 32
    stall_levels: tuple[int, ...] = (500, 1000, 2000, 3000)
    stall_itl_s: float = 0.1
    stall_tokens: int = 300
    stall_gap_s: float = 1.0
    workers: bool = True


PROFILES = {
    "full": Profile("full", warmup_s=2.0, windows=3, window_s=4.0),
    "quick": Profile("quick", warmup_s=0.3, windows=1, window_s=0.8, latency_tokens=10, latency_streams=(10,),
                     paced_streams=10, paced_tokens=50, full_streams=4, full_tokens=200, request_concurrency=4,
                     stall_levels=(20,), stall_tokens=20, workers=False),
}


class Bench:
    """Owns the engines and proxies of one run and runs scenarios against them."""

    def __init__(self, profile: Profile, others: dict[str, str]) -> None:
        self.p = profile
        self.others = others
        self.proxy_cpus, self.load_cpus = fleet.cpu_split()
        self.prefiller = fleet.fake_engine("prefiller", self.load_cpus)
        self.decoder = fleet.fake_engine("decoder", self.load_cpus)
        self.proxies: dict[str, fleet.Child] = {}
        self.skipped: dict[str, str] = {}
        self.started_at = time.monotonic()

    def __enter__(self) -> Bench:
        self.prefiller.start()
        self.decoder.start()
        for name, template in {"pdproxy": PDPROXY, **self.others}.items():
            child = fleet.proxy_child(name, template, self.prefiller.url, self.decoder.url, self.proxy_cpus)
            try:
                self.proxies[name] = child.start()
            except (RuntimeError, OSError) as exc:
                self.skipped[name] = str(exc)[-500:]
        return self

    def __exit__(self, *exc: object) -> None:
        for child in [*self.proxies.values(), self.prefiller, self.decoder]:
            child.stop()

    def targets(self, floors: bool = True) -> list[str]:
        """Target names: the two floors (``direct``, ``client_pd``) unless ``floors`` is False, then the proxies."""
        return (["direct", "client_pd"] if floors else []) + list(self.proxies)

    def run(self, target: str, arrival: dict[str, Any], tokens: int, itl_s: float, *,
            stall_gap_s: float = 1.0, warmup_s: float | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """One workload against one target; returns (summary, windows)."""
        for url in (self.prefiller.url, self.decoder.url):
            fleet.configure_engine(url, itl_s=itl_s, ttft_s=0.0, prefill_s=0.0)
        pids: dict[str, list[int]] = {"engines": [self.prefiller.pid, self.decoder.pid]}
        spec: dict[str, Any] = {
            "mode": target if target in ("direct", "client_pd") else "proxy", "prefill": self.prefiller.url,
            "decode": self.decoder.url, "max_tokens": tokens, "arrival": arrival, "stall_gap_s": stall_gap_s,
            "warmup_s": self.p.warmup_s if warmup_s is None else warmup_s, "windows": self.p.windows,
            "window_s": self.p.window_s, "cpu_pids": pids}
        if target in self.proxies:
            spec["target"] = self.proxies[target].url
            pids["proxy"] = [self.proxies[target].pid]
        budget = 120 + spec["warmup_s"] + self.p.windows * self.p.window_s * 2
        windows = fleet.run_loadgen(spec, self.load_cpus, budget)["windows"]
        return report.summarize(windows, "proxy" if target in self.proxies else None), windows

    def latency(self) -> dict[str, Any]:
        """``idle`` and ``poisson_<streams>`` summaries for every target (open-loop Poisson arrivals)."""
        p, out = self.p, {}
        duration = p.latency_tokens * p.itl_s
        out["idle"] = {t: self.run(t, {"kind": "closed", "concurrency": 1}, 4, 0.005)[0] for t in self.targets()}
        for streams in p.latency_streams:
            arrival = {"kind": "poisson", "rate": streams / duration}
            out[f"poisson_{streams}"] = {t: self.run(t, arrival, p.latency_tokens, p.itl_s)[0]
                                         for t in self.targets()}
        return out

    def cpu(self) -> dict[str, Any]:
        """``cpu_paced``, ``cpu_full_speed`` and ``cpu_per_request`` summaries for every proxy (closed loops)."""
        p = self.p
        return {
            "cpu_paced": {t: self.run(t, {"kind": "closed", "concurrency": p.paced_streams, "ramp_s": 1.0},
                                      p.paced_tokens, p.itl_s)[0] for t in self.targets(False)},
            "cpu_full_speed": {t: self.run(t, {"kind": "closed", "concurrency": p.full_streams}, p.full_tokens,
                                           0.0)[0] for t in self.targets(False)},
            "cpu_per_request": {t: self.run(t, {"kind": "closed", "concurrency": p.request_concurrency}, 1,
                                            0.0)[0] for t in self.targets(False)},
        }

    def streams(self) -> dict[str, Any]:
        """Raise N until a stall; report the largest N held and the proxy's RSS per stream."""
        p, out = self.p, {}
        for name, child in self.proxies.items():
            idle_rss = procstat.tree_rss_bytes(procstat.process_tree([child.pid]))
            levels, held = [], None
            for n in p.stall_levels:
                arrival = {"kind": "closed", "concurrency": n, "ramp_s": max(1.0, n / 1000)}
                s, _ = self.run(name, arrival, p.stall_tokens, p.stall_itl_s, stall_gap_s=p.stall_gap_s,
                                warmup_s=max(p.warmup_s, n / 1000 + 1.0))
                ok = s["errors"] == 0 and s["stalls"] == 0 and (s["concurrency_mean"] or 0) >= 0.95 * n
                levels.append({"streams": n, "held": ok, **{k: s[k] for k in (
                    "errors", "error_samples", "stalls", "concurrency_mean", "gap_ms_p99", "gap_ms_max",
                    "events_per_s", "proxy_cpu_frac", "proxy_rss_bytes", "loadgen_cpu_frac")}})
                if ok:
                    held = (n, s["proxy_rss_bytes"])
                elif len(levels) >= 2 and not levels[-2]["held"]:
                    break  # two failed levels in a row
            out[name] = {"levels": levels, "max_streams_no_stall": held[0] if held else 0, "idle_rss_bytes": idle_rss,
                         "rss_bytes_per_stream": round((held[1] - idle_rss) / held[0]) if held else None}
        return out

    def workers(self) -> dict[str, Any]:
        """PD-request capacity (1-token streams, requests/s, wall) with 1 and 2 workers, nothing pinned."""
        out: dict[str, Any] = {}
        for workers in (1, 2):
            child = fleet.proxy_child(f"pdproxy-w{workers}", PDPROXY + f" --workers {workers}", self.prefiller.url,
                                      self.decoder.url, None)
            with child:
                forked = len(procstat.process_tree([child.pid])) - 1
                if workers == 2 and forked < 2:
                    return {"supported": False, "note": "pdproxy serve --workers 2 did not fork worker processes"}
                self.proxies["_w"] = child
                try:
                    s, _ = self.run("_w", {"kind": "closed", "concurrency": self.p.request_concurrency * 2}, 1,
                                    0.0)
                finally:
                    del self.proxies["_w"]
                out[f"workers_{workers}"] = s
        one, two = out["workers_1"]["requests_per_s"], out["workers_2"]["requests_per_s"]
        out["capacity_ratio"] = round(two / one, 3) if one and two else None
        return out


def figures(scen: dict[str, Any], name: str) -> dict[str, Any]:
    """The headline figures of one proxy from the scenario summaries."""
    fig: dict[str, Any] = {}
    idle = scen.get("idle", {})
    if name in idle:
        fig["added_ttft_ms_idle_p50"] = report.versus(idle[name], idle["client_pd"])["added_ttft_ms_p50"]
    for key, runs in scen.items():
        if key.startswith("poisson_") and name in runs:
            fig["at_" + key.split("_", 1)[1]] = {**report.versus(runs[name], runs["client_pd"]),
                                                 "vs_direct": report.versus(runs[name], runs["direct"])}
    get = lambda s, k: (scen.get(s) or {}).get(name, {}).get(k)  # noqa: E731
    fig["cpu_us_per_event_paced"] = get("cpu_paced", "proxy_us_per_event")
    full = get("cpu_full_speed", "proxy_us_per_event")
    fig["cpu_us_per_event_full_speed"] = full
    fig["events_per_cpu_s_full_speed"] = round(1e6 / full) if full else None
    fig["cpu_us_per_pd_request"] = get("cpu_per_request", "proxy_us_per_request")
    streams = (scen.get("streams") or {}).get(name) or {}
    fig["max_streams_no_stall"] = streams.get("max_streams_no_stall")
    fig["rss_bytes_per_stream"] = streams.get("rss_bytes_per_stream")
    if name == "pdproxy" and isinstance(scen.get("workers"), dict):
        fig["workers_2_capacity_ratio"] = scen["workers"].get("capacity_ratio")
    return fig


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its JSON document; returns the exit code (0)."""
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--profile", choices=sorted(PROFILES), default="full")
    ap.add_argument("--other", action="append", default=[], metavar="NAME=COMMAND",
                    help="another proxy to measure (placeholders {prefill} {decode} {port}); default: vllm-router "
                         "if it is installed")
    ap.add_argument("--no-other", action="store_true", help="measure pdproxy only")
    ap.add_argument("--only", nargs="+", choices=["latency", "cpu", "streams", "workers", "admission"],
                    default=None)
    ap.add_argument("--out", help="also write the JSON document to this file")
    args = ap.parse_args(argv)
    profile = PROFILES[args.profile]
    others = dict(o.split("=", 1) for o in args.other)
    router = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    if not others and not args.no_other and Path(router).exists():
        others["vllm-router"] = ROUTER.replace("vllm-router", router, 1)
    parts = args.only or ["latency", "cpu", "streams"] + (["workers", "admission"] if profile.workers else [])
    t0 = time.monotonic()
    scen: dict[str, Any] = {}
    with Bench(profile, others) as bench:
        if "latency" in parts:
            scen.update(bench.latency())
        if "cpu" in parts:
            scen.update(bench.cpu())
        if "streams" in parts:
            scen["streams"] = bench.streams()
        if "workers" in parts:
            with contextlib.suppress(RuntimeError):
                scen["workers"] = bench.workers()
        names = list(bench.proxies)
        doc: dict[str, Any] = {
            "machine": procstat.describe_machine(), "profile": asdict(profile),
            "pinning": {"proxy_cpus": bench.proxy_cpus, "engines_and_loadgen_cpus": bench.load_cpus},
            "engines": "loadtest.fake_engine (1 prefiller + 1 decoder, raw asyncio/uvloop, zero prefill cost)",
            "targets": {"pdproxy": PDPROXY, **others}, "skipped": bench.skipped,
            "command": "python -m loadtest.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
    if "admission" in parts:  # its own sim engines (with prefill cost) and proxies; after ours are stopped
        from loadtest import admission_bench

        scen["admission"] = admission_bench.run(admission_bench.Profile() if profile.name == "full"
                                                else admission_bench.QUICK)
    figs = {n: figures(scen, n) for n in names}
    adm = scen.get("admission")
    if adm and "pdproxy" in figs:
        figs["pdproxy"]["admission"] = {
            "reject_200k_400_ms": {k: adm["reject_200k"].get(k) for k in ("p50_ms", "p99_ms")},
            "small_ttft_under_120k_prefills": adm["hol"]["ratios"], "hol_met": adm["hol"]["met"]}
    doc["figures"] = figs
    router_fig = next((figs[n] for n in names if n != "pdproxy"), None)
    doc["targets_met"] = report.check_targets(figs.get("pdproxy", {}), router_fig)
    if router_fig and figs.get("pdproxy", {}).get("cpu_us_per_event_paced") and router_fig.get(
            "cpu_us_per_event_paced"):
        doc["pdproxy_vs_other_cpu_per_event_paced"] = round(
            figs["pdproxy"]["cpu_us_per_event_paced"] / router_fig["cpu_us_per_event_paced"], 3)
    doc["others_cpu_frac"] = {k: {t: v.get("others_cpu_frac") for t, v in runs.items() if isinstance(v, dict)}
                              for k, runs in scen.items() if k not in ("streams", "workers")}
    doc["scenarios"] = scen
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    text = orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
