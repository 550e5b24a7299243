"""How fast one simulator process streams: the target is ≥ 20,000 streamed tokens/s on one core.

Run: ``python -m loadtest.sim_throughput [--quick] [--streams 256] [--seconds 5]`` — prints one JSON document.

Setup: ``python -m pdproxy.sim`` in its own process pinned to CPU 0. This load generator is pinned to CPU 1.
It is a closed loop of ``--streams`` concurrent ``/v1/completions`` streams, each ``--tokens`` tokens, built
on ``loadtest.client.Pool`` (httptools, a few µs per event). Figures per scenario, over a measuring window
after a warm-up:

- ``events_per_s``: SSE token events received per second. Each event carries ≥ 1 token (the sim merges
  tokens into one event only when a client lags), so this is a lower bound on streamed tokens/s;
- ``sim_cpu_util``: the sim's CPU-seconds per wall second (1.0 = one core saturated);
- ``events_per_sim_cpu_s``: events per CPU-second of the sim, the capacity of one core;
- ``meets_20k``: whether ``events_per_sim_cpu_s >= 20000`` and, for paced runs, the target rate was met.

Scenarios: ``full_speed`` (zero-cost engine: as fast as the loop goes) and ``paced`` (each sequence decodes
at ``--paced-rate`` tokens/s, so ``streams × rate`` is the demanded rate, 25,600 tokens/s by default).

``--http-layers`` adds the measurement behind the choice of HTTP layer: two minimal streamers that do the same
work per event (one ``orjson.dumps`` of a completion chunk, one write, one loop yield), one on
``aiohttp.web`` and one on raw ASGI under uvicorn (httptools + uvloop), each measured in events per server
CPU-second with the same client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.client import Pool
from loadtest.procstat import cpu_seconds

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Sink:
    """Live counters filled by ``loadtest.client`` (events, inter-event gaps, TTFTs in seconds)."""

    events: int = 0
    gaps: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)


@contextlib.contextmanager
def sim_process(*flags: str, cpu: int | None) -> Iterator[tuple[int, str]]:
    """Start ``python -m pdproxy.sim --port 0 FLAGS`` (pinned to ``cpu``); yield ``(pid, base_url)``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pdproxy.sim", "--port", "0", *flags], stdout=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        if cpu is not None:
            os.sched_setaffinity(proc.pid, {cpu})
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        yield proc.pid, ready["base_urls"][0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def closed_loop(url: str, streams: int, tokens: int, warmup_s: float, seconds: float,
                      pid: int) -> dict[str, Any]:
    """Run ``streams`` concurrent request loops; measure a window of ``seconds`` after ``warmup_s``."""
    sink = Sink()
    pool = Pool(sink)
    body = json.dumps({"prompt": " hello world", "max_tokens": tokens, "stream": True}).encode()
    stop = False
    completed = [0]
    errors = [0]

    async def worker() -> None:
        while not stop:
            resp = await pool.request(url, "/v1/completions", body)
            if resp.error or not resp.done:
                errors[0] += 1
            else:
                completed[0] += 1

    tasks = [asyncio.create_task(worker()) for _ in range(streams)]
    try:
        await asyncio.sleep(warmup_s)
        events0, done0, cpu0, t0 = sink.events, completed[0], cpu_seconds(pid), time.perf_counter()
        await asyncio.sleep(seconds)
        events1, done1, cpu1, t1 = sink.events, completed[0], cpu_seconds(pid), time.perf_counter()
    finally:
        stop = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        pool.close()
    wall, cpu, events = t1 - t0, cpu1 - cpu0, events1 - events0
    gaps = sorted(sink.gaps[-50_000:])
    return {"streams": streams, "tokens_per_stream": tokens, "window_s": round(wall, 3), "events": events,
            "events_per_s": round(events / wall), "streams_completed_per_s": round((done1 - done0) / wall, 1),
            "sim_cpu_s": round(cpu, 3), "sim_cpu_util": round(cpu / wall, 3),
            "events_per_sim_cpu_s": round(events / cpu) if cpu > 0 else None,
            "gap_p50_ms": round(gaps[len(gaps) // 2] * 1000, 3) if gaps else None,
            "gap_p99_ms": round(gaps[int(len(gaps) * 0.99)] * 1000, 3) if gaps else None,
            "errors": errors[0]}


def run_scenario(name: str, flags: list[str], args: argparse.Namespace, demanded: float | None) -> dict[str, Any]:
    """One scenario against a fresh sim process."""
    with sim_process("--max-num-seqs", str(max(args.streams, 256)), *flags, cpu=0 if args.pin else None) as (pid, url):
        result = asyncio.run(closed_loop(url, args.streams, args.tokens, args.warmup, args.seconds, pid))
    result["scenario"] = name
    if demanded is not None:
        result["demanded_tokens_per_s"] = demanded
        result["achieved_ratio"] = round(result["events_per_s"] / demanded, 3)
    capacity = result["events_per_sim_cpu_s"] or 0
    result["meets_20k"] = capacity >= 20_000 and (demanded is None or result["achieved_ratio"] >= 0.95)
    return result


_MINIMAL_CHUNK = {"id": "cmpl-x", "object": "text_completion", "created": 0, "model": "m",
                  "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None,
                               "stop_reason": None}]}


def serve_minimal(layer: str, tokens: int) -> None:
    """Serve a minimal SSE streamer on an ephemeral port with ``layer`` (aiohttp | asgi); print the port."""
    import socket

    import orjson

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    print(json.dumps({"base_urls": [f"http://127.0.0.1:{sock.getsockname()[1]}"]}), flush=True)
    if layer == "aiohttp":
        from aiohttp import web

        async def handler(request: web.Request) -> web.StreamResponse:
            await request.read()
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            with contextlib.suppress(ConnectionResetError):  # the load generator hangs up at the end
                for _ in range(tokens):
                    await resp.write(b"data: " + orjson.dumps(_MINIMAL_CHUNK) + b"\n\n")
                    await asyncio.sleep(0)
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            return resp

        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        web.run_app(app, sock=sock, print=None, access_log=None, loop=None)
        return
    import uvicorn

    async def asgi(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(tokens):
            await send({"type": "http.response.body", "body": b"data: " + orjson.dumps(_MINIMAL_CHUNK) + b"\n\n",
                        "more_body": True})
            await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    config = uvicorn.Config(asgi, loop="uvloop", http="httptools", lifespan="off", access_log=False,
                            log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


@contextlib.contextmanager
def minimal_process(layer: str, tokens: int, cpu: int | None) -> Iterator[tuple[int, str]]:
    """Start ``serve_minimal`` in a child process pinned to ``cpu``; yield ``(pid, base_url)``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.sim_throughput", "--serve-minimal", layer,
                             "--tokens", str(tokens)], stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        if cpu is not None:
            os.sched_setaffinity(proc.pid, {cpu})
        assert proc.stdout is not None
        yield proc.pid, json.loads(proc.stdout.readline())["base_urls"][0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def run_http_layer(layer: str, args: argparse.Namespace) -> dict[str, Any]:
    """The same closed loop against a minimal streamer on ``layer``."""
    with minimal_process(layer, args.tokens, 0 if args.pin else None) as (pid, url):
        result = asyncio.run(closed_loop(url, args.streams, args.tokens, args.warmup, args.seconds, pid))
    result["scenario"] = f"minimal_{layer}"
    return result


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run the scenarios, print JSON; exit 0 (figures, not a pass/fail test)."""
    p = argparse.ArgumentParser(prog="python -m loadtest.sim_throughput", description=__doc__.split("\n")[0])
    p.add_argument("--streams", type=int, default=256, help="concurrent streams")
    p.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    p.add_argument("--seconds", type=float, default=5.0, help="measuring window per scenario")
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--paced-rate", type=float, default=100.0, help="per-sequence decode tokens/s (paced scenario)")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin sim/client to CPUs 0/1")
    p.add_argument("--quick", action="store_true", help="2 s windows, 0.5 s warm-up")
    p.add_argument("--http-layers", action="store_true", help="also measure minimal aiohttp vs raw-ASGI streamers")
    p.add_argument("--serve-minimal", choices=("aiohttp", "asgi"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_minimal:
        serve_minimal(args.serve_minimal, args.tokens)
        return 0
    if args.quick:
        args.seconds, args.warmup = 2.0, 0.5
    if args.pin and len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {1})
    else:
        args.pin = False
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    results = [
        run_scenario("full_speed", [], args, None),
        run_scenario("paced", ["--decode-tokens-per-s", str(args.paced_rate)], args, args.streams * args.paced_rate),
    ]
    if args.http_layers:
        results += [run_http_layer("aiohttp", args), run_http_layer("asgi", args)]
    print(json.dumps({"benchmark": "sim_throughput", "target_tokens_per_s_per_core": 20_000, "pinned": args.pin,
                      "cpus": os.cpu_count(), "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
