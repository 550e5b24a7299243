"""The load generator: one workload against one target, measured in windows; runs as its own process.

``python -m loadtest.loadgen '<spec JSON>'`` prints one JSON result.  Spec keys:

- ``mode``: ``direct`` (POST the client body to ``decode``), ``client_pd`` (the generator itself POSTs the prefill
  leg to ``prefill`` — ``stream`` false, ``max_tokens`` 1, the ``kv_transfer_params`` stub of
  docs/pd-protocol.md §1 — then the original body plus the prefiller's ``kv_transfer_params`` to ``decode``: the
  floor of any PD proxy),
  ``proxy`` (POST the client body to ``target``);
- ``api`` (``completions`` | ``chat``), ``max_tokens`` (events per stream), ``prompt_bytes`` (unique text: a
  random hex word, then ordinary words; past 4 KiB a random slice of a word corpus made once per process, so a
  ~250 KB prompt costs the generator a copy, not 40,000 random draws);
- ``agent``: ``{"system_bytes", "tools", "turn_bytes", "turns"}`` (chat only): each closed-loop worker holds a
  conversation — one system prompt and ``tools`` function tools shared by every conversation, a unique first user
  message, then per turn an assistant tool call and a tool result of ``turn_bytes`` unique words appended — for
  ``turns`` turns, then a new conversation.  A turn's body repeats the earlier turns' messages byte for byte
  (the prefix an agent's engine caches);
- ``arrival``: ``{"kind": "poisson", "rate": req/s}`` (open loop), ``{"kind": "closed", "concurrency": n,
  "ramp_s": s}`` (closed loop, workers started evenly over ``ramp_s``) or ``{"kind": "batch", "n": n,
  "ramp_s": s}`` (``n`` requests, one each, started evenly over ``ramp_s``; the whole run, from just before the
  first request to the last answer, is the one window: see :func:`run_batch`) or ``{"kind": "closed_n",
  "concurrency": c, "n": n, "ramp_s": s}`` (closed loop: ``c`` workers, started evenly over ``ramp_s``, run ``n``
  requests in all; measured as one window like ``batch``);
- ``warmup_s``, ``windows``, ``window_s``: a discarded warm-up, then ``windows`` windows of ``window_s`` seconds;
- ``stall_gap_s``: an inter-event gap longer than this counts as a stall;
- ``read_pause_s``, ``rcvbuf``: slow readers (each stream unread for that long after its first event; the
  client socket's ``SO_RCVBUF``), see :class:`loadtest.client.Pool`;
- ``cpu_pids``: ``{"name": [root pid, ...]}`` whose CPU seconds (``/proc``, descendants included) and RSS are
  read at each window boundary.

Per window: completed requests, errors, relayed events, TTFT / inter-event gap / E2E percentiles (ms), stalls,
concurrency (mean, max), CPU seconds per pid group and of the generator itself, RSS bytes per group, and
``others_cpu_frac``: CPUs' worth of busy time spent by processes outside the benchmark (a shared machine skews
latency figures; ``/proc/stat`` ticks, so ±0.01 s per window).
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any

import orjson

from loadtest import procstat
from loadtest.client import Pool, Response, now

_WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet", "kilo", "lima",
          "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango", "uniform", "victor", "whiskey",
          "xray", "yankee", "zulu")


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """p50/p90/p99/p99.9/max/mean of ``values`` × ``scale`` (nearest rank), None when empty."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "p999": None, "max": None, "mean": None, "n": 0}
    v = sorted(values)
    n = len(v)

    def q(p: float) -> float:
        return round(v[min(n - 1, int(p * n))] * scale, 3)

    return {"p50": q(0.50), "p90": q(0.90), "p99": q(0.99), "p999": q(0.999), "max": round(v[-1] * scale, 3),
            "mean": round(sum(v) / n * scale, 3), "n": n}


@dataclass(slots=True)
class Sink:
    """What completed or arrived within one window."""

    ttfts: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    events: int = 0
    requests: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    conc_sum: float = 0.0
    conc_n: int = 0
    conc_max: int = 0


_CORPUS_BYTES = 1 << 20


def _words(rng: random.Random, size: int) -> str:
    """Ordinary words (:data:`_WORDS`) joined by spaces, at least ``size`` characters."""
    out: list[str] = []
    n = 0
    while n < size:
        w = rng.choice(_WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


class Agents:
    """Agent conversations, one per closed-loop worker slot (see ``agent`` in the module docstring)."""

    def __init__(self, conf: dict[str, Any], rng: random.Random) -> None:
        self.rng = rng
        self.turn_bytes = int(conf.get("turn_bytes", 6000))
        self.turns = int(conf.get("turns", 12))
        shared = random.Random(7)  # the same system prompt and tools in every run and for every conversation
        self.system = {"role": "system", "content": "You are a coding agent. " + _words(
            shared, int(conf.get("system_bytes", 24000)))}
        self.tools = [{"type": "function", "function": {
            "name": f"tool_{i}", "description": _words(shared, 400),
            "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": _words(
                shared, 80)}, "query": {"type": "string"}}, "required": ["path"]}}}
            for i in range(int(conf.get("tools", 16)))]
        self.history: dict[int, list[dict[str, Any]]] = {}
        self.done_turns: dict[int, int] = {}

    def messages(self, slot: int) -> list[dict[str, Any]]:
        """The messages of ``slot``'s next turn (a new conversation after ``turns`` turns)."""
        hist = self.history.get(slot)
        if hist is None or self.done_turns.get(slot, 0) >= self.turns:
            hist = [self.system, {"role": "user", "content": uuid.uuid4().hex + " " + _words(self.rng, 1000)}]
            self.history[slot], self.done_turns[slot] = hist, 0
        return list(hist)

    def answered(self, slot: int) -> None:
        """Append the turn's tool call and its result to ``slot``'s conversation."""
        hist = self.history[slot]
        call = "call_" + uuid.uuid4().hex[:16]
        hist.append({"role": "assistant", "content": None, "tool_calls": [{
            "id": call, "type": "function", "function": {"name": "tool_1", "arguments": '{"path": "src/a.py"}'}}]})
        hist.append({"role": "tool", "tool_call_id": call, "content": uuid.uuid4().hex + " " + _words(
            self.rng, self.turn_bytes)})
        self.done_turns[slot] = self.done_turns.get(slot, 0) + 1


class Workload:
    """Issues requests per the spec and records them into the current :class:`Sink`."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self._sink = Sink()
        self.pool = Pool(self._sink, read_pause_s=float(spec.get("read_pause_s", 0.0)),
                         rcvbuf=int(spec.get("rcvbuf", 0)))
        self.active = 0
        self.stopping = False
        self.rng = random.Random(spec.get("seed", 1))
        self.api = spec.get("api", "completions")
        self.path = "/v1/chat/completions" if self.api == "chat" else "/v1/completions"
        self.tasks: set[asyncio.Task[None]] = set()
        self.corpus = _words(self.rng, _CORPUS_BYTES) if int(spec.get("prompt_bytes", 400)) > 4096 else ""
        self.agents = Agents(spec["agent"], self.rng) if spec.get("agent") else None

    @property
    def sink(self) -> Sink:
        return self._sink

    @sink.setter
    def sink(self, value: Sink) -> None:
        self._sink = self.pool.sink = value

    def body(self, slot: int = 0) -> dict[str, Any]:
        """A fresh client body with a unique prompt (no accidental prefix-cache hits), or ``slot``'s next agent
        turn."""
        out: dict[str, Any] = {"model": "bench-model", "max_tokens": int(self.spec.get("max_tokens", 64)),
                               "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        if self.agents is not None:
            out["messages"] = self.agents.messages(slot)
            out["tools"] = self.agents.tools
            return out
        size = int(self.spec.get("prompt_bytes", 400))
        if self.corpus:
            at = self.rng.randrange(0, len(self.corpus) - size)
            text = uuid.uuid4().hex + " " + self.corpus[at:at + size]
        else:
            words = [uuid.uuid4().hex[:12]]
            while sum(len(w) + 1 for w in words) < size:
                words.append(self.rng.choice(_WORDS))
            text = " ".join(words)
        if self.api == "chat":
            out["messages"] = [{"role": "user", "content": text}]
        else:
            out["prompt"] = text
        return out

    async def one(self, slot: int = 0) -> None:
        """Run one request end to end and record it (``slot``: the closed-loop worker, for agent turns)."""
        spec, body = self.spec, self.body(slot)
        mode = spec["mode"]
        self.active += 1
        start = now()
        try:
            rid = uuid.uuid4().hex
            headers = b"x-request-id: %s\r\n" % rid.encode()
            if mode == "client_pd":
                pbody = {k: v for k, v in body.items() if k != "stream_options"}
                pbody.update(stream=False, max_tokens=1, kv_transfer_params={
                    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                    "remote_block_ids": None, "remote_host": None, "remote_port": None})
                pre = await self.pool.request(spec["prefill"], self.path, orjson.dumps(pbody), headers, start)
                if pre.error or pre.status != 200:
                    self._record(pre, start)
                    return
                body["kv_transfer_params"] = orjson.loads(pre.body).get("kv_transfer_params")
                url = spec["decode"]
            else:
                url = spec["decode"] if mode == "direct" else spec["target"]
            resp = await self.pool.request(url, self.path, orjson.dumps(body), headers, start)
            self._record(resp, start)
            if self.agents is not None:
                self.agents.answered(slot)
        finally:
            self.active -= 1

    def _record(self, r: Response, start: float) -> None:
        if self.stopping:
            return
        s = self.sink
        if r.error or r.status != 200 or not r.done:
            s.errors += 1
            if len(s.error_samples) < 3:
                s.error_samples.append(r.error or f"HTTP {r.status} done={r.done} {r.body[:200]!r}")
            return
        s.requests += 1
        if r.end_at is not None:
            s.e2es.append(r.end_at - start)

    def spawn(self) -> None:
        """Start one request as its own task (open loop)."""
        t = asyncio.ensure_future(self.one())
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def poisson(self, rate: float) -> None:
        """Open loop: requests at exponential inter-arrival times, ``rate`` per second on average."""
        loop = asyncio.get_running_loop()
        at = loop.time()
        while not self.stopping:
            at += self.rng.expovariate(rate)
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self.spawn()

    async def closed(self, concurrency: int, ramp_s: float) -> None:
        """Closed loop: ``concurrency`` workers, started evenly over ``ramp_s`` seconds, each one request at a time."""
        async def worker(i: int) -> None:
            await asyncio.sleep(ramp_s * i / max(1, concurrency))
            while not self.stopping:
                await self.one()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))

    async def sample(self) -> None:
        """Sample the number of requests in flight every 20 ms (concurrency mean and max per window)."""
        while True:
            await asyncio.sleep(0.02)
            s = self.sink
            s.conc_sum += self.active
            s.conc_n += 1
            s.conc_max = max(s.conc_max, self.active)


def _groups(spec: dict[str, Any]) -> dict[str, list[int]]:
    return {name: procstat.process_tree(pids) for name, pids in (spec.get("cpu_pids") or {}).items()}


def _self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _window(s: Sink, wall: float, stall: float, cpu: dict[str, float], loadgen_cpu: float, others: float,
            rss: dict[str, int]) -> dict[str, Any]:
    return {
        "wall_s": round(wall, 3), "requests": s.requests, "errors": s.errors,
        "error_samples": s.error_samples, "events": s.events, "events_per_s": round(s.events / wall, 1),
        "requests_per_s": round(s.requests / wall, 2),
        "ttft_ms": percentiles(s.ttfts), "gap_ms": percentiles(s.gaps), "e2e_ms": percentiles(s.e2es),
        "stalls": sum(1 for g in s.gaps if g > stall),
        "concurrency": {"mean": round(s.conc_sum / max(1, s.conc_n), 1), "max": s.conc_max},
        "cpu_s": cpu, "loadgen_cpu_s": round(loadgen_cpu, 4), "others_cpu_frac": round(others / wall, 3),
        "rss_bytes": rss,
    }


async def run_batch(spec: dict[str, Any]) -> dict[str, Any]:
    """The users' measurement: ``arrival.n`` requests started evenly over ``arrival.ramp_s`` seconds, each run
    once to its end.  CPU (utime + stime + cutime + cstime of each pid group's whole process tree,
    ``/proc/PID/stat``) is read just before
    the first request and after the last answer, so connection set-up, the ramp and the tail are all paid for.
    RSS is sampled every 100 ms: ``rss_bytes`` is each group's peak, ``rss_idle_bytes`` its value before the
    run.  ``sched``: each group's :func:`~loadtest.procstat.sched_figures` over the run (is its busiest thread
    the bottleneck, or the machine's cores).  Returns ``{"windows": [one window]}``."""
    w = Workload(spec)
    arrival = spec["arrival"]
    n, ramp = int(arrival["n"]), float(arrival.get("ramp_s", 0.0))
    concurrency = int(arrival.get("concurrency", 0)) if arrival["kind"] == "closed_n" else 0
    stall = float(spec.get("stall_gap_s", 1.0))
    groups = _groups(spec)
    idle = {name: procstat.tree_rss_bytes(p) for name, p in groups.items()}
    peak = dict(idle)

    async def rss_sampler() -> None:
        while True:
            await asyncio.sleep(0.1)
            for name, p in groups.items():
                peak[name] = max(peak[name], procstat.tree_rss_bytes(p))

    async def one_at(i: int) -> None:
        await asyncio.sleep(ramp * i / max(1, n))
        await w.one()

    left = [n]

    async def worker(i: int) -> None:
        await asyncio.sleep(ramp * i / max(1, concurrency))
        while left[0] > 0:
            left[0] -= 1
            await w.one(i)

    cpu0 = {name: procstat.tree_stat_cpu_seconds(p) for name, p in groups.items()}
    sched0 = {name: procstat.thread_schedstats(p) for name, p in groups.items()}
    self0, t0, busy0 = _self_cpu(), now(), procstat.machine_busy_seconds()
    sampler, rss_task = asyncio.ensure_future(w.sample()), asyncio.ensure_future(rss_sampler())
    try:
        if concurrency:
            await asyncio.gather(*(worker(i) for i in range(concurrency)))
        else:
            await asyncio.gather(*(one_at(i) for i in range(n)))
    finally:
        sampler.cancel()
        rss_task.cancel()
        await asyncio.gather(sampler, rss_task, return_exceptions=True)
    wall = now() - t0
    groups_end = _groups(spec)  # a worker forked meanwhile is counted from 0
    sched1 = {name: procstat.thread_schedstats(p) for name, p in groups_end.items()}   # read with the wall time
    cpu = {name: round(procstat.tree_stat_cpu_seconds(groups_end[name]) - cpu0[name], 4) for name in groups}
    own = sum(cpu.values()) + _self_cpu() - self0
    others = max(0.0, procstat.machine_busy_seconds() - busy0 - own)
    window = _window(w.sink, wall, stall, cpu, _self_cpu() - self0, others, peak)
    window["rss_idle_bytes"] = idle
    window["sched"] = {name: procstat.sched_figures(sched0[name], sched1[name], wall) for name in groups}
    w.pool.close()
    return {"windows": [window]}


async def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the spec; return ``{"windows": [...], "spec": spec}``."""
    arrival = spec["arrival"]
    if arrival["kind"] in ("batch", "closed_n"):
        return await run_batch(spec)
    w = Workload(spec)
    if arrival["kind"] == "poisson":
        driver = asyncio.ensure_future(w.poisson(float(arrival["rate"])))
    else:
        driver = asyncio.ensure_future(w.closed(int(arrival["concurrency"]), float(arrival.get("ramp_s", 0.5))))
    sampler = asyncio.ensure_future(w.sample())
    groups = _groups(spec)
    stall = float(spec.get("stall_gap_s", 1.0))
    windows = []
    try:
        await asyncio.sleep(float(spec.get("warmup_s", 1.0)))
        groups = _groups(spec)  # workers may have been forked after we started
        for _ in range(int(spec.get("windows", 3))):
            cpu0 = {n: procstat.tree_cpu_seconds(p) for n, p in groups.items()}
            self0, t0, busy0 = _self_cpu(), now(), procstat.machine_busy_seconds()
            w.sink = Sink()
            await asyncio.sleep(float(spec.get("window_s", 5.0)))
            s, wall = w.sink, now() - t0
            cpu = {n: round(procstat.tree_cpu_seconds(p) - cpu0[n], 4) for n, p in groups.items()}
            own = sum(cpu.values()) + _self_cpu() - self0
            others = max(0.0, procstat.machine_busy_seconds() - busy0 - own)
            windows.append(_window(s, wall, stall, cpu, _self_cpu() - self0, others,
                                   {n: procstat.tree_rss_bytes(p) for n, p in groups.items()}))
    finally:
        w.stopping = True
        driver.cancel()
        sampler.cancel()
        for t in list(w.tasks):
            t.cancel()
        w.pool.close()
        await asyncio.gather(driver, sampler, *w.tasks, return_exceptions=True)
    return {"windows": windows}


def main() -> None:
    """Entry point: the spec is ``argv[1]`` (JSON); the result is one JSON line on stdout."""
    spec = orjson.loads(sys.argv[1])
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if spec.get("cpus"):
        os.sched_setaffinity(0, spec["cpus"])
    import uvloop

    result = uvloop.run(run(spec))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")


if __name__ == "__main__":
    main()
