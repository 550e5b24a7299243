"""The active probes of ``pdproxy doctor``: a P→D round trip with a tool call, and a cold long-context probe.

Both send real requests to the engines, so ``pdproxy doctor`` has switches to skip them on a busy production
deployment.  Facts they rely on:

- the P→D round trip is the proxy's own handshake (:mod:`pdproxy.apis.kv_transfer`): prefill with the
  ``do_remote_decode`` stub and ``max_tokens=1``; a prefiller with a KV connector answers with
  ``kv_transfer_params``; the decoder gets the original body plus those params and pulls the KV.  Both legs
  carry the same ``X-Request-Id`` (vLLM's ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py`` does the
  same).  A tool call expects ``finish_reason: "tool_calls"`` (vLLM needs ``--enable-auto-tool-choice
  --tool-call-parser …`` for that; verification step 3 in ``docs/field-reports.md``);
- the cold probe sends plain completions (no ``kv_transfer_params``, so nothing stays pinned) of unique text —
  a counter and a nonce in every paragraph, so the prefix cache cannot help (``docs/field-reports.md``: repeated
  filler "passed" 49.4K tokens, unique text only 13.4K) — with ``max_tokens=1``.  Sizes are measured with the
  engine's ``/tokenize`` (vLLM ``vllm/entrypoints/serve/tokenize/protocol.py``: ``{"count", "max_model_len",
  "tokens"}``).  A size that does not finish within its wait has *stalled*: the request is abandoned by closing
  its connection, which makes vLLM abort it (``vllm/entrypoints/serve/utils/api_utils.py::with_cancellation``).

Two plans (:func:`cold_probe`):

- **boundary** — the engine's KV pool is below ``max_model_len`` (``kv_pool``'s static check already proved the
  cliff): one prompt just under the pool, then one just over it.  The under-pool time calibrates how long the
  over-pool prompt is given (:func:`stall_wait_s`), so the confirmation costs seconds, not ``max_model_len``'s
  worth of prefill;
- **ladder** — otherwise: doubling sizes up to ``max_model_len − 1``, each given a wait scaled from the last
  size's time, then a bisection between the last success and the first stall.

Every attempt is reported to a :class:`ProbeProgress` as it starts and ends (``pdproxy doctor`` prints it).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import httpx
import orjson

from pdproxy.apis import kv_transfer
from pdproxy.endpoints import Endpoint

Outcome = Literal["ok", "stalled", "error"]
Plan = Literal["boundary", "ladder"]


class ProbeProgress(Protocol):
    """Receives each cold-probe attempt as it starts (``wait_s``: how long it is given) and ends."""

    def attempt_started(self, endpoint: str, tokens: int, wait_s: float) -> None: ...

    def attempt_ended(self, endpoint: str, tokens: int, outcome: Outcome, elapsed_s: float) -> None: ...


class NoProgress:
    """A :class:`ProbeProgress` that ignores everything."""

    def attempt_started(self, endpoint: str, tokens: int, wait_s: float) -> None:
        """Ignore the start of an attempt."""

    def attempt_ended(self, endpoint: str, tokens: int, outcome: Outcome, elapsed_s: float) -> None:
        """Ignore the end of an attempt."""


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
class Attempt:
    """One cold prompt: its size (prompt tokens), what happened, how long it ran and was allowed to (seconds)."""

    tokens: int
    outcome: Outcome
    elapsed_s: float
    wait_s: float


@dataclass(slots=True)
class ColdProbe:
    """Outcome of a cold long-context probe on one engine.  Sizes are prompt tokens.

    ``plan``: ``boundary`` (``kv_pool`` below ``max_model_len``: one prompt under the pool, one over) or ``ladder``;
    ``limit``: the largest prompt the engine declares it accepts (``max_model_len − 1``); ``kv_pool``: the pool the
    boundary plan probes around (None for a ladder)."""

    endpoint: str
    limit: int
    plan: Plan = "ladder"
    kv_pool: int | None = None
    attempts: list[Attempt] = field(default_factory=list)
    error: str | None = None
    skipped: str | None = None

    @property
    def completed(self) -> list[tuple[int, float]]:
        """``(tokens, seconds)`` of every attempt that completed."""
        return [(a.tokens, a.elapsed_s) for a in self.attempts if a.outcome == "ok"]

    @property
    def largest_ok(self) -> int | None:
        """The largest prompt (tokens) that completed, or None if none did."""
        return max((n for n, _ in self.completed), default=None)

    @property
    def stalled_at(self) -> int | None:
        """The smallest prompt (tokens) that stalled, or None if none did."""
        return min((a.tokens for a in self.attempts if a.outcome == "stalled"), default=None)

    def wait_of(self, tokens: int) -> float | None:
        """How long (seconds) the attempt of ``tokens`` tokens was given, or None if there was none."""
        return next((a.wait_s for a in self.attempts if a.tokens == tokens), None)


@dataclass(frozen=True, slots=True)
class ColdPlan:
    """The knobs of one cold probe: ``start_tokens`` (first ladder size), ``min_wait_s`` / ``max_wait_s`` (bounds
    of the wait given to one size, seconds), ``deadline`` (``time.monotonic()`` instant after which no size is
    started and no wait runs past), ``bisect_steps`` (ladder sizes tried between the last success and the first
    stall), ``margin_tokens`` (how far under / over the pool the boundary prompts aim)."""

    start_tokens: int = 1024
    min_wait_s: float = 5.0
    max_wait_s: float = 30.0
    deadline: float = float("inf")
    bisect_steps: int = 2
    margin_tokens: int = 64


def stall_wait_s(tokens: int, last: tuple[int, float] | None, *, min_s: float, max_s: float) -> float:
    """How long a cold prompt of ``tokens`` tokens is given before it counts as stalled (seconds).

    ``last``: ``(tokens, seconds)`` of the largest prompt that completed so far.  Prefill time grows at most
    quadratically with the prompt (attention), so the wait is 3 × ``seconds × (tokens / last_tokens)²``, within
    ``[min_s, max_s]``; with nothing completed yet it is ``max_s``.
    """
    if last is None or last[0] <= 0:
        return max_s
    n0, t0 = last
    scale = max(1.0, tokens / n0) ** 2
    return min(max_s, max(min_s, 3.0 * t0 * scale))


def _headers(endpoint: Endpoint, request_id: str, api_key: str | None) -> dict[str, str]:
    headers = {"X-Request-Id": request_id, **endpoint.extra_headers()}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def _brief(resp: httpx.Response) -> str:
    text = resp.text.strip().replace("\n", " ")
    return f"HTTP {resp.status_code}: {text[:200]}"


def _round_trip_chat(model: str, tools: bool) -> dict[str, Any]:
    """The round trip's chat body (with the ``get_weather`` tool when ``tools``), built afresh for each probe: no
    module-level object is shared into a request body."""
    body: dict[str, Any] = {"model": model, "messages": [
        {"role": "user", "content": "What is the weather in Paris right now? Use the get_weather tool."}],
        "max_tokens": 64, "temperature": 0}
    if tools:
        body["tools"] = [{"type": "function", "function": {
            "name": "get_weather", "description": "Current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "city name"}},
                           "required": ["city"]}}}]
        body["tool_choice"] = "auto"
    return body


async def pd_round_trip(client: httpx.AsyncClient, prefiller: Endpoint, decoder: Endpoint, model: str, *,
                        timeout_s: float, api_key: str | None = None, tools: bool = True) -> RoundTrip:
    """Chat (with a tool unless ``tools`` is False) through ``prefiller`` then ``decoder``, the way the proxy
    does; each leg is given ``timeout_s`` seconds.  Never raises for engine or transport errors (they go to
    ``RoundTrip.error``)."""
    out = RoundTrip(prefiller.name, decoder.name)
    body = _round_trip_chat(model, tools)
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
        handle = kv_transfer.extract_params(kv_transfer.load_prefill_answer(r.content))
        if handle is None:
            return out  # no KV connector on the prefiller: nothing pinned, nothing to pull
        out.kv_transfer_params = handle.params()
        t0 = time.monotonic()
        r = await client.post(decoder.url + path, content=orjson.dumps(kv_transfer.decode_body(body, handle)),
                              headers={**_headers(decoder, rid, api_key), "Content-Type": "application/json"},
                              timeout=timeout_s)
        out.decode_s = time.monotonic() - t0
        if r.status_code != 200:
            out.error = f"decode leg: {_brief(r)}"
            return out
        choices = r.json().get("choices") or [{}]
        out.finish_reason = choices[0].get("finish_reason")
    except httpx.TimeoutException:
        out.error = f"no answer within {timeout_s:g} s"
    except (httpx.HTTPError, ValueError) as exc:
        out.error = f"{exc.__class__.__name__}: {exc}"
    return out


def cold_paragraph(i: int, nonce: str) -> str:
    """Paragraph ``i`` of a probe: unique by its counter and the probe's nonce."""
    return (f"Section {i} of cold probe {nonce}: paragraph number {i} is unique text, counted so that no "
            f"prefix-cache block can be shared between probes or paragraphs ({nonce}-{i}).\n")


class PromptSizer:
    """Builds unique prompts of a wanted size for one engine, measured with its ``/tokenize`` (``count``).  Falls
    back to 4 characters per token when the engine has no ``/tokenize`` (then sizes are estimates)."""

    def __init__(self, client: httpx.AsyncClient, endpoint: Endpoint, model: str, api_key: str | None,
                 timeout_s: float) -> None:
        self.client, self.endpoint, self.model = client, endpoint, model
        self.api_key, self.timeout_s = api_key, timeout_s
        self.per_paragraph: float | None = None
        self.exact = True

    async def count(self, text: str) -> int | None:
        """Prompt tokens of ``text`` per the engine's ``POST /tokenize`` (its ``count`` field), or None when the
        engine has no usable ``/tokenize`` (transport error, non-200, malformed JSON); then ``exact`` becomes
        False.  Never raises."""
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

    async def build(self, lo: int, hi: int) -> tuple[str, int]:
        """``(text, tokens)``: a unique prompt whose size is within ``[lo, hi]`` tokens when the engine can count
        (a few ``/tokenize`` calls), else the largest one found under ``hi`` — never one over ``hi`` when a
        smaller one exists, since over ``max_model_len`` is the engine's 400, not a finding; an estimate
        aiming at the middle without ``/tokenize``.

        Tokens grow strictly with the number of paragraphs, so the search keeps the largest paragraph count
        known to fit and the smallest known not to, and never tries outside them.  Its guesses follow a line
        through the last two counts (tokens = a fixed part — BOS, the template — plus a part per paragraph), so
        a fixed part larger than a paragraph does not slow it down; if its tries run out with nothing seen under
        ``hi``, it tries the smallest count not yet known to be over (one more ``/tokenize``)."""
        lo, hi = max(1, min(lo, hi)), max(1, hi)
        target = (lo + hi) // 2
        nonce = uuid.uuid4().hex[:12]
        if self.per_paragraph is None:
            sample = "".join(cold_paragraph(i, nonce) for i in range(32))
            n = await self.count(sample)
            self.per_paragraph = max(1.0, (n if n else len(sample) / 4) / 32)
        under: tuple[str, int, int] | None = None        # (text, tokens, paragraphs): the largest seen ≤ hi
        over: tuple[str, int, int] | None = None         # the smallest seen > hi
        last: tuple[int, int] | None = None              # (paragraphs, tokens) of the try before
        paragraphs = max(1, round(target / self.per_paragraph))
        for _ in range(9):
            text = "".join(cold_paragraph(i, nonce) for i in range(paragraphs))
            got = await self.count(text) if self.exact else None
            if got is None:
                return text, max(1, len(text) // 4)
            if lo <= got <= hi:
                return text, got
            if got < lo:
                under = (text, got, paragraphs) if under is None or got > under[1] else under
            else:
                over = (text, got, paragraphs) if over is None or got < over[1] else over
            floor = under[2] + 1 if under is not None else 1
            ceiling = over[2] - 1 if over is not None else None
            if ceiling is not None and floor > ceiling:
                break                                     # no paragraph count lands inside [lo, hi]
            if last is not None and last[0] != paragraphs and last[1] != got:
                self.per_paragraph = max(1.0, (got - last[1]) / (paragraphs - last[0]))
            else:
                self.per_paragraph = max(1.0, got / paragraphs)
            last = (paragraphs, got)
            guess = paragraphs + round((target - got) / self.per_paragraph)
            paragraphs = max(floor, guess if ceiling is None else min(guess, ceiling))
        else:
            if under is None and over is not None and over[2] > 1:    # the smallest prompt may still fit
                text = "".join(cold_paragraph(i, nonce) for i in range(1))
                got = await self.count(text)
                if got is not None and got <= hi:
                    return text, got
        if under is not None:
            return under[0], under[1]
        assert over is not None
        return over[0], over[1]


def cold_sizes(limit: int, start: int) -> list[int]:
    """Doubling sizes from ``start`` up to ``limit`` (the last one is ``limit`` itself)."""
    sizes, n = [], max(1, min(start, limit))
    while n < limit:
        sizes.append(n)
        n *= 2
    sizes.append(limit)
    return sizes


class _Prober:
    """One engine's cold probe: builds prompts, sends them, records :class:`Attempt` s (see :func:`cold_probe`)."""

    def __init__(self, client: httpx.AsyncClient, endpoint: Endpoint, model: str, plan: ColdPlan,
                 api_key: str | None, progress: ProbeProgress, out: ColdProbe) -> None:
        self.client, self.endpoint, self.model, self.plan = client, endpoint, model, plan
        self.api_key, self.progress, self.out = api_key, progress, out
        self.sizer = PromptSizer(client, endpoint, model, api_key, min(10.0, plan.max_wait_s))

    def remaining_s(self) -> float:
        return self.plan.deadline - time.monotonic()

    def last_ok(self) -> tuple[int, float] | None:
        done = self.out.completed
        return max(done) if done else None

    async def attempt(self, lo: int, hi: int) -> Outcome | None:
        """Send one prompt of ``[lo, hi]`` tokens.  None: not sent (no time left; ``skipped`` is set)."""
        if self.remaining_s() < 1.0:
            self.out.skipped = f"time budget used up before {lo:,} tokens"
            return None
        text, tokens = await self.sizer.build(lo, hi)
        wait = min(stall_wait_s(tokens, self.last_ok(), min_s=self.plan.min_wait_s, max_s=self.plan.max_wait_s),
                   self.remaining_s())
        if wait < 1.0:
            self.out.skipped = f"time budget used up before {tokens:,} tokens"
            return None
        name = self.endpoint.name
        self.progress.attempt_started(name, tokens, wait)
        body = {"model": self.model, "prompt": text, "max_tokens": 1, "temperature": 0}
        t0 = time.monotonic()
        outcome: Outcome = "ok"
        try:
            r = await self.client.post(self.endpoint.url + "/v1/completions", json=body, timeout=wait,
                                       headers=_headers(self.endpoint, f"pdproxy-doctor-cold-{uuid.uuid4().hex}",
                                                        self.api_key))
            if r.status_code != 200:
                outcome, self.out.error = "error", f"{tokens:,} tokens: {_brief(r)}"
            else:
                usage = r.json().get("usage") or {}
                tokens = int(usage.get("prompt_tokens") or tokens)
        except httpx.TimeoutException:  # closing the connection makes vLLM abort the request
            outcome = "stalled"
        except (httpx.HTTPError, ValueError) as exc:
            outcome, self.out.error = "error", f"{tokens:,} tokens: {exc.__class__.__name__}: {exc}"
        elapsed = time.monotonic() - t0
        self.out.attempts.append(Attempt(tokens, outcome, elapsed, wait))
        self.progress.attempt_ended(name, tokens, outcome, elapsed)
        return outcome

    async def boundary(self, pool: int) -> None:
        """One prompt just under the pool (it must fit, with a token to spare), then one just over."""
        m = self.plan.margin_tokens
        under = min(pool - 1, self.out.limit)
        if await self.attempt(max(1, under - m), under) is None:
            return
        await self.attempt(pool + 1, pool + m)

    async def ladder(self) -> None:
        """Doubling sizes until one stalls, then ``bisect_steps`` sizes between the last success and the stall."""
        limit = self.out.limit
        for size in cold_sizes(limit, self.plan.start_tokens):
            outcome = await self.attempt(max(1, size - self.plan.margin_tokens), size)
            if outcome is None or outcome == "error":
                return
            if outcome == "stalled":
                break
        else:
            return
        for _ in range(self.plan.bisect_steps):
            lo, hi = self.out.largest_ok or 0, self.out.stalled_at or limit
            if hi - lo < 2 * self.plan.margin_tokens:
                break
            mid = (lo + hi) // 2
            if await self.attempt(mid - self.plan.margin_tokens // 2, mid + self.plan.margin_tokens // 2) in (
                    None, "error"):
                break


async def cold_probe(client: httpx.AsyncClient, endpoint: Endpoint, model: str, max_model_len: int, *,
                     kv_pool_tokens: int | None = None, plan: ColdPlan = ColdPlan(), api_key: str | None = None,
                     progress: ProbeProgress | None = None) -> ColdProbe:
    """Probe one engine with cold prompts (module docstring: the boundary plan when ``kv_pool_tokens`` is below
    ``max_model_len``, else the ladder).  Never raises for engine or transport errors, and starts nothing after
    ``plan.deadline``."""
    limit = max_model_len - 1  # max_tokens=1 must still fit: prompt + 1 ≤ max_model_len
    boundary = kv_pool_tokens is not None and 1 < kv_pool_tokens < max_model_len
    out = ColdProbe(endpoint.name, limit, plan="boundary" if boundary else "ladder",
                    kv_pool=kv_pool_tokens if boundary else None)
    prober = _Prober(client, endpoint, model, plan, api_key, progress or NoProgress(), out)
    if boundary and kv_pool_tokens is not None:
        await prober.boundary(kv_pool_tokens)
    else:
        await prober.ladder()
    return out
