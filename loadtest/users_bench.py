"""``make bench``: pdproxy against vLLM's Rust router, measured the way users run a proxy, printed as ratios.

Run: ``python -m loadtest.users_bench [--quick] [--reps 3] [--out FILE] [--no-workers] [--only SCENARIO ...]
[--profile DIR]`` (≈ 14 min on a quiet 2-core machine, more with outside load; ``--quick`` ≈ 1 min,
shape only).  Prints a table of figures with the pdproxy / vllm-router ratio and whether each target is
met, then writes the whole JSON document to ``--out`` (default ``loadtest/results/users-latest.json``).

Conditions (the same for every target, in one run):

- **nothing pinned**: the proxies, the two engines and the load generator share the machine's CPUs as the
  scheduler likes (what a user's host does);
- **engines**: ``loadtest.fake_engine``, 1 prefiller + 1 decoder, zero prefill cost, paced events on a 5 ms step
  grid (every stream due in the same engine step is written in the same loop turn, like a real engine's step);
- **load generator**: ``loadtest.loadgen`` in its own process; every request is a PD request
  (``stream: true``, ``stream_options.include_usage``); ``client_pd`` is the generator doing the prefill and
  decode legs itself — the floor of any PD proxy, and the baseline of the added-TTFT figure;
- **CPU**: ``utime + stime`` (plus reaped children) of the proxy's whole process tree, from just before the
  first request to the last answer: connection set-up, the ramp and the tail are all paid for.  Divided by the
  SSE events the client received;
- **logging as shipped**: each proxy at its default log level — pdproxy's writes one request line per request
  (INFO, ``pdproxy/ops/reqlog.py``), vllm-router's none — to a file (``loadtest/fleet.py``); before 2026-12-03
  both ran at ``--log-level warning``, which spared pdproxy its request lines (≈ 0.05–0.09 ms per short request);
- **repetitions**: each scenario runs ``--reps`` times per target, interleaved (pdproxy, vllm-router,
  client_pd, then again), and the **median** is reported.

Targets (each started once, all idle but the one measured): ``pdproxy`` (``pdproxy serve``, defaults: prefix
routing ``auto``, which with these engines — no KV events, no tokenizer — is the *approximate* index over text
chunks of the rendered prompt), ``pdproxy_noprefix`` (``--prefix-routing off``), ``pdproxy_continuation``
(``--stream-continuation``; ``paced_1000`` and ``full_100`` only), ``vllm-router`` (``--policy round_robin``:
the reference of every ratio; before this target was explicit the router ran its default ``cache_aware``),
``vllm-router_cache_aware`` (``--policy cache_aware``; the per-request scenarios only), ``bare_relay``
(``loadtest/bare_relay.py``: a PD relay in Python with no feature at all — uvloop + httptools both sides, one
JSON parse, the two legs, the decoder's pieces relayed as they arrive; the per-request scenarios only: the floor
of any Python relay on the same machine, which tells Python's part of a figure from pdproxy's features') and
``client_pd``.

Scenarios:

- ``paced_1000``: 1,000 streams of 150 tokens at 10 tokens/s, started evenly over 3 s (a 333 req/s ramp), each
  once — CPU per event, added TTFT p99 (vs ``client_pd``), errors, stalls (an inter-event gap > 1 s), peak RSS;
- ``full_100``: 100 streams of 2,000 tokens at full speed (the engine writes bursts of 8 events), started
  together — CPU per event;
- ``paced_3000``: 3,000 streams as in ``paced_1000``, started over 9 s — errors, stalls, RSS per stream;
- ``slow_readers_1000``: 1,000 streams of 1,000 tokens at full speed (≈ 250 KiB each), started over 3 s, whose
  clients stop reading for 4 s after the first event (64 KiB receive buffers) — peak RSS growth per stream: a
  proxy without back-pressure buffers the whole stream;
- ``short_100``, ``long_16``, ``agent_16`` — per-request cost, closed loop (each worker sends its next request
  when its last one ends), a fixed number of requests, engines at full speed: ``short_100`` 6,000 requests by
  100 workers, 64-token answers, 400-byte completions prompts; ``long_16`` 1,200 chat requests by 16 workers,
  ~64K-token unique prompts of ordinary words (250,000 characters, a ~250 KB body), 32-token answers;
  ``agent_16`` 1,200 chat requests by 16 workers, each an agent conversation (a 24 KB system prompt and 16 tools
  shared by all, then per turn a tool call and a 6 KB tool result appended, 12 turns, so each turn's body
  repeats the earlier turns' bytes; 40–110 KB bodies), 32-token answers — CPU per request and per event, added
  TTFT p50 / p99 over ``client_pd``, requests per second, errors, and where each proxy's time went (its busiest
  thread's on-CPU share and its threads' run-queue wait: a closed loop saturates the machine, and a proxy's
  added TTFT is where the queue forms — its own loop, or the cores it shares; ``loadtest/RESULTS.md`` §4);
- ``short_open``, ``long_open`` — the same requests as ``short_100`` and ``long_16`` arriving at a fixed rate
  (7,200 over 9 s: 800 per second; 1,800 chat requests of ~250 KB over 6 s: 300 per second), whatever the
  answers' pace: an open loop at a load both proxies serve, so their added TTFT compares at equal offered
  load (reported, not a target);
- ``workers_2`` (pdproxy only): ``paced_1000`` through ``pdproxy serve --workers 2`` — events per CPU-second of
  the whole tree and per worker (on 2 cores this shows cost, not scaling).

The figures' targets: CPU per event ≤ 1.0× the router's at 1,000 paced and at 100 full-speed streams; added
TTFT p99 ≤ 20 ms during the 1,000-stream ramp; 0 errors and 0 stalls at 1,000 and 3,000 streams; RSS per
stream ≤ the router's; CPU per request ≤ 1.0× the router's and added TTFT p50 ≤ the router's + 5 ms at
``short_100``, ``long_16`` and ``agent_16``; CPU per request ≤ 0.5× the router's ``cache_aware`` at ``long_16``;
with ``--stream-continuation`` CPU per event ≤ 1.05× pdproxy's without it.

``--profile DIR``: after the measured runs, one more pdproxy run of each per-request scenario under ``py-spy
record --nonblocking --gil --format raw`` (collapsed stacks, the flame graph's data: ``speedscope`` and
``flamegraph.pl`` read it), written to ``DIR/<scenario>.txt`` with a summary of the top frames (self and
inclusive %) in ``DIR/<scenario>-top.txt``; these runs are not in the figures.  ``--gil`` keeps only the thread
holding the GIL: py-spy's idle filter does not see a worker thread blocked on its queue or uvloop's poll, and
the CPU spent in libuv's poll and syscalls without the GIL is not in the profile.  ``--reps 0 --profile DIR``:
the profiles only.  Other load on the machine is recorded per run as ``others_cpu_frac`` (CPUs' worth of
busy time outside the benchmark); on a shared machine read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from loadtest import fleet, procstat
from loadtest.bench import PDPROXY, ROUTER


@dataclass(frozen=True, slots=True)
class Scenario:
    """One workload: ``streams`` requests of ``tokens`` events every ``itl_s`` seconds (0: full speed), started
    evenly over ``ramp_s`` seconds; ``read_pause_s``: each client stops reading for that long after its first
    event (a slow reader, with a 64 KiB receive buffer).  ``concurrency`` > 0: a closed loop instead — that many
    workers (started over ``ramp_s``) run the ``streams`` requests one after another; ``api``, ``prompt_bytes``
    and ``agent`` shape the bodies (``loadtest/loadgen.py``)."""

    name: str
    streams: int
    tokens: int
    itl_s: float
    ramp_s: float
    read_pause_s: float = 0.0
    concurrency: int = 0
    api: str = "completions"
    prompt_bytes: int = 400
    agent: bool = False


AGENT = {"system_bytes": 24000, "tools": 16, "turn_bytes": 6000, "turns": 12}
"""The agent conversations of ``agent_16`` (``agent`` in loadtest/loadgen.py)."""
PER_REQUEST = ("short_100", "long_16", "agent_16")
"""The closed-loop scenarios whose figure is CPU per request (the issue's done-when rows)."""
OPEN_LOOP = ("short_open", "long_open")
"""The same requests arriving at a fixed rate both proxies serve (equal offered load): reported beside the closed
loops, whose added TTFT says where a saturated machine queues (``loadtest/RESULTS.md`` §4)."""

FULL = (Scenario("paced_1000", 1000, 150, 0.1, 3.0), Scenario("full_100", 100, 2000, 0.0, 0.0),
        Scenario("short_100", 6000, 64, 0.0, 0.0, concurrency=100),
        Scenario("long_16", 1200, 32, 0.0, 0.0, concurrency=16, api="chat", prompt_bytes=250_000),
        Scenario("agent_16", 1200, 32, 0.0, 0.0, concurrency=16, api="chat", agent=True),
        Scenario("short_open", 7200, 64, 0.0, 9.0),
        Scenario("long_open", 1800, 32, 0.0, 6.0, api="chat", prompt_bytes=250_000),
        Scenario("paced_3000", 3000, 150, 0.1, 9.0), Scenario("slow_readers_1000", 1000, 1000, 0.0, 3.0, 4.0))
QUICK = (Scenario("paced_1000", 100, 20, 0.1, 0.3), Scenario("full_100", 10, 200, 0.0, 0.0),
         Scenario("short_100", 200, 64, 0.0, 0.0, concurrency=20),
         Scenario("long_16", 24, 32, 0.0, 0.0, concurrency=4, api="chat", prompt_bytes=250_000),
         Scenario("agent_16", 40, 32, 0.0, 0.0, concurrency=4, api="chat", agent=True),
         Scenario("short_open", 100, 64, 0.0, 0.5),
         Scenario("long_open", 20, 32, 0.0, 0.5, api="chat", prompt_bytes=250_000),
         Scenario("paced_3000", 200, 20, 0.1, 0.6), Scenario("slow_readers_1000", 50, 1000, 0.0, 0.3, 1.0))
STEP_S = 0.005
USERS_PDPROXY = PDPROXY.replace(" --log-level warning", "")   # logging as shipped (module docstring)
USERS_ROUTER = ROUTER.replace(" --log-level warning", "")
ROUTER_RR = USERS_ROUTER + " --policy round_robin"
COMMANDS = {"pdproxy": USERS_PDPROXY, "pdproxy_noprefix": USERS_PDPROXY + " --prefix-routing off",
            "pdproxy_continuation": USERS_PDPROXY + " --stream-continuation", "vllm-router": ROUTER_RR,
            "vllm-router_cache_aware": USERS_ROUTER + " --policy cache_aware",
            "bare_relay": "{python} -m loadtest.bare_relay --port {port} --prefill {prefill} --decode {decode}"}
"""The proxies under test: name → command template (loadtest/fleet.py ``proxy_child``)."""


def targets(sc: Scenario) -> list[str]:
    """The targets of one scenario, in the order each repetition runs them (``client_pd`` is the generator)."""
    if sc.name in PER_REQUEST:
        return ["pdproxy", "pdproxy_noprefix", "vllm-router", "vllm-router_cache_aware", "bare_relay", "client_pd"]
    if sc.name in OPEN_LOOP:
        return ["pdproxy", "vllm-router", "client_pd"]
    if sc.name in ("paced_1000", "full_100"):
        return ["pdproxy", "pdproxy_continuation", "vllm-router"] + (["client_pd"] if sc.name == "paced_1000"
                                                                      else [])
    return ["pdproxy", "vllm-router"]


class Run:
    """Engines and proxies of one benchmark run (all unpinned)."""

    def __init__(self, scenarios: tuple[Scenario, ...], reps: int, workers: bool) -> None:
        self.scenarios = scenarios
        self.reps = reps
        self.workers = workers
        self.prefiller = fleet.fake_engine("users-prefiller", None)
        self.decoder = fleet.fake_engine("users-decoder", None)
        self.proxies: dict[str, fleet.Child] = {}
        wanted = {t for sc in scenarios for t in targets(sc)}
        self.commands: dict[str, str] = {k: v for k, v in COMMANDS.items() if k in wanted}
        router = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        for name, template in list(self.commands.items()):
            if template.startswith("vllm-router"):
                if Path(router).exists():
                    self.commands[name] = template.replace("vllm-router", router, 1)
                else:
                    del self.commands[name]
        self.skipped: dict[str, str] = {}

    def __enter__(self) -> Run:
        self.prefiller.start()
        self.decoder.start()
        for name, template in self.commands.items():
            child = fleet.proxy_child(name, template, self.prefiller.url, self.decoder.url, None)
            try:
                self.proxies[name] = child.start()
            except (RuntimeError, OSError) as exc:
                self.skipped[name] = str(exc)[-500:]
        return self

    def __exit__(self, *exc: object) -> None:
        for child in [*self.proxies.values(), self.prefiller, self.decoder]:
            child.stop()

    def once(self, target: str, sc: Scenario, child: fleet.Child | None = None,
             profile: Path | None = None) -> dict[str, Any]:
        """One run of ``sc`` against ``target`` (a proxy name, or ``client_pd``); returns its window.
        ``profile``: record the proxy with py-spy meanwhile (collapsed stacks to that file)."""
        for url in (self.prefiller.url, self.decoder.url):
            fleet.configure_engine(url, itl_s=sc.itl_s, ttft_s=0.0, prefill_s=0.0, step_s=STEP_S)
        spec: dict[str, Any] = {
            "mode": "client_pd" if target == "client_pd" else "proxy", "prefill": self.prefiller.url,
            "decode": self.decoder.url, "max_tokens": sc.tokens, "stall_gap_s": 1.0 + sc.read_pause_s,
            "read_pause_s": sc.read_pause_s, "rcvbuf": 65536 if sc.read_pause_s else 0,
            "arrival": ({"kind": "closed_n", "concurrency": sc.concurrency, "n": sc.streams, "ramp_s": sc.ramp_s}
                        if sc.concurrency else {"kind": "batch", "n": sc.streams, "ramp_s": sc.ramp_s}),
            "api": sc.api, "prompt_bytes": sc.prompt_bytes,
            "cpu_pids": {"engines": [self.prefiller.pid, self.decoder.pid]}}
        if sc.agent:
            spec["agent"] = AGENT
        proxy = child or self.proxies.get(target)
        if proxy is not None:
            spec["target"] = proxy.url
            spec["cpu_pids"]["proxy"] = [proxy.pid]
        budget = 120 + sc.ramp_s + sc.tokens * sc.itl_s * 3 + (sc.streams * 0.05 if sc.concurrency else 0)
        spy: subprocess.Popen[bytes] | None = None
        if profile is not None and proxy is not None:
            spy = subprocess.Popen([py_spy(), "record", "--nonblocking", "--gil", "--format", "raw", "--rate", "250",
                                    "-o", str(profile), "--pid", str(proxy.pid)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            time.sleep(1.0)  # py-spy attaches
        try:
            window = fleet.run_loadgen(spec, None, budget)["windows"][0]
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                try:
                    _, err = spy.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    spy.kill()
                    _, err = spy.communicate()
                if not profile.exists():  # type: ignore[union-attr]
                    raise RuntimeError(f"py-spy wrote no profile: {err.decode()[-1000:]}")
        time.sleep(1.0)  # let closed connections and timers settle before the next run
        return dict(window)

    def measure(self) -> dict[str, Any]:
        """Every scenario × target × repetition; returns ``{scenario: {target: [windows]}}``."""
        out: dict[str, Any] = {}
        for sc in self.scenarios:
            names = [t for t in targets(sc) if t in self.proxies or t == "client_pd"]
            runs: dict[str, list[dict[str, Any]]] = {t: [] for t in names}
            reps = (self.reps if sc.name in ("paced_1000", "full_100", *PER_REQUEST, *OPEN_LOOP)
                    else max(1, min(self.reps, 2)))
            for _ in range(reps):
                for t in names:
                    runs[t].append(self.once(t, sc))
            out[sc.name] = runs
        if self.workers and self.scenarios and self.scenarios[0].name == "paced_1000":
            sc = self.scenarios[0]
            child = fleet.proxy_child("pdproxy-w2", USERS_PDPROXY + " --workers 2", self.prefiller.url, self.decoder.url,
                                      None)
            with child:
                time.sleep(1.0)
                windows = []
                for _ in range(self.reps):
                    tree = procstat.process_tree([child.pid])
                    before = {pid: procstat.stat_cpu_seconds(pid) for pid in tree}
                    w = self.once("pdproxy-w2", sc, child)
                    w["per_process_cpu_s"] = {str(pid): round(procstat.stat_cpu_seconds(pid) - before[pid], 3)
                                              for pid in tree}
                    windows.append(w)
                out["workers_2"] = {"pdproxy --workers 2": windows}
        return out

    def profile(self, directory: Path) -> dict[str, str]:
        """One pdproxy run of each per-request scenario under py-spy; returns ``{scenario: summary text}``."""
        directory.mkdir(parents=True, exist_ok=True)
        out: dict[str, str] = {}
        for sc in self.scenarios:
            if sc.name not in PER_REQUEST or "pdproxy" not in self.proxies:
                continue
            raw = directory / f"{sc.name}.txt"
            raw.unlink(missing_ok=True)
            w = self.once("pdproxy", sc, profile=raw)
            text = (f"{sc.name}: pdproxy, {w['requests']} requests, {w['cpu_s'].get('proxy')} CPU s of the tree "
                    f"under py-spy (250 Hz, samples of the thread holding the GIL: 250 samples = 1 s)\n"
                    + top_frames(raw.read_text()))
            (directory / f"{sc.name}-top.txt").write_text(text)
            out[sc.name] = text
        return out


def py_spy() -> str:
    """The py-spy executable (the bench extra installs it beside the interpreter)."""
    return shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")


IDLE_LEAVES = ("_worker (futures/thread.py)", "Runner.run (asyncio/runners.py)")
"""Leaves that are waits, not work: a thread-pool worker blocked on its queue; uvloop's loop in C (its poll, and
also its native socket I/O, which py-spy cannot see without ``--native``).  py-spy's idle filter misses both
under ``--nonblocking``."""


def top_frames(collapsed: str, n: int = 25) -> str:
    """A flame graph's story from py-spy's collapsed stacks (``frame;frame;... count`` per line): the top ``n``
    functions by inclusive share (a function counted once per stack) and by self share (the leaf), in % of the
    busy samples (stacks whose leaf is one of :data:`IDLE_LEAVES` are counted apart)."""
    total = idle = 0
    incl: dict[str, int] = {}
    self_: dict[str, int] = {}
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = [_frame(f) for f in stack.split(";")]
        if frames[-1] in IDLE_LEAVES:
            idle += k
            continue
        total += k
        for f in set(frames):
            incl[f] = incl.get(f, 0) + k
        self_[frames[-1]] = self_.get(frames[-1], 0) + k
    if not total:
        return "no samples\n"
    lines = [f"{total} busy samples ({idle} more in waits: {', '.join(IDLE_LEAVES)})", "",
             "inclusive %  function"]
    lines += [f"{100 * v / total:10.1f}  {f}" for f, v in sorted(incl.items(), key=lambda kv: -kv[1])[:n]]
    lines += ["", "self %  function"]
    lines += [f"{100 * v / total:6.1f}  {f}" for f, v in sorted(self_.items(), key=lambda kv: -kv[1])[:n]]
    return "\n".join(lines) + "\n"


def _frame(f: str) -> str:
    """``func (path/to/file.py:123)`` → ``func (file.py)``: a function, not a line."""
    name, _, where = f.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = path.split("/")
    short = "/".join(parts[-2:]) if len(parts) > 1 else path
    return f"{name} ({short})" if where else name


def _pair(ttft: float | None, e2e: float | None) -> str:
    """``TTFT / E2E`` p50 in whole ms (absolute, not added): how much of a request's time comes after its first
    event — in a saturated closed loop, where a proxy's queue sits (``loadtest/RESULTS.md`` §4)."""
    return "—" if ttft is None or e2e is None else f"{ttft:.0f} / {e2e:.0f}"


def _median(windows: list[dict[str, Any]], f: Any) -> float | None:
    values = [v for v in (f(w) for w in windows) if v is not None]
    return round(statistics.median(values), 3) if values else None


def summary(windows: list[dict[str, Any]], streams: int) -> dict[str, Any]:
    """The medians of one scenario × target (``windows`` from :meth:`Run.once`)."""
    def cpu_us(w: dict[str, Any]) -> float | None:
        cpu = w["cpu_s"].get("proxy")
        return cpu / w["events"] * 1e6 if cpu is not None and w["events"] else None

    def rss_per_stream(w: dict[str, Any]) -> float | None:
        if "proxy" not in w["rss_bytes"]:
            return None
        return (w["rss_bytes"]["proxy"] - w["rss_idle_bytes"]["proxy"]) / streams

    def cpu_ms_req(w: dict[str, Any]) -> float | None:
        cpu = w["cpu_s"].get("proxy")
        return cpu / w["requests"] * 1e3 if cpu is not None and w["requests"] else None

    return {
        "runs": len(windows), "cpu_us_per_event": _median(windows, cpu_us),
        "cpu_ms_per_request": _median(windows, cpu_ms_req), "requests": _median(windows, lambda w: w["requests"]),
        "requests_per_s": _median(windows, lambda w: w["requests"] / w["wall_s"] if w["wall_s"] else None),
        "proxy_cpu_s": _median(windows, lambda w: w["cpu_s"].get("proxy")),
        "events": _median(windows, lambda w: w["events"]), "wall_s": _median(windows, lambda w: w["wall_s"]),
        "ttft_ms_p50": _median(windows, lambda w: w["ttft_ms"]["p50"]),
        "ttft_ms_p99": _median(windows, lambda w: w["ttft_ms"]["p99"]),
        "e2e_ms_p50": _median(windows, lambda w: (w.get("e2e_ms") or {}).get("p50")),
        "gap_ms_p99": _median(windows, lambda w: w["gap_ms"]["p99"]),
        "gap_ms_max": max((w["gap_ms"]["max"] or 0.0) for w in windows),
        "errors": sum(w["errors"] for w in windows), "stalls": sum(w["stalls"] for w in windows),
        "error_samples": [s for w in windows for s in w["error_samples"]][:3],
        "peak_rss_mib": _median(windows, lambda w: w["rss_bytes"].get("proxy", 0) / 2**20),
        "rss_kib_per_stream": _median(windows, lambda w: (lambda v: None if v is None else v / 1024)(
            rss_per_stream(w))),
        "concurrency_max": max(w["concurrency"]["max"] for w in windows),
        "others_cpu_frac": _median(windows, lambda w: w["others_cpu_frac"]),
        "busiest_thread_cpu_frac": _median(windows, lambda w: w.get("sched", {}).get("proxy", {}).get(
            "busiest_thread_cpu_frac")),
        "run_queue_wait_frac": _median(windows, lambda w: w.get("sched", {}).get("proxy", {}).get(
            "run_queue_wait_frac")),
    }


def figures(data: dict[str, Any], scenarios: tuple[Scenario, ...]) -> dict[str, Any]:
    """Per-scenario summaries and the headline figures with their pdproxy / router ratios and targets."""
    streams = {sc.name: sc.streams for sc in scenarios}
    summ = {name: {t: summary(ws, streams.get(name, scenarios[0].streams)) for t, ws in runs.items()}
            for name, runs in data.items()}
    p, r = "pdproxy", "vllm-router"

    def get(scen: str, target: str, key: str) -> Any:
        return (summ.get(scen) or {}).get(target, {}).get(key)

    def ratio(a: Any, b: Any) -> float | None:
        return round(a / b, 3) if isinstance(a, int | float) and isinstance(b, int | float) and b else None

    base = get("paced_1000", "client_pd", "ttft_ms_p99")
    added = {t: (round(get("paced_1000", t, "ttft_ms_p99") - base, 2)
                 if get("paced_1000", t, "ttft_ms_p99") is not None and base is not None else None)
             for t in (p, r)}
    rows = []

    def row(label: str, key: str, pv: Any, rv: Any, target: str, ok: bool | None, *, ratio_of: bool = True,
            ref: str = "router RR") -> None:
        """One headline row; ``ratio_of`` False: no ratio (differences such as added TTFT, counts)."""
        rows.append({"figure": label, "key": key, "pdproxy": pv, "vllm-router": rv, "reference": ref,
                     "ratio": ratio(pv, rv) if ratio_of else None, "target": target, "met": ok})

    pc, rc = get("paced_1000", p, "cpu_us_per_event"), get("paced_1000", r, "cpu_us_per_event")
    row("CPU µs per event, 1,000 paced streams", "cpu_paced", pc, rc, "≤ 1.0× router",
        None if ratio(pc, rc) is None else ratio(pc, rc) <= 1.0)  # type: ignore[operator]
    pf, rf = get("full_100", p, "cpu_us_per_event"), get("full_100", r, "cpu_us_per_event")
    row("CPU µs per event, 100 full-speed streams", "cpu_full", pf, rf, "≤ 1.0× router",
        None if ratio(pf, rf) is None else ratio(pf, rf) <= 1.0)  # type: ignore[operator]
    row("added TTFT p99 ms, 1,000-stream ramp (vs client-side PD)", "added_ttft_p99", added[p], added[r],
        "≤ 20 ms", None if added[p] is None else added[p] <= 20.0, ratio_of=False)
    for scen in ("paced_1000", "paced_3000"):
        pe = (get(scen, p, "errors") or 0) + (get(scen, p, "stalls") or 0) if scen in summ else None
        re_ = (get(scen, r, "errors") or 0) + (get(scen, r, "stalls") or 0) if r in summ.get(scen, {}) else None
        row(f"errors + stalls > 1 s, {scen}", f"faults_{scen}", pe, re_, "0", None if pe is None else pe == 0,
            ratio_of=False)
    pr, rr = get("paced_3000", p, "rss_kib_per_stream"), get("paced_3000", r, "rss_kib_per_stream")
    row("RSS KiB per stream, 3,000 paced streams", "rss_per_stream", pr, rr, "≤ router",
        None if pr is None or rr is None else pr <= rr)
    slow = next((sc for sc in scenarios if sc.name == "slow_readers_1000"), None)
    ps, rs = get("slow_readers_1000", p, "rss_kib_per_stream"), get("slow_readers_1000", r, "rss_kib_per_stream")
    if slow is not None:
        stream_kib = slow.tokens * 0.25  # ~250 bytes per event: what an unbounded buffer would hold
        row(f"RSS KiB per slow reader ({slow.streams} × {stream_kib:.0f} KiB streams)", "rss_per_slow_reader", ps,
            rs, f"< {stream_kib:.0f} KiB",
            None if ps is None else ps < stream_kib)
    for scen in ("paced_1000", "full_100"):
        on, off = get(scen, "pdproxy_continuation", "cpu_us_per_event"), get(scen, p, "cpu_us_per_event")
        if on is not None:
            row(f"CPU µs per event, {scen}: --stream-continuation vs off", f"continuation_{scen}", on, off,
                "≤ 1.05× off", None if ratio(on, off) is None else ratio(on, off) <= 1.05,  # type: ignore[operator]
                ref="pdproxy (off)")
    per_request: dict[str, dict[str, Any]] = {}
    for scen in (*PER_REQUEST, *OPEN_LOOP):
        if scen not in summ:
            continue
        s = summ[scen]
        base50, base99 = get(scen, "client_pd", "ttft_ms_p50"), get(scen, "client_pd", "ttft_ms_p99")

        def added(t: str, key: str, b: Any) -> float | None:
            v = get(scen, t, key)  # noqa: B023
            return round(v - b, 2) if v is not None and b is not None else None

        per_request[scen] = {t: {"cpu_ms_per_request": v["cpu_ms_per_request"], "cpu_us_per_event": v["cpu_us_per_event"],
                                 "added_ttft_ms_p50": added(t, "ttft_ms_p50", base50) if t != "client_pd" else None,
                                 "added_ttft_ms_p99": added(t, "ttft_ms_p99", base99) if t != "client_pd" else None,
                                 "ttft_ms_p50": v["ttft_ms_p50"], "ttft_ms_p99": v["ttft_ms_p99"],
                                 "e2e_ms_p50": v.get("e2e_ms_p50"),
                                 "requests_per_s": v["requests_per_s"], "errors": v["errors"],
                                 "others_cpu_frac": v["others_cpu_frac"],
                                 "busiest_thread_cpu_frac": v.get("busiest_thread_cpu_frac"),
                                 "run_queue_wait_frac": v.get("run_queue_wait_frac")} for t, v in s.items()}
        pr = per_request[scen]
        if scen in OPEN_LOOP:   # reported beside the done-when rows, not one of them
            sc_open = next((sc for sc in scenarios if sc.name == scen), None)
            rate = f"{sc_open.streams / sc_open.ramp_s:,.0f}" if sc_open is not None and sc_open.ramp_s else "?"
            for pct in ("p50", "p99"):
                pt, rt = pr.get(p, {}).get(f"added_ttft_ms_{pct}"), pr.get(r, {}).get(f"added_ttft_ms_{pct}")
                row(f"added TTFT {pct} ms, {scen} ({rate}/s)", f"ttft_{pct}_{scen}", pt, rt, "reported", None,
                    ratio_of=False)
            continue
        pq, rq = pr.get(p, {}).get("cpu_ms_per_request"), pr.get(r, {}).get("cpu_ms_per_request")
        row(f"CPU ms per request, {scen}, prefix routing on", f"cpu_req_{scen}", pq, rq, "≤ 1.0× router RR",
            None if ratio(pq, rq) is None else ratio(pq, rq) <= 1.0)  # type: ignore[operator]
        pt, rt = pr.get(p, {}).get("added_ttft_ms_p50"), pr.get(r, {}).get("added_ttft_ms_p50")
        row(f"added TTFT p50 ms, {scen} (vs client-side PD)", f"ttft_p50_{scen}", pt, rt, "≤ router RR + 5 ms",
            None if pt is None or rt is None else pt <= rt + 5.0, ratio_of=False)
        if scen == "long_16":
            cq = pr.get("vllm-router_cache_aware", {}).get("cpu_ms_per_request")
            row(f"CPU ms per request, {scen}: vs router cache_aware", f"cpu_req_{scen}_cache_aware", pq, cq,
                "≤ 0.5× cache_aware", None if ratio(pq, cq) is None else ratio(pq, cq) <= 0.5,  # type: ignore[operator]
                ref="cache_aware")
    doc: dict[str, Any] = {"summaries": summ, "headline": rows, "per_request": per_request}
    w2 = (data.get("workers_2") or {}).get("pdproxy --workers 2")
    if w2:
        evs = [w["events"] / w["cpu_s"]["proxy"] for w in w2 if w["cpu_s"].get("proxy")]
        doc["workers_2"] = {
            "events_per_cpu_s_whole_tree": round(statistics.median(evs)) if evs else None,
            "events_per_cpu_s_1_worker": round(1e6 / pc) if pc else None,
            "per_process_cpu_s": [w["per_process_cpu_s"] for w in w2],
            "note": "2 workers on a 2-core machine shared with the engines and the generator: the per-event cost "
                    "of the whole tree (supervisor included), not a scaling figure"}
    return doc


def render(doc: dict[str, Any]) -> str:
    """The headline table as text."""
    def fmt(v: Any) -> str:
        return "—" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))

    lines = ["", "pdproxy vs vllm-router — users' conditions (nothing pinned; whole-run CPU of each proxy's process "
             "tree, ramp included; median of runs)", ""]
    for scen, per in (doc.get("per_request") or {}).items():
        head = (f"{scen:24} {'CPU ms/req':>10} {'µs/event':>9} {'+TTFT p50':>10} {'+TTFT p99':>10} "
                f"{'TTFT/E2E p50':>13} {'req/s':>8} {'errors':>6} {'others':>6} {'busiest':>7} {'runq':>5}")
        lines += [head, "-" * len(head)]
        for t, v in per.items():
            lines.append(f"{t:24} {fmt(v['cpu_ms_per_request']):>10} {fmt(v['cpu_us_per_event']):>9} "
                         f"{fmt(v['added_ttft_ms_p50']):>10} {fmt(v['added_ttft_ms_p99']):>10} "
                         f"{_pair(v.get('ttft_ms_p50'), v.get('e2e_ms_p50')):>13} {fmt(v['requests_per_s']):>8} {fmt(v['errors']):>6} {fmt(v['others_cpu_frac']):>6} "
                         f"{fmt(v.get('busiest_thread_cpu_frac')):>7} {fmt(v.get('run_queue_wait_frac')):>5}")
        lines.append("")
    head = f"{'figure':58} {'pdproxy':>10} {'ref':>10} {'ratio':>7}  {'target':20} met  (ref)"
    lines += [head, "-" * len(head)]
    for r in doc["headline"]:
        met = {True: "yes", False: "NO", None: "—"}[r["met"]]
        lines.append(f"{r['figure']:58} {fmt(r['pdproxy']):>10} {fmt(r['vllm-router']):>10} {fmt(r['ratio']):>7}  "
                     f"{r['target']:20} {met:4} ({r.get('reference', 'router RR')})")
    w2 = doc.get("workers_2")
    if w2:
        lines += ["", f"--workers 2: {w2['events_per_cpu_s_whole_tree']} events per CPU-second (whole tree) vs "
                      f"{w2['events_per_cpu_s_1_worker']} with 1 worker; {w2['note']}"]
    others = {k: {t: s.get("others_cpu_frac") for t, s in v.items()} for k, v in doc["summaries"].items()}
    lines += ["", f"outside load (CPUs' worth, median per run): {orjson.dumps(others).decode()}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run, print the table, write the JSON; returns 0."""
    ap = argparse.ArgumentParser(prog="python -m loadtest.users_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, one repetition: shape only (≈ 1 min)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-workers", action="store_true", help="skip the --workers 2 runs")
    ap.add_argument("--only", nargs="+", metavar="SCENARIO", help="run only these scenarios (names as above)")
    ap.add_argument("--out", default=str(fleet.ROOT / "loadtest" / "results" / "users-latest.json"))
    ap.add_argument("--profile", metavar="DIR", help="after the runs, profile pdproxy on the per-request "
                                                      "scenarios with py-spy into DIR (e.g. loadtest/out/profiles)")
    args = ap.parse_args(argv)
    scenarios = QUICK if args.quick else FULL
    if args.only:
        scenarios = tuple(sc for sc in scenarios if sc.name in args.only)
    reps = 1 if args.quick else args.reps
    t0 = time.monotonic()
    with Run(scenarios, reps, workers=not args.no_workers) as run:
        data = run.measure() if reps > 0 else {}
        profiles = run.profile(Path(args.profile)) if args.profile else {}
        commands, skipped = run.commands, run.skipped
    doc = {"machine": procstat.describe_machine(), "conditions": __doc__.split("Conditions", 1)[1].split(
        "Scenarios:", 1)[0].strip(), "scenarios": [asdict(s) for s in scenarios], "step_s": STEP_S, "reps": reps,
        "commands": commands, "skipped": skipped, **figures(data, scenarios), "runs": data,
        "profiles": profiles,
        "elapsed_s": round(time.monotonic() - t0, 1),
        "command": "python -m loadtest.users_bench " + " ".join(argv if argv is not None else sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
    print(render(doc))
    for text in profiles.values():
        print(text)
    print(f"JSON: {args.out}  (elapsed {doc['elapsed_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
