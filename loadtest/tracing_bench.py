"""What tracing costs: µs of proxy CPU per PD request with tracing off against the code before tracing existed,
and with tracing on (OTLP/gRPC and OTLP/HTTP), all in one run.

Run: ``python -m loadtest.tracing_bench [--baseline REF] [--rounds 3] [--out FILE]`` (≈ 3 min).  Prints one JSON
document; its ``ratios`` are each target's median µs per request over ``baseline``'s.

Targets (``python -m pdproxy serve`` in front of ``loadtest.fake_engine`` engines, 1 prefiller + 1 decoder):

- ``baseline``: pdproxy at git ``REF`` (default: the parent of the commit that added ``pdproxy/ops/tracing.py``),
  exported with ``git archive`` into a temporary directory and run from there (``PYTHONSAFEPATH`` + ``PYTHONPATH``,
  so the checkout's own package is not imported);
- ``off``: this checkout, no ``otlp_traces_endpoint`` (the default);
- ``on_grpc`` / ``on_http``: this checkout exporting every span to ``loadtest.otlp_receiver`` (a separate
  process on the load CPUs) over OTLP/gRPC and OTLP/HTTP; the spans it received per request the proxy served
  (its ``pdproxy_requests_total``, warm-ups included) are reported: 5 means none was dropped (a shortfall: the
  SDK's batch queue was full, which makes "on" look cheaper);
- ``on_grpc_sampled_10pct``: as ``on_grpc`` with the SDK's ``OTEL_TRACES_SAMPLER=parentbased_traceidratio``,
  ``OTEL_TRACES_SAMPLER_ARG=0.1`` (the engine legs still carry a ``traceparent``, unsampled for 9 in 10).

Workload: closed loop, ``concurrency`` streams of 1-token PD requests (the ``cpu_per_request`` scenario of
``loadtest.bench``), the proxy pinned to the last CPU and everything else to the others (``loadtest.fleet``).
Rounds run every target once, in the opposite order each round (so no target always follows another), with the
same pause after each (``settle_s``: the batch processor's last export of an "on" target, at most 5 s after its
last span, must not fall into the next target's windows); each round is a warm-up and ``windows`` windows; the
figure per target is the median over all its windows.  CPU is the proxy process's own (``/proc``), so it includes
the exporter's background thread.  On a shared machine the process figures move by ± 5 % between windows
(``spread_us``), more than the off path costs; ``hooks_off_us_per_request`` therefore also times the five hooks of
a request with tracing off in this process (no-op context managers, ``timeit``), the part the process figure
cannot resolve.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest import fleet, procstat, report

PDPROXY = "{python} -m pdproxy serve --host 127.0.0.1 --port {port} --prefill {prefill} --decode {decode} " \
          "--log-level warning"
SPANS_PER_REQUEST = 5  # request, admission, queue_wait, prefill, decode


def default_baseline() -> str:
    """The parent of the commit that added ``pdproxy/ops/tracing.py`` (``HEAD`` when it is not committed yet)."""
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--", "pdproxy/ops/tracing.py"],
                         cwd=fleet.ROOT, capture_output=True, text=True, check=True).stdout.split()
    return f"{out[-1]}^" if out else "HEAD"


def export_tree(ref: str, into: Path) -> str:
    """Write ``ref``'s ``pdproxy/`` package into ``into``; returns the commit id.  Raises ``CalledProcessError``."""
    commit = subprocess.run(["git", "rev-parse", ref], cwd=fleet.ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    archive = subprocess.run(["git", "archive", commit, "pdproxy"], cwd=fleet.ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return commit


def served(url: str) -> float:
    """``pdproxy_requests_total`` of the proxy at ``url`` (every api, status and outcome)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pdproxy_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class Receiver(fleet.Child):
    """``loadtest.otlp_receiver`` on two free ports, counting what it receives (``--out``: one line per span)."""

    def __init__(self, cpus: list[int] | None, out: Path) -> None:
        self.http_port, self.grpc_port = fleet.free_port(), fleet.free_port()
        self.out = out
        super().__init__("otlp-receiver", [sys.executable, "-m", "loadtest.otlp_receiver", "--http-port",
                                           str(self.http_port), "--grpc-port", str(self.grpc_port), "--out",
                                           str(out)], cpus=cpus, health_url=None)

    def wait_ready(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "ready" in self.log_tail():
                return
            if self.proc is not None and self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"OTLP receiver not ready: {self.log_tail()}")

    def spans(self) -> int:
        """Spans received so far."""
        try:
            with open(self.out, "rb") as f:
                return sum(1 for _ in f)
        except OSError:
            return 0


def hooks_off_us() -> float:
    """µs per request of the five tracing hooks with tracing off (best of 5 × 200,000, ``timeit``)."""
    import timeit

    from pdproxy.apis.request import Api, parse_request
    from pdproxy.endpoints import Endpoint, Role
    from pdproxy.ops.tracing import NO_TRACING as t
    from pdproxy.timeline import RequestContext

    ctx = RequestContext(request_id="r", client_request_id=None, api_label="chat")
    req = parse_request(b'{"model": "m", "prompt": "x"}', Api.COMPLETIONS)
    p, d = Endpoint("http://p:1", Role.PREFILL), Endpoint("http://d:2", Role.DECODE)

    def hooks() -> None:
        with t.request(req, ctx):
            with t.admission(ctx):
                pass
            with t.queue_wait(ctx):
                pass
            with t.prefill(ctx, p):
                pass
            with t.decode(ctx, d):
                pass

    def bare() -> None:
        pass

    n = 200_000
    return round((min(timeit.repeat(hooks, number=n, repeat=5)) - min(timeit.repeat(bare, number=n, repeat=5)))
                 / n * 1e6, 3)


def run(baseline: str, rounds: int, windows: int, window_s: float, warmup_s: float, concurrency: int,
        settle_s: float = 6.0) -> dict[str, Any]:
    """The whole benchmark; returns its JSON document (see the module docstring)."""
    proxy_cpus, load_cpus = fleet.cpu_split()
    with tempfile.TemporaryDirectory(prefix="pdproxy-baseline-") as tmp:
        commit = export_tree(baseline, Path(tmp))
        prefiller = fleet.fake_engine("prefiller", load_cpus).start()
        decoder = fleet.fake_engine("decoder", load_cpus).start()
        receiver = Receiver(load_cpus, Path(tmp) / "spans.jsonl")
        receiver.start()
        proxies: dict[str, fleet.Child] = {}
        try:
            receiver.wait_ready()
            base_env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": tmp}
            grpc_ = f" --otlp-traces-endpoint http://127.0.0.1:{receiver.grpc_port} --otlp-traces-protocol grpc"
            http = (f" --otlp-traces-endpoint http://127.0.0.1:{receiver.http_port}/v1/traces "
                    "--otlp-traces-protocol http/protobuf")
            sampled = {**os.environ, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                       "OTEL_TRACES_SAMPLER_ARG": "0.1"}
            commands = {"baseline": (PDPROXY, base_env), "off": (PDPROXY, None), "on_grpc": (PDPROXY + grpc_, None),
                        "on_http": (PDPROXY + http, None), "on_grpc_sampled_10pct": (PDPROXY + grpc_, sampled)}
            for name, (template, env) in commands.items():
                child = fleet.proxy_child(name, template, prefiller.url, decoder.url, proxy_cpus)
                child.env = env
                proxies[name] = child.start()
            for url in (prefiller.url, decoder.url):
                fleet.configure_engine(url, itl_s=0.0, ttft_s=0.0, prefill_s=0.0)
            per_target: dict[str, list[dict[str, Any]]] = {name: [] for name in proxies}
            spans_seen: dict[str, int] = {name: 0 for name in proxies}
            requests_served: dict[str, float] = {name: 0 for name in proxies}
            for round_ in range(rounds):
                for name, child in (list(proxies.items()) if round_ % 2 == 0 else list(proxies.items())[::-1]):
                    before, served_before = receiver.spans(), served(child.url)
                    spec = {"mode": "proxy", "target": child.url, "prefill": prefiller.url, "decode": decoder.url,
                            "max_tokens": 1, "arrival": {"kind": "closed", "concurrency": concurrency},
                            "warmup_s": warmup_s, "windows": windows, "window_s": window_s,
                            "cpu_pids": {"proxy": [child.pid], "engines": [prefiller.pid, decoder.pid]}}
                    result = fleet.run_loadgen(spec, load_cpus, 120 + warmup_s + windows * window_s * 2)
                    per_target[name].extend(result["windows"])
                    requests_served[name] += served(child.url) - served_before
                    time.sleep(settle_s)
                    spans_seen[name] += receiver.spans() - before
        finally:
            for child in [*proxies.values(), receiver, prefiller, decoder]:
                child.stop()
    summary = {name: report.summarize(ws) for name, ws in per_target.items()}
    us = {name: s["proxy_us_per_request"] for name, s in summary.items()}
    base = us["baseline"]
    return {
        "machine": procstat.describe_machine(),
        "baseline_commit": commit, "baseline_ref": baseline,
        "conditions": {"rounds": rounds, "windows_per_round": windows, "window_s": window_s, "warmup_s": warmup_s,
                       "concurrency": concurrency, "max_tokens": 1, "settle_s": settle_s, "proxy_cpus": proxy_cpus,
                       "engines_loadgen_receiver_cpus": load_cpus,
                       "engines": "loadtest.fake_engine (zero prefill cost)"},
        "proxy_us_per_request": us,
        "hooks_off_us_per_request": hooks_off_us(),
        "ratios": {name: round(v / base, 4) if v and base else None for name, v in us.items()},
        "added_us_per_request": {name: round(v - base, 1) if v is not None and base is not None else None
                                 for name, v in us.items()},
        "requests_per_s": {name: s["requests_per_s"] for name, s in summary.items()},
        "errors": {name: s["errors"] for name, s in summary.items()},
        "others_cpu_frac": {name: s["others_cpu_frac"] for name, s in summary.items()},
        "us_per_request_windows": {name: [round(w["cpu_s"]["proxy"] / w["requests"] * 1e6, 1)
                                          for w in ws if w["requests"]] for name, ws in per_target.items()},
        "spans_received_per_request": {name: round(spans_seen[name] / requests_served[name], 3)
                                       for name in spans_seen if name.startswith("on_") and requests_served[name]},
        "spread_us": {name: round(statistics.pstdev([w["cpu_s"]["proxy"] / w["requests"] * 1e6
                                                     for w in ws if w["requests"]]), 1)
                      for name, ws in per_target.items()},
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its JSON document; returns the exit code (0)."""
    ap = argparse.ArgumentParser(prog="python -m loadtest.tracing_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=None, help="git ref of the code before tracing (default: the parent of "
                                                     "the commit that added pdproxy/ops/tracing.py)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=3.0)
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--out", help="also write the JSON document to this file")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    doc = run(args.baseline or default_baseline(), args.rounds, args.windows, args.window_s, args.warmup_s,
              args.concurrency)
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    doc["command"] = "python -m loadtest.tracing_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    text = orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode()
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
