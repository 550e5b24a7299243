"""The prefill leg: wait for a prefill slot, send the prompt to the prefiller, get its ``kv_transfer_params``.

Failure policy (the director's, pdproxy/pd/director.py): a prefiller that refuses, resets, times out or answers
502/503/504 is replaced by another one (``prefill_attempts``, jittered exponential backoff) — by one that already
failed the request when no other could take it (a lone prefiller is tried again; its breaker decides); a 500 is
retried at most once elsewhere, and only when the engine says its core died (:func:`~pdproxy.errors.classify`:
any other 500 would fail the same way on every prefiller); a 4xx is the request's fault and passes through at once.
When the attempts run out or no prefiller is left, the client gets the last prefiller's own error answer, or —
after a refusal, reset or timeout — 503 with ``Retry-After`` (:meth:`PrefillLeg.gave_up`).  ``Retry-After`` holds that
prefiller's breaker open (:meth:`~pdproxy.engines.health.HealthMonitor.record_error`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import orjson

from pdproxy.apis import kv_transfer
from pdproxy.apis.request import ProxyRequest, over_max_model_len
from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.health import HealthMonitor
from pdproxy.engines.pool import EndpointLoad, EndpointPool, Lease
from pdproxy.errors import (
    Action,
    EnginesFailed,
    NoEndpointAvailable,
    ProxyError,
    UpstreamUnavailable,
    classify,
)
from pdproxy.http.engine_headers import EngineHeaders
from pdproxy.http.upstream import Upstream
from pdproxy.ops.tracing import NO_TRACING, Tracing
from pdproxy.pd.backoff import Backoff
from pdproxy.pd.kv_release import KVReleaser
from pdproxy.prefix.source import NoPrefix, PrefixSource
from pdproxy.scheduling import PickRequest
from pdproxy.scheduling.queue import PrefillQueue, PrefillSlot
from pdproxy.settings import Settings
from pdproxy.timeline import RequestContext

_NO_PREFIX = NoPrefix()


@dataclass(slots=True)
class PrefillResult:
    """What the prefill leg produced: the prefiller, its still-held lease (released when the decoder starts
    answering — the KV stays pinned on the prefiller until pulled), the opaque ``kv_transfer_params`` (None only
    when decode-side prefill is allowed) and the prefiller's ``cached_tokens``.  ``consumed``: a decoder answered,
    so it pulled the KV (nothing left to release); ``decoders``: the decoders sent this handle (a release leg
    avoids them); ``slot``: the prefill queue's slot (its decoder reservation ends when the decode lease starts);
    ``handed``: a decoder answered an error status for the handle, and vLLM frees the prefiller's KV of a rejected
    request itself (``generate/base/serving.py::_with_kv_transfer_rejection_cleanup``), so no release leg is
    needed — a decoder that never answered (refused, reset, timed out, stalled, or the client left first) may be
    gone; ``answer``: the prefiller's JSON answer when it finished the request itself
    (``kv_transfer.ended_on_prefill``)."""

    endpoint: Endpoint
    lease: Lease
    params: kv_transfer.KVHandle | None
    cached_tokens: int | None
    consumed: bool = field(default=False)
    decoders: list[Endpoint] = field(default_factory=list)
    slot: PrefillSlot | None = None
    handed: bool = False
    answer: dict[str, Any] | None = None

    @classmethod
    def skipped(cls) -> PrefillResult:
        """Conditional disaggregation (``ctx.disaggregated`` False, decided by admission): no prefill leg; the
        decoder gets the client's body without ``kv_transfer_params`` and prefills the prompt itself."""
        none = Endpoint("decode-only:", Role.PREFILL)
        return cls(none, Lease(none, EndpointLoad(), 0), None, None, consumed=True)

    def consume(self) -> None:
        """Mark the KV as pulled (a decoder answered) and release the prefiller's lease; nothing is left to free."""
        self.consumed = True
        self.lease.release()


class PrefillLeg:
    """Runs the prefill leg of a request (see the module docstring).  ``queue`` grants the prefiller (the
    scheduler's pick inside it), ``pool`` holds its lease, ``health`` hears each attempt's verdict, ``upstream``
    sends it with ``headers``; ``backoff`` spaces the attempts; ``tracing`` spans the queue wait and each
    attempt; ``releaser`` takes over the answer of a prefill whose request left while it was in flight
    (:meth:`KVReleaser.drain`; without one the connection is closed at once)."""

    def __init__(self, settings: Settings, *, queue: PrefillQueue, pool: EndpointPool, health: HealthMonitor,
                 upstream: Upstream, headers: EngineHeaders, backoff: Backoff, tracing: Tracing = NO_TRACING,
                 releaser: KVReleaser | None = None) -> None:
        self.settings = settings
        self.queue = queue
        self.pool = pool
        self.health = health
        self.upstream = upstream
        self.headers = headers
        self.backoff = backoff
        self.tracing = tracing
        self.releaser = releaser

    async def run(self, req: ProxyRequest, ctx: RequestContext, pick: PickRequest, stack: AsyncExitStack,
                  prefix: PrefixSource | None = None) -> PrefillResult:
        """Send the prefill leg, failing over to other prefillers; the slot and the lease live in ``stack``.
        ``prefix`` hears of each attempt (:meth:`PrefixSource.prefilling <pdproxy.prefix.source.PrefixSource.
        prefilling>`: in flight, then answered or failed).

        Raises :class:`UpstreamHTTPError` for an engine 4xx (passed through), the last failure when every attempt
        failed, the scheduler's refusal (:class:`NoEndpointAvailable`, :class:`~pdproxy.errors.ModelNotFound`)
        when no prefiller is usable, :class:`UpstreamUnavailable` when the answer has no ``kv_transfer_params``
        though it did not finish the request (a prefiller without a KV connector; unless decode-side prefill is
        allowed), ``req.fault`` when a request pdproxy found invalid for vLLM was accepted by the prefiller.
        """
        s = self.settings
        tokens = req.prompt_tokens or 0
        body = orjson.dumps(kv_transfer.prefill_body(req.body, req.api, engine_judges=req.engine_judges,
                                                     request_id=ctx.request_id, relax=s.prefill_relax_constraints))
        timeout_s = s.prefill_timeout_base_s + s.prefill_timeout_per_1k_tokens_s * tokens / 1000
        tried: list[Endpoint] = []
        dead: list[Endpoint] = []                      # answered that its engine core died: never tried again
        last: ProxyError | None = None
        retried_500 = False
        for attempt in range(s.prefill_attempts):
            if attempt:
                ctx.retried("prefill", last.outcome if last is not None else "error")
                await self.backoff.sleep(attempt)
            exclude = self.queue.scheduler.retry_exclusion(Role.PREFILL, pick, tried, dead)
            try:                                       # wait in the prefill queue for a slot (queue → pick)
                with self.tracing.queue_wait(ctx):
                    slot = await stack.enter_async_context(self.queue.slot(tokens, tokens + 1, exclude=exclude,
                                                                           request=pick))
            except NoEndpointAvailable:
                if last is not None:
                    raise self.gave_up(last) from None
                raise
            endpoint = slot.endpoint
            with self.health.judging(endpoint) as verdict:   # from the pick on: no verdict (cancelled, refused
                # before it was sent, a fault) is neutral on exit: a half-open trial the pick took given back
                leg, fault = body, req.fault          # a fault: the leg is the client's body, for the engine to judge
                max_model_len = self.queue.ledger.limits.of(endpoint).max_model_len
                if max_model_len is not None and kv_transfer.engine_must_judge(req.max_output_tokens, max_model_len):
                    if not req.engine_judges:
                        # vLLM's first check on a valid body, before any work: its 400 here, no engine asked (an
                        # engine that accepted would first generate the whole answer on the prefiller)
                        slot.release()
                        raise over_max_model_len(req, max_model_len)   # never sent: no verdict (its trial back)
                    leg = orjson.dumps(kv_transfer.prefill_body(req.body, req.api, engine_judges=True))
                    fault = over_max_model_len(req, max_model_len)
                lease = stack.enter_context(self.pool.lease(endpoint, tokens))
                slot.handed_over()                         # the lease counts the prompt's KV from here on
                ctx.prefiller = endpoint.name
                ctx.timeline.prefill_start_at = time.monotonic()
                try:
                    with (self.tracing.prefill(ctx, endpoint),                 # the span is the leg's traceparent
                          (prefix or _NO_PREFIX).prefilling(req, ctx, endpoint)):  # in flight there; answered/failed
                        headers = self.headers.leg(endpoint, ctx.request_id, ctx.authorization, ctx.client_headers)
                        reply = await self.answer(req, ctx, endpoint, slot, self.upstream.post_json(
                            endpoint, req.api.value, leg, headers, timeout_s=timeout_s,
                            parse=kv_transfer.load_prefill_answer) if fault is None else self.upstream.judge(
                            endpoint, req.api.value, leg, headers, timeout_s=timeout_s))
                        refused = kv_transfer.error_answer(reply, endpoint.name)
                        if refused is not None:          # an error in a 200: judged as that error's status would be
                            raise refused
                        ctx.cached_tokens = kv_transfer.prefill_cached_tokens(reply, req.api)
                        ctx.engine_prompt_tokens = kv_transfer.prefill_prompt_tokens(reply, req.api)
                except ProxyError as exc:
                    lease.release()
                    slot.release()
                    if not verdict.error(exc, again=endpoint in tried):
                        raise
                    failure = classify(exc)
                    if not failure.retry(retried_500):
                        raise
                    if failure.action is Action.RETRY_ONCE:
                        retried_500 = True
                        dead.append(endpoint)
                    tried.append(endpoint)
                    last = exc
                    continue
                ctx.timeline.prefill_end_at = time.monotonic()
                slot.prefilled(ctx.engine_prompt_tokens, ctx.cached_tokens)
                verdict.success()
            if fault is not None:        # an engine that accepts what vLLM 0.32 refuses: say what vLLM would
                lease.release()
                raise fault
            params = kv_transfer.extract_params(reply)
            ended = kv_transfer.ended_on_prefill(reply, req.api)
            if params is None and not ended and not s.allow_decode_side_prefill:
                lease.release()
                raise UpstreamUnavailable(
                    f"prefiller {endpoint.name} answered without kv_transfer_params: is it started with a KV "
                    "connector (--kv-transfer-config) in the producer role? (set allow_decode_side_prefill to let "
                    "decoders prefill locally instead)", endpoint=endpoint.name)
            if ctx.on_prefilled is not None:
                ctx.on_prefilled(endpoint)
            return PrefillResult(endpoint, lease, params, ctx.cached_tokens, slot=slot,
                                 answer=reply if ended else None)
        assert last is not None
        raise self.gave_up(last)

    def gave_up(self, last: ProxyError) -> ProxyError:
        """What the client gets when the attempts ran out (or no prefiller is left to try) after ``last``: a
        prefiller's own error answer (a 502/503/504, a 500 with a dead core) as it sent it; a transport failure
        (refused, reset, timed out) becomes :class:`EnginesFailed`, 503 with ``Retry-After`` until a prefiller's
        breaker re-admits it — what the next request gets when none is available (:class:`NoEndpointAvailable`)."""
        return EnginesFailed.after(Role.PREFILL, last, self.health.retry_after_s(self.pool.endpoints(Role.PREFILL)))

    async def answer(self, req: ProxyRequest, ctx: RequestContext, endpoint: Endpoint, slot: PrefillSlot | None,
                     post: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
        """Await the prefiller's answer (``post``).  When the request is cancelled meanwhile (client gone,
        deadline) the answer is not dropped unread: the engine may have finished and pinned the KV already, so the
        releaser awaits it (bounded by ``prefill_cancel_grace_s``) and frees what it reports
        (:meth:`KVReleaser.drain`), the prefill still held against ``slot``'s budget until then (it is still in
        flight on the engine)."""
        answer = asyncio.ensure_future(post)
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            if self.releaser is None:
                answer.cancel()
            else:
                self.releaser.drain(answer, req, ctx.request_id, ctx.authorization, prefiller=endpoint,
                                    grace_s=self.settings.prefill_cancel_grace_s,
                                    answered=slot.hand_off_prefill() if slot is not None else None)
            raise
