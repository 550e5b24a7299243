"""Fault bench for stream continuation (docs/stream-continuation.md): streamed requests mixed across chat,
completions, Responses and Messages through pdproxy, while every decoder loses streams at random events — a
connection reset, an end of body without the end marker, vLLM's in-band error event, a stall.

Run: ``python -m loadtest.fault_bench [--requests 1000] [--concurrency 32] [--fault-rate 0.2] [--out FILE]``.

Everything runs on 127.0.0.1: ``--prefillers`` (2) and ``--decoders`` (3) simulated engines (``pdproxy sim``, one
token per event at ``--decode-tokens-per-s``), ``pdproxy serve`` in its own process with ``--stream-continuation``,
and this load generator.  First every distinct request is run once with no fault (the uninterrupted, greedy
reference); then the faults are installed on every decoder (``POST /sim/faults``: each kind at a few event
counts, each firing with a probability so that about ``--fault-rate`` of all decode legs — continuation legs too —
are lost) and ``--requests`` streams run.  A share of the requests (``--ineligible-share``) carry stop strings,
which this version does not continue: they must end with the typed error event.

Prints a table and one JSON document:

- ``eligible_broken``: eligible streams that ended in an error event, without their end marker, or not 200
  (target 0);
- ``one_opening``: streams with exactly one role chunk (chat) / ``response.created`` / ``message_start``;
- ``usage_ok``: streams whose usage output/completion tokens equal the tokens of the reference run;
- ``identical``: streams whose text is byte-identical to the reference run;
- ``ineligible_error_s``: for ineligible streams that were cut, seconds from the last event before the error to
  the error event (p50 / max), detection included (a stall is detected by ``decode_idle_timeout_s`` =
  ``--stall-min-s``); the error itself follows detection at once;
- ``gap_s``: the longest client-visible gap between two chunks of a stream (p50 / p99 / max), and ``cut``: how
  many streams had at least one lost decode leg (from the decoders' own fault counters).

Exit status 1 when an eligible stream broke or an output differed.  Bounded: about ``requests / concurrency``
stream times plus start-up.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from loadtest.chaos import Proc, free_port

KINDS = ("reset_after_events", "close_without_done", "error_after_events", "stall_after_events")
EVENT_COUNTS = (2, 4, 7, 11)
APIS = ("chat", "completions", "responses", "messages")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": "/v1/responses",
         "messages": "/v1/messages"}
TOPICS = ("disaggregated serving", "KV cache transfer", "prefix caching", "decode ranks", "stream continuation",
          "load balancing", "tail latency", "breakers")


@dataclass(frozen=True)
class Spec:
    """One distinct request: its API, prompt topic, output budget and whether it is continuable."""

    api: str
    topic: int
    max_tokens: int
    eligible: bool

    def body(self) -> dict[str, Any]:
        text = f"Tell me about {TOPICS[self.topic]}."
        if self.api == "chat":
            body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": self.max_tokens,
                                    "stream_options": {"include_usage": True}}
        elif self.api == "completions":
            body = {"prompt": text, "max_tokens": self.max_tokens, "stream_options": {"include_usage": True}}
        elif self.api == "responses":
            body = {"input": text, "max_output_tokens": self.max_tokens}
        else:
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": self.max_tokens}
        if not self.eligible:
            body["stop"] = ["never said"]
        return {"model": "sim-model", "temperature": 0, "stream": True, **body}


@dataclass
class Stream:
    """What one client stream saw (times in monotonic seconds)."""

    spec: Spec
    status: int = 0
    text: str = ""
    openings: int = 0
    usage_tokens: int | None = None
    ended: bool = False
    error: bool = False
    gap_s: float = 0.0
    error_after_s: float | None = None
    detail: str = ""
    times: list[float] = field(default_factory=list)


def read_events(api: str, body: bytes, stream: Stream) -> None:
    """Fill ``stream`` from the SSE body of ``api``."""
    parts: list[str] = []
    for raw in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        name, data = "", b""
        for line in raw.strip().split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode()
            elif line.startswith(b"data:"):
                data = line[5:].strip()
        if not data:
            continue
        if data == b"[DONE]":
            stream.ended = True
            continue
        obj = orjson.loads(data)
        if name == "error" or (isinstance(obj, dict) and "error" in obj and api in ("chat", "completions")):
            stream.error = True
            continue
        if api in ("chat", "completions"):
            for choice in obj.get("choices") or []:
                delta = choice.get("delta") or {}
                stream.openings += "role" in delta
                parts.append(delta.get("content") or choice.get("text") or "")
            if obj.get("usage"):
                stream.usage_tokens = obj["usage"]["completion_tokens"]
        elif name == "response.output_text.delta":
            parts.append(obj["delta"])
        elif name == "response.created":
            stream.openings += 1
        elif name == "response.completed":
            stream.ended = True
            stream.usage_tokens = obj["response"]["usage"]["output_tokens"]
        elif name == "content_block_delta":
            parts.append(obj["delta"].get("text") or "")
        elif name == "message_start":
            stream.openings += 1
        elif name == "message_delta":
            stream.usage_tokens = obj["usage"]["output_tokens"]
        elif name == "message_stop":
            stream.ended = True
    stream.text = "".join(parts)


async def one(client: httpx.AsyncClient, url: str, spec: Spec) -> Stream:
    """Run one stream, timing every chunk the client receives."""
    s = Stream(spec)
    chunks: list[bytes] = []
    try:
        async with client.stream("POST", url + PATHS[spec.api], json=spec.body()) as resp:
            s.status = resp.status_code
            async for chunk in resp.aiter_raw():
                s.times.append(time.monotonic())
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        s.detail = f"{type(exc).__name__}: {exc}"
    body = b"".join(chunks)
    if s.status == 200:
        read_events(spec.api, body, s)
    else:
        s.detail = s.detail or body[:200].decode(errors="replace")
    gaps = [b - a for a, b in zip(s.times, s.times[1:], strict=False)]
    s.gap_s = max(gaps, default=0.0)
    if s.error and len(s.times) >= 2:
        s.error_after_s = s.times[-1] - s.times[-2]
    return s


async def drive(url: str, specs: list[Spec], concurrency: int) -> list[Stream]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        async def bounded(spec: Spec) -> Stream:
            async with sem:
                return await one(client, url, spec)
        return await asyncio.gather(*(bounded(s) for s in specs))


def fault_specs(rate: float, seed: int) -> list[dict[str, Any]]:
    """One spec per kind and event count, each firing with a probability so that about ``rate`` of the legs
    meet one."""
    per = 1 - (1 - rate) ** (1 / (len(KINDS) * len(EVENT_COUNTS)))
    return [{"kind": k, "events": n, "probability": per} for k in KINDS for n in EVENT_COUNTS]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    py = sys.executable
    flags = ["--served-model-name", "sim-model", "--max-model-len", "8192", "--prefill-tokens-per-s", "0",
             "--decode-tokens-per-s", str(args.decode_tokens_per_s), "--kv-pin-timeout-s", "60",
             "--output-tokens", "256"]
    sims = [Proc(f"{role}{k}", [py, "-m", "pdproxy", "sim", "--role", role, "--port", str(port), "--seed",
                                str(k), *flags], f"http://127.0.0.1:{port}")
            for role, count in (("prefill", args.prefillers), ("decode", args.decoders))
            for k, port in ((k, free_port()) for k in range(count))]
    prefillers = [s.url for s in sims if s.name.startswith("prefill")]
    decoders = [s for s in sims if s.name.startswith("decode")]
    port = free_port()
    proxy = Proc("pdproxy", [py, "-m", "pdproxy", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--prefill", *prefillers, "--decode", *(d.url for d in decoders),
                             "--stream-continuation", "--stream-continuation-max", str(args.max_continuations),
                             "--stream-continuation-stall-min-s", str(args.stall_min_s),
                             "--decode-idle-timeout-s", str(args.stall_min_s), "--breaker-open-s", "0.5",
                             "--decode-first-byte-timeout-s", str(args.stall_min_s * 4),
                             "--log-level", "error"], f"http://127.0.0.1:{port}")
    rng = random.Random(args.seed)
    distinct = [Spec(api, topic, rng.choice((12, 20, 32)), True) for api in APIS for topic in range(len(TOPICS))]
    ineligible = [Spec("chat", t, 16, False) for t in range(2)]
    try:
        await asyncio.gather(*(s.start() for s in sims))
        await proxy.start()
        reference = {s.spec: s for s in await drive(proxy.url, distinct + ineligible, args.concurrency)}
        broken_reference = [s.spec for s in reference.values() if s.status != 200 or s.error or not s.ended]
        async with httpx.AsyncClient(timeout=5.0) as client:
            for d in decoders:
                (await client.post(d.url + "/sim/faults", json=fault_specs(args.fault_rate, args.seed))
                 ).raise_for_status()
        specs = [rng.choice(ineligible) if rng.random() < args.ineligible_share else rng.choice(distinct)
                 for _ in range(args.requests)]
        t0 = time.monotonic()
        streams = await drive(proxy.url, specs, args.concurrency)
        wall_s = time.monotonic() - t0
        async with httpx.AsyncClient(timeout=5.0) as client:
            fired = 0
            for d in decoders:
                faults = (await client.get(d.url + "/sim/faults")).json()["faults"]
                fired += sum(f["fired"] for f in faults)
    finally:
        proxy.stop()
        for s in sims:
            s.stop()
    eligible = [s for s in streams if s.spec.eligible]
    broken = [s for s in eligible if s.status != 200 or s.error or not s.ended]
    differ = [s for s in eligible if s not in broken and s.text != reference[s.spec].text]
    usage_ok = [s for s in eligible if s.usage_tokens is not None
                and s.usage_tokens == reference[s.spec].usage_tokens]
    one_opening = [s for s in eligible if s.openings == (0 if s.spec.api == "completions" else 1)]
    cut_ineligible = [s for s in streams if not s.spec.eligible and s.error]
    err_s = [s.error_after_s for s in cut_ineligible if s.error_after_s is not None]
    gaps = [s.gap_s for s in eligible]
    result = {
        "config": {"requests": args.requests, "concurrency": args.concurrency, "prefillers": args.prefillers,
                   "decoders": args.decoders, "fault_rate": args.fault_rate, "decode_tokens_per_s":
                   args.decode_tokens_per_s, "max_continuations": args.max_continuations,
                   "stall_min_s": args.stall_min_s, "cpus": len(os.sched_getaffinity(0)), "seed": args.seed},
        "wall_s": round(wall_s, 2),
        "legs_lost": fired,
        "eligible": len(eligible),
        "eligible_broken": len(broken),
        "one_opening": len(one_opening),
        "usage_ok": len(usage_ok),
        "identical": len(eligible) - len(broken) - len(differ),
        "differ": len(differ),
        "ineligible": len(streams) - len(eligible),
        "ineligible_cut_typed_error": len(cut_ineligible),
        "ineligible_error_s": {"p50": pct(err_s, 0.5), "max": max(err_s, default=None)},
        "gap_s": {"p50": pct(gaps, 0.5), "p99": pct(gaps, 0.99), "max": max(gaps, default=None)},
        "per_api": {api: sum(1 for s in eligible if s.spec.api == api) for api in APIS},
        "broken_reference": len(broken_reference),
        "broken_details": [f"{s.spec.api}: {s.status} {s.detail or s.text[-80:]}" for s in broken[:5]],
        "usage_details": [f"{s.spec.api}/{s.spec.max_tokens}: {s.usage_tokens} vs {reference[s.spec].usage_tokens}"
                          for s in eligible if s not in usage_ok][:5],
        "differ_details": [f"{s.spec.api}: {s.text[:60]!r} vs {reference[s.spec].text[:60]!r}" for s in differ[:5]],
    }
    result["pass"] = (not broken and not differ and not broken_reference and len(usage_ok) == len(eligible)
                      and len(one_opening) == len(eligible))
    return result


def table(r: dict[str, Any]) -> str:
    rows = [("eligible streams", r["eligible"], ""),
            ("  ended in error / truncated", r["eligible_broken"], "target 0"),
            ("  one role chunk / response.created / message_start", r["one_opening"], f"of {r['eligible']}"),
            ("  usage == delivered tokens", r["usage_ok"], f"of {r['eligible']}"),
            ("  byte-identical to the uninterrupted run", r["identical"], f"of {r['eligible']}"),
            ("decode legs lost (faults fired)", r["legs_lost"], ""),
            ("ineligible streams", r["ineligible"], ""),
            ("  cut, typed error event", r["ineligible_cut_typed_error"], ""),
            ("  last event -> error (with detection), p50 / max s", f"{r['ineligible_error_s']['p50']} / "
                                                      f"{r['ineligible_error_s']['max']}", "target <= 1 s"),
            ("client-visible gap p50 / p99 / max s", f"{r['gap_s']['p50']} / {r['gap_s']['p99']} / "
                                                    f"{r['gap_s']['max']}", ""),
            ("wall s", r["wall_s"], "")]
    return "\n".join(f"{name:<55} {value!s:>22}  {note}" for name, value, note in rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m loadtest.fault_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prefillers", type=int, default=2)
    parser.add_argument("--decoders", type=int, default=3)
    parser.add_argument("--fault-rate", type=float, default=0.2, help="share of decode legs that meet a fault")
    parser.add_argument("--ineligible-share", type=float, default=0.05)
    parser.add_argument("--decode-tokens-per-s", type=float, default=200.0)
    parser.add_argument("--max-continuations", type=int, default=6)
    parser.add_argument("--stall-min-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", help="also write the JSON here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(main_async(args))
    print(table(result))
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
