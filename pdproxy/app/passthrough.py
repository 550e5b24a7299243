"""Every other vLLM route a client uses, passed through to one engine serving the request's model.

PD disaggregation is for generation; these routes run whole on one engine (vLLM 0.32,
``docs/apis-through-pd.md`` "Routes by model kind"): tokenizing (``/tokenize``, ``/detokenize``,
``/v1/messages/count_tokens``), the scale-out render routes (exact prompt token ids) and tokens-in/tokens-out
``/inference/v1/generate``, the pooling routes (``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score``,
``/rerank``, …; a pooling model, ``--runner pooling``) and speech-to-text (``/v1/audio/transcriptions``, multipart).

**Which engine.**  The scheduler's decode profile first, then its prefill profile (:meth:`Scheduler.pick`: healthy,
not draining, breaker closed, serving ``model``, DP rank), so a pooling or audio engine is reached by naming its
model; a request for a model nobody serves is vLLM's 404 before any engine is contacted
(:meth:`~pdproxy.engines.models.ServedModels.require`; the Anthropic envelope on ``count_tokens``).  The model is
the JSON body's ``model``, or the ``model`` field of a multipart form.

**Failover**, before any byte reached the client: a refused / reset connection or a 502/503/504 tries the next
engine (breaker fed, ``Retry-After`` honoured); an engine that does not serve the route at all — FastAPI's 404
``{"detail": "Not Found"}``, what vLLM answers for a pooling route on a generate model and the reverse — tries the
next engine without counting against it, and when none serves it the client gets a 404 in the OpenAI envelope
naming the route.  Any other status (4xx, 500) is the engine's answer, relayed as is.

**Transport**: httpx (control-plane style), not the data-plane client of :mod:`pdproxy.http.upstream`: these routes are
not on the hot path, they need arbitrary bodies (multipart uploads) and content types, and their answers are
relayed chunk by chunk as the engine writes them (``/inference/v1/generate`` streams SSE).  Timeouts: connect
``connect_timeout_s``; each read (the headers included) ``decode_first_byte_timeout_s``.  Headers to the engine:
the client's ``Content-Type`` and ``Accept``, one ``X-Request-Id``, ``Authorization`` by the rule of
:mod:`pdproxy.http.engine_headers`, the DP-rank pin.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.health import HealthMonitor
from pdproxy.engines.models import ServedModels
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import (
    Action,
    NotFound,
    ProxyError,
    UpstreamHTTPError,
    classify_status,
    error_body,
)
from pdproxy.http.engine_headers import EngineHeaders
from pdproxy.http.errors import httpx_error, httpx_errors
from pdproxy.pd.decode import routing_headers
from pdproxy.scheduling import PickRequest, Scheduler
from pdproxy.settings import Settings
from pdproxy.timeline import RequestContext

Send = Callable[[dict[str, Any]], Awaitable[None]]

ROUTES: dict[str, str] = {
    "/tokenize": "tokenize", "/detokenize": "detokenize",
    "/v1/messages/count_tokens": "count_tokens",
    "/v1/chat/completions/render": "render", "/v1/completions/render": "render",
    "/v1/messages/render": "render", "/v1/responses/render": "render",
    "/v1/chat/completions/derender": "render", "/v1/completions/derender": "render",
    "/inference/v1/generate": "generate",
    "/v1/embeddings": "embeddings", "/v2/embed": "embeddings", "/pooling": "pooling", "/classify": "classify",
    "/score": "score", "/v1/score": "score", "/rerank": "rerank", "/v1/rerank": "rerank", "/v2/rerank": "rerank",
    "/v1/audio/transcriptions": "audio", "/v1/audio/translations": "audio",
}
"""Passed-through path → its ``api`` label in metrics and logs."""

ANTHROPIC_ROUTES = frozenset({"/v1/messages/count_tokens"})
"""Routes whose own errors take the Anthropic envelope."""

_MULTIPART_MODEL = re.compile(rb'name="model"\r?\n(?:[^\r\n]+\r?\n)*\r?\n([^\r\n]*)\r?\n')
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                         b"proxy-authenticate", b"proxy-authorization", b"content-length", b"server", b"date",
                         b"x-request-id"})
"""Engine response headers not relayed (hop-by-hop, framing, and the ones pdproxy sets itself)."""


def _route_not_found(data: bytes) -> bool:
    """True for FastAPI's 404 body ``{"detail": "Not Found"}``: the engine does not serve the route at all."""
    try:
        return bool(orjson.loads(data) == {"detail": "Not Found"})
    except orjson.JSONDecodeError:
        return False


def request_model(body: bytes, content_type: str) -> str | None:
    """The ``model`` a passthrough request names: the JSON object's ``model``, or a multipart form's ``model``
    field; None when it names none (any engine may take it)."""
    if content_type.startswith("multipart/form-data"):
        found = _MULTIPART_MODEL.search(body)
        return found.group(1).decode("utf-8", "replace").strip() or None if found else None
    try:
        obj = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return None
    model = obj.get("model") if isinstance(obj, dict) else None
    return model if isinstance(model, str) and model else None


class Passthrough:
    """Serves the :data:`ROUTES` (module docstring) on raw ASGI.  ``scheduler`` picks the engine, ``served`` knows
    which models exist, ``pool`` holds a lease on the engine while the call runs (its in-flight count),
    ``health`` hears each attempt's verdict, ``headers`` builds the engine headers.  :meth:`aclose` closes the
    httpx client (the app's lifespan does)."""

    def __init__(self, settings: Settings, *, scheduler: Scheduler, served: ServedModels, pool: EndpointPool,
                 health: HealthMonitor, headers: EngineHeaders) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.served = served
        self.pool = pool
        self.health = health
        self.headers = headers
        timeout = httpx.Timeout(settings.decode_first_byte_timeout_s, connect=settings.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1024,
                                                                             max_keepalive_connections=64))

    async def aclose(self) -> None:
        """Close the engine connections."""
        await self.client.aclose()

    def _candidates(self, request: PickRequest, tried: list[Endpoint]) -> Endpoint | None:
        """The next engine to try: decoders first, then prefillers; None when every one was tried."""
        for role in (Role.DECODE, Role.PREFILL):
            try:
                return self.scheduler.pick(role, request, tried, capacity=False)
            except ProxyError:
                continue
        return None

    def _engine_headers(self, endpoint: Endpoint, ctx: RequestContext, client: dict[bytes, str]) -> dict[str, str]:
        headers = self.headers.leg(endpoint, ctx.request_id, ctx.authorization)
        for name in (b"content-type", b"accept"):
            if name in client:
                headers[name.decode().title()] = client[name]
        return headers

    async def serve(self, path: str, body: bytes, client: dict[bytes, str], ctx: RequestContext, send: Send,
                    anthropic: bool = False) -> None:
        """Pass ``body`` (``POST path``, the client's ``client`` headers) to an engine and relay its answer to
        ``send``.  Raises :class:`ProxyError` while nothing was sent (404 for an unknown model or a route no engine
        serves, 503 when no engine can take it, the last engine failure)."""
        model = request_model(body, client.get(b"content-type", ""))
        ctx.model = model
        self.served.require(model)
        request = PickRequest(request_id=ctx.request_id, model=model)
        tried: list[Endpoint] = []
        last: ProxyError | None = None
        not_served = 0
        while (endpoint := self._candidates(request, tried)) is not None:
            tried.append(endpoint)
            if endpoint.role is Role.DECODE:                # the engine that served it (logs, routing header)
                ctx.prefiller, ctx.decoder, ctx.decoder_dp_rank = None, endpoint.name, endpoint.dp_rank
            else:
                ctx.prefiller, ctx.decoder = endpoint.name, None
            with self.pool.lease(endpoint, 0):
                try:
                    outcome = await self._attempt(endpoint, path, body, client, ctx, send)
                except ProxyError as exc:
                    if not self.health.record_error(endpoint, exc):
                        raise
                    last = exc
                    continue
            if outcome == "not_served":
                not_served += 1
                continue
            return
        if last is not None and not not_served:
            raise last
        if not tried:                                    # the scheduler's reason (503, or 404 for the model)
            self.scheduler.pick(Role.DECODE, request, capacity=False)
        raise NotFound(f"no engine serves {path}" + (f" for model {model}" if model else "") +
                       f" ({not_served} answered 404 Not Found for that route)", param=None)

    async def _attempt(self, endpoint: Endpoint, path: str, body: bytes, client: dict[bytes, str],
                       ctx: RequestContext, send: Send) -> str:
        """One engine: ``"done"`` when its answer was relayed, ``"not_served"`` when it does not serve the route.
        Raises :class:`ProxyError` for a failure worth another engine (nothing was sent)."""
        who = f"{endpoint.role.value} {endpoint.name}"
        request = self.client.build_request("POST", endpoint.url + path, content=body,
                                            headers=self._engine_headers(endpoint, ctx, client))
        with httpx_errors(who, endpoint.name, f" on {path}"):
            resp = await self.client.send(request, stream=True)
        try:
            retry = resp.status_code >= 500 and classify_status(resp.status_code).action is Action.FAIL_OVER
            if resp.status_code == 404 or retry:
                with httpx_errors(who, endpoint.name, f" on {path}"):
                    data = await resp.aread()
                if resp.status_code == 404 and _route_not_found(data):
                    self.health.record_neutral(endpoint)
                    return "not_served"
                if retry:
                    raise UpstreamHTTPError(resp.status_code, data, endpoint=endpoint.name,
                                            content_type=resp.headers.get("content-type", "application/json"),
                                            retry_after=resp.headers.get("retry-after"))
                await self._relay_whole(resp.status_code, resp.headers, data, ctx, send)
                self.health.record_neutral(endpoint)
                return "done"
            await self._relay_stream(resp, ctx, send)
        finally:
            await resp.aclose()
        if resp.status_code < 500:
            self.health.record_success(endpoint)
        return "done"

    def _headers_out(self, headers: httpx.Headers, ctx: RequestContext) -> list[tuple[bytes, bytes]]:
        """The engine's response headers for the client (hop-by-hop ones dropped), plus ``x-pdproxy-decoder`` /
        ``x-pdproxy-prefiller`` naming the engine when ``expose_routing_headers`` is set."""
        out = [(k, v) for k, v in headers.raw if k.lower() not in _HOP_BY_HOP]
        if self.settings.expose_routing_headers:
            out.extend(routing_headers(ctx))
        return out

    @staticmethod
    def _who(ctx: RequestContext) -> str:
        return ctx.decoder or ctx.prefiller or ""

    async def _relay_whole(self, status: int, headers: httpx.Headers, data: bytes, ctx: RequestContext,
                           send: Send) -> None:
        ctx.status = status
        ctx.timeline.first_token_at = ctx.timeline.last_token_at = time.monotonic()
        await send({"type": "http.response.start", "status": status,
                    "headers": self._headers_out(headers, ctx) + [(b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    async def _relay_stream(self, resp: httpx.Response, ctx: RequestContext, send: Send) -> None:
        """The engine's status, headers and body as they come (chunked); a failure after the first byte ends
        the body where it broke (the status line is out: nothing else can be said)."""
        ctx.status = resp.status_code
        if resp.status_code >= 400:
            ctx.outcome = "upstream_rejected" if resp.status_code < 500 else "upstream_error"
        started = False
        try:
            async for chunk in resp.aiter_raw():
                if not started:
                    ctx.timeline.first_token_at = time.monotonic()
                    await send({"type": "http.response.start", "status": resp.status_code,
                                "headers": self._headers_out(resp.headers, ctx)})
                    started = True
                if chunk:
                    ctx.events += 1
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.HTTPError as exc:
            if not started:
                raise httpx_error(exc, f"engine {self._who(ctx)}", self._who(ctx), " before its answer") from None
            ctx.outcome = "upstream_error"
            ctx.error = f"engine {self._who(ctx)} failed mid-answer: {exc.__class__.__name__}"
        if not started:
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": self._headers_out(resp.headers, ctx)})
        ctx.timeline.last_token_at = time.monotonic()
        await send({"type": "http.response.body", "body": b""})


class TrackedSend:
    """An ASGI ``send`` that remembers whether the response started and ended, and adds ``headers`` (the
    proxy's own, e.g. ``x-request-id``) to its status line."""

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        self.send = send
        self.headers = headers
        self.started = False
        self.ended = False

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            message = {**message, "headers": list(message.get("headers") or []) + self.headers}
        elif not message.get("more_body", False):
            self.ended = True
        await self.send(message)


def not_found_body() -> bytes:
    """The OpenAI-envelope 404 for a path pdproxy does not serve."""
    return orjson.dumps(error_body(404, "Not Found"))
