"""The request path: admit → prefill → decode → relay, each a named step.

``Director.serve`` is the whole lifecycle of one completion request on one screen.  Every lease and upstream
response is entered into one ``AsyncExitStack``, so success, error and client disconnect (the handler cancels
this coroutine) release everything the same way.
"""

from __future__ import annotations

import time
from contextlib import AsyncExitStack
from dataclasses import dataclass

import aiohttp
import orjson

from pdproxy import kv_transfer
from pdproxy.endpoints import Endpoint, Role
from pdproxy.errors import ProxyError, UpstreamHTTPError, UpstreamTimeout, UpstreamUnavailable
from pdproxy.pool import Lease
from pdproxy.protocol import ProxyRequest, patch_usage_bytes
from pdproxy.relay import Responder, StreamRelay
from pdproxy.state import ProxyState
from pdproxy.timeline import RequestContext

# Prefiller answers worth another prefiller (reference: vLLM-Ascend proxy retries non-400 errors; we retry only
# what says "not me, not now").  A 4xx is the request's fault and is never retried.
_RETRYABLE_STATUS = frozenset({502, 503, 504})


@dataclass(slots=True)
class PrefillResult:
    """What the prefill leg produced: the prefiller, its still-held lease (released when the decoder's first
    event arrives — the KV stays pinned on the prefiller until pulled), the opaque ``kv_transfer_params``
    (None only when decode-side prefill is allowed) and the prefiller's ``cached_tokens``."""

    endpoint: Endpoint
    lease: Lease
    params: kv_transfer.KVTransferParams | None
    cached_tokens: int | None


class Director:
    """Runs requests against the state's pool, scheduler and upstream client."""

    def __init__(self, state: ProxyState) -> None:
        self.state = state

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
        await self.state.admission.admit(req, ctx)                      # 1. fits? (400 before any engine)
        async with AsyncExitStack() as stack:
            prefill = await self.run_prefill(req, ctx, stack)          # 2. prefiller: max_tokens=1 → KV handle
            await self.run_decode(req, ctx, prefill, out, stack)       # 3-4. decoder pulls KV; relay to client

    async def run_prefill(self, req: ProxyRequest, ctx: RequestContext, stack: AsyncExitStack) -> PrefillResult:
        """Send the prefill leg, failing over to other prefillers on refusal/reset/502/503/504.

        Raises :class:`UpstreamHTTPError` for an engine 4xx (passed through), :class:`UpstreamUnavailable` when
        the answer has no ``kv_transfer_params`` (unless decode-side prefill is allowed) or every attempt failed.
        """
        st = self.state
        tokens = req.prompt_tokens or 0
        body = orjson.dumps(kv_transfer.prefill_body(req.body))
        timeout_s = st.settings.prefill_timeout_base_s + st.settings.prefill_timeout_per_1k_tokens_s * tokens / 1000
        tried: list[Endpoint] = []
        last: ProxyError | None = None
        for _attempt in range(st.settings.prefill_attempts):
            endpoint = st.scheduler.choose(Role.PREFILL, exclude=tried, fits=st.admission.fits_prefiller(req))
            lease = stack.enter_context(st.pool.lease(endpoint, tokens))
            ctx.prefiller = endpoint.name
            ctx.timeline.prefill_start_at = time.monotonic()
            try:
                reply = await st.upstream.post_json(endpoint, req.api.value, body,
                                                    self.engine_headers(ctx, endpoint), timeout_s=timeout_s)
            except (UpstreamUnavailable, UpstreamTimeout, UpstreamHTTPError) as exc:
                lease.release()
                if isinstance(exc, UpstreamHTTPError) and exc.status_code not in _RETRYABLE_STATUS:
                    raise
                st.health.record_failure(endpoint)
                tried.append(endpoint)
                last = exc
                continue
            ctx.timeline.prefill_end_at = time.monotonic()
            st.health.record_success(endpoint)
            params = kv_transfer.extract_params(reply)
            if params is None and not st.settings.allow_decode_side_prefill:
                lease.release()
                raise UpstreamUnavailable(
                    f"prefiller {endpoint.name} answered without kv_transfer_params: is it started with a KV "
                    "connector (--kv-transfer-config) in the producer role? (set allow_decode_side_prefill to let "
                    "decoders prefill locally instead)", endpoint=endpoint.name, retryable=False)
            ctx.cached_tokens = kv_transfer.prefill_cached_tokens(reply)
            return PrefillResult(endpoint, lease, params, ctx.cached_tokens)
        assert last is not None
        raise last

    async def run_decode(self, req: ProxyRequest, ctx: RequestContext, prefill: PrefillResult, out: Responder,
                         stack: AsyncExitStack) -> None:
        """Open the decode leg with the prefiller's ``kv_transfer_params`` and relay its answer.

        The client's status line is sent only once the decoder's first event (stream) or whole body (JSON) is
        in, so a decoder error reaches the client with the engine's status and body.
        """
        st = self.state
        tokens = (req.prompt_tokens or 0) + (req.max_output_tokens or 0)
        endpoint = st.scheduler.choose(Role.DECODE, fits=st.admission.fits_decoder(req))
        stack.enter_context(st.pool.lease(endpoint, tokens))
        ctx.decoder = endpoint.name
        ctx.decoder_dp_rank = endpoint.dp_rank
        body = kv_transfer.decode_body_bytes(req.raw, prefill.params)
        ctx.timeline.decode_start_at = time.monotonic()
        s = st.settings
        first_byte_s = s.decode_first_byte_timeout_s if req.stream else s.decode_nonstream_timeout_s
        resp = await stack.enter_async_context(st.upstream.open_stream(
            endpoint, req.api.value, body, self.engine_headers(ctx, endpoint),
            first_byte_timeout_s=first_byte_s, idle_timeout_s=s.decode_idle_timeout_s if req.stream else first_byte_s))
        routing = st.routing_headers(ctx)
        if req.stream:
            await StreamRelay(resp, out, ctx, cached_tokens=prefill.cached_tokens, first_event_timeout_s=first_byte_s,
                              on_first_event=prefill.lease.release, headers=routing).run()
            st.health.record_success(endpoint)
            return
        try:
            data = await resp.read()
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(f"decoder {endpoint.name} failed: {exc.__class__.__name__}: {exc}",
                                      endpoint=endpoint.name) from None
        except TimeoutError:
            raise UpstreamTimeout(f"decoder {endpoint.name} did not finish within {first_byte_s:.1f} s",
                                  endpoint=endpoint.name) from None
        prefill.lease.release()
        ctx.timeline.first_token_at = ctx.timeline.last_token_at = time.monotonic()
        st.health.record_success(endpoint)
        await out.json(resp.status, patch_usage_bytes(data, prefill.cached_tokens), routing)
