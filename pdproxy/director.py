"""The request path: admit → prefill → decode → relay, each a named step.

``Director.serve`` is the whole lifecycle of one completion request on one screen.  Leases and upstream responses
live in ``AsyncExitStack``s, so success, error and client disconnect (the handler cancels this coroutine) release
everything the same way.

Failure policy (issue 5), decided here and nowhere else:

- **prefill**: a prefiller that refuses, resets, times out or answers 502/503/504 is replaced by another one
  (``prefill_attempts``, jittered exponential backoff); a 500 is retried at most once elsewhere; a 4xx is the
  request's fault and passes through at once.  ``Retry-After`` holds that prefiller's breaker open.
- **decode, before the decoder's first event reached the client**: another decoder (``decode_attempts``).  When
  the connection was refused the decoder never saw the request and the KV handle is reused; otherwise the KV may
  have been pulled or freed, so the prefill runs again for the new pair and the old handle is released.
- **after the first event**: never replayed (the relay sends an SSE error event + ``[DONE]``), except vLLM-Ascend's
  ``stop_reason "recomputed"``, which is continued on a new P→D pair (:mod:`pdproxy.recompute`).
- **leaving early** (client disconnect, deadline, error) between the prefill and the decoder's first event: the
  prefiller's pinned KV is released by a release leg (:mod:`pdproxy.kv_release`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
import orjson

from pdproxy import kv_transfer, recompute
from pdproxy.endpoints import Endpoint, Role
from pdproxy.errors import NoEndpointAvailable, ProxyError, UpstreamHTTPError, UpstreamTimeout, UpstreamUnavailable
from pdproxy.h1client import H1Response
from pdproxy.kv_release import KVReleaser
from pdproxy.pool import EndpointLoad, Lease
from pdproxy.prefill_queue import PrefillSlot
from pdproxy.protocol import Api, ProxyRequest, completion_tokens_in, parse_request, patch_usage_bytes
from pdproxy.relay import Responder, StreamRelay
from pdproxy.state import ProxyState
from pdproxy.timeline import RequestContext, new_request_id
from pdproxy.upstream import UpstreamRefused, retry_after_seconds

# Prefiller answers worth another prefiller: they say "not me, not now".  500 gets one more try elsewhere.
_RETRYABLE_STATUS = frozenset({502, 503, 504})


@dataclass(slots=True)
class PrefillResult:
    """What the prefill leg produced: the prefiller, its still-held lease (released when the decoder's first
    event arrives — the KV stays pinned on the prefiller until pulled), the opaque ``kv_transfer_params``
    (None only when decode-side prefill is allowed) and the prefiller's ``cached_tokens``.
    ``consumed``: a decoder answered, so it pulled the KV (nothing left to release); ``decoders``: the decoders
    sent this handle (a release leg avoids them)."""

    endpoint: Endpoint
    lease: Lease
    params: kv_transfer.KVTransferParams | None
    cached_tokens: int | None
    consumed: bool = field(default=False)
    decoders: list[Endpoint] = field(default_factory=list)
    slot: PrefillSlot | None = None

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


class DecodeFailed(Exception):
    """A decoder failed before its first event reached the client (internal: the director may fail over).
    ``kv_intact``: the decoder never saw the request, so the prefiller's KV handle is still good."""

    def __init__(self, error: ProxyError, endpoint: Endpoint, kv_intact: bool) -> None:
        super().__init__(error.message)
        self.error = error
        self.endpoint = endpoint
        self.kv_intact = kv_intact


def _retry_after_s(exc: ProxyError) -> float | None:
    return retry_after_seconds(exc.retry_after) if isinstance(exc, UpstreamHTTPError) else None


def _engine_fault(exc: ProxyError) -> bool:
    """True when ``exc`` says the engine is unwell (transport, timeout, 5xx); a 4xx is the request's fault."""
    return not (isinstance(exc, UpstreamHTTPError) and exc.status_code < 500)


class Director:
    """Runs requests against the state's pool, scheduler and upstream client."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state
        self.kv_release = KVReleaser(state, timeout_s=state.settings.kv_release_timeout_s)
        self.rng = random.Random()

    async def aclose(self) -> None:
        """Let background release legs finish (bounded); the app lifespan calls this before stopping state."""
        await self.kv_release.aclose()

    def engine_headers(self, ctx: RequestContext, endpoint: Endpoint) -> dict[str, str]:
        """Headers for one leg: the shared ``X-Request-Id``, auth, and the DP-rank pin if any."""
        headers = {"Content-Type": "application/json", "X-Request-Id": ctx.request_id}
        auth = self.state.engine_authorization(ctx.authorization)
        if auth:
            headers["Authorization"] = auth
        headers.update(endpoint.extra_headers())
        return headers

    async def serve(self, req: ProxyRequest, ctx: RequestContext, out: Responder) -> None:
        """Serve one completion request end to end.  Raises :class:`ProxyError` for the handler to send."""
        async with self.deadline(ctx):                                  # optional end-to-end deadline
            await self.state.admission.admit(req, ctx)                  # 1. fits? (400 before any engine)
            transcript = self.new_transcript(req)
            leg: ProxyRequest | None = req
            while leg is not None:
                recomputed = await self.run_pd(leg, ctx, out, transcript)  # 2-4. prefill → decode → relay
                leg = await self.continuation(req, ctx, out, transcript) if recomputed else None  # 5. Ascend

    @asynccontextmanager
    async def deadline(self, ctx: RequestContext) -> AsyncIterator[None]:
        """Bound the request by ``request_timeout_s`` seconds from arrival (if set); expiry closes every upstream
        connection and raises :class:`UpstreamTimeout` (504 before the response started, SSE error after)."""
        limit = self.state.settings.request_timeout_s
        if limit is None:
            yield
            return
        remaining = limit - (time.monotonic() - ctx.timeline.arrived_at)
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                yield
        except TimeoutError:
            raise UpstreamTimeout(f"request exceeded the end-to-end deadline of {limit:.1f} s") from None

    def pick(self, role: Role, req: ProxyRequest, exclude: list[Endpoint],
             also: Callable[[Endpoint], bool] | None = None) -> Endpoint:
        """The scheduler's choice among endpoints whose breaker admits traffic and that admission says fit.
        Raises :class:`NoEndpointAvailable` (503, ``Retry-After`` = seconds until a breaker re-admits)."""
        st = self.state
        fits = st.admission.fits_prefiller(req) if role is Role.PREFILL else st.admission.fits_decoder(req)
        if also is not None:
            fits = also if fits is None else (lambda e, f=fits: f(e) and also(e))
        try:
            endpoint = st.scheduler.choose(role, exclude=exclude, fits=st.health.admits(fits))
        except NoEndpointAvailable as exc:
            exc.headers["retry-after"] = str(st.health.retry_after_s(st.pool.endpoints(role)))
            raise
        st.health.on_pick(endpoint)
        return endpoint

    def require(self, role: Role, req: ProxyRequest) -> None:
        """Raise :class:`NoEndpointAvailable` (503 + ``Retry-After``) at once when no endpoint of ``role`` could
        take ``req`` — checked for decoders before the prefill, so no prefill (and no pinned KV) is wasted."""
        st = self.state
        fits = st.admission.fits_prefiller(req) if role is Role.PREFILL else st.admission.fits_decoder(req)
        if not any(st.health.admits(fits)(e) for e in st.pool.available(role)):
            raise NoEndpointAvailable(role.value, retry_after_s=st.health.retry_after_s(st.pool.endpoints(role)))

    async def backoff(self, attempt: int) -> None:
        """Sleep before retry ``attempt`` (≥ 1): ``retry_backoff_s · 2^(attempt-1)``, ×0.5–1.5 jitter, capped."""
        s = self.state.settings
        delay = min(s.retry_backoff_s * 2 ** (attempt - 1), s.retry_backoff_max_s) * self.rng.uniform(0.5, 1.5)
        if delay > 0:
            await asyncio.sleep(delay)

    async def run_pd(self, req: ProxyRequest, ctx: RequestContext, out: Responder,
                     transcript: recompute.Transcript | None) -> bool:
        """Prefill, then decode; a decoder failing before its first event is replaced (re-prefilling unless the
        KV handle is known intact).  Returns True when the decoder ended with ``stop_reason "recomputed"``."""
        attempts = self.state.settings.decode_attempts
        failed: list[Endpoint] = []
        prefill: PrefillResult | None = None
        self.require(Role.DECODE, req)
        async with AsyncExitStack() as stack:
            try:
                for attempt in range(attempts):
                    if prefill is None:
                        prefill = (await self.run_prefill(req, ctx, stack) if ctx.disaggregated
                                   else PrefillResult.skipped())
                    try:
                        return await self.run_decode(req, ctx, prefill, out, failed, transcript)
                    except DecodeFailed as f:
                        failed.append(f.endpoint)
                        if attempt + 1 >= attempts:
                            raise f.error from None
                        if not f.kv_intact:
                            self.release_kv(req, ctx, prefill)
                            prefill.lease.release()
                            prefill = None
                        await self.backoff(attempt + 1)
            except BaseException:
                if prefill is not None and not prefill.consumed:
                    self.release_kv(req, ctx, prefill)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def release_kv(self, req: ProxyRequest, ctx: RequestContext, prefill: PrefillResult) -> None:
        """Free the prefiller's pinned KV that no decoder will read (background release leg, sent to a decoder
        other than the ones that already had the handle when possible)."""
        if not prefill.consumed:
            prefill.consumed = True
            self.kv_release.release(req, ctx.request_id, ctx.authorization, prefill.params,
                                    avoid=list(prefill.decoders))

    async def run_prefill(self, req: ProxyRequest, ctx: RequestContext, stack: AsyncExitStack) -> PrefillResult:
        """Send the prefill leg, failing over to other prefillers (see module docstring).

        Raises :class:`UpstreamHTTPError` for an engine 4xx (passed through), the last failure when every attempt
        failed, :class:`NoEndpointAvailable` when no prefiller is usable, :class:`UpstreamUnavailable` when the
        answer has no ``kv_transfer_params`` (unless decode-side prefill is allowed).
        """
        st = self.state
        s = st.settings
        tokens = req.prompt_tokens or 0
        body = orjson.dumps(kv_transfer.prefill_body(req.body))
        timeout_s = s.prefill_timeout_base_s + s.prefill_timeout_per_1k_tokens_s * tokens / 1000
        tried: list[Endpoint] = []
        last: ProxyError | None = None
        retried_500 = False
        for attempt in range(s.prefill_attempts):
            if attempt:
                await self.backoff(attempt)
            try:                                       # waits in the prefill queue (issue 4) for a slot
                slot = await stack.enter_async_context(st.admission.queue.slot(
                    tokens, tokens + 1, exclude=tried, fits=st.health.admits(st.admission.fits_prefiller(req)),
                    choose=lambda room: self.pick(Role.PREFILL, req, tried, also=room)))
            except NoEndpointAvailable:
                if last is not None:
                    raise last from None
                raise
            endpoint = slot.endpoint
            lease = stack.enter_context(st.pool.lease(endpoint, tokens))
            ctx.prefiller = endpoint.name
            ctx.timeline.prefill_start_at = time.monotonic()
            try:
                reply = await st.upstream.post_json(endpoint, req.api.value, body,
                                                    self.engine_headers(ctx, endpoint), timeout_s=timeout_s)
            except ProxyError as exc:
                lease.release()
                slot.release()
                if not _engine_fault(exc):
                    st.health.record_neutral(endpoint)
                    raise
                st.health.record_failure(endpoint, retry_after_s=_retry_after_s(exc),
                                         hard=isinstance(exc, UpstreamRefused))
                status = exc.status_code if isinstance(exc, UpstreamHTTPError) else None
                if status is not None and status not in _RETRYABLE_STATUS and (status != 500 or retried_500):
                    raise
                retried_500 = retried_500 or status == 500
                tried.append(endpoint)
                last = exc
                continue
            ctx.timeline.prefill_end_at = time.monotonic()
            slot.prefill_done()
            st.health.record_success(endpoint)
            params = kv_transfer.extract_params(reply)
            if params is None and not s.allow_decode_side_prefill:
                lease.release()
                raise UpstreamUnavailable(
                    f"prefiller {endpoint.name} answered without kv_transfer_params: is it started with a KV "
                    "connector (--kv-transfer-config) in the producer role? (set allow_decode_side_prefill to let "
                    "decoders prefill locally instead)", endpoint=endpoint.name, retryable=False)
            ctx.cached_tokens = kv_transfer.prefill_cached_tokens(reply)
            return PrefillResult(endpoint, lease, params, ctx.cached_tokens, slot=slot)
        assert last is not None
        raise last

    async def run_decode(self, req: ProxyRequest, ctx: RequestContext, prefill: PrefillResult, out: Responder,
                         exclude: list[Endpoint], transcript: recompute.Transcript | None) -> bool:
        """Open the decode leg with the prefiller's ``kv_transfer_params`` and relay its answer.

        The client's status line is sent only once the decoder's first event (stream) or whole body (JSON) is
        in, so a decoder error reaches the client with the engine's status and body.  Raises
        :class:`DecodeFailed` for an engine fault before that point, :class:`UpstreamHTTPError` for its 4xx.
        Returns True when the decoder ended with ``stop_reason "recomputed"``.
        """
        st = self.state
        s = st.settings
        tokens = (req.prompt_tokens or 0) + (req.max_output_tokens or 0)
        endpoint = self.pick(Role.DECODE, req, exclude)
        prefill.decoders.append(endpoint)
        ctx.decoder = endpoint.name
        ctx.decoder_dp_rank = endpoint.dp_rank
        body = kv_transfer.decode_body_bytes(req.raw, prefill.params)
        strip_usage = bool(req.stream and transcript is not None and not req.include_usage)
        if strip_usage:
            body = recompute.force_usage_bytes(body, req.body)
        ctx.timeline.decode_start_at = time.monotonic()
        first_byte_s = s.decode_first_byte_timeout_s if req.stream else s.decode_nonstream_timeout_s
        routing = st.routing_headers(ctx)
        with st.pool.lease(endpoint, tokens):
            if prefill.slot is not None:
                prefill.slot.decode_started()
            try:
                async with st.upstream.open_stream(
                        endpoint, req.api.value, body, self.engine_headers(ctx, endpoint),
                        first_byte_timeout_s=first_byte_s) as resp:
                    if req.stream:
                        recomputed = await StreamRelay(
                            resp, out, ctx, cached_tokens=prefill.cached_tokens, first_event_timeout_s=first_byte_s,
                            on_first_event=prefill.consume, headers=routing, transcript=transcript,
                            strip_usage=strip_usage, idle_timeout_s=s.decode_idle_timeout_s).run()
                    else:
                        recomputed = await self.relay_json(resp, ctx, prefill, out, transcript, first_byte_s, routing)
            except ProxyError as exc:
                if not _engine_fault(exc):
                    st.health.record_neutral(endpoint)
                    raise
                refused = isinstance(exc, UpstreamRefused)
                st.health.record_failure(endpoint, retry_after_s=_retry_after_s(exc), hard=refused)
                raise DecodeFailed(exc, endpoint, kv_intact=refused) from None
        st.health.record_success(endpoint)
        return recomputed

    async def relay_json(self, resp: H1Response, ctx: RequestContext, prefill: PrefillResult,
                         out: Responder, transcript: recompute.Transcript | None, timeout_s: float,
                         routing: list[tuple[bytes, bytes]]) -> bool:
        """Read a non-streaming decode answer and send it (usage patched; a ``recomputed`` answer is kept back
        and True returned; a continuation's answer is merged with the earlier text)."""
        endpoint = ctx.decoder or ""
        try:
            async with asyncio.timeout(timeout_s):
                data = await resp.read()
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(f"decoder {endpoint} failed: {exc.__class__.__name__}: {exc}",
                                      endpoint=endpoint) from None
        except TimeoutError:
            raise UpstreamTimeout(f"decoder {endpoint} did not finish within {timeout_s:.1f} s",
                                  endpoint=endpoint) from None
        prefill.consume()
        ctx.timeline.first_token_at = ctx.timeline.last_token_at = time.monotonic()
        if transcript is not None and (recompute.MARKER in data or transcript.attempts > 1):
            obj = orjson.loads(data)
            if recompute.is_recomputed(obj):
                transcript.observe(obj)
                return True
            if transcript.attempts > 1:
                data = orjson.dumps(transcript.merge_json(obj))
        if b'"completion_tokens"' in data:
            ctx.completion_tokens = completion_tokens_in(data)
        await out.json(resp.status, patch_usage_bytes(data, prefill.cached_tokens if transcript is None
                                                      or transcript.attempts == 1 else None), routing)
        return False

    def new_transcript(self, req: ProxyRequest) -> recompute.Transcript | None:
        """A transcript when ``recompute_continuation`` is on (see :mod:`pdproxy.recompute`)."""
        return recompute.Transcript(req.api is Api.CHAT) if self.state.settings.recompute_continuation else None

    async def continuation(self, req: ProxyRequest, ctx: RequestContext, out: Responder,
                           transcript: recompute.Transcript | None) -> ProxyRequest | None:
        """After ``stop_reason "recomputed"``: the request that continues ``req`` on a new P→D pair with a new
        request id, or None when the budget was spent (the response is then finished here with "length").
        Raises :class:`UpstreamUnavailable` when the request cannot be continued."""
        assert transcript is not None
        if transcript.cached_tokens is None:
            transcript.cached_tokens = ctx.cached_tokens
        sent = transcript.end_attempt()
        limit = self.state.settings.recompute_max_attempts
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
        leg = parse_request(orjson.dumps(body), req.api)
        leg.prompt_tokens = (req.prompt_tokens or 0) + sent
        ctx.request_id = new_request_id(ctx.client_request_id)
        return leg
