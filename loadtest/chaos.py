"""Chaos run: steady load through pdproxy while a decoder and then a prefiller process are killed
(SIGKILL) and brought back on the same port.

Run: ``python -m loadtest.chaos [--duration-s 24] [--concurrency 16] [--out FILE]``.  Prints one JSON document:

- ``requests``: sent, ``ok`` (200, complete stream, one ``[DONE]``), ``lost_before_stream`` (the client got an
  error status or a dropped connection before any byte: the proxy should have failed over — must be 0),
  ``errors_sent`` (a stream that had started and then carried an SSE error event + ``[DONE]`` because its decoder
  died mid-stream: the documented, honest outcome), ``truncated`` (a stream that ended without ``[DONE]``: must
  be 0);
- per chaos event (``kill``/``restart`` of a role): ``detect_s`` (kill → the proxy marks it unhealthy or opens
  its breaker), ``recover_s`` (restart → the restarted engine receives traffic from the proxy again), and the
  outcomes of requests that were in flight at the kill;
- TTFT p50/p99 and E2E p50/p99 (seconds) over the whole run.

Everything runs on 127.0.0.1: two simulated prefillers and two decoders (``pdproxy sim``, ~100 tokens/s decode so
streams are in flight when a decoder dies), ``pdproxy serve`` (its own process) and this load generator.  Exit status
1 when a request was lost before streaming or truncated.  Bounded: ``duration_s`` plus start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from loadtest.ports import free_port

ADMIN_KEY = "chaos-admin"
SIM_FLAGS = ["--served-model-name", "sim-model", "--max-model-len", "8192", "--prefill-tokens-per-s", "200000",
             "--decode-tokens-per-s", "100", "--kv-pin-timeout-s", "30"]


@dataclass
class Proc:
    """A child process in its own session, restartable on the same port."""

    name: str
    argv: list[str]
    url: str
    popen: subprocess.Popen[bytes] | None = None

    def spawn(self) -> subprocess.Popen[bytes]:
        """Start the process (returns at once)."""
        self.popen = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True)
        return self.popen

    async def start(self, timeout_s: float = 30.0) -> float:
        """Start and wait for ``/health``; returns the monotonic time it became healthy."""
        popen = self.spawn()
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if popen.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {popen.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(self.url + "/health")).status_code == 200:
                        return time.monotonic()
                await asyncio.sleep(0.05)
        raise RuntimeError(f"{self.name} not healthy within {timeout_s} s")

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait()

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Outcome:
    """One request: ``kind`` ∈ ok | lost_before_stream | errors_sent | truncated; times in monotonic seconds."""

    kind: str
    started_at: float
    ttft_s: float | None = None
    e2e_s: float | None = None
    detail: str = ""


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


async def one_request(client: httpx.AsyncClient, url: str, i: int) -> Outcome:
    body = {"model": "sim-model", "max_tokens": 24, "stream": True,
            "messages": [{"role": "user", "content": f"chaos request {i}: tell me about prefill and decode"}]}
    started = time.monotonic()
    first: float | None = None
    data = b""
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread())[:200].decode(errors="replace")
                return Outcome("lost_before_stream", started, detail=f"HTTP {resp.status_code}: {text}")
            async for chunk in resp.aiter_raw():
                if first is None:
                    first = time.monotonic()
                data += chunk
    except httpx.HTTPError as exc:
        kind = "lost_before_stream" if first is None else "truncated"
        return Outcome(kind, started, detail=f"{exc.__class__.__name__}: {exc}")
    end = time.monotonic()
    ttft = None if first is None else first - started
    if b'data: {"error"' in data:
        return Outcome("errors_sent", started, ttft, end - started)
    if data.count(b"data: [DONE]") != 1:
        return Outcome("truncated", started, ttft, end - started, detail=data[-200:].decode(errors="replace"))
    return Outcome("ok", started, ttft, end - started)


async def load(url: str, concurrency: int, until: float, run: Run) -> None:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        counter = iter(range(10**9))

        async def worker() -> None:
            while time.monotonic() < until:
                run.outcomes.append(await one_request(client, url, next(counter)))
        await asyncio.gather(*(worker() for _ in range(concurrency)))


async def admin_row(client: httpx.AsyncClient, proxy: str, url: str) -> dict[str, Any] | None:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        r = await client.get(proxy + "/admin/endpoints", headers={"X-Admin-Key": ADMIN_KEY})
        for row in r.json()["endpoints"]:
            if row["url"] == url:
                return dict(row)
    return None


async def received(client: httpx.AsyncClient, url: str) -> int:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        r = await client.get(url + "/sim/received")
        return sum(1 for q in r.json()["requests"] if q["path"].endswith("/completions"))
    return -1


async def chaos(victim: Proc, proxy: str, run: Run, down_s: float) -> None:
    """Kill ``victim``, measure detection, restart it after ``down_s`` seconds, measure recovery."""
    event: dict[str, Any] = {"victim": victim.name}
    async with httpx.AsyncClient(timeout=2.0) as client:
        killed = time.monotonic()
        victim.kill()
        event["killed_at_s"] = round(killed - run.events[0]["t0"], 3) if run.events else 0.0
        detect = None
        while time.monotonic() - killed < down_s:
            row = await admin_row(client, proxy, victim.url)
            if detect is None and row is not None and (not row["healthy"] or row["breaker"] != "closed"):
                detect = time.monotonic() - killed
            await asyncio.sleep(0.05)
        event["detect_s"] = None if detect is None else round(detect, 3)
        healthy_at = await victim.start()
        recover = None
        while time.monotonic() - healthy_at < 15:
            if await received(client, victim.url) > 0:
                recover = time.monotonic() - healthy_at
                break
            await asyncio.sleep(0.02)
        event["recover_s"] = None if recover is None else round(recover, 3)
        in_flight = [o for o in run.outcomes if o.started_at <= killed <= o.started_at + (o.e2e_s or 0.0)]
        event["in_flight_at_kill"] = {k: sum(o.kind == k for o in in_flight)
                                      for k in ("ok", "errors_sent", "lost_before_stream", "truncated")}
    run.events.append(event)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 4)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    py = sys.executable
    sims = [Proc(f"{role}{k}", [py, "-m", "pdproxy", "sim", "--role", role, "--port", str(port), *SIM_FLAGS],
                 f"http://127.0.0.1:{port}")
            for role, k, port in [("prefill", 0, free_port()), ("prefill", 1, free_port()),
                                  ("decode", 0, free_port()), ("decode", 1, free_port())]]
    port = free_port()
    proxy = Proc("pdproxy", [py, "-m", "pdproxy", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--prefill", sims[0].url, sims[1].url, "--decode", sims[2].url, sims[3].url,
                             "--health-interval-s", str(args.health_interval_s), "--breaker-open-s", "1",
                             "--admin-key", ADMIN_KEY, "--log-level", "error"], f"http://127.0.0.1:{port}")
    run = Run()
    try:
        await asyncio.gather(*(s.start() for s in sims))
        await proxy.start()
        t0 = time.monotonic()
        until = t0 + args.duration_s
        third = args.duration_s / 3
        loader = asyncio.create_task(load(proxy.url, args.concurrency, until, run))
        run.events.append({"t0": t0})
        await asyncio.sleep(third * 0.5)
        await chaos(sims[2], proxy.url, run, args.down_s)       # a decoder
        await asyncio.sleep(max(0.0, t0 + third * 1.5 - time.monotonic()))
        await chaos(sims[0], proxy.url, run, args.down_s)       # a prefiller
        await loader
    finally:
        proxy.stop()
        for s in sims:
            s.kill()
    run.events.pop(0)
    kinds = {k: sum(o.kind == k for o in run.outcomes) for k in ("ok", "lost_before_stream", "errors_sent",
                                                                  "truncated")}
    ttft = [o.ttft_s for o in run.outcomes if o.ttft_s is not None]
    e2e = [o.e2e_s for o in run.outcomes if o.e2e_s is not None]
    return {
        "config": {"duration_s": args.duration_s, "concurrency": args.concurrency, "down_s": args.down_s,
                   "health_interval_s": args.health_interval_s, "engines": "2 prefill + 2 decode pdproxy sim",
                   "cpus": len(os.sched_getaffinity(0))},
        "requests": {"sent": len(run.outcomes), **kinds},
        "lost_details": [o.detail for o in run.outcomes if o.kind in ("lost_before_stream", "truncated")][:10],
        "chaos": run.events,
        "ttft_s": {"p50": pct(ttft, 0.5), "p99": pct(ttft, 0.99)},
        "e2e_s": {"p50": pct(e2e, 0.5), "p99": pct(e2e, 0.99)},
        "pass": kinds["lost_before_stream"] == 0 and kinds["truncated"] == 0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__.split("\n")[0])
    parser.add_argument("--duration-s", type=float, default=24.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--down-s", type=float, default=3.0, help="seconds a killed engine stays down")
    parser.add_argument("--health-interval-s", type=float, default=0.5)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    result = asyncio.run(main_async(args))
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
