"""Helpers for the simulator tests: HTTP calls against an in-process sim, SSE parsing, polling with deadlines."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aiohttp

from pdproxy.tokens import sim_prompt

T = TypeVar("T")

PREFILL_STUB = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}


def sse_data(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, in order (framing must be exactly ``data: X\\n\\n``)."""
    assert text.endswith("\n\n"), text[-80:]
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    return [e[len("data: "):] for e in events]


def sse_json(text: str) -> list[dict[str, Any]]:
    """Parsed JSON events of an SSE body that ends with exactly one ``data: [DONE]``."""
    data = sse_data(text)
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1, data[-3:]
    return [json.loads(d) for d in data[:-1]]


async def post(session: aiohttp.ClientSession, url: str, body: Any, **headers: str) -> tuple[int, str, Any]:
    """POST JSON; return (status, text, headers)."""
    async with session.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.text(), resp.headers


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def eventually(cond: Callable[[], Awaitable[T]], timeout_s: float = 5.0, what: str = "") -> T:
    """Poll ``cond`` until it returns a truthy value; fail after ``timeout_s`` (never a bare sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: T | None = None
    while loop.time() < deadline:
        last = await cond()
        if last:
            return last
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}: last={last!r}")


async def prefill(session: aiohttp.ClientSession, base: str, n_tokens: int = 100, request_id: str = "r1",
                  unique_seed: int | None = None) -> dict[str, Any]:
    """Run a proxy-style prefill leg (``max_tokens=1``, the stub params); return the JSON response."""
    prompt = sim_prompt(n_tokens, unique=unique_seed is not None, seed=unique_seed or 0)
    status, text, _ = await post(session, base + "/v1/completions",
                                 {"prompt": prompt, "max_tokens": 1, "stream": False,
                                  "kv_transfer_params": PREFILL_STUB}, **{"X-Request-Id": request_id})
    assert status == 200, text
    return json.loads(text)
