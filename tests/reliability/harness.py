"""Fault-matrix harness: a fleet of 2 simulated prefillers + 2 decoders, a load driver (asyncio + httpx, real
sockets on 127.0.0.1) and the end-of-cell checks (pinned KV, engine streams and proxy load counters back to zero).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from tests.conftest import Fleet
from tests.support import ProxyThread, wait_until

SIM_ARGS = ("--served-model-name", "sim-model", "--max-model-len", "4096", "--prefill-tokens-per-s", "0",
            "--decode-tokens-per-s", "0")
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "Tell me about disaggregated serving."}],
        "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}


@dataclass
class Fleet4(Fleet):
    """Two prefillers and two decoders (sim processes), plus a proxy factory and the end-of-cell checks."""

    def proxy(self, **settings: Any) -> ProxyThread:
        settings.setdefault("prefill", [s.url for s in self.prefillers])
        settings.setdefault("decode", [s.url for s in self.decoders])
        settings.setdefault("retry_backoff_s", 0.01)
        return ProxyThread(**settings).start()

    def pinned(self) -> int:
        return sum(s.state()["pinned_blocks"] for s in self.prefillers)

    def engine_busy(self) -> dict[str, Any]:
        """Non-zero engine counters that must drain after a cell (streams, running/waiting, pins)."""
        out = {}
        for s in self.all:
            st = s.state()
            busy = {k: st[k] for k in ("active_streams", "running", "waiting", "pinned_blocks") if st[k]}
            if busy:
                out[f"{s.role}:{s.port}"] = busy
        return out

    def assert_clean(self, proxy: ProxyThread, timeout_s: float = 5.0) -> None:
        """Pinned KV, engine streams and the proxy's load counters are all back to zero."""
        busy: dict[str, Any] = {}

        def idle() -> bool:
            busy.clear()
            busy.update(self.engine_busy())
            return not busy

        try:
            wait_until(idle, timeout_s, 0.05, "engines idle and no pinned KV")
        except AssertionError:
            raise AssertionError(f"engines still busy after {timeout_s} s: {busy}") from None
        proxy.wait_idle(timeout_s)


@dataclass
class Result:
    """What one client request saw.  ``elapsed_s``: seconds from send to the end of the body."""

    status: int
    headers: dict[str, str]
    body: bytes
    elapsed_s: float
    events: list[dict[str, Any]] = field(default_factory=list)
    done: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        parts = []
        for ev in self.events:
            for ch in ev.get("choices") or []:
                parts.append((ch.get("delta") or {}).get("content") or ch.get("text") or "")
        return "".join(parts)

    def json(self) -> Any:
        return orjson.loads(self.body)


def parse_sse(body: bytes) -> tuple[list[dict[str, Any]], int, list[dict[str, Any]]]:
    """(events, number of [DONE], error events) of an SSE body."""
    events, errors, done = [], [], 0
    for raw in body.replace(b"\r\n", b"\n").split(b"\n\n"):
        raw = raw.strip()
        if not raw.startswith(b"data:"):
            continue
        data = raw[5:].strip()
        if data == b"[DONE]":
            done += 1
            continue
        obj = orjson.loads(data)
        (errors if "error" in obj else events).append(obj)
    return events, done, errors


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any], path: str) -> Result:
    started = time.monotonic()
    async with client.stream("POST", url + path, json=body) as resp:
        data = await resp.aread()
    res = Result(resp.status_code, dict(resp.headers), data, time.monotonic() - started)
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        res.events, res.done, res.errors = parse_sse(data)
    return res


async def drive(url: str, body: dict[str, Any] | None = None, *, n: int = 20, concurrency: int = 16,
                path: str = "/v1/chat/completions", timeout_s: float = 30.0) -> list[Result]:
    """Send ``n`` requests with at most ``concurrency`` in flight; results in completion order."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        async def bounded() -> Result:
            async with sem:
                return await one(client, url, body or CHAT, path)
        return await asyncio.gather(*(bounded() for _ in range(n)))


def run(url: str, body: dict[str, Any] | None = None, **kw: Any) -> list[Result]:
    return asyncio.run(drive(url, body, **kw))
