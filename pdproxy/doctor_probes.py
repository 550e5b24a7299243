"""The active probes of ``pdproxy doctor``: a P→D round trip with a tool call, and a cold long-context probe.

Both send real requests to the engines, so ``pdproxy doctor`` has switches to skip them on a busy production
deployment.  Facts they rely on:

- the P→D round trip is the proxy's own handshake (:mod:`pdproxy.kv_transfer`, reference §1): prefill with the
  ``do_remote_decode`` stub and ``max_tokens=1``; a prefiller with a KV connector answers with
  ``kv_transfer_params``; the decoder gets the original body plus those params and pulls the KV.  Both legs
  carry the same ``X-Request-Id`` (reference §1.6).  A tool call expects ``finish_reason: "tool_calls"``
  (vLLM needs ``--enable-auto-tool-choice --tool-call-parser …`` for that; seed 000's final check);
- the cold probe sends plain completions (no ``kv_transfer_params``, so nothing stays pinned) of unique text —
  a counter and a nonce in every paragraph, so the prefix cache cannot help (seed 000: repeated filler "passed"
  49.4K tokens, unique text only 13.4K) — with ``max_tokens=1`` at growing sizes up to ``max_model_len − 1``.
  A size that does not finish within the timeout has *stalled*: the request is abandoned by closing its
  connection, which makes vLLM abort it (reference §1.5).  Sizes are measured with the engine's ``/tokenize``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx

from pdproxy import kv_transfer
from pdproxy.endpoints import Endpoint

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "city name"}},
                   "required": ["city"]}}}]
TOOL_MESSAGES = [{"role": "user", "content": "What is the weather in Paris right now? Use the get_weather tool."}]


@dataclass(slots=True)
class RoundTrip:
    """Outcome of one P→D round trip.  Times in seconds; ``error`` names the leg that failed."""

    prefiller: str
    decoder: str
    kv_transfer_params: dict[str, Any] | None = None
    finish_reason: str | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    error: str | None = None


@dataclass(slots=True)
class ColdProbe:
    """Outcome of a cold long-context probe on one engine.  Sizes are prompt tokens."""

    endpoint: str
    limit: int
    completed: list[tuple[int, float]] = field(default_factory=list)  # (tokens, seconds)
    stalled_at: int | None = None
    error: str | None = None
    skipped: str | None = None

    @property
    def largest_ok(self) -> int | None:
        """The largest prompt (tokens) that completed, or None if none did."""
        return max((n for n, _ in self.completed), default=None)


def _headers(endpoint: Endpoint, request_id: str, api_key: str | None) -> dict[str, str]:
    headers = {"X-Request-Id": request_id, **endpoint.extra_headers()}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _brief(resp: httpx.Response) -> str:
    text = resp.text.strip().replace("\n", " ")
    return f"HTTP {resp.status_code}: {text[:200]}"


async def pd_round_trip(client: httpx.AsyncClient, prefiller: Endpoint, decoder: Endpoint, model: str, *,
                        timeout_s: float, api_key: str | None = None, tools: bool = True) -> RoundTrip:
    """Chat (with a tool unless ``tools`` is False) through ``prefiller`` then ``decoder``, the way the proxy
    does.  Never raises for engine or transport errors (they go to ``RoundTrip.error``)."""
    out = RoundTrip(prefiller.name, decoder.name)
    body: dict[str, Any] = {"model": model, "messages": TOOL_MESSAGES, "max_tokens": 64, "temperature": 0}
    if tools:
        body.update(tools=TOOLS, tool_choice="auto")
    rid = f"pdproxy-doctor-{uuid.uuid4().hex}"
    path = "/v1/chat/completions"
    try:
        t0 = time.monotonic()
        r = await client.post(prefiller.url + path, json=kv_transfer.prefill_body(body),
                              headers=_headers(prefiller, rid, api_key), timeout=timeout_s)
        out.prefill_s = time.monotonic() - t0
        if r.status_code != 200:
            out.error = f"prefill leg: {_brief(r)}"
            return out
        out.kv_transfer_params = kv_transfer.extract_params(r.json())
        if out.kv_transfer_params is None:
            return out  # no KV connector on the prefiller: nothing pinned, nothing to pull
        t0 = time.monotonic()
        r = await client.post(decoder.url + path, json=kv_transfer.decode_body(body, out.kv_transfer_params),
                              headers=_headers(decoder, rid, api_key), timeout=timeout_s)
        out.decode_s = time.monotonic() - t0
        if r.status_code != 200:
            out.error = f"decode leg: {_brief(r)}"
            return out
        choices = r.json().get("choices") or [{}]
        out.finish_reason = choices[0].get("finish_reason")
    except httpx.TimeoutException:
        out.error = f"no answer within {timeout_s:.0f} s"
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{exc.__class__.__name__}: {exc}"
    return out


def cold_paragraph(i: int, nonce: str) -> str:
    """Paragraph ``i`` of a probe: unique by its counter and the probe's nonce."""
    return (f"Section {i} of cold probe {nonce}: paragraph number {i} is unique text, counted so that no "
            f"prefix-cache block can be shared between probes or paragraphs ({nonce}-{i}).\n")


class PromptSizer:
    """Builds unique prompts of about ``n`` tokens for one engine, measured with its ``/tokenize``
    (vLLM ``serve/tokenize``: ``{"count", "max_model_len", "tokens"}``; reference §2.1).  Falls back to
    4 characters per token when the engine has no ``/tokenize``."""

    def __init__(self, client: httpx.AsyncClient, endpoint: Endpoint, model: str, api_key: str | None,
                 timeout_s: float) -> None:
        self.client, self.endpoint, self.model = client, endpoint, model
        self.api_key, self.timeout_s = api_key, timeout_s
        self.per_paragraph: float | None = None
        self.exact = True

    async def count(self, text: str) -> int | None:
        """Prompt tokens of ``text`` per the engine's ``POST /tokenize`` (its ``count`` field; vLLM
        ``serve/tokenize/protocol.py``, reference §2.1), or None when the engine has no usable ``/tokenize``
        (transport error, non-200, malformed JSON); then ``exact`` becomes False.  Never raises."""
        try:
            r = await self.client.post(self.endpoint.url + "/tokenize", json={"model": self.model, "prompt": text},
                                       headers=_headers(self.endpoint, uuid.uuid4().hex, self.api_key),
                                       timeout=self.timeout_s)
            if r.status_code == 200:
                return int(r.json()["count"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            pass
        self.exact = False
        return None

    async def build(self, target: int, limit: int) -> tuple[str, int]:
        """``(text, tokens)``: a unique prompt of about ``min(target, limit)`` tokens, at most ``limit`` when the
        engine can count (a few ``/tokenize`` calls); otherwise an estimate."""
        target = min(target, limit)
        nonce = uuid.uuid4().hex[:12]
        if self.per_paragraph is None:
            sample = "".join(cold_paragraph(i, nonce) for i in range(32))
            n = await self.count(sample)
            self.per_paragraph = max(1.0, (n if n else len(sample) / 4) / 32)
        best: tuple[str, int] | None = None
        for _ in range(6):
            paragraphs = max(1, int(target / self.per_paragraph))
            text = "".join(cold_paragraph(i, nonce) for i in range(paragraphs))
            counted = await self.count(text) if self.exact else None
            if counted is None:
                return text, min(limit, len(text) // 4)
            self.per_paragraph = max(1.0, counted / paragraphs)  # refine with what the engine counted
            if counted <= limit and (best is None or counted > best[1]):
                best = (text, counted)
            if counted <= limit and counted >= target - 2 * self.per_paragraph:
                break
        return best if best is not None else (text, counted)


def cold_sizes(limit: int, start: int) -> list[int]:
    """Doubling sizes from ``start`` up to ``limit`` (the last one is ``limit`` itself)."""
    sizes, n = [], max(1, min(start, limit))
    while n < limit:
        sizes.append(n)
        n *= 2
    sizes.append(limit)
    return sizes


async def cold_probe(client: httpx.AsyncClient, endpoint: Endpoint, model: str, max_model_len: int, *,
                     start_tokens: int, timeout_s: float, deadline: float, bisect_steps: int = 2,
                     api_key: str | None = None) -> ColdProbe:
    """Probe growing cold prompts on one engine until one stalls, then bisect a little (``bisect_steps``).

    ``deadline`` is a ``time.monotonic()`` instant after which no new size is tried.  Never raises for engine or
    transport errors.
    """
    limit = max_model_len - 1  # max_tokens=1 must still fit: prompt + 1 ≤ max_model_len
    out = ColdProbe(endpoint.name, limit)
    sizer = PromptSizer(client, endpoint, model, api_key, timeout_s)

    async def attempt(target: int) -> bool | None:
        """True: completed; False: stalled; None: error (recorded)."""
        text, tokens = await sizer.build(target, limit)
        body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0}
        t0 = time.monotonic()
        try:
            r = await client.post(endpoint.url + "/v1/completions", json=body, timeout=timeout_s,
                                  headers=_headers(endpoint, f"pdproxy-doctor-cold-{uuid.uuid4().hex}", api_key))
        except httpx.TimeoutException:
            out.stalled_at = tokens if out.stalled_at is None else min(out.stalled_at, tokens)
            return False
        except httpx.HTTPError as exc:
            out.error = f"{tokens:,} tokens: {exc.__class__.__name__}: {exc}"
            return None
        if r.status_code != 200:
            out.error = f"{tokens:,} tokens: {_brief(r)}"
            return None
        usage = r.json().get("usage") or {}
        out.completed.append((int(usage.get("prompt_tokens") or tokens), time.monotonic() - t0))
        return True

    for size in cold_sizes(limit, start_tokens):
        if time.monotonic() >= deadline:
            out.skipped = f"time budget used up before {size:,} tokens"
            return out
        ok = await attempt(size)
        if ok is None:
            return out
        if not ok:
            break
    else:
        return out
    for _ in range(bisect_steps):
        lo, hi = out.largest_ok or 0, out.stalled_at or limit
        if hi - lo < 64 or time.monotonic() >= deadline:
            break
        if await attempt((lo + hi) // 2) is None:
            break
    return out
