"""Admission benchmark: small requests under long prefills, and how fast over-length prompts are refused.

Run: ``python -m loadtest.admission_bench [--quick] [--out FILE]``.  Prints one JSON document with figures and
ratios from this run.  Engines are ``pdproxy sim`` processes with this benchmark's engine model: 10,000 prefill
tokens/s in 8,192-token chunks (one chunk step = 0.82 s), ``max_model_len`` 133,120.

Scenarios:

- ``hol``: three 120K-token streaming prompts are started, then 2-token streaming requests arrive open-loop
  (``rate`` per second for ``window_s``) while the three are in flight.  TTFT of the small requests (p50/p99),
  against their idle TTFT on the same target.  Targets: ``pdproxy`` (defaults: prefill queue + conditional
  disaggregation), ``pdproxy_unprotected`` (``--prefill-budget-tokens 0 --decode-only-busy-max-prompt-tokens 0
  --no-prefill-tied-to-decoders``) and ``direct`` (the client talks to one engine, ``--role both``).  A small
  request still unanswered after ``deadline_s`` counts as ``deadline_s`` (censored; ``timeouts`` says how many).
  Goal: ``pdproxy`` busy p99 ≤ 2 × idle p50 + one chunk step.
- ``reject_200k``: a 200K-token prompt (1.8 MB body) sent ``n`` times to pdproxy; latency of the 400.  Goal: p99
  under 50 ms.  ``reject_200k_no_spaces``: the same size without whitespace (``"x."`` × 100,000), which the word
  bound cannot decide: counted by the engine's ``/tokenize`` (default) and by a local tokenizer (``--tokenizer
  sim``).
- ``seed_000``: engines declaring 133,120 tokens over a KV pool of 1,146 × 4 = 4,584 tokens; a 10K-token agent
  prompt (system + tools) gets a 400 naming the KV pool, then a 2-token request; both latencies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from loadtest.fleet import Child, free_port
from pdproxy.tokens import sim_prompt

ENGINE = ("--max-model-len", "133120", "--prefill-tokens-per-s", "10000", "--max-num-batched-tokens", "8192",
          "--step-overhead-s", "0.002")
SEED = ("--max-model-len", "133120", "--block-size", "4", "--num-gpu-blocks-override", "1146")
CHUNK_STEP_S = 8192 / 10000
UNPROTECTED = ("--prefill-budget-tokens", "0", "--decode-only-busy-max-prompt-tokens", "0",
               "--no-prefill-tied-to-decoders")
SMALL = {"model": "sim-model", "prompt": " hello there", "max_tokens": 2, "stream": True}


@dataclass(frozen=True, slots=True)
class Profile:
    """Sizes of one run: big prompts (tokens), small-request arrivals (per second, seconds), deadlines (seconds)."""

    big_tokens: int = 120_000
    big_count: int = 3
    rate: float = 5.0
    window_s: float = 8.0
    deadline_s: float = 15.0
    idle_n: int = 20
    reject_n: int = 40


QUICK = Profile(big_tokens=60_000, rate=4.0, window_s=4.0, deadline_s=8.0, idle_n=10, reject_n=15)


def sim(role: str, *args: str) -> Child:
    port = free_port()
    child = Child(f"sim-{role}-{port}", [sys.executable, "-m", "pdproxy", "sim", "--role", role, "--port", str(port),
                                         *args], cpus=None, health_url=f"http://127.0.0.1:{port}/health")
    child.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return child


def proxy(prefill: str, decode: str, *args: str) -> Child:
    port = free_port()
    child = Child(f"pdproxy-{port}", [sys.executable, "-m", "pdproxy", "serve", "--host", "127.0.0.1", "--port",
                                      str(port), "--prefill", prefill, "--decode", decode, "--log-level", "warning",
                                      "--no-request-log", *args],
                  cpus=None, health_url=f"http://127.0.0.1:{port}/health")
    child.url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    return child


@contextlib.contextmanager
def running(*children: Child) -> Iterator[None]:
    """Start ``children`` (in order) and stop them all on exit."""
    started: list[Child] = []
    try:
        for c in children:
            started.append(c.start(timeout_s=60))
        yield
    finally:
        for c in reversed(started):
            c.stop()


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0–1) by nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def r3(v: float | None) -> float | None:
    return None if v is None else round(v, 4)


async def ttft(client: httpx.AsyncClient, url: str, body: dict[str, Any], deadline_s: float) -> float | None:
    """Seconds to the first content event of a streaming completion; None when ``deadline_s`` passed first."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(deadline_s), client.stream("POST", url + "/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {") and '"text"' in line:
                    return time.perf_counter() - start
                if line.startswith("data: {\"error"):
                    raise RuntimeError(line)
    except TimeoutError:
        return None
    raise RuntimeError(f"stream from {url} ended without a token")


async def hol(url: str, p: Profile) -> dict[str, Any]:
    """Idle TTFT, then TTFT under ``big_count`` long prefills (see module docstring)."""
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        idle = [t for t in [await ttft(client, url, SMALL, p.deadline_s) for _ in range(p.idle_n)] if t is not None]
        bigs = [asyncio.ensure_future(ttft(client, url, {"model": "sim-model", "stream": True, "max_tokens": 4,
                                                         "prompt": sim_prompt(p.big_tokens, unique=True, seed=s)},
                                           3600))
                for s in range(1, p.big_count + 1)]
        await asyncio.sleep(1.0)                                   # let the big prompts reach the engines
        smalls: list[asyncio.Future[float | None]] = []
        begin = time.perf_counter()
        for i in range(int(p.rate * p.window_s)):
            await asyncio.sleep(max(0.0, begin + i / p.rate - time.perf_counter()))
            smalls.append(asyncio.ensure_future(ttft(client, url, SMALL, p.deadline_s)))
        results = await asyncio.gather(*smalls)
        still_running = sum(1 for b in bigs if not b.done())
        for b in bigs:
            b.cancel()
        await asyncio.gather(*bigs, return_exceptions=True)
    busy = [p.deadline_s if t is None else t for t in results]
    return {"idle_ttft_p50_s": r3(pct(idle, 0.5)), "idle_ttft_p99_s": r3(pct(idle, 0.99)),
            "busy_ttft_p50_s": r3(pct(busy, 0.5)), "busy_ttft_p99_s": r3(pct(busy, 0.99)),
            "busy_n": len(busy), "timeouts": sum(1 for t in results if t is None),
            "big_prompts_in_flight_at_end": still_running}


def wait_engines_idle(*urls: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = [httpx.get(u + "/sim/state", timeout=5).json() for u in urls]
        if all(s["running"] == 0 and s["waiting"] == 0 for s in states):
            return
        time.sleep(0.1)
    raise RuntimeError(f"engines not idle after {timeout_s} s")


def routed(prefill: str, decode: str) -> dict[str, int]:
    """How many small requests each engine saw (from the simulators' recordings)."""
    def smalls(url: str) -> int:
        recs = httpx.get(url + "/sim/received", timeout=10).json()["requests"]
        return sum(1 for r in recs if (r.get("body") or {}).get("prompt") == SMALL["prompt"])
    return {"small_on_prefiller": smalls(prefill), "small_on_decoder": smalls(decode)}


def latencies(url: str, raw: bytes | list[bytes], n: int) -> tuple[list[float], int]:
    """Latency (seconds) of ``n`` sequential POSTs of ``raw`` (or of each body in turn); and the last status."""
    out: list[float] = []
    status = 0
    bodies = raw if isinstance(raw, list) else [raw]
    with httpx.Client(timeout=30) as client:
        for i in range(n):
            raw = bodies[i % len(bodies)]
            start = time.perf_counter()
            r = client.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
            out.append(time.perf_counter() - start)
            status = r.status_code
    return out, status


def ms(values: list[float]) -> dict[str, float | None]:
    return {"p50_ms": r3(1000 * pct(values, 0.5)) if values else None,  # type: ignore[operator]
            "p99_ms": r3(1000 * pct(values, 0.99)) if values else None,  # type: ignore[operator]
            "max_ms": r3(1000 * max(values)) if values else None}


def run(p: Profile) -> dict[str, Any]:
    out: dict[str, Any] = {"profile": dataclasses.asdict(p), "chunk_step_s": CHUNK_STEP_S}
    pre, dec, both = sim("prefill", *ENGINE), sim("decode", *ENGINE), sim("both", *ENGINE)
    targets: dict[str, Any] = {}
    with running(pre, dec, both):
        for name, extra in (("pdproxy", ()), ("pdproxy_unprotected", UNPROTECTED)):
            px = proxy(pre.url, dec.url, *extra)  # type: ignore[attr-defined]
            with running(px):
                for s in (pre, dec):
                    httpx.post(s.url + "/sim/reset", timeout=10)  # type: ignore[attr-defined]
                targets[name] = asyncio.run(hol(px.url, p))  # type: ignore[attr-defined]
                targets[name].update(routed(pre.url, dec.url))  # type: ignore[attr-defined]
            wait_engines_idle(pre.url, dec.url)  # type: ignore[attr-defined]
        targets["direct"] = asyncio.run(hol(both.url, p))  # type: ignore[attr-defined]
        wait_engines_idle(both.url)  # type: ignore[attr-defined]

        px = proxy(pre.url, dec.url)  # type: ignore[attr-defined]
        with running(px):
            raw = orjson.dumps({"model": "sim-model", "prompt": sim_prompt(200_000, unique=True), "max_tokens": 16})
            lat, status = latencies(px.url, raw, p.reject_n)  # type: ignore[attr-defined]
            out["reject_200k"] = {"n": p.reject_n, "status": status, "body_bytes": len(raw), **ms(lat),
                                  "target_p99_ms": 50.0, "met": bool(status == 400 and pct(lat, 0.99) < 0.05)}  # type: ignore[operator]
            # no whitespace: the word bound cannot decide, so the prompt is counted (engine /tokenize here)
            n_dense = max(5, p.reject_n // 4)
            dense = [orjson.dumps({"model": "sim-model", "prompt": f"{i}" + "x." * 100_000, "max_tokens": 16})
                     for i in range(n_dense)]                      # all different: no count cache hits
            lat, status = latencies(px.url, dense, n_dense)  # type: ignore[attr-defined]
            out["reject_200k_no_spaces"] = {"engine_tokenize": {"status": status, **ms(lat)}}
        px = proxy(pre.url, dec.url, "--tokenizer", "sim")  # type: ignore[attr-defined]
        with running(px):
            lat, status = latencies(px.url, dense, n_dense)  # type: ignore[attr-defined]
            out["reject_200k_no_spaces"]["local_tokenizer"] = {"status": status, **ms(lat)}

    sp, sd = sim("prefill", *SEED), sim("decode", *SEED)
    with running(sp, sd):
        px = proxy(sp.url, sd.url)  # type: ignore[attr-defined]
        with running(px):
            tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": sim_prompt(100, True, i),
                                                       "parameters": {"type": "object"}}} for i in range(10)]
            agent = orjson.dumps({"model": "sim-model", "stream": True, "tools": tools, "messages": [
                {"role": "system", "content": sim_prompt(9000, unique=True, seed=5)},
                {"role": "user", "content": " read the repository and fix the failing test"}]})
            small = orjson.dumps({"model": "sim-model", "prompt": " hello there", "max_tokens": 2})
            rejects: list[float] = []
            smalls: list[float] = []
            statuses: set[int] = set()
            message = ""
            with httpx.Client(timeout=30) as client:
                for _ in range(max(5, p.reject_n // 2)):
                    start = time.perf_counter()
                    r = client.post(px.url + "/v1/chat/completions", content=agent,  # type: ignore[attr-defined]
                                    headers={"content-type": "application/json"})
                    rejects.append(time.perf_counter() - start)
                    statuses.add(r.status_code)
                    message = r.json()["error"]["message"]
                    start = time.perf_counter()
                    r = client.post(px.url + "/v1/completions", content=small,  # type: ignore[attr-defined]
                                    headers={"content-type": "application/json"})
                    smalls.append(time.perf_counter() - start)
                    statuses.add(r.status_code)
            out["seed_000"] = {"statuses": sorted(statuses), "reject": ms(rejects), "small_after": ms(smalls),
                               "names_kv_pool": "KV cache pool" in message and "4584" in message,
                               "message": message}

    on, off, direct = targets["pdproxy"], targets["pdproxy_unprotected"], targets["direct"]
    bound = 2 * on["idle_ttft_p50_s"] + CHUNK_STEP_S
    out["hol"] = {"targets": targets, "bound_s": r3(bound),
                  "ratios": {"pdproxy_busy_p99_over_bound": r3(on["busy_ttft_p99_s"] / bound),
                             "pdproxy_busy_p99_over_idle_p50": r3(on["busy_ttft_p99_s"] / on["idle_ttft_p50_s"]),
                             "unprotected_over_pdproxy_busy_p99": r3(off["busy_ttft_p99_s"] / on["busy_ttft_p99_s"]),
                             "direct_over_pdproxy_busy_p99": r3(direct["busy_ttft_p99_s"] / on["busy_ttft_p99_s"])},
                  "met": on["busy_ttft_p99_s"] <= bound and on["timeouts"] == 0}
    out["note"] = "busy TTFT of unanswered requests is censored at deadline_s; ratios against them are lower bounds"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller prompts and windows (about a minute)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args(argv)
    result = run(QUICK if args.quick else Profile())
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
