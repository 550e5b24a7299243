"""Prefix-cache-aware PD routing, measured: the same traffic through pdproxy (precise, approximate, approximate
with text keys, load only) and vLLM's Rust router (``vllm-router``'s ``cache_aware``), against the cached-token
ratio the same traffic gets on a single prefiller — in one run, on simulated engines.

``python -m loadtest.prefix_bench`` (``make prefix-bench``; ``--quick`` for a smaller run, ``--json FILE`` to keep
the figures).  What it runs:

- **engines**: ``--prefillers`` (3) ``pdproxy sim --role prefill`` with ``--enable-prefix-caching``, block size 16,
  ``--prefill-tokens-per-s`` (20,000: a 2K-token miss costs 100 ms) and vLLM's ``--kv-events-config`` (ZMQ PUB and
  replay sockets); two decoders.  Between configurations every engine's prefix cache is reset (``/sim/reset``).
- **workloads** (deterministic, the same bytes for every configuration):
  *agent* — ``--conversations`` × ``--turns`` chats, all conversations at once, each turn sent when the previous
  answered; a shared tool block (3 tools), a system prompt of its own of ~1,500 words, then per turn a user
  message (~80 words) and, every other turn, an assistant tool call with its ~300-word tool result, so the history
  grows every turn; *shared* — ``--shared-requests`` users with one ~1,500-word system prompt and a question of
  their own, ``--concurrency`` at a time.
- **figures**, per workload and configuration: the cached-token ratio (Δ ``vllm:prefix_cache_hits`` / Δ
  ``vllm:prefix_cache_queries`` over the prefillers) divided by the same traffic's ratio on one prefiller; TTFT
  p50/p99 at the client (streamed, first event); each prefiller's share of the requests
  (Δ ``vllm:request_success_total``); the proxy's CPU per request (``/proc``, process tree); for pdproxy precise
  its predicted cached tokens against the prefillers' (its ``/metrics``).  Separately, in this process: the
  tokenizer + block keys cost per request of the agent workload, and at 128K tokens (sim and a byte-level BPE
  ``tokenizers`` tokenizer with a chat template, cold and with the history's blocks cached).

Output: a Markdown table (README "Prefix-cache-aware routing") and, with ``--json``, everything as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest import fleet, procstat
from loadtest.client import Pool
from pdproxy.prefix.index import block_keys
from pdproxy.tokens import sim_prompt

BLOCK = 16
WORDS = ("the", "agent", "reads", "code", "and", "writes", "tests", "for", "every", "module", "then", "checks",
         "output", "against", "spec", "before", "commit", "review", "patch", "branch", "merge", "build", "deploy")


def words(n: int, seed: int) -> str:
    """``n`` words of English-like text, distinct per ``seed`` (the sim tokenizer counts ≈ one token a word)."""
    out = []
    x = seed * 2654435761 % 2**32
    for i in range(n):
        x = (x * 1103515245 + 12345) % 2**31
        out.append(WORDS[x % len(WORDS)] if i % 4 else sim_prompt(1, unique=True, seed=seed * 7919 + i).strip())
    return " ".join(out)


TOOLS = [{"type": "function", "function": {
    "name": name, "description": words(40, 100 + i),
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "query": {"type": "string"}}}}}
    for i, name in enumerate(("read_file", "grep", "run_tests"))]


def agent_turns(conversations: int, turns: int, max_tokens: int) -> list[list[dict[str, Any]]]:
    """Per conversation, the body of each turn (the history grows by the user message, the assistant's answer —
    a fixed stand-in, the engines' output is not part of the next prompt's cached prefix anyway — and every
    other turn a tool call and its result)."""
    out = []
    for c in range(conversations):
        history: list[dict[str, Any]] = [{"role": "system", "content": words(1500, 1000 + c)}]
        bodies = []
        for t in range(turns):
            history.append({"role": "user", "content": words(80, 10_000 + 100 * c + t)})
            bodies.append({"model": "sim-model", "messages": list(history), "tools": TOOLS, "tool_choice": "none",
                           "max_tokens": max_tokens, "stream": True})
            if t % 2 == 0:
                call = {"id": f"call_{c}_{t}", "type": "function",
                        "function": {"name": "grep", "arguments": json.dumps({"query": words(3, c * 31 + t)})}}
                history += [{"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "tool_call_id": call["id"], "content": words(300, 20_000 + 100 * c + t)}]
            else:
                history.append({"role": "assistant", "content": words(30, 30_000 + 100 * c + t)})
        out.append(bodies)
    return out


def shared_bodies(n: int, max_tokens: int) -> list[dict[str, Any]]:
    """``n`` users' requests sharing one ~1,500-word system prompt."""
    system = words(1500, 7)
    return [{"model": "sim-model", "max_tokens": max_tokens, "stream": True,
             "messages": [{"role": "system", "content": system}, {"role": "user", "content": words(60, 50_000 + i)}]}
            for i in range(n)]


@dataclass
class Sink:
    events: int = 0
    gaps: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)


async def run_agent(url: str, turns: list[list[dict[str, Any]]]) -> list[float]:
    """Every conversation at once, each turn after the previous answered; TTFTs (seconds)."""
    pool = Pool(Sink())
    ttfts: list[float] = []

    async def conversation(bodies: list[dict[str, Any]]) -> None:
        for body in bodies:
            r = await pool.request(url, "/v1/chat/completions", orjson.dumps(body))
            if r.status != 200 or r.first_at is None:
                raise RuntimeError(f"{url}: status {r.status} {r.error} {r.body[:300]!r}")
            ttfts.append(r.first_at - r.start_at)

    try:
        await asyncio.gather(*(conversation(b) for b in turns))
    finally:
        pool.close()
    return ttfts


async def run_shared(url: str, bodies: list[dict[str, Any]], concurrency: int) -> list[float]:
    pool = Pool(Sink())
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def one(body: dict[str, Any]) -> None:
        async with sem:
            r = await pool.request(url, "/v1/chat/completions", orjson.dumps(body))
            if r.status != 200 or r.first_at is None:
                raise RuntimeError(f"{url}: status {r.status} {r.error} {r.body[:300]!r}")
            ttfts.append(r.first_at - r.start_at)

    try:
        await asyncio.gather(*(one(b) for b in bodies))
    finally:
        pool.close()
    return ttfts


_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)$")


def scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of the named series (any labels) in ``url``'s ``/metrics``."""
    out = dict.fromkeys(names, 0.0)
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


ENGINE_SERIES = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


@dataclass
class Config:
    name: str
    argv: Callable[[list[str], list[str], int, int], list[str]]
    prefillers: int  # how many of the fleet's prefillers it is given


REQUEST_LOGS: list[str] = []
"""``--request-logs DIR``: each pdproxy run writes its request log there (one file per run)."""


def pdproxy_argv(*extra: str, events: bool = False, kv: dict[str, str] | None = None
                 ) -> Callable[[list[str], list[str], int, int], list[str]]:
    def argv(prefill: list[str], decode: list[str], port: int, _port2: int) -> list[str]:
        log = (["--request-log-path", f"{REQUEST_LOGS[0]}/pdproxy-{port}.log"] if REQUEST_LOGS
               else ["--no-request-log"])
        a = [sys.executable, "-m", "pdproxy", "serve", "--host", "127.0.0.1", "--port", str(port), "--prefill",
             *prefill, "--decode", *decode, "--log-level", "warning", *log, *extra]
        if events and kv:
            a += ["--kv-events", *(f"{u}={kv[u]}" for u in prefill)]
        return a
    return argv


def router_argv(router: str) -> Callable[[list[str], list[str], int, int], list[str]]:
    def argv(prefill: list[str], decode: list[str], port: int, port2: int) -> list[str]:
        a = [router, "--vllm-pd-disaggregation"]
        for u in prefill:
            a += ["--prefill", u]
        for u in decode:
            a += ["--decode", u]
        return a + ["--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port), "--log-level",
                    "warning", "--prometheus-port", str(port2)]
    return argv


def measure(config: Config, engines: dict[str, Any], workload: str, run: Callable[[str], list[float]],
            requests: int, cpus: Any) -> dict[str, Any]:
    """Run one workload through one configuration (fresh proxy process, engine caches reset)."""
    prefill = engines["prefill"][:config.prefillers]
    for u in engines["prefill"] + engines["decode"]:
        httpx.post(u + "/sim/reset", timeout=10).raise_for_status()
    port, port2 = fleet.free_port(), fleet.free_port()
    child = fleet.Child(f"{config.name}-{workload}".replace(" ", "_").replace(",", ""),
                        config.argv(prefill, engines["decode"], port, port2), cpus=cpus,
                        health_url=f"http://127.0.0.1:{port}/health")
    url = f"http://127.0.0.1:{port}"
    with child:
        if "--kv-events" in child.argv:     # wait for the subscriptions (a SUB misses what precedes it)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                live = [x for x in httpx.get(url + "/metrics", timeout=5).text.splitlines()
                        if x.startswith("pdproxy_kv_events_publisher_live{")]
                if len(live) >= len(prefill) and all(x.endswith(" 1.0") for x in live):
                    break
                time.sleep(0.1)
            # the subscriber replays each engine's buffered history on connect (earlier runs' batches, ending
            # in their /sim/reset's AllBlocksCleared): let that finish before the CPU is measured
            last = -1.0
            while time.monotonic() < deadline:
                applied = scrape(url, ("pdproxy_kv_events_batches_total",))["pdproxy_kv_events_batches_total"]
                if applied == last:
                    break
                last = applied
                time.sleep(0.5)
        time.sleep(1.0)                    # let health probes read the engines' block sizes
        before = {u: scrape(u, ENGINE_SERIES) for u in prefill}
        cpu0 = procstat.tree_cpu_seconds([child.pid])
        t0 = time.monotonic()
        ttfts = run(url)
        wall = time.monotonic() - t0
        cpu = procstat.tree_cpu_seconds([child.pid]) - cpu0
        after = {u: scrape(u, ENGINE_SERIES) for u in prefill}
        proxy_metrics = httpx.get(url + "/metrics", timeout=5).text if config.name.startswith("pdproxy") else ""
    delta = {u: {k: after[u][k] - before[u][k] for k in ENGINE_SERIES} for u in prefill}
    queries = sum(d["vllm:prefix_cache_queries_total"] for d in delta.values())
    hits = sum(d["vllm:prefix_cache_hits_total"] for d in delta.values())
    served = [d["vllm:request_success_total"] for d in delta.values()]
    out: dict[str, Any] = {
        "requests": len(ttfts), "wall_s": round(wall, 2), "prompt_tokens": int(queries), "cached_tokens": int(hits),
        "cached_ratio": hits / queries if queries else 0.0,
        "ttft_p50_ms": round(pct(ttfts, 0.5) * 1e3, 1), "ttft_p99_ms": round(pct(ttfts, 0.99) * 1e3, 1),
        "shares": [round(s / max(sum(served), 1), 3) for s in served], "served": served, "ttfts": ttfts,
        "proxy_cpu_per_request_us": round(cpu / max(len(ttfts), 1) * 1e6, 1)}
    if proxy_metrics:
        pred = sum(float(m.group(1)) for m in re.finditer(
            r"^pdproxy_prefix_predicted_cached_tokens_total\{[^}]*\} (\S+)$", proxy_metrics, re.M))
        act = sum(float(m.group(1)) for m in re.finditer(
            r"^pdproxy_prefix_actual_cached_tokens_total\{[^}]*\} (\S+)$", proxy_metrics, re.M))
        exact = sum(float(m.group(1)) for m in re.finditer(
            r'^pdproxy_prefix_predictions_total\{outcome="exact"[^}]*\} (\S+)$', proxy_metrics, re.M))
        out.update(predicted_cached_tokens=int(pred), reported_cached_tokens=int(act), exact_predictions=int(exact))
        for name in ("gaps", "restarts", "forgotten", "decode_errors"):
            total = sum(float(m.group(1)) for m in re.finditer(
                rf"^pdproxy_kv_events_{name}_total\{{[^}}]*\}} (\S+)$", proxy_metrics, re.M))
            if total:
                out[f"kv_events_{name}"] = int(total)
    assert len(ttfts) == requests, (len(ttfts), requests)
    return out


def combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's repetitions as one figure: token sums (ratio = Σ hits / Σ queries), TTFT percentiles and
    shares over every request, the median CPU per request, prediction counters summed."""
    ttfts = [t for r in runs for t in r["ttfts"]]
    served = [sum(col) for col in zip(*(r["served"] for r in runs), strict=True)]
    queries, hits = sum(r["prompt_tokens"] for r in runs), sum(r["cached_tokens"] for r in runs)
    out: dict[str, Any] = {
        "repeats": len(runs), "requests": len(ttfts), "prompt_tokens": queries, "cached_tokens": hits,
        "cached_ratio": hits / queries if queries else 0.0,
        "cached_ratio_per_run": [round(r["cached_ratio"], 3) for r in runs],
        "ttft_p50_ms": round(pct(ttfts, 0.5) * 1e3, 1), "ttft_p99_ms": round(pct(ttfts, 0.99) * 1e3, 1),
        "shares": [round(x / max(sum(served), 1), 3) for x in served],
        "busiest_share_per_run": [max(r["shares"]) for r in runs],
        "proxy_cpu_per_request_us": round(statistics.median(r["proxy_cpu_per_request_us"] for r in runs), 1),
        "proxy_cpu_per_request_us_per_run": [r["proxy_cpu_per_request_us"] for r in runs]}
    for key in ("predicted_cached_tokens", "reported_cached_tokens", "exact_predictions", "kv_events_gaps",
                "kv_events_restarts", "kv_events_forgotten", "kv_events_decode_errors"):
        if any(key in r for r in runs):
            out[key] = sum(r.get(key, 0) for r in runs)
    return out


def router_cost(order: list[dict[str, Any]], prefillers: int = 3) -> dict[str, float]:
    """Process CPU (µs) per request of pdproxy's whole prefix-routing path in this process, no network: the
    router's ``hints`` (token ids in the tokenizer thread, keys, the index query, the tie-break key) and
    ``prefilling`` (in flight, the approximate record, the prediction), round-robin over ``prefillers``
    endpoints (approximate mode, sim tokenizer), against the same requests with ``prefix_routing: off``."""
    from pdproxy.apis.request import Api, parse_request
    from pdproxy.app.state import ProxyState
    from pdproxy.endpoints import Role
    from pdproxy.settings import load_settings
    from pdproxy.timeline import RequestContext

    async def run(mode: str) -> float:
        settings = load_settings(prefill=[f"http://p{i}:1" for i in range(prefillers)], decode=["http://d:1"],
                                 tokenizer="sim", prefix_routing=mode)
        state = ProxyState.build(settings)
        await state.admission.start()
        try:
            router, ends = state.prefix, state.pool.endpoints(Role.PREFILL)
            t0 = time.process_time()
            for i, body in enumerate(order):
                req = parse_request(orjson.dumps(body), Api.CHAT)
                ctx = RequestContext(request_id=f"r{i}", client_request_id=None, api_label="chat")
                req.prompt_tokens = 1
                await router.hints(req, ctx)
                with router.prefilling(req, ctx, ends[i % len(ends)]):
                    pass
            return (time.process_time() - t0) / len(order) * 1e6
        finally:
            await state.admission.aclose()

    off, on = asyncio.run(run("off")), asyncio.run(run("approximate"))
    return {"off": round(off, 1), "approximate": round(on, 1), "added": round(on - off, 1)}


def tokenizer_cost(turns: list[list[dict[str, Any]]], hf_dir: Path) -> dict[str, Any]:
    """Token ids + block keys (block 16) per request, in this process: the agent workload in order (the ids
    cache as the proxy has it), and a 128K-token chat cold and as the next turn of a cached history."""
    from pdproxy.admission.count import LocalCounter

    out: dict[str, Any] = {}
    order = [b for rnd in zip(*turns, strict=True) for b in rnd]
    counter = LocalCounter("sim")
    t0 = time.process_time()
    for body in order:
        block_keys(counter.token_ids(body, True), BLOCK)
    out["agent_workload_sim_us_per_request"] = round((time.process_time() - t0) / len(order) * 1e6, 1)
    out["agent_workload_router_us_per_request"] = router_cost(order)

    def long_chat(src: str, target: int) -> tuple[dict[str, Any], dict[str, Any], int]:
        from pdproxy.tokens import load_tokenizer, prompt_token_ids

        tok = load_tokenizer(None if src == "sim" else src)
        msgs: list[dict[str, Any]] = [{"role": "system", "content": words(1500, 1)}]
        n, i = 0, 0
        while n < target:
            msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": words(2000, 900 + i)})
            i += 1
            if i % 8 == 0:
                n = len(prompt_token_ids(tok, {"messages": msgs}, "chat"))
        nxt = msgs + [{"role": "user", "content": words(400, 5)}]
        return {"messages": msgs}, {"messages": nxt}, len(prompt_token_ids(tok, {"messages": nxt}, "chat"))

    for label, src in (("sim", "sim"), ("bpe", str(hf_dir))):
        body, nxt, n = long_chat(src, 128_000)
        c = LocalCounter(src)
        t = time.perf_counter()
        ids = c.token_ids(nxt, True)
        cold = time.perf_counter() - t
        c2 = LocalCounter(src)
        c2.token_ids(body, True)                     # the previous turn: its messages' ids are cached
        t = time.perf_counter()
        ids = c2.token_ids(nxt, True)
        warm = time.perf_counter() - t
        t = time.perf_counter()
        block_keys(ids, 16)
        k16 = time.perf_counter() - t
        t = time.perf_counter()
        block_keys(ids, 128)
        k128 = time.perf_counter() - t
        t = time.perf_counter()
        c2.count(nxt, True)
        count = time.perf_counter() - t
        out[f"128k_{label}"] = {"tokens": n, "ids_cold_ms": round(cold * 1e3, 1), "ids_next_turn_ms":
                                round(warm * 1e3, 1), "keys_block16_ms": round(k16 * 1e3, 2),
                                "keys_block128_ms": round(k128 * 1e3, 2), "count_only_ms": round(count * 1e3, 1)}
    return out


def engine_tokenize_ms(url: str, body: dict[str, Any], n: int = 5) -> float:
    """p50 of ``POST /tokenize`` round trips to a simulated engine (its tokenizer included)."""
    times = []
    with httpx.Client(timeout=60) as client:
        for _ in range(n):
            t = time.perf_counter()
            client.post(url + "/tokenize", json={"model": "sim-model", **body}).raise_for_status()
            times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e3, 1)


def table(results: dict[str, dict[str, dict[str, Any]]], prefillers: int) -> str:
    lines = ["| workload | router | cached ratio vs 1 prefiller | TTFT p50 / p99 (ms) | prefillers' shares | "
             "proxy CPU / request |", "|---|---|---|---|---|---|"]
    for workload, rows in results.items():
        base = rows["single prefiller"]["cached_ratio"]
        for name, r in rows.items():
            rel = r["cached_ratio"] / base if base else float("nan")
            shares = " / ".join(f"{s:.2f}" for s in r["shares"])
            lines.append(f"| {workload} | {name} | {rel:.3f} ({r['cached_ratio']:.3f}) | {r['ttft_p50_ms']:.0f} / "
                         f"{r['ttft_p99_ms']:.0f} | {shares} | {r['proxy_cpu_per_request_us']:.0f} µs |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m loadtest.prefix_bench")
    ap.add_argument("--prefillers", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--shared-requests", type=int, default=96)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--prefill-tokens-per-s", type=int, default=20_000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="rounds over every configuration, interleaved (the "
                                                           "figures pool them; a busy machine hits all alike)")
    ap.add_argument("--quick", action="store_true", help="8 conversations × 4 turns, 36 shared requests, 1 round")
    ap.add_argument("--only", nargs="+", help="configurations to run (names as in the table; default all)")
    ap.add_argument("--json", help="write every figure to this file")
    ap.add_argument("--request-logs", help="a directory for pdproxy's request logs (one file per run)")
    ap.add_argument("--skip-workload", nargs="+", default=[], help="workloads not to run (agent, shared)")
    ap.add_argument("--unpinned", action="store_true", help="pin nothing (as users run a proxy): proxy, engines "
                    "and load generator share every CPU; the default pins the proxy to the last CPU")
    args = ap.parse_args(argv)
    if args.request_logs:
        Path(args.request_logs).mkdir(parents=True, exist_ok=True)
        REQUEST_LOGS.append(args.request_logs)
    if args.quick:
        args.conversations, args.turns, args.shared_requests, args.concurrency, args.repeat = 8, 4, 36, 8, 1
    cpus_proxy, cpus_load = (None, None) if args.unpinned else fleet.cpu_split()
    pub_ports = {}
    engine_args = ["--served-model-name", "sim-model", "--max-model-len", "32768", "--block-size", str(BLOCK),
                   "--enable-prefix-caching", "--decode-tokens-per-s", "0"]
    children = []
    for i in range(args.prefillers):
        port, pub, replay = fleet.free_port(), fleet.free_port(), fleet.free_port()
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
               "replay_endpoint": f"tcp://*:{replay}"}
        children.append(fleet.Child(f"prefill{i}", [sys.executable, "-m", "pdproxy", "sim", "--role", "prefill",
                                                   "--port", str(port), *engine_args, "--prefill-tokens-per-s",
                                                   str(args.prefill_tokens_per_s), "--kv-events-config",
                                                   json.dumps(cfg)],
                                    cpus=cpus_load, health_url=f"http://127.0.0.1:{port}/health"))
        pub_ports[f"http://127.0.0.1:{port}"] = f"tcp://127.0.0.1:{pub}"
    for i in range(2):
        port = fleet.free_port()
        children.append(fleet.Child(f"decode{i}", [sys.executable, "-m", "pdproxy", "sim", "--role", "decode",
                                                  "--port", str(port), *engine_args], cpus=cpus_load,
                                    health_url=f"http://127.0.0.1:{port}/health"))
    engines = {"prefill": [c.argv[c.argv.index("--port") + 1] for c in children[:args.prefillers]],
               "decode": [c.argv[c.argv.index("--port") + 1] for c in children[args.prefillers:]]}
    engines = {k: [f"http://127.0.0.1:{p}" for p in v] for k, v in engines.items()}
    router = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    n = args.prefillers
    configs = [
        Config("single prefiller", pdproxy_argv("--prefix-routing", "off"), 1),
        Config("pdproxy precise", pdproxy_argv("--tokenizer", "sim", events=True, kv=pub_ports), n),
        Config("pdproxy approximate", pdproxy_argv("--tokenizer", "sim"), n),
        Config("pdproxy approximate, text keys", pdproxy_argv("--prefix-keys", "text"), n),
        Config("pdproxy load-only", pdproxy_argv("--prefix-routing", "off"), n),
        Config("vllm-router cache_aware", router_argv(router), n),
        Config("pdproxy load-only, following KV events", pdproxy_argv("--prefix-routing", "off", events=True,
                                                                      kv=pub_ports), n),
    ]
    # the last configuration only on request (--only): what following the events costs without routing on them
    configs = [c for c in configs if c.name in args.only or c.name == "single prefiller"] if args.only \
        else configs[:-1]
    turns = agent_turns(args.conversations, args.turns, args.max_tokens)
    shared = shared_bodies(args.shared_requests, args.max_tokens)
    workloads: dict[str, tuple[Callable[[str], list[float]], int]] = {
        "agent": (lambda url: asyncio.run(run_agent(url, turns)), args.conversations * args.turns),
        "shared system prompt": (lambda url: asyncio.run(run_shared(url, shared, args.concurrency)),
                                 args.shared_requests),
    }
    started = time.time()
    machine = procstat.describe_machine()
    load_before = procstat.load_average()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        for c in children:
            c.start()
        for workload, (run, count) in workloads.items():
            if workload.split()[0] in args.skip_workload:
                continue
            runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in configs}
            for rep in range(args.repeat):
                for config in configs:
                    r = measure(config, engines, workload, run, count, cpus_proxy)
                    runs[config.name].append(r)
                    print(f"{workload:>22} #{rep} | {config.name:<32} ratio {r['cached_ratio']:.3f} ttft p50 "
                          f"{r['ttft_p50_ms']} ms p99 {r['ttft_p99_ms']} ms shares {r['shares']} cpu/request "
                          f"{r['proxy_cpu_per_request_us']} µs", flush=True)
            results[workload] = {name: combine(rs) for name, rs in runs.items()}
        from pdproxy.tools.tinymodel import write_tokenizer

        with tempfile.TemporaryDirectory() as tmp:
            cost = tokenizer_cost(turns, write_tokenizer(Path(tmp)))
        big = {"messages": [{"role": "user", "content": words(128_000, 3)}]}
        cost["engine_tokenize_128k_round_trip_ms (pdproxy sim engine)"] = engine_tokenize_ms(engines["prefill"][0],
                                                                                              big)
    finally:
        for c in children:
            c.stop()
    summary = summarize(results, cost, args, n)
    doc = {"when": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)), "machine": machine,
           "load_average_before": load_before, "load_average_after": procstat.load_average(),
           "args": vars(args), "results": results, "tokenizer_cost": cost, "summary": summary}
    print()
    print(table(results, n))
    print()
    print(json.dumps({"tokenizer_cost": cost, "summary": summary}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0


def summarize(results: dict[str, dict[str, dict[str, Any]]], cost: dict[str, Any], args: argparse.Namespace,
              n: int) -> dict[str, Any]:
    """The targets: precise ≥ 0.95 and approximate ≥ 0.9 of the single prefiller's cached ratio; shared prompt's
    busiest prefiller ≤ 1/N + 0.15; TTFT p50 below load-only's by about the prefill time saved; CPU per request
    grown by no more than the tokenizer's cost."""
    out: dict[str, Any] = {}
    for workload, rows in results.items():
        base = rows.get("single prefiller", {}).get("cached_ratio") or float("nan")
        w: dict[str, Any] = {name: round(r["cached_ratio"] / base, 3) for name, r in rows.items()}
        load = rows.get("pdproxy load-only")
        for name in ("pdproxy precise", "pdproxy approximate", "pdproxy approximate, text keys"):
            r = rows.get(name)
            if r is None or load is None:
                continue
            saved_ms = (r["cached_tokens"] - load["cached_tokens"]) / r["requests"] / args.prefill_tokens_per_s * 1e3
            w[f"{name}: prefill time saved per request (ms)"] = round(saved_ms, 1)
            w[f"{name}: TTFT p50 below load-only (ms)"] = round(load["ttft_p50_ms"] - r["ttft_p50_ms"], 1)
            w[f"{name}: CPU per request above load-only (µs)"] = round(
                r["proxy_cpu_per_request_us"] - load["proxy_cpu_per_request_us"], 1)
        w["busiest prefiller share"] = {name: max(r["shares"]) for name, r in rows.items() if len(r["shares"]) == n}
        w["busiest prefiller share, worst run"] = {name: max(r["busiest_share_per_run"]) for name, r in rows.items()
                                                   if len(r["shares"]) == n}
        w["share limit 1/N + 0.15"] = round(1 / n + 0.15, 3)
        out[workload] = w
    out["tokenizer + keys per agent request (µs, sim tokenizer)"] = cost["agent_workload_sim_us_per_request"]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
