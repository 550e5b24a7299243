"""Fault bench for stream continuation (docs/stream-continuation.md): streamed requests mixed across chat,
completions, Responses and Messages through pdproxy, while every decoder loses streams at random events — a
connection reset, an end of body without the end marker, vLLM's in-band error event, a stall.

Run: ``python -m loadtest.fault_bench [--requests 1000] [--concurrency 32] [--fault-rate 0.2] [--out FILE]``.

Everything runs on 127.0.0.1: ``--prefillers`` (2) and ``--decoders`` (3) simulated engines (``pdproxy sim``, one
token per event at ``--decode-tokens-per-s``), ``pdproxy serve`` in its own process with ``--stream-continuation``,
and this load generator, a client that retries as the OpenAI and Anthropic SDKs do (a 429 / 503 answered with
``Retry-After`` before the stream's first byte, twice: with every decoder's breaker open pdproxy refuses a new
request at once, as vllm-router and LiteLLM do; ``client_retried`` counts them).  First every distinct request is run once with no fault (the uninterrupted, greedy
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
- ``broken_details``: for the first broken streams, the API, status, the ``x-request-id`` the bench sent (the
  ``client_request_id`` of its line in ``--request-log``), the client's transport error if any and the body's last bytes;
- ``gap_s``: the longest client-visible gap between two chunks of a stream (p50 / p99 / max), and ``cut``: how
  many streams had at least one lost decode leg (from the decoders' own fault counters).

Exit status 1 when an eligible stream broke or an output differed.  Bounded: about ``requests / concurrency``
stream times plus start-up.

**Drain mode** (``--drain``; defaults 200 streams live at once, at least 600 in all, 40 tokens/s): no faults; a
rolling restart of the decoders — each in turn, once 90 % of the streams are streaming, is drained with
``{"migrate": true}`` (``POST /admin/endpoints/drain``), waited for until it has no request in flight, its process
restarted (``--no-restart``: not) and undrained.  The table: streams broken (error, truncated, no end marker),
byte-identical to the uninterrupted greedy run, with one opening, with usage equal to the delivered tokens,
migrated per drain (the admin answers' ``migrated``) against the proxy's ``pdproxy_continuations_total{cause=
"drain"}``, the longest client-visible gap per stream (p50 / p99 / max; the reference runs' beside it) and the
proxy's ``pdproxy_continuation_gap_seconds`` (bucket bounds and mean).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

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
    request_id: str = ""
    tail: bytes = b""
    times: list[float] = field(default_factory=list)
    retry_after_s: float | None = None     # the answer was a 429 / 503 with Retry-After (before any stream byte)
    retries: int = 0                       # how many such answers the client retried before this one


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
            stream.detail = str(obj.get("error", obj))[:300]
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


CLIENT_RETRIES = 2
"""What the OpenAI and Anthropic SDKs do by default: a 429 / 5xx answered before any stream byte is retried twice,
after the ``Retry-After`` the server gave (here capped at 5 s)."""


async def one(client: httpx.AsyncClient, url: str, spec: Spec, live: Live | None = None) -> Stream:
    """Run one stream as an SDK client would (:data:`CLIENT_RETRIES`), timing every chunk the client receives;
    ``live`` counts it while it streams."""
    for attempt in range(CLIENT_RETRIES + 1):
        s = await _one(client, url, spec, live)
        s.retries = attempt
        retry_after = s.retry_after_s
        if retry_after is None or attempt == CLIENT_RETRIES:
            return s
        await asyncio.sleep(min(retry_after, 5.0))
    raise AssertionError("unreachable")  # pragma: no cover


async def _one(client: httpx.AsyncClient, url: str, spec: Spec, live: Live | None = None) -> Stream:
    s = Stream(spec)
    chunks: list[bytes] = []
    counted = False
    try:
        s.request_id = f"fb-{uuid.uuid4().hex[:16]}"   # the proxy logs it as client_request_id (--request-log)
        async with client.stream("POST", url + PATHS[spec.api], json=spec.body(),
                                 headers={"x-request-id": s.request_id}) as resp:
            s.status = resp.status_code
            if resp.status_code in (429, 503) and "retry-after" in resp.headers:
                try:
                    s.retry_after_s = float(resp.headers["retry-after"])
                except ValueError:
                    s.retry_after_s = 1.0
            async for chunk in resp.aiter_raw():
                s.times.append(time.monotonic())
                chunks.append(chunk)
                if live is not None and not counted:
                    live.now += 1
                    counted = True
    except httpx.HTTPError as exc:
        s.detail = f"{type(exc).__name__}: {exc}"
    finally:
        if live is not None and counted:
            live.now -= 1
    body = b"".join(chunks)
    s.tail = body[-240:]
    if s.status == 200:
        read_events(spec.api, body, s)
    else:
        s.detail = s.detail or body[:200].decode(errors="replace")
    gaps = [b - a for a, b in zip(s.times, s.times[1:], strict=False)]
    s.gap_s = max(gaps, default=0.0)
    if s.error and len(s.times) >= 2:
        s.error_after_s = s.times[-1] - s.times[-2]
    return s


@dataclass
class Live:
    """Streams that have received their first bytes and not ended yet (the drain mode waits for a full load)."""

    now: int = 0


async def drive(url: str, specs: list[Spec], concurrency: int, live: Live | None = None) -> list[Stream]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        async def bounded(spec: Spec) -> Stream:
            async with sem:
                return await one(client, url, spec, live)
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
                             # the same budget of decoder legs before the first event as after it: this bench's
                             # faults strike each leg independently (a Responses stream's opening events are held
                             # back, so its faults after 2 events come before pdproxy's first event), unlike a
                             # dead decoder, which its breaker routes around
                             "--decode-attempts", str(min(10, args.max_continuations)),
                             "--stream-continuation-stall-min-s", str(args.stall_min_s),
                             "--decode-idle-timeout-s", str(args.stall_min_s), "--breaker-open-s", "0.5",
                             "--decode-first-byte-timeout-s", str(args.stall_min_s * 4),
                             "--log-level", "error",
                             *(["--request-log-path", args.request_log] if args.request_log else [])],
                 f"http://127.0.0.1:{port}")
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
        "client_retried": sum(1 for s in streams if s.retries),
        "broken_details": [f"{s.spec.api}: {s.status} error={s.error} ended={s.ended} request {s.request_id}: "
                           f"{s.detail} body tail {s.tail!r}" for s in broken[:5]],
        "usage_details": [f"{s.spec.api}/{s.spec.max_tokens}: {s.usage_tokens} vs {reference[s.spec].usage_tokens}"
                          for s in eligible if s not in usage_ok][:5],
        "differ_details": [f"{s.spec.api}: {s.text[:60]!r} vs {reference[s.spec].text[:60]!r}" for s in differ[:5]],
    }
    result["pass"] = (not broken and not differ and not broken_reference and len(usage_ok) == len(eligible)
                      and len(one_opening) == len(eligible))
    return result


def proxy_argv(args: argparse.Namespace, port: int, prefillers: list[str], decoders: list[str],
               extra: list[str]) -> list[str]:
    """``pdproxy serve`` with stream continuation over the simulated engines."""
    return [sys.executable, "-m", "pdproxy", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--prefill", *prefillers, "--decode", *decoders, "--stream-continuation",
            "--stream-continuation-max", str(args.max_continuations), "--log-level", "error", *extra]


def histogram_quantiles(text: str, name: str, **labels: str) -> dict[str, float | None]:
    """p50 / p99 (the upper bound of the bucket holding them) and the mean of one histogram of a scrape."""
    by_le: dict[float, float] = {}
    total = count = 0.0
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            if not all(sample.labels.get(k) == v for k, v in labels.items()):
                continue
            if sample.name == name + "_bucket":
                le = float(sample.labels["le"])
                by_le[le] = by_le.get(le, 0.0) + sample.value
            elif sample.name == name + "_sum":
                total += sample.value
            elif sample.name == name + "_count":
                count += sample.value
    buckets = sorted(by_le.items())

    def q(x: float) -> float | None:
        return next((le for le, n in buckets if n >= x * count), None) if count else None

    return {"p50": q(0.5), "p99": q(0.99), "mean": round(total / count, 4) if count else None, "count": count}


async def sustain(url: str, specs: list[Spec], concurrency: int, live: Live, done: asyncio.Event,
                  minimum: int) -> list[Stream]:
    """Keep ``concurrency`` streams going (``specs`` in turn) until ``done`` is set and at least ``minimum`` ran."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    results: list[Stream] = []
    issued = 0
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        async def worker() -> None:
            nonlocal issued
            while not (done.is_set() and issued >= minimum):
                spec = specs[issued % len(specs)]
                issued += 1
                results.append(await one(client, url, spec, live))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def drain_async(args: argparse.Namespace) -> dict[str, Any]:
    """The drain mode: ``--concurrency`` streams live at once (at least ``--requests`` in all, and until the last
    decoder is back) while every decoder in turn is drained with ``migrate`` (``POST /admin/endpoints/drain``),
    waited for until idle, restarted (``--restart``) and undrained — a rolling restart of the decoders.  No faults
    are injected."""
    flags = ["--served-model-name", "sim-model", "--max-model-len", "8192", "--prefill-tokens-per-s", "0",
             "--decode-tokens-per-s", str(args.decode_tokens_per_s), "--kv-pin-timeout-s", "60",
             "--output-tokens", "256"]
    sims = [Proc(f"{role}{k}", [sys.executable, "-m", "pdproxy", "sim", "--role", role, "--port", str(port),
                                "--seed", str(k), *flags], f"http://127.0.0.1:{port}")
            for role, count in (("prefill", args.prefillers), ("decode", args.decoders))
            for k, port in ((k, free_port()) for k in range(count))]
    decoders = [s for s in sims if s.name.startswith("decode")]
    port = free_port()
    key = "drain-bench"
    proxy = Proc("pdproxy", proxy_argv(args, port, [s.url for s in sims if s.name.startswith("prefill")],
                                       [d.url for d in decoders],
                                       ["--admin-key", key, "--decode-first-byte-timeout-s", "30",
                                        "--max-client-connections", str(args.concurrency * 2 + 64)]),
                 f"http://127.0.0.1:{port}")
    rng = random.Random(args.seed)
    distinct = [Spec(api, topic, rng.choice(args.drain_tokens), True) for api in APIS
                for topic in range(len(TOPICS))]
    specs = [distinct[i % len(distinct)] for i in range(args.requests)]
    rng.shuffle(specs)
    auth = {"authorization": f"Bearer {key}"}
    steps: list[dict[str, Any]] = []
    live = Live()
    rolled = asyncio.Event()

    async def rolling(client: httpx.AsyncClient) -> None:
        try:
            await roll(client)
        finally:
            rolled.set()

    async def roll(client: httpx.AsyncClient) -> None:
        for d in decoders:
            deadline = time.monotonic() + 60        # each drain during a full load: 90 % of the streams streaming
            while live.now < args.concurrency * 0.9 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            ref = {"url": d.url, "role": "decode"}
            step: dict[str, Any] = {"decoder": d.name, "live_streams": live.now}
            t0 = time.monotonic()
            answer = (await client.post(proxy.url + "/admin/endpoints/drain", json={**ref, "migrate": True},
                                        headers=auth)).json()
            step["migrated"] = answer["migrated"]
            while time.monotonic() - t0 < 60:       # its non-continuable / not yet started streams finish
                rows = (await client.get(proxy.url + "/admin/endpoints", headers=auth)).json()["endpoints"]
                if all(r["requests"] == 0 for r in rows if r["url"] == d.url):
                    break
                await asyncio.sleep(0.05)
            step["idle_after_s"] = round(time.monotonic() - t0, 3)
            if args.restart:
                d.stop()
                await d.start()
            (await client.post(proxy.url + "/admin/endpoints/undrain", json=ref, headers=auth)).raise_for_status()
            step["back_after_s"] = round(time.monotonic() - t0, 3)
            steps.append(step)
            await asyncio.sleep(args.drain_pause_s)

    try:
        await asyncio.gather(*(s.start() for s in sims))
        await proxy.start()
        reference = {s.spec: s for s in await drive(proxy.url, distinct, args.concurrency)}
        broken_reference = [s.spec for s in reference.values() if s.status != 200 or s.error or not s.ended]
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=30.0) as client:
            streams, _ = await asyncio.gather(sustain(proxy.url, specs, args.concurrency, live, rolled,
                                                      args.requests), rolling(client))
            wall_s = time.monotonic() - t0
            metrics = (await client.get(proxy.url + "/metrics")).text
    finally:
        proxy.stop()
        for s in sims:
            s.stop()
    broken = [s for s in streams if s.status != 200 or s.error or not s.ended]
    differ = [s for s in streams if s not in broken and s.text != reference[s.spec].text]
    usage_ok = [s for s in streams if s.usage_tokens is not None and s.usage_tokens == reference[s.spec].usage_tokens]
    one_opening = [s for s in streams if s.openings == (0 if s.spec.api == "completions" else 1)]
    gaps = [s.gap_s for s in streams]
    ref_gaps = [s.gap_s for s in reference.values()]
    continued = sum(_counter(metrics, "pdproxy_continuations_total", cause="drain"))
    refused = sum(_counter(metrics, "pdproxy_continuations_refused_total"))
    result = {
        "mode": "drain",
        "config": {"requests": args.requests, "concurrency": args.concurrency, "prefillers": args.prefillers,
                   "decoders": args.decoders, "decode_tokens_per_s": args.decode_tokens_per_s,
                   "max_tokens": list(args.drain_tokens), "restart": args.restart,
                   "max_continuations": args.max_continuations, "cpus": len(os.sched_getaffinity(0)),
                   "seed": args.seed},
        "wall_s": round(wall_s, 2),
        "streams": len(streams),
        "broken": len(broken),
        "identical": len(streams) - len(broken) - len(differ),
        "differ": len(differ),
        "one_opening": len(one_opening),
        "usage_ok": len(usage_ok),
        "migrated": sum(st["migrated"] for st in steps),
        "continued_after_drain": continued,
        "refused": refused,
        "steps": steps,
        "gap_s": {"p50": pct(gaps, 0.5), "p99": pct(gaps, 0.99), "max": max(gaps, default=None)},
        "reference_gap_s": {"p50": pct(ref_gaps, 0.5), "p99": pct(ref_gaps, 0.99)},
        "continuation_gap_s": histogram_quantiles(metrics, "pdproxy_continuation_gap_seconds"),
        "per_api": {api: sum(1 for s in streams if s.spec.api == api) for api in APIS},
        "broken_reference": len(broken_reference),
        "broken_details": [f"{s.spec.api}: {s.status} {s.detail or s.text[-80:]}" for s in broken[:5]],
        "differ_details": [f"{s.spec.api}: {s.text[:60]!r} vs {reference[s.spec].text[:60]!r}" for s in differ[:5]],
    }
    result["pass"] = (not broken and not differ and not broken_reference and len(usage_ok) == len(streams)
                      and len(one_opening) == len(streams))
    return result


def _counter(text: str, name: str, **labels: str) -> list[float]:
    """The values of one counter's samples matching ``labels`` in a scrape."""
    return [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def drain_table(r: dict[str, Any]) -> str:
    """The drain mode's table."""
    n = r["streams"]
    cg = r["continuation_gap_s"]
    rows = [("streams (--concurrency of them live at once)", n, ""),
            ("  broken (error / truncated / no end marker)", r["broken"], "target 0"),
            ("  byte-identical to the uninterrupted greedy run", r["identical"], f"of {n}"),
            ("  one role chunk / response.created / message_start", r["one_opening"], f"of {n}"),
            ("  usage == delivered tokens", r["usage_ok"], f"of {n}"),
            ("streams migrated by the drains", r["migrated"], " + ".join(str(s["migrated"]) for s in r["steps"])),
            ("continuations counted (cause drain) / refused", f"{r['continued_after_drain']:g} / {r['refused']:g}",
             ""),
            ("drained decoder idle after, s", " / ".join(str(s["idle_after_s"]) for s in r["steps"]), ""),
            ("client max gap per stream p50 / p99 / max s", f"{r['gap_s']['p50']} / {r['gap_s']['p99']} / "
                                                          f"{r['gap_s']['max']}", ""),
            ("  the same, uninterrupted reference runs (no drain)", f"{r['reference_gap_s']['p50']} / "
                                                                  f"{r['reference_gap_s']['p99']}", ""),
            ("continuation gap (proxy histogram) p50 / p99 / mean s", f"<={cg['p50']} / <={cg['p99']} / "
                                                                     f"{cg['mean']}", ""),
            ("wall s", r["wall_s"], "")]
    return "\n".join(f"{name:<55} {value!s:>22}  {note}" for name, value, note in rows)


def table(r: dict[str, Any]) -> str:
    rows = [("eligible streams", r["eligible"], ""),
            ("  ended in error / truncated", r["eligible_broken"], "target 0"),
            ("  one role chunk / response.created / message_start", r["one_opening"], f"of {r['eligible']}"),
            ("  usage == delivered tokens", r["usage_ok"], f"of {r['eligible']}"),
            ("  byte-identical to the uninterrupted run", r["identical"], f"of {r['eligible']}"),
            ("decode legs lost (faults fired)", r["legs_lost"], ""),
            ("requests the client retried (503 + Retry-After first)", r["client_retried"], "as the SDKs do"),
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
    parser.add_argument("--requests", type=int)
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--prefillers", type=int, default=2)
    parser.add_argument("--decoders", type=int, default=3)
    parser.add_argument("--fault-rate", type=float, default=0.2, help="share of decode legs that meet a fault")
    parser.add_argument("--ineligible-share", type=float, default=0.05)
    parser.add_argument("--decode-tokens-per-s", type=float)
    parser.add_argument("--max-continuations", type=int, default=6)
    parser.add_argument("--stall-min-s", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--request-log", help="the proxy's request log (one JSON line per request: outcome, "
                        "error, decoders) goes to this file; a broken stream's request id is its client_request_id")
    parser.add_argument("--drain", action="store_true", help="drain mode: a rolling drain with migrate of every "
                        "decoder during --concurrency live streams, no faults (defaults: 600 requests, 200 live)")
    parser.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True,
                        help="drain mode: restart each drained decoder's process before undraining it")
    parser.add_argument("--drain-tokens", type=int, nargs="+", default=[120, 160, 200],
                        help="drain mode: max_tokens choices (below the sim's 256-token EOS)")
    parser.add_argument("--drain-pause-s", type=float, default=0.3, help="drain mode: pause between decoders")
    args = parser.parse_args(argv)
    for name, fault_default, drain_default in (("requests", 1000, 600), ("concurrency", 32, 200),
                                               ("decode_tokens_per_s", 200.0, 40.0)):
        if getattr(args, name) is None:
            setattr(args, name, drain_default if args.drain else fault_default)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = asyncio.run(drain_async(args) if args.drain else main_async(args))
    print(drain_table(result) if args.drain else table(result))
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
