"""The request path: admit → prefill (queue → prefiller) → decode → relay, each a named step.

``Director.serve`` is the whole lifecycle of one completion request on one screen; the legs live in
:mod:`pdproxy.pd.prefill` and :mod:`pdproxy.pd.decode`, and every endpoint is chosen by the scheduler
(:mod:`pdproxy.scheduling`).  Leases and upstream responses live in ``AsyncExitStack``s, so success, error and
client disconnect (the handler cancels this coroutine) release everything the same way.

Failure policy, decided here and in the two leg modules and nowhere else:

- **prefill**: a prefiller that refuses, resets, times out or answers 502/503/504 is replaced by another one
  (``prefill_attempts``, jittered exponential backoff) — by one that failed the request already when no other
  could take it, as on the decode side (a lone prefiller is tried again; its breaker decides); a 500 is retried at most once elsewhere; a 4xx is the
  request's fault and passes through at once.  ``Retry-After`` holds that prefiller's breaker open.
- **decode, before the decoder's first event reached the client**: another decoder (``decode_attempts``).  When
  the connection was refused the decoder never saw the request and the KV handle is reused; otherwise the KV may
  have been pulled or freed, so the prefill runs again for the new pair and the old handle is released.  When the
  attempts run out or no decoder is left, the client gets the last decoder's own error answer, or — after a
  refusal, reset or timeout — 503 with ``Retry-After``, as on the prefill side.
- **after the first event**: never replayed; with ``stream_continuation`` an eligible chat / completions stream
  continues token-exact on a new P→D pair (:mod:`pdproxy.pd.continuation`), otherwise the relay sends an SSE
  error event + ``[DONE]``; vLLM-Ascend's ``stop_reason "recomputed"`` is continued on a new P→D pair
  (:mod:`pdproxy.apis.recompute`).
- **leaving early** (client disconnect, deadline, error) between the prefill and the decoder's first event: the
  prefiller's pinned KV is released by a release leg (:mod:`pdproxy.pd.kv_release`); leaving while the prefill
  leg is in flight, its answer is still awaited (``prefill_cancel_grace_s``) and released the same way, since the
  engine may have finished and pinned the KV already.

A request for a model no decoder serves is vLLM's 404 before anything else (:mod:`pdproxy.engines.models`); a
request of several sequences (``n > 1``, a completion prompt list) runs one P→D path per sequence
(:mod:`pdproxy.pd.fanout`), each the same :meth:`Director.run_sequence` as a single request.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import orjson

from pdproxy.admission.admission import Admission
from pdproxy.apis import recompute
from pdproxy.apis.request import Api, ProxyRequest, parse_request
from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.health import HealthMonitor
from pdproxy.engines.models import ServedModels
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import (
    DecodeFailed,
    NoEndpointAvailable,
    ProxyError,
    UpstreamHTTPError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from pdproxy.http.engine_headers import EngineHeaders
from pdproxy.http.upstream import Upstream
from pdproxy.ops.tracing import NO_TRACING, Tracing
from pdproxy.pd import continuation, fanout, prefill_answer
from pdproxy.pd.backoff import Backoff
from pdproxy.pd.decode import DecodeLeg, routing_headers
from pdproxy.pd.kv_release import KVReleaser
from pdproxy.pd.prefill import PrefillLeg, PrefillResult
from pdproxy.pd.responder import Responder
from pdproxy.prefix.source import NoPrefix, PrefixSource
from pdproxy.scheduling import PickRequest, Scheduler
from pdproxy.scheduling.decider import PDDecision
from pdproxy.scheduling.queue import PrefillQueue
from pdproxy.settings import Settings
from pdproxy.timeline import RequestContext


class Director:
    """Runs requests through admission, the prefill and decode legs and the relay.

    ``admission`` admits; ``decision`` (from the settings and ``queue``) says whether a request skips the
    prefiller; ``scheduler`` answers "could any decoder take it" before a prefill is spent (and picks
    inside the legs); ``queue`` grants prefill slots; ``pool``, ``health``, ``upstream`` and ``headers`` serve the
    legs; ``releaser`` frees KV that no decoder will read; ``prefix`` supplies prefix hints; ``tracing`` spans
    each step (:mod:`pdproxy.ops.tracing`; off by default); ``live`` lists the continuable streams per decoder
    (:mod:`pdproxy.pd.continuation`, moved by a drain with ``migrate``).  :meth:`pdproxy.app.state.ProxyState.director`
    wires one from the proxy's components.
    """

    def __init__(self, settings: Settings, *, admission: Admission, scheduler: Scheduler, queue: PrefillQueue,
                 pool: EndpointPool, health: HealthMonitor, upstream: Upstream, headers: EngineHeaders,
                 releaser: KVReleaser, prefix: PrefixSource | None = None, tracing: Tracing = NO_TRACING,
                 served: ServedModels | None = None, live: continuation.LiveStreams | None = None) -> None:
        self.settings = settings
        self.served = served
        self.admission = admission
        self.scheduler = scheduler
        self.kv_release = releaser
        self.prefix: PrefixSource = prefix or NoPrefix()
        self.tracing = tracing
        self.upstream = upstream
        self.headers = headers
        self.backoff = Backoff(settings.retry_backoff_s, settings.retry_backoff_max_s)
        self.no_endpoint_wait = Backoff(0.05, 1.0)      # a continuation leg no endpoint could take, tried again
        self.prefill = PrefillLeg(settings, queue=queue, pool=pool, health=health, upstream=upstream,
                                  headers=headers, backoff=self.backoff, tracing=tracing, releaser=releaser)
        self.decision = PDDecision.from_settings(settings, queue)
        self.decode = DecodeLeg(settings, scheduler=scheduler, pool=pool, health=health, upstream=upstream,
                                headers=headers, tracing=tracing, live=live, limits=admission.limits)
        self.fan_out = fanout.FanOut(admit=self.admit, run=self.run_sequence,
                                     max_sequences=settings.fan_out_max_sequences,
                                     max_bytes=settings.max_body_bytes, max_items=settings.max_json_items)

    async def aclose(self) -> None:
        """Let background release legs finish (bounded); the app lifespan calls this before stopping state."""
        await self.kv_release.aclose()

    async def serve(self, req: ProxyRequest, ctx: RequestContext, out: Responder) -> None:
        """Serve one completion request end to end.  Raises :class:`~pdproxy.errors.ProxyError` for the handler
        to send."""
        with self.tracing.request(req, ctx):                            # the request's span (if tracing)
            async with self.deadline(ctx):                              # optional end-to-end deadline
                if self.served is not None:
                    req.model = ctx.model = self.served.route_model(req.model)   # none named: the one served
                    self.served.require(req.model)                      # 0. a served model? (vLLM's 404)
                if self.fans_out(req):
                    await self.fan_out.serve(req, ctx, out)             # n > 1, prompt lists: a pair per sequence
                    return
                await self.admit(req, ctx)                              # 1. fits? (400 before any engine)
                await self.run_sequence(req, ctx, out, None)            # 2-4. queue+prefill, decode, relay

    @staticmethod
    def fans_out(req: ProxyRequest) -> bool:
        """True for a request of several sequences served one P/D pair each (:mod:`pdproxy.pd.fanout`); not for one
        the prefiller judges with the client's own body (invalid for vLLM: its 400, ``n`` included) or one a
        decoder serves alone anyway (beam search, prompt logits), whose ``n`` and prompts the decoder runs."""
        return req.sequences > 1 and not (req.engine_judges or req.decoder_prefills)

    async def admit(self, req: ProxyRequest, ctx: RequestContext) -> None:
        """Admission (:meth:`Admission.admit`: counted, fits), in its tracing span; then the PD decision
        (:mod:`pdproxy.scheduling.decider`: through a prefiller, or straight to a decoder), counted by admission."""
        with self.tracing.admission(ctx):
            await self.admission.admit(req, ctx)
            reason = self.decision.decode_only(req.prompt_tokens or 0, PickRequest.of(req, ctx.request_id))
            self.admission.count_path(ctx, reason)

    async def run_sequence(self, req: ProxyRequest, ctx: RequestContext, out: Responder,
                           affinity: Endpoint | None) -> None:
        """One admitted sequence: queue + prefill → decode → relay, continued on a new pair after vLLM-Ascend's
        ``stop_reason "recomputed"``; ``affinity``: a prefiller to prefer (a fan-out sibling's)."""
        transcript = self.new_transcript(req)
        resume = continuation.Resume.of(req, self.settings.stream_continuation)
        if resume is not None:
            resume.observer = self.decode.live.observer
        tl = ctx.timeline

        def first_leg() -> tuple[int | None, int | None, float | None, float | None, float | None]:
            """What the first leg set and a later one overwrites: the prefiller's prompt count and cache hits,
            the prefill and decode marks (restored at the end: the client's usage and TTFT are the first leg's)."""
            return (ctx.engine_prompt_tokens, ctx.cached_tokens, tl.prefill_start_at, tl.prefill_end_at,
                    tl.decode_start_at)

        first = first_leg()
        leg: ProxyRequest | None = req
        resumed = False
        later_legs = False      # a continuation (a lost decoder's or vLLM-Ascend's "recomputed") ran
        try:
            while leg is not None:
                try:
                    if resumed and resume is not None:              # a lost decoder's continuation
                        await self.run_resumed(leg, ctx, out, resume)
                        recomputed = False
                    else:                                           # 2-4. queue+prefill → decode → relay
                        recomputed = await self.run_pd(leg, ctx, out, transcript, affinity if leg is req else None,
                                                       resume)
                except continuation.StreamLost as lost:             # the decoder was lost mid-stream
                    assert resume is not None
                    if not later_legs:
                        first = first_leg()
                    later_legs = True
                    leg, resumed = await self.resume_leg(resume, ctx, out, lost), True
                    continue
                if recomputed and not later_legs:
                    first = first_leg()
                later_legs = later_legs or recomputed
                leg = await self.continuation(req, ctx, out, transcript) if recomputed else None  # again: Ascend
        finally:
            if later_legs:   # the re-prefills are counted apart (pdproxy_continuation_prefill_tokens_total); the
                # phases (log, histograms) are the first leg's, up to the first token the client saw
                (ctx.engine_prompt_tokens, ctx.cached_tokens, tl.prefill_start_at, tl.prefill_end_at,
                 tl.decode_start_at) = first

    async def run_resumed(self, leg: ProxyRequest, ctx: RequestContext, out: Responder,
                          resume: continuation.Resume) -> None:
        """Run one continuation leg (prefill → decode → relay, re-framed), its first event due within
        ``stream_continuation_timeout_s`` seconds of the loss's detection (``resume.deadline``; however many
        prefillers and decoders it tries meanwhile); past that the legs are cancelled (their KV released) and the
        client gets the typed error event.  After the first event the leg is watched like any continuable stream
        (stall detection).  A moment with no endpoint that could take the leg (every breaker open, the lost decoder
        the only one, all drained) is waited out within the budget: the leg is tried again after a short backoff
        (50 ms doubling to 1 s), the lost decoder no longer excluded (its breaker and health decide).
        Raises :class:`continuation.StreamLost` when it is lost in turn, a :class:`ProxyError` when its legs
        fail (counted as refused, ``failed``)."""
        budget = self.settings.stream_continuation_timeout_s
        api = ctx.api_label
        assert resume.deadline is not None                  # set by resume_leg at the loss's detection
        timer = asyncio.timeout_at(resume.deadline)
        unavailable: NoEndpointAvailable | None = None
        try:
            async with timer:
                resume.waiting = timer
                for attempt in itertools.count(1):
                    try:
                        await self.run_pd(leg, ctx, out, None, None, resume, avoid_lost=attempt == 1)
                        break
                    except NoEndpointAvailable as refusal:
                        unavailable = refusal
                    await self.no_endpoint_wait.sleep(attempt)
        except TimeoutError:
            if not timer.expired():             # not the budget's
                raise
            resume.cause = None
            resume.observer.refused(continuation.Refusal.TIMEOUT, api)
            ctx.outcome = "upstream_error"
            why = f" (meanwhile: {unavailable.message})" if unavailable is not None else ""
            out.error_nowait(UpstreamTimeout(
                f"decoder {resume.lost[-1].name if resume.lost else ''} was lost mid-stream and no continuation "
                f"answered within stream_continuation_timeout_s ({budget:g} s){why}; the response is incomplete",
                endpoint=ctx.decoder or ""))
        except ProxyError as exc:
            resume.cause = None
            resume.observer.refused(continuation.Refusal.FAILED, api)
            said = exc.message
            if isinstance(exc, UpstreamHTTPError):       # the engine's own words (its body is not the client's here)
                with contextlib.suppress(orjson.JSONDecodeError, KeyError, AttributeError, TypeError):
                    said = f"{said}: {orjson.loads(exc.body_bytes())['error']['message']}"
            raise UpstreamUnavailable(
                f"decoder {resume.lost[-1].name if resume.lost else ''} was lost mid-stream and its continuation "
                f"failed: {said}; the response is incomplete", endpoint=getattr(exc, "endpoint", "")) from None
        finally:
            resume.waiting = None

    @asynccontextmanager
    async def deadline(self, ctx: RequestContext) -> AsyncIterator[None]:
        """Bound the request by ``request_timeout_s`` seconds from arrival (if set); expiry closes every upstream
        connection and raises :class:`UpstreamTimeout` (504 before the response started, SSE error after)."""
        limit = self.settings.request_timeout_s
        if limit is None:
            yield
            return
        remaining = limit - (time.monotonic() - ctx.timeline.arrived_at)
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                yield
        except TimeoutError:
            raise UpstreamTimeout(f"request exceeded the end-to-end deadline of {limit:.1f} s") from None

    async def resume_leg(self, resume: continuation.Resume, ctx: RequestContext, out: Responder,
                         lost: continuation.StreamLost) -> ProxyRequest | None:
        """After a decoder was lost mid-stream: the continuation leg (:mod:`pdproxy.pd.continuation`; its prompt
        ends before any ids whose text vLLM held back, :func:`continuation.held_in_text`, asked within a quarter of
        ``stream_continuation_timeout_s``, whose count starts here: ``resume.deadline``), or None when the stream
        was finished here (nothing left to generate) or refused with the typed error event.  Counts the
        continuation (by cause), its re-prefilled tokens, or the refusal (by reason)."""
        resume.read_transcript()
        api = ctx.api_label
        why = resume.refusal(self.settings.stream_continuation_max)
        if why is not None:
            resume.observer.refused(why[0], api)
            if resume.lost:                     # this loss's decoder (a continued one's: renew_request_id)
                ctx.lost_decoders += (resume.lost[-1].name,)
            lost.error.note(f" (not continued: {why[1]})")
            ctx.outcome = "upstream_error"
            out.error_nowait(lost.error)
            return None
        resume.cause = lost.cause               # counted as continued once the stream goes on (resume.resumed)
        resume.last_write = lost.last_write
        budget = self.settings.stream_continuation_timeout_s
        resume.deadline = asyncio.get_running_loop().time() + budget       # the budget runs from the detection
        with contextlib.suppress(TimeoutError):   # a quarter of it at most for the check: then the cut as it is
            async with asyncio.timeout(min(self.settings.tokenize_timeout_s, budget / 4)):
                await continuation.held_in_text(resume, functools.partial(self.detokenize, ctx, resume.req.model,
                                                                          resume.lost[-1:]))
        leg = resume.next_leg(self.admission.limits.context_len(Role.DECODE, resume.req.model))
        if leg is None:
            resume.resumed(api)
            tail = continuation.closing(resume, out)
            out.done_sent = True
            out.end_nowait(tail)
            return None
        resume.observer.reprefilled(api, leg.prompt_tokens or 0)
        ctx.renew_request_id(resume.lost[-1].name if resume.lost else "")
        return leg

    async def detokenize(self, ctx: RequestContext, model: str | None, avoid: list[Endpoint],
                         ids: list[int]) -> str | None:
        """The text of token ``ids`` from an engine's ``POST /detokenize`` (vLLM ``{"model", "tokens"}`` →
        ``{"prompt": text}``, ``vllm/entrypoints/serve/tokenize/``): a prefiller's, else a decoder's other than
        ``avoid``.  None when no engine answers with text within ``tokenize_timeout_s`` (at most
        ``stream_continuation_timeout_s``) seconds; :meth:`resume_leg` bounds all of a loss's calls together by
        a quarter of ``stream_continuation_timeout_s``, which they count against."""
        try:
            endpoint = self.scheduler.pick_engine(PickRequest(request_id=ctx.request_id, model=model), avoid)
            reply = await self.upstream.post_json(
                endpoint, "/detokenize", orjson.dumps({"model": model, "tokens": ids}),
                self.headers.leg(endpoint, f"{ctx.request_id}-detokenize", ctx.authorization),
                timeout_s=min(self.settings.tokenize_timeout_s, self.settings.stream_continuation_timeout_s))
        except ProxyError:
            return None
        text = reply.get("prompt")
        return text if isinstance(text, str) else None

    async def run_pd(self, req: ProxyRequest, ctx: RequestContext, out: Responder,
                     transcript: recompute.Transcript | None, affinity: Endpoint | None = None,
                     resume: continuation.Resume | None = None, *, avoid_lost: bool = True) -> bool:
        """Prefill, then decode; a decoder failing before its first event is replaced (re-prefilling unless the
        KV handle is known intact) — by one that has not failed this request while there is one, else by one that
        has (``decode_attempts`` in all).  Returns True when the decoder ended with ``stop_reason "recomputed"``.
        When the attempts run out or no decoder is left, before the response started, the client gets
        :meth:`DecodeLeg.gave_up <pdproxy.pd.decode.DecodeLeg.gave_up>`: the last decoder's own error answer, or
        503 + ``Retry-After`` after a refusal, reset or timeout.
        A continuation leg (``resume``) avoids the decoder just lost when ``avoid_lost``.
        Raises the scheduler's refusal at once when no decoder could take the request (no prefill is spent)."""
        attempts = self.settings.decode_attempts
        hints = await self.prefix.hints(req, ctx)                       # who holds the prompt's prefix
        pick = PickRequest.of(req, ctx.request_id, hints, affinity=affinity)
        lost: list[Endpoint] = resume.lost[-1:] if resume is not None and avoid_lost else []  # the one just lost
        failed = list(lost)
        struck: list[Endpoint] = []                    # the decoders this leg's failures were strikes against
        prefill: PrefillResult | None = None
        last: ProxyError | None = None                 # the last decoder failure, for the client (decode.gave_up)
        self.scheduler.require(Role.DECODE, pick)
        async with AsyncExitStack() as stack:
            try:
                for attempt in range(attempts):
                    if prefill is None:
                        disaggregated = ctx.disaggregated and not req.decoder_prefills
                        prefill = (await self.prefill.run(req, ctx, pick, stack, self.prefix) if disaggregated
                                   else PrefillResult.skipped())
                        if prefill.answer is not None and await self.answer_from_prefill(
                                req, ctx, out, prefill, transcript):
                            return False
                    exclude = (self.scheduler.retry_exclusion(Role.DECODE, pick, failed, lost) if attempt
                               else failed)
                    try:
                        return await self.decode.run(req, ctx, pick, prefill, out, exclude, transcript, resume,
                                                     struck)
                    except NoEndpointAvailable:
                        if last is None or out.started:  # a continuation leg waits such a moment out
                            raise
                        raise self.decode.gave_up(last) from None   # the decoders tried failed: none is left
                    except DecodeFailed as f:
                        failed.append(f.endpoint)
                        if f.struck:
                            struck.append(f.endpoint)
                        last = f.error
                        if attempt + 1 >= attempts:
                            raise (f.error if out.started else self.decode.gave_up(f.error)) from None
                        ctx.retried("decode", f.error.outcome, failover=not f.kv_intact)
                        if not f.kv_intact:
                            self.release_kv(req, ctx, prefill)
                            prefill.lease.release()
                            prefill = None
                        await self.backoff.sleep(attempt + 1)
            except BaseException:
                if prefill is not None and not prefill.consumed:
                    self.release_kv(req, ctx, prefill)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def release_kv(self, req: ProxyRequest, ctx: RequestContext, prefill: PrefillResult) -> None:
        """Free the prefiller's pinned KV that no decoder will read: nothing to do when a decoder answered an error
        for the handle (vLLM freed it), else a background release leg, sent to a decoder other than the ones that
        already had the handle when possible."""
        if not prefill.consumed:
            prefill.consumed = True
            if not prefill.handed:
                self.kv_release.release(req, ctx.request_id, ctx.authorization, prefill.params,
                                        avoid=list(prefill.decoders), prefiller=prefill.endpoint)

    async def answer_from_prefill(self, req: ProxyRequest, ctx: RequestContext, out: Responder,
                                  prefill: PrefillResult, transcript: recompute.Transcript | None) -> bool:
        """The prefiller finished the request itself (first-token EOS or stop, no KV handle): send its answer
        (:mod:`pdproxy.pd.prefill_answer`) and return True — unless it cannot stand for the client's request (a
        ``min_tokens`` above 1, or a continuation whose response already started), in which case a decoder
        prefills the request itself (False; ``prefill.params`` is None)."""
        reply = prefill.answer
        assert reply is not None
        prefill.answer = None
        if not prefill_answer.usable(req) or out.started or (transcript is not None and transcript.attempts > 1):
            ctx.cached_tokens = prefill.cached_tokens = None
            return False
        prefill.consume()
        routing = routing_headers(ctx) if self.settings.expose_routing_headers else []
        await prefill_answer.send(req, ctx, out, reply, routing)
        return True

    def new_transcript(self, req: ProxyRequest) -> recompute.Transcript | None:
        """A transcript when ``recompute_continuation`` is on (see :mod:`pdproxy.apis.recompute`)."""
        if not self.settings.recompute_continuation or req.api not in (Api.CHAT, Api.COMPLETIONS):
            return None
        return recompute.Transcript(req.api is Api.CHAT)

    async def continuation(self, req: ProxyRequest, ctx: RequestContext, out: Responder,
                           transcript: recompute.Transcript | None) -> ProxyRequest | None:
        """After ``stop_reason "recomputed"``: the request that continues ``req`` on a new P→D pair with a new
        request id, or None when the budget was spent (the response is then finished here with "length").
        Raises :class:`UpstreamUnavailable` when the request cannot be continued."""
        assert transcript is not None
        if transcript.cached_tokens is None:
            transcript.cached_tokens = ctx.cached_tokens
        sent = transcript.end_attempt()
        limit = self.settings.recompute_max_attempts
        if transcript.attempts > limit + 1 or transcript.tool_calls:
            why = "during a tool call" if transcript.tool_calls else f"{limit} times"
            raise UpstreamUnavailable(f"decoder {ctx.decoder} preempted the request (stop_reason \"recomputed\") "
                                      f"{why}; the response is incomplete", endpoint=ctx.decoder or "")
        try:
            body = recompute.continuation_body(req.body, req.api is Api.CHAT, transcript.text, sent)
        except ValueError as exc:
            raise UpstreamUnavailable(f"decoder {ctx.decoder} preempted the request (stop_reason \"recomputed\") "
                                      f"and {exc}", endpoint=ctx.decoder or "") from None
        if body is None:
            await recompute.finish_length(out, transcript, stream=req.stream, include_usage=req.include_usage)
            return None
        leg = parse_request(orjson.dumps(body), req.api, max_items=None)     # built from a checked body
        leg.size_from(req, sent)
        ctx.renew_request_id(ctx.decoder or "")    # the decoder that preempted it
        return leg
