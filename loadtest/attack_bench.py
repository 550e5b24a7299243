"""``make attack-bench``: a normal client's streams while pdproxy is under a mixed attack, on loopback.

Run: ``python -m loadtest.attack_bench [--duration 40] [--slow-heads 1000] [--endless 50] [--deep 4] [--redos 2]
[--clients 4] [--json FILE]``.

What runs (all on 127.0.0.1, all bounded in count and time):

- **engines**: two ``pdproxy sim`` processes (1 prefiller, 1 decoder; decode paced at 200 tokens/s);
- **pdproxy**: ``pdproxy serve`` with its default limits (docs/limits.md), in its own process;
- **the attack** (this process, its RLIMIT_NOFILE raised to the hard limit for its sockets), for ``--duration``
  seconds:
  - ``--slow-heads`` connections that send a request line and one header field, then one more header line every
    10 s and never the end of the head (slowloris); each one the proxy closes is opened again;
  - ``--endless`` connections that send one header line that never ends, 8 KiB every 0.125 s, until the proxy
    refuses it; then again;
  - ``--deep`` workers posting a 1,100-deep JSON body to ``/v1/chat/completions`` and to ``/tokenize`` (a
    passthrough route), in turn, each waiting at most 10 s for an answer;
  - ``--redos`` workers posting a 60 KB multipart body of ``name="model"`` lines without a blank line (the
    pattern a backtracking ``model`` regex is quadratic on) to ``/v1/audio/transcriptions``, 10 s each;
- **the normal client** (its own process): ``--clients`` concurrent loops of streamed chat completions
  (``max_tokens`` 16), started once the attack is established.

Printed: the normal client's requests, successes and TTFT p50/p99 (target: all succeed, p99 < 1 s), what each
attack got back (status counts, closes, time-outs), and pdproxy's RSS before the attack and its peak during it
(the bound expected: under 400 MB; the slow heads hold a few KB each, an endless line at most the head limit +
4 KiB + one read until it is refused).  On a shared machine the TTFT is the machine's too: the conditions
(CPUs, load average) are printed with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from loadtest import fleet, procstat

SIM_ARGS = ("--served-model-name", "sim-model", "--max-model-len", "4096", "--prefill-tokens-per-s", "0",
            "--decode-tokens-per-s", "200")
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello under attack"}], "max_tokens": 16,
        "stream": True}
RSS_BOUND = 400 * 1024 * 1024


@dataclass
class Tally:
    """What one kind of attack got back: answer status lines (first line's code), closes without an answer,
    client-side time-outs, connect failures."""

    statuses: Counter[str] = field(default_factory=Counter)
    closed: int = 0
    timeouts: int = 0
    connect_errors: int = 0
    connections: int = 0

    def answer(self, data: bytes) -> None:
        if data.startswith(b"HTTP/1.1 "):
            self.statuses[data[9:12].decode()] += 1
        else:
            self.closed += 1


async def _connect(port: int, tally: Tally) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    try:
        conn = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        tally.connect_errors += 1
        await asyncio.sleep(0.5)
        return None
    tally.connections += 1
    return conn


async def slow_head(port: int, stop: float, tally: Tally, delay: float) -> None:
    """One slowloris connection at a time, reopened when closed, until ``stop`` (loop time)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(delay)
    while loop.time() < stop:
        conn = await _connect(port, tally)
        if conn is None:
            continue
        reader, writer = conn
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            read = asyncio.ensure_future(reader.read(65536))
            while loop.time() < stop and not read.done():
                await asyncio.wait([read], timeout=min(10.0, max(0.0, stop - loop.time())))
                if not read.done():
                    writer.write(b"X-Slow: 1\r\n")
            if read.done() and not read.cancelled() and read.exception() is None:
                tally.answer(read.result())
            else:
                read.cancel()
        except OSError:
            tally.closed += 1
        finally:
            writer.close()


async def endless_header(port: int, stop: float, tally: Tally) -> None:
    """One header line that never ends, 8 KiB every 0.125 s, until refused; then again, until ``stop``."""
    loop = asyncio.get_running_loop()
    piece = b"a" * 8192
    while loop.time() < stop:
        conn = await _connect(port, tally)
        if conn is None:
            continue
        reader, writer = conn
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Endless: ")
            read = asyncio.ensure_future(reader.read(65536))
            sent = 0
            while loop.time() < stop and not read.done() and sent < 64 * 1024 * 1024:
                writer.write(piece)
                sent += len(piece)
                await asyncio.wait([read], timeout=0.125)
            if read.done() and not read.cancelled() and read.exception() is None:
                tally.answer(read.result())
            else:
                read.cancel()
                tally.timeouts += 1
        except OSError:
            tally.closed += 1
        finally:
            writer.close()
        await asyncio.sleep(0.1)


async def poster(port: int, stop: float, tally: Tally, requests: list[bytes]) -> None:
    """Post ``requests`` (whole raw requests, ``Connection: close``) in turn until ``stop``; 10 s per answer."""
    loop = asyncio.get_running_loop()
    i = 0
    while loop.time() < stop:
        conn = await _connect(port, tally)
        if conn is None:
            continue
        reader, writer = conn
        try:
            writer.write(requests[i % len(requests)])
            i += 1
            try:
                tally.answer(await asyncio.wait_for(reader.read(65536), 10.0))
            except TimeoutError:
                tally.timeouts += 1
        except OSError:
            tally.closed += 1
        finally:
            writer.close()
        await asyncio.sleep(0.2)


def raw_post(path: str, body: bytes, content_type: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def deep_json(depth: int = 1100) -> bytes:
    return b'{"model": "sim-model", "messages": ' + b"[" * depth + b"]" * depth + b"}"


def redos_multipart(size: int = 60_000) -> bytes:
    line = b'name="model"\r\n'
    return b"--b\r\nContent-Disposition: form-data; " + line * (size // len(line))


# --- the normal client (its own process) ----------------------------------------------------------------------
async def normal_client(url: str, clients: int, duration: float) -> dict[str, Any]:
    """``clients`` loops of streamed chat completions for ``duration`` s: TTFT (first content event) per request."""
    ttfts: list[float] = []
    slowest: list[tuple[float, float]] = []  # (seconds into the run the request started, its TTFT)
    outcomes: Counter[str] = Counter()
    begin = time.monotonic()
    stop = begin + duration

    async def one(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            start = time.monotonic()
            first: float | None = None
            try:
                async with client.stream("POST", url + "/v1/chat/completions", json=CHAT) as r:
                    done = False
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and first is None and '"content"' in line:
                            first = time.monotonic() - start
                        done = done or line == "data: [DONE]"
                outcomes["ok" if r.status_code == 200 and done and first is not None else f"http_{r.status_code}"] += 1
                if first is not None:
                    ttfts.append(first)
                    slowest.append((round(start - begin, 2), round(first, 3)))
            except httpx.HTTPError as exc:
                outcomes[type(exc).__name__] += 1

    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0), limits=httpx.Limits(max_connections=clients)) as c:
        await asyncio.gather(*(one(c) for _ in range(clients)))
    ttfts.sort()

    def q(p: float) -> float | None:
        return ttfts[min(len(ttfts) - 1, int(p * len(ttfts)))] if ttfts else None

    return {"requests": sum(outcomes.values()), "ok": outcomes["ok"], "outcomes": dict(outcomes),
            "ttft_p50_s": q(0.5), "ttft_p99_s": q(0.99), "ttft_max_s": ttfts[-1] if ttfts else None,
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
            "slowest": sorted(slowest, key=lambda x: -x[1])[:5]}


# --- the run ---------------------------------------------------------------------------------------------------
def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        return int(want)
    return int(soft)


async def attack(port: int, args: argparse.Namespace, rss_pid: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    stop = loop.time() + args.duration
    tallies = {k: Tally() for k in ("slow_heads", "endless_headers", "deep_json", "redos_multipart")}
    deep = deep_json()
    posts_deep = [raw_post("/v1/chat/completions", deep, "application/json"),
                  raw_post("/tokenize", deep, "application/json")]
    posts_redos = [raw_post("/v1/audio/transcriptions", redos_multipart(), "multipart/form-data; boundary=b")]
    tasks = [asyncio.ensure_future(slow_head(port, stop, tallies["slow_heads"], i / 200))
             for i in range(args.slow_heads)]
    tasks += [asyncio.ensure_future(endless_header(port, stop, tallies["endless_headers"]))
              for _ in range(args.endless)]
    tasks += [asyncio.ensure_future(poster(port, stop, tallies["deep_json"], posts_deep)) for _ in range(args.deep)]
    tasks += [asyncio.ensure_future(poster(port, stop, tallies["redos_multipart"], posts_redos))
              for _ in range(args.redos)]
    peak = 0
    while loop.time() < stop:
        peak = max(peak, procstat.rss_bytes(rss_pid))
        await asyncio.sleep(0.2)
    await asyncio.wait(tasks, timeout=15)
    for t in tasks:
        t.cancel()
    peak = max(peak, procstat.rss_bytes(rss_pid))
    return {"peak_rss_bytes": peak, "attacks": {k: {**asdict(v), "statuses": dict(v.statuses)}
                                                for k, v in tallies.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=40.0, help="attack length (s)")
    ap.add_argument("--warmup", type=float, default=8.0, help="attack time before the normal client starts (s)")
    ap.add_argument("--slow-heads", type=int, default=1000)
    ap.add_argument("--endless", type=int, default=50)
    ap.add_argument("--deep", type=int, default=4)
    ap.add_argument("--redos", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--client-only", nargs=3, metavar=("URL", "CLIENTS", "DURATION"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client_only:
        url, clients, duration = args.client_only
        print(orjson.dumps(asyncio.run(normal_client(url, int(clients), float(duration)))).decode())
        return 0
    nofile = raise_nofile()
    engines = [fleet.Child(f"attack-{role}", [sys.executable, "-m", "pdproxy", "sim", "--role", role, "--port",
                                               str(port), *SIM_ARGS], cpus=None,
                           health_url=f"http://127.0.0.1:{port}/health")
               for role, port in (("prefill", fleet.free_port()), ("decode", fleet.free_port()))]
    with contextlib.ExitStack() as stack:
        for e in engines:
            stack.enter_context(e)
        prefill, decode = (f"http://127.0.0.1:{e.argv[e.argv.index('--port') + 1]}" for e in engines)
        proxy = fleet.proxy_child("attack-pdproxy", f"{{python}} -m pdproxy serve --host 127.0.0.1 --port {{port}} "
                                  f"--prefill {prefill} --decode {decode} --no-request-log", "", "", None)
        stack.enter_context(proxy)
        port = int(proxy.url.rsplit(":", 1)[1])  # type: ignore[attr-defined]
        baseline = procstat.rss_bytes(proxy.pid)
        client_s = max(5.0, args.duration - args.warmup - 2)

        async def run() -> tuple[dict[str, Any], dict[str, Any]]:
            atk = asyncio.ensure_future(attack(port, args, proxy.pid))
            await asyncio.sleep(args.warmup)
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "loadtest.attack_bench", "--client-only", proxy.url,  # type: ignore[attr-defined]
                str(args.clients), str(client_s), stdout=asyncio.subprocess.PIPE, cwd=fleet.ROOT)
            out, _ = await proc.communicate()
            return await atk, orjson.loads(out.splitlines()[-1])

        attacked, client = asyncio.run(run())
        log_tail = proxy.log_tail(4000)
    result = {"conditions": {"cpus": os.cpu_count(), "load_average": procstat.load_average(),
                             "bench_nofile": nofile, "duration_s": args.duration, "warmup_s": args.warmup,
                             "slow_heads": args.slow_heads, "endless": args.endless, "deep": args.deep,
                             "redos": args.redos, "clients": args.clients},
              "normal_client": client, "pdproxy_rss_baseline_bytes": baseline, **attacked,
              "pdproxy_log_errors": [ln for ln in log_tail.splitlines() if "ERROR" in ln or "Traceback" in ln][-5:]}
    mib = 1024 * 1024
    p99 = client["ttft_p99_s"]
    print(f"normal client: {client['ok']}/{client['requests']} streams ok, TTFT p50 "
          f"{client['ttft_p50_s'] or float('nan'):.3f} s, p99 {p99 or float('nan'):.3f} s (target < 1 s: "
          f"{'met' if p99 is not None and p99 < 1 and client['ok'] == client['requests'] else 'NOT met'})")
    print(f"  slowest (s into the client's run, TTFT s): {client['slowest']}")
    print(f"pdproxy RSS: {baseline / mib:.0f} MiB before, peak {attacked['peak_rss_bytes'] / mib:.0f} MiB "
          f"(bound {RSS_BOUND / mib:.0f} MiB: {'held' if attacked['peak_rss_bytes'] < RSS_BOUND else 'EXCEEDED'})")
    for name, t in attacked["attacks"].items():
        print(f"  {name:16s} connections {t['connections']:6d}  answers {t['statuses']}  closed {t['closed']}  "
              f"client time-outs {t['timeouts']}  connect errors {t['connect_errors']}")
    print(f"conditions: {result['conditions']}")
    if result["pdproxy_log_errors"]:
        print("pdproxy logged:", *result["pdproxy_log_errors"], sep="\n  ")
    if args.json:
        Path(args.json).write_text(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
