"""Admission: count the prompt, check it against the engines' real limits before any engine is contacted, decide
whether it needs the prefiller at all, and own the prefill queue.

Steps of :meth:`Admission.admit`:

1. **Limit.**  ``M`` = the largest prompt some prefiller and some decoder accept (:mod:`pdproxy.engines.limits`: their
   ``max_model_len`` and real KV pool, with this request's ``max_tokens`` counted on the decoder).
2. **Bounds** (:mod:`pdproxy.admission.bounds`, no tokenizer): ``upper <= M`` → fits, no count (the common case:
   only lengths are summed, on the event loop); else the word count gives ``lower``, and ``lower > M`` →
   400 at once ("at least L+1 tokens", the way vLLM 0.32 words a truncated count) — except when ``lower`` is at
   most the ``max_model_len`` L it breaks: the bound misses BOS, so "exactly L" (vLLM's ``max_tokens`` 400) and
   "more than L" (its ``input_tokens`` 400) are told apart by an exact count.
3. **Exact count** otherwise (:mod:`pdproxy.admission.count`): a local tokenizer (``tokenizer`` / ``model_tokenizers``
   setting: a directory with ``tokenizer.json``, or ``sim``) in a worker thread with a block cache and early stop
   past ``M``; or the engine's ``/tokenize`` (a round trip; whole-prompt cache).  ``token_count = "estimate"``
   counts nothing.  If ``/tokenize`` fails (not a 4xx), the request goes on with the estimate and the engine
   enforces its own limit.
4. **Over the limit** → :class:`~pdproxy.errors.PromptTooLong` (HTTP 400, vLLM's envelope and wording, names the KV
   pool when that is the limit).  No engine received anything but, in engine mode, ``/tokenize``; no retry; no
   effect on health.

Whether the request then goes through a prefiller at all is not admission's call: the director asks the PD
decision (:mod:`pdproxy.scheduling.decider`) and admission counts the outcome (:meth:`Admission.count_path`).

Counters for metrics live in :class:`AdmissionStats` (``state.admission.stats``) and the queue's
:class:`~pdproxy.scheduling.queue.QueueStats` (``state.admission.queue.stats``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from pdproxy.admission import count as token_count
from pdproxy.admission.bounds import PromptBounds, ToolsBytes, prompt_bounds, text_bytes_floor
from pdproxy.apis.request import Api, ProxyRequest, prompt_list
from pdproxy.endpoints import Endpoint
from pdproxy.engines.limits import Limits
from pdproxy.errors import BadRequest, ProxyError, UpstreamHTTPError
from pdproxy.http.engine_headers import EngineHeaders
from pdproxy.http.upstream import Upstream
from pdproxy.scheduling import PickRequest, Scheduler
from pdproxy.scheduling.queue import PrefillQueue
from pdproxy.settings import Settings
from pdproxy.timeline import RequestContext

T = TypeVar("T")

INLINE_BYTES = 16_384
"""Request bodies up to this size are bounded/counted on the event loop; larger ones in the worker threads."""
BOUND_BYTES_PER_MESSAGE = 256
"""The byte bound's work per chat message, as bytes of :data:`INLINE_BYTES` (it sums lengths, never reads text):
chats of up to 64 messages are bounded on the event loop."""


MIN_COUNT_LIMIT_TOKENS = 1024
"""The smallest token limit ``engine_count_max_bytes_per_token`` is weighed against: a limit cut small by a large
``max_tokens`` (``max_tokens_overflow = reject``) leaves a prompt of a few hundred bytes to the engine's count."""


@dataclass(slots=True)
class AdmissionStats:
    """Plain counters.  ``pdproxy/ops/metrics.py`` exports ``counted_total[method]`` (``ids`` | ``bound`` |
    ``local`` | ``engine`` | ``estimate``), ``count_errors_total``, ``count_seconds_total``,
    ``tokenize_skipped_total`` (precise prefix keys that found their engine's ``/tokenize`` places taken) and
    ``decode_only_total[reason]`` (``short_prompt`` | ``prefillers_busy``); ``admitted_total``,
    ``disaggregated_total`` and ``rejected_total["<role>:<limit_kind>"]`` (``max_model_len`` | ``kv_pool``) are
    read by ``GET /debug/load`` (:meth:`Admission.snapshot`) — the rejections' metric is
    ``pdproxy_rejections_total{reason,detail}``, counted per answer."""

    admitted_total: int = 0
    disaggregated_total: int = 0
    rejected_total: dict[str, int] = field(default_factory=dict)
    counted_total: dict[str, int] = field(default_factory=dict)
    count_errors_total: int = 0
    count_seconds_total: float = 0.0
    tokenize_skipped_total: int = 0
    decode_only_total: dict[str, int] = field(default_factory=dict)

    @staticmethod
    def bump(counter: dict[str, int], key: str) -> None:
        counter[key] = counter.get(key, 0) + 1


def _model_sources(pairs: list[str]) -> dict[str, str]:
    """``["model=dir", …]`` → ``{model: dir}``.  Raises ``ValueError`` on an entry without ``=``."""
    out: dict[str, str] = {}
    for pair in pairs:
        model, sep, source = pair.partition("=")
        if not sep or not model or not source:
            raise ValueError(f"model_tokenizers entry {pair!r} is not MODEL=TOKENIZER")
        out[model] = source
    return out


def _view_bytes(req: ProxyRequest) -> int:
    """How large building ``req``'s count view is, in :data:`INLINE_BYTES` terms: nothing for chat and completions
    (their body is the view); for Responses and Messages :data:`BOUND_BYTES_PER_MESSAGE` per item of the prompt
    list, and an eighth of the body (tool inputs are re-encoded as JSON: ~30 ns a byte of numbers)."""
    if req.api is not Api.RESPONSES and req.api is not Api.MESSAGES:
        return 0
    items = req.body.get(req.prompt_param)
    return max(BOUND_BYTES_PER_MESSAGE * len(items) if isinstance(items, list) else 0, len(req.raw) >> 3)


class Admission:
    """Decides whether a request may enter and how many prompt tokens it has (which endpoints it fits is the
    scheduler's limits filter).

    Use as ``async with Admission(...)`` (or :meth:`start` / :meth:`aclose`): owns the tokenizer worker threads.
    ``limits``: the engines' limits; ``queue``: the prefill queue (asked whether prefillers are busy);
    ``scheduler``: picks the engine asked to ``/tokenize``; ``upstream`` sends it with ``headers``.
    """

    def __init__(self, settings: Settings, *, limits: Limits, queue: PrefillQueue, scheduler: Scheduler,
                 upstream: Upstream, headers: EngineHeaders) -> None:
        self.settings = settings
        self.limits = limits
        self.queue = queue
        self.scheduler = scheduler
        self.upstream = upstream
        self.headers = headers
        self.stats = AdmissionStats()
        s = settings
        self._sources = _model_sources(list(s.model_tokenizers))
        self._local: dict[str, token_count.LocalCounter] = {}
        self._engine_cache = token_count.BlockCache(s.token_count_cache_entries)
        self._tools_bytes = ToolsBytes()
        self._executor: ThreadPoolExecutor | None = None
        self._tokenize_slots: dict[Endpoint, asyncio.Semaphore] = {}   # per engine: /tokenize calls in flight

    async def start(self) -> None:
        """Start the worker threads and load the configured local tokenizers.  Raises ``FileNotFoundError`` for a
        tokenizer directory without ``tokenizer.json``, ``ValueError`` for ``token_count = "local"`` without a
        ``tokenizer``."""
        if self.settings.token_count == "local" and not self.settings.tokenizer:
            raise ValueError("token_count 'local' needs a tokenizer (a directory with tokenizer.json, or 'sim')")
        self._executor = ThreadPoolExecutor(self.settings.token_count_threads, thread_name_prefix="pdproxy-tokens")
        sources = {src for src in (self.settings.tokenizer, *self._sources.values()) if src and src != "engine"}
        for src in sources:
            self._local[src] = await self._offload(
                functools.partial(token_count.LocalCounter, src,
                                  cache_entries=self.settings.token_count_cache_entries,
                                  ids_cache_tokens=self.settings.token_ids_cache_tokens), size=INLINE_BYTES + 1)

    async def aclose(self) -> None:
        """Stop the worker threads (counts in progress are abandoned)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    async def __aenter__(self) -> Admission:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _offload(self, fn: Callable[[], T], *, size: int) -> T:
        """Run ``fn`` in a worker thread when the work is large (``size`` bytes), else inline."""
        if size <= INLINE_BYTES or self._executor is None:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    async def offload(self, fn: Callable[[], T], *, size: int) -> T:
        """Run ``fn`` off the event loop in the tokenizer threads when ``size`` (bytes of input, or 4 per token)
        is above :data:`INLINE_BYTES`, else inline (prefix routing hashes its block keys here)."""
        return await self._offload(fn, size=size)

    async def prompt_token_ids(self, req: ProxyRequest, ctx: RequestContext,
                               derive: Callable[[list[int]], T]) -> T | None:
        """``derive(ids)`` for the prompt's token ids, or None when they cannot be had (``token_count =
        "estimate"``, no engine answers ``/tokenize``, the template rejects the messages: the engine will say so).

        The counting path's sources, in its order: an id prompt as given; the model's local tokenizer
        (:meth:`~pdproxy.admission.count.LocalCounter.token_ids`, in a worker thread, blocks cached); else the
        engine's ``/tokenize`` (a round trip, ``tokens`` of its answer).  ``derive`` runs in the same worker thread
        as the tokenizer for large prompts (prefix routing computes its block keys there)."""
        view, chat, special = await self._offload(req.count_view, size=_view_bytes(req))   # Responses / Messages:
        # the chat they render (a 900,000-key tool_use input: 0.71 s of json.dumps), as admit builds it
        prompt = None if chat else view.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            ids = [int(t) for t in prompt]
            return await self._offload(functools.partial(derive, ids), size=4 * len(ids))
        source = self.source_for(req.model)
        if source == "estimate":
            return None
        counter = self._local.get(source)
        if counter is not None:
            def local() -> T:
                return derive(counter.token_ids(view, chat, add_special_tokens=special))
            try:
                return await self._offload(local, size=len(req.raw))
            except ValueError:
                return None
        engine_ids = await self._engine_ids(req, ctx)
        if engine_ids is None:
            return None
        return await self._offload(functools.partial(derive, engine_ids), size=4 * len(engine_ids))

    def source_for(self, model: str | None) -> str:
        """How this model's prompts are counted: ``"estimate"``, ``"engine"`` or a local tokenizer source."""
        mode = self.settings.token_count
        if mode in ("estimate", "engine"):
            return mode
        return self._sources.get(model or "") or self.settings.tokenizer or "engine"

    async def admit(self, req: ProxyRequest, ctx: RequestContext) -> None:
        """Count ``req.prompt_tokens`` and check the limits.

        Raises :class:`~pdproxy.errors.PromptTooLong` (400) when no prefiller/decoder pair can take the prompt,
        :class:`BadRequest` when the chat template rejects the messages, or the engine's own 4xx from
        ``/tokenize`` (:class:`UpstreamHTTPError`).
        """
        if req.prompts > 1 and req.api is Api.COMPLETIONS:
            prompts = prompt_list(req.body.get("prompt"))
            if prompts is not None and len(prompts) > 1:
                await self._admit_each(req, ctx, prompts)
                return
        s = self.settings
        view, chat, special = await self._offload(req.count_view, size=_view_bytes(req))   # Responses / Messages:
        # the chat they render, built in Python item by item (300,000 items held the event loop 0.25 s)
        max_output = req.max_output_tokens
        limit = self.limits.max_prompt_tokens(max_output, model=req.model)
        overhead = s.chat_template_max_overhead_tokens + (2 if special else 0)
        messages = view.get("messages") if chat else None          # the sizes: O(messages), not O(bytes)
        bounds = await self._offload(functools.partial(prompt_bounds, view, chat, template_overhead=overhead,
                                                       lower=False, tools_bytes=self._tools_bytes),
                                     size=BOUND_BYTES_PER_MESSAGE * len(messages) if isinstance(messages, list) else 0)
        if not bounds.exact and limit is not None and bounds.upper > limit and s.word_bound:
            bounds = await self._offload(functools.partial(    # the word count reads every byte: only when it decides
                prompt_bounds, view, chat, template_overhead=overhead, tools_bytes=self._tools_bytes),
                size=len(req.raw))
        lower = bounds.lower if bounds.exact or s.word_bound else 0
        if bounds.exact:                                   # token ids
            tokens, exact, method, upper = bounds.lower, True, "ids", bounds.lower
        elif limit is None or bounds.upper <= limit:       # fits: no count needed
            tokens, exact, method, upper = bounds.estimate, False, "bound", bounds.upper
        elif lower > limit and not self._ambiguous(lower, max_output, req.model):   # too long whatever the exact count
            tokens, exact, method, upper = lower, False, "bound", bounds.upper
        elif await self._too_large_to_count(req, view, chat, bounds.upper, limit):   # no engine renders it to count
            least = max(limit, 0) + 1           # what the text's size shows, whatever a limit cut by max_tokens
            violation = self.limits.violation(least, max_output, model=req.model)
            if violation is not None:
                AdmissionStats.bump(self.stats.counted_total, "bound")
                AdmissionStats.bump(self.stats.rejected_total, f"{violation.role.value}:{violation.limit_kind}")
                least = least if violation.requested else max(least, violation.limit + 1)
                ctx.prompt_tokens = least
                raise violation.error(least, exact=False)
            tokens, exact, method, upper = bounds.estimate, False, "estimate", bounds.estimate
        else:
            started = time.perf_counter()
            counted = await self._count(req, ctx, chat, bounds, limit)
            if counted is not None and self._ambiguous(counted.tokens, max_output, req.model, exact=counted.exact):
                counted = await self._count(req, ctx, chat, bounds, None)      # stopped at exactly L: go on
            self.stats.count_seconds_total += time.perf_counter() - started
            if counted is None:                            # the engine enforces its own limit
                tokens, exact, method, upper = bounds.estimate, False, "estimate", bounds.estimate
            else:
                tokens, exact, method, upper = counted.tokens, counted.exact, counted.method, counted.tokens
        AdmissionStats.bump(self.stats.counted_total, method)
        ctx.prompt_tokens = tokens
        if method != "estimate" and limit is not None and tokens > limit:
            violation = self.limits.violation(tokens, max_output, model=req.model)
            if violation is not None:
                AdmissionStats.bump(self.stats.rejected_total, f"{violation.role.value}:{violation.limit_kind}")
                raise violation.error(tokens, exact=exact)
        req.prompt_tokens = tokens
        req.prompt_tokens_upper = upper
        req.prompt_tokens_lower = tokens if exact else min(lower, tokens)
        req.prompt_tokens_exact = exact
        req.prompt_tokens_estimated = method == "estimate"
        self.stats.admitted_total += 1
        ctx.timeline.admitted_at = time.monotonic()

    async def _admit_each(self, req: ProxyRequest, ctx: RequestContext, prompts: list[Any]) -> None:
        """:meth:`admit` of a completion prompt list sent whole to one engine (not fanned out: the decoder prefills
        it, ``prompt_logprobs`` or beam search; or the prefiller judges it): each prompt is an engine request of its
        own, so each is admitted as one (the counting and limits of a single prompt), and ``req`` is sized as its
        largest.  Read as one prompt, the list was sized as token ids, one per prompt: two prompts over a decoder's
        KV pool were admitted as 2 tokens and waited forever there (a prompt over the pool is never scheduled:
        ``docs/field-reports.md``).  Each prompt's body holds only what counting a completions prompt reads
        (``model``, ``prompt``: :func:`~pdproxy.admission.count.tokenize_body`), not a copy of the client's: 1,024
        prompts beside 200,000 other keys copied 200 million entries on the event loop (3 s)."""
        largest: ProxyRequest | None = None
        model = req.body.get("model")
        for prompt in prompts:
            body = {"prompt": prompt} if model is None else {"model": model, "prompt": prompt}
            one = dataclasses.replace(req, body=body, prompts=1, _count_view=None)
            await self.admit(one, ctx)
            if largest is None or (one.prompt_tokens_upper or 0) > (largest.prompt_tokens_upper or 0):
                largest = one
        assert largest is not None
        self.stats.admitted_total -= len(prompts) - 1   # one request admitted (each prompt was counted: counted_total)
        ctx.prompt_tokens = req.prompt_tokens = largest.prompt_tokens
        req.prompt_tokens_upper = largest.prompt_tokens_upper
        req.prompt_tokens_lower = largest.prompt_tokens_lower
        req.prompt_tokens_exact = largest.prompt_tokens_exact
        req.prompt_tokens_estimated = largest.prompt_tokens_estimated

    async def _too_large_to_count(self, req: ProxyRequest, view: dict[str, Any], chat: bool, upper: int,
                                  limit: int) -> bool:
        """True when ``req``'s model is counted by an engine's ``/tokenize`` and the text it would render to count
        this prompt (:func:`~pdproxy.admission.bounds.text_bytes_floor`: media data and template layout left out)
        is more than ``engine_count_max_bytes_per_token`` bytes per token of the ``limit`` (at least 1,024 tokens'
        worth): only a chat template that drops nearly all of it (tool calls' arguments, tools) could make it fit,
        and counting it would have an engine render all of it (a 20 MB ``tool_use`` input: a 70 MB ``/tokenize``
        body that held a simulated prefiller ~40 s, past ``tokenize_timeout_s``, its ``/health`` unanswered).
        ``upper`` (tokens, at least the bytes) rules most prompts out before the text is measured."""
        ratio = self.settings.engine_count_max_bytes_per_token
        threshold = ratio * max(limit, MIN_COUNT_LIMIT_TOKENS)
        if not ratio or upper <= threshold or self.source_for(req.model) != "engine":
            return False
        floor = await self._offload(functools.partial(text_bytes_floor, view, chat), size=len(req.raw))
        return floor > threshold

    def _ambiguous(self, lower: int, max_output: int | None, model: str | None, *, exact: bool = False) -> bool:
        """True when a rejection at ``lower`` (a lower bound unless ``exact``) would hit a ``max_model_len`` of
        exactly ``lower`` or more: the word bound misses BOS and special tokens, so "exactly L" and "L + 1" cannot
        be told apart and vLLM words them differently (:meth:`~pdproxy.engines.limits.Violation.ambiguous`)."""
        violation = self.limits.violation(lower, max_output, model=model)
        return violation is not None and violation.ambiguous(lower, exact=exact)

    def count_path(self, ctx: RequestContext, decode_only: str | None) -> None:
        """Record the PD decision for an admitted request: ``decode_only`` is the reason it goes straight to a
        decoder (:mod:`pdproxy.scheduling.decider`), or None when it is disaggregated; sets
        ``ctx.disaggregated``."""
        if decode_only is None:
            self.stats.disaggregated_total += 1
            ctx.disaggregated = True
        else:
            AdmissionStats.bump(self.stats.decode_only_total, decode_only)
            ctx.disaggregated = False

    async def _count(self, req: ProxyRequest, ctx: RequestContext, chat: bool, bounds: PromptBounds,
                     limit: int | None) -> token_count.TokenCount | None:
        """The exact count (or "at least" past ``limit``; None: no early stop); None when it could not be made."""
        source = self.source_for(req.model)
        if source == "estimate":
            return None
        counter = self._local.get(source)
        view, _, special = req.count_view()
        if counter is not None:
            try:
                return await self._offload(functools.partial(counter.count, view, chat, limit,
                                                             add_special_tokens=special), size=bounds.text_bytes)
            except ValueError as exc:
                raise BadRequest(f"the chat template rejected the request: {exc}", param=req.prompt_param) from None
        return await self._engine_count(req, ctx, chat, bounds)

    async def _engine_count(self, req: ProxyRequest, ctx: RequestContext, chat: bool,
                            bounds: PromptBounds) -> token_count.TokenCount | None:
        view, _, special = req.count_view()
        key = await self._offload(functools.partial(token_count.engine_cache_key, view, chat, special),
                                  size=bounds.text_bytes)
        cached = self._engine_cache.get(key)
        if cached is not None:
            return token_count.TokenCount(cached, True, "engine")
        try:
            endpoint = self.scheduler.pick_engine(PickRequest(request_id=ctx.request_id, model=req.model))
        except ProxyError:
            self.stats.count_errors_total += 1
            return None
        body = orjson.dumps(token_count.tokenize_body(view, chat, special))
        headers = self.headers.leg(endpoint, f"{ctx.request_id}-tokenize", ctx.authorization)
        deadline = time.monotonic() + self.settings.tokenize_timeout_s
        slots = self._slots(endpoint)
        try:
            async with asyncio.timeout(self.settings.tokenize_timeout_s):
                await slots.acquire()                   # at most tokenize_max_inflight calls on this engine
        except TimeoutError:
            self.stats.count_errors_total += 1
            return None
        try:
            reply = await self.upstream.post_json(endpoint, "/tokenize", body, headers,
                                                  timeout_s=max(deadline - time.monotonic(), 0.001))
            count = token_count.parse_tokenize_reply(reply)
        except UpstreamHTTPError as exc:
            if exc.status_code in (400, 422):
                raise                         # the engine would refuse the completion the same way
            self.stats.count_errors_total += 1
            return None
        except (ProxyError, ValueError):
            self.stats.count_errors_total += 1
            return None
        finally:
            slots.release()
        self._engine_cache.put(key, count)
        return token_count.TokenCount(count, True, "engine")

    def _slots(self, endpoint: Endpoint) -> asyncio.Semaphore:
        """``endpoint``'s places for ``/tokenize`` calls (``tokenize_max_inflight``): one engine that does not
        answer holds its own places, not every engine's."""
        slots = self._tokenize_slots.get(endpoint)
        if slots is None:
            slots = self._tokenize_slots[endpoint] = asyncio.Semaphore(self.settings.tokenize_max_inflight)
        return slots

    async def _engine_ids(self, req: ProxyRequest, ctx: RequestContext) -> list[int] | None:
        """The prompt's token ids from an engine's ``/tokenize`` (None when no engine answers with them, or when
        ``tokenize_max_inflight`` calls are already out to the engine picked: prefix routing then keys the text,
        without waiting; counted in ``tokenize_skipped_total``)."""
        try:
            endpoint = self.scheduler.pick_engine(PickRequest(request_id=ctx.request_id, model=req.model))
        except ProxyError:
            return None
        slots = self._slots(endpoint)
        if slots.locked():
            self.stats.tokenize_skipped_total += 1
            return None
        view, chat, special = req.count_view()
        body = orjson.dumps(token_count.tokenize_body(view, chat, special))
        headers = self.headers.leg(endpoint, f"{ctx.request_id}-tokenize", ctx.authorization)
        await slots.acquire()                          # not locked: no wait
        try:
            reply = await self.upstream.post_json(endpoint, "/tokenize", body, headers,
                                                  timeout_s=self.settings.tokenize_timeout_s)
        except ProxyError:
            self.stats.count_errors_total += 1
            return None
        finally:
            slots.release()
        return token_count.parse_tokenize_ids(reply)

    def snapshot(self) -> dict[str, Any]:
        """Counters and queue state as a plain dict (debug endpoint, tests)."""
        q = self.queue
        return {"stats": {k: getattr(self.stats, k) for k in AdmissionStats.__slots__},
                "queue": {"depth": q.depth, **{k: getattr(q.stats, k) for k in type(q.stats).__slots__}},
                "count_cache": {src: {"hits": c.cache.hits, "misses": c.cache.misses} for src, c in self._local.items()},
                "engine_count_cache": {"hits": self._engine_cache.hits, "misses": self._engine_cache.misses}}

