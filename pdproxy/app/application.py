"""The application: pdproxy's own HTTP protocol for the two completion routes, FastAPI for everything else.

Why two paths: FastAPI's ``StreamingResponse`` plus httpx cost ~460 µs of proxy CPU per relayed event and
~8.5 ms per PD request on this machine kind; a raw ASGI handler on uvicorn still paid an ASGI message, an
``await send()`` and a coroutine switch per event; the completion routes are now served by
:mod:`pdproxy.http.server`, whose connections hand the relay the client's transport (README "Performance" has the
figures).  The control plane (models, health, version, metrics, admin) is not on the hot path and keeps
FastAPI's conveniences, reached through ASGI from the same server and port.

``create_app(settings)`` builds a :class:`PDProxyApp`; its state (``ProxyState``) is created in the lifespan,
inside the running event loop, and torn down there.  Serve it with ``pdproxy.http.server.uvicorn_config(app, …)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast

import orjson
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match

from pdproxy import __version__
from pdproxy.apis import streams as api_streams
from pdproxy.apis.kv_transfer import client_handle_fault
from pdproxy.apis.request import Api, ProxyRequest, load_json, parse_request, require_json
from pdproxy.app import passthrough
from pdproxy.app.admin import build_admin_router, check_debug_access, read_body
from pdproxy.app.disconnect import asgi_disconnect, cancel_on_disconnect, exchange_disconnect
from pdproxy.app.passthrough import Send
from pdproxy.app.state import ProxyState
from pdproxy.endpoints import Endpoint, Role
from pdproxy.errors import (
    BadRequest,
    EdgeRefused,
    InternalError,
    NoEndpointAvailable,
    PayloadTooLarge,
    ProxyError,
    ShuttingDown,
    Unauthorized,
    UpstreamHTTPError,
    error_body,
)
from pdproxy.http.auth import INVALID_KEY, key_accepted
from pdproxy.http.engine_headers import TRACE_HEADERS, client_authorization, names_pdproxy
from pdproxy.http.server import Exchange
from pdproxy.ops.gcpolicy import GcPolicy
from pdproxy.ops.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pdproxy.ops.metrics import ProxyMetrics, rejection_of
from pdproxy.ops.reqlog import RequestLog
from pdproxy.pd.director import Director
from pdproxy.pd.responder import Responder
from pdproxy.prefix.metrics import PrefixCacheCollector
from pdproxy.settings import Settings
from pdproxy.timeline import RequestContext, new_request_id

if TYPE_CHECKING:
    from starlette.types import ASGIApp

    from pdproxy.workers.share import WorkerShare

log = logging.getLogger("pdproxy")
Receive = Callable[[], Awaitable[dict[str, Any]]]
"""An ASGI ``receive``, as :func:`pdproxy.app.disconnect.asgi_disconnect` takes it (``Send``: passthrough's)."""
_PASSED_HEADERS = (b"content-type", b"accept", *TRACE_HEADERS)  # client headers a passthrough route hands on

def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v).decode("latin-1")
    return None


class _InFlight:
    """``with _InFlight(state):`` counts a request in ``state.in_flight`` (the drain's wait, pdproxy/app/shutdown.py)
    for the block, however it is left (an answer, an error, a cancellation)."""

    __slots__ = ("state",)

    def __init__(self, state: ProxyState) -> None:
        self.state = state

    def __enter__(self) -> None:
        self.state.in_flight += 1

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.state.in_flight -= 1


class _RequestEnd:
    """``with _RequestEnd(app, ctx) as end:`` around a generation request (``handle_completion``): on leaving the
    block, however it is left, the request is recorded (:meth:`PDProxyApp._finished` with ``end.req``, the parsed
    request once there is one) and then, if :meth:`in_flight` counted it, it leaves ``state.in_flight`` — recorded
    first, so an idle proxy has logged all it served.  One object and one ``with`` per request, where an
    :class:`_InFlight` inside a record-once block would be two of each."""

    __slots__ = ("app", "ctx", "req", "state")

    def __init__(self, app: PDProxyApp, ctx: RequestContext) -> None:
        self.app = app
        self.ctx = ctx
        self.req: ProxyRequest | None = None
        self.state: ProxyState | None = None

    def __enter__(self) -> _RequestEnd:
        return self

    def in_flight(self, state: ProxyState) -> None:
        """Count the request in ``state.in_flight`` until the block is left."""
        state.in_flight += 1
        self.state = state

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.app._finished(self.ctx, self.req)
        state = self.state
        if state is not None:
            state.in_flight -= 1


class PDProxyApp:
    """Top-level ASGI app.  ``state`` is None outside the lifespan."""

    def __init__(self, settings: Settings, *, share: WorkerShare | None = None) -> None:
        self.settings = settings
        self.completion_routes: dict[str, str] = {api.value: api for api in Api}
        self.error_routes: dict[str, str] = {**self.completion_routes,
                                             **dict.fromkeys(passthrough.ANTHROPIC_ROUTES, Api.MESSAGES)}
        """Path → the route whose error shape a refusal of any request there takes (Anthropic's on Messages and
        ``/v1/messages/count_tokens``): the HTTP server's own refusals and the 405s below."""
        s = settings
        self._entry: Callable[..., Awaitable[None]] = self._dispatch if not s.allowed_origins else CORSMiddleware(
            cast("ASGIApp", self._dispatch), allow_origins=s.allowed_origins, allow_credentials=s.allow_credentials,
            allow_methods=s.allowed_methods, allow_headers=s.allowed_headers)
        """Every ASGI request (all but a generation route's POST, which pdproxy.http.server answers with the same
        headers: pdproxy/http/cors.py) goes through Starlette's CORS middleware when ``allowed_origins`` is set,
        as vLLM's routes do; it answers preflights."""
        self.state: ProxyState | None = None
        self.director: Director | None = None
        self.unready = False  # /health answers 503 (shutdown_delay_s: draining soon, still serving)
        self.share = share
        self.metrics = ProxyMetrics(lambda: self.state,
                                    known_model=lambda model: self.state is not None and self.state.served.known(model))
        self.metrics.add_collector(PrefixCacheCollector(     # pdproxy_kv_events_*, pdproxy_prefix_index_*
            lambda: self.state.prefix_cache.subscriber if self.state else None,
            lambda: self.state.prefix_cache.index if self.state else None,
            lambda: self.state.prefix_cache.approx if self.state else None))
        self.request_log = RequestLog(settings)
        self.control = build_control_app(self)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        await self._entry(scope, receive, send)

    async def _dispatch(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"].rstrip("/")
            route = self.completion_routes.get(path)
            if route is not None:                 # answered in the route's error shape (Anthropic's on Messages)
                if scope["method"] == "POST":  # only under a server other than pdproxy.http.server
                    body = self.refusal_body(route, 500, "the completion routes need pdproxy's own HTTP protocol: "
                                                         "serve the app with pdproxy.http.server.uvicorn_config()")
                    await send({"type": "http.response.start", "status": 500,
                                "headers": [(b"content-type", b"application/json"),
                                            (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
                else:
                    await self._post_only(path, send)
                return
            label = passthrough.ROUTES.get(path)
            if label is not None:
                if scope["method"] == "POST":
                    await self.handle_passthrough(path, label, scope, receive, send)
                else:
                    await self._post_only(path, send)
                return
        # Starlette's Send type takes any MutableMapping; what it sends is a dict
        await self.control(scope, receive, send)  # type: ignore[arg-type]

    async def _post_only(self, path: str, send: Send) -> None:
        """The 405 (``Allow: POST``) of another method on a POST-only route (``path``: without trailing slash), in
        the route's error shape: Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on ``/v1/messages``
        and ``/v1/messages/count_tokens`` (``error_routes``), vLLM's OpenAI envelope elsewhere."""
        shape = self.error_routes.get(path)
        body = (orjson.dumps(api_streams.anthropic_envelope("MethodNotAllowed", "Method Not Allowed"))
                if shape is not None and Api(shape) is Api.MESSAGES else
                orjson.dumps(error_body(405, "Method Not Allowed", error_type="MethodNotAllowed")))
        await send({"type": "http.response.start", "status": 405,
                    "headers": [(b"content-type", b"application/json"), (b"allow", b"POST"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    async def handle_passthrough(self, path: str, label: str, scope: dict[str, Any], receive: Receive,
                                 send: Send) -> None:
        """Raw ASGI handler for the routes passed through to one engine (:mod:`pdproxy.app.passthrough`)."""
        state = self.state
        client_id = _header(scope, b"x-request-id")
        ctx = RequestContext(request_id=new_request_id(client_id), client_request_id=client_id, api_label=label,
                             engine_request=label not in passthrough.MODEL_CALLS)
        out = passthrough.TrackedSend(send, [(b"x-request-id", (client_id or ctx.request_id).encode("latin-1"))])
        ctx.gaps = self.metrics.started(label)
        anthropic = path in passthrough.ANTHROPIC_ROUTES
        try:
            if state is None or state.shutting_down:
                raise ShuttingDown()
            ctx.authorization = self._check_auth(lambda name: _header(scope, name))
            body = await self._read_body(receive, scope)
            headers = {k: v.decode("latin-1") for k, v in scope["headers"] if k in _PASSED_HEADERS}
            with _InFlight(state):
                work = state.passthrough.serve(path, body, headers, ctx, out)
                if await cancel_on_disconnect(work, asgi_disconnect(receive), lambda: out.ended):
                    ctx.outcome = "client_disconnected"
        except asyncio.CancelledError:
            ctx.outcome = "client_disconnected"
        except Exception as exc:
            if isinstance(exc, ProxyError):
                err = exc
                ctx.outcome = err.outcome
                ctx.rejection = rejection_of(err)
            else:               # a bug, not an upstream condition: counted as one, answered in the API's shape
                log.exception("request %s failed", ctx.request_id)
                err = InternalError(exc)
                ctx.outcome = "internal_error"
            ctx.error = err.message
            if not out.started:
                body = api_streams.error_json(Api.MESSAGES if anthropic else Api.CHAT, err)
                ctype = err.content_type if isinstance(err, UpstreamHTTPError) else "application/json"
                ctx.status = err.status_code
                await out({"type": "http.response.start", "status": err.status_code,
                           "headers": [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode()),
                                       *((k.lower().encode(), v.encode()) for k, v in err.headers.items())]})
                await out({"type": "http.response.body", "body": body})
        finally:
            self._finished(ctx, None)

    async def _read_body(self, receive: Receive, scope: dict[str, Any]) -> bytes:
        limit = self.settings.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise asyncio.CancelledError
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
            chunks.append(body)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def _check_auth(self, header: Callable[[bytes], str | None]) -> str | None:
        """Enforce ``api_keys``: the client's key is ``Authorization: Bearer <key>``, or ``x-api-key: <key>`` as
        the Anthropic client sends it (``header``: the request's header by lower-case name).  Returns the client's
        credential as an ``Authorization`` value (for the engine-header rule; ``x-api-key`` becomes a bearer token)."""
        if not key_accepted(self.settings.api_keys, header):
            raise Unauthorized(INVALID_KEY)
        return client_authorization(header(b"authorization"), header(b"x-api-key"))

    def refusal_body(self, route: str, status: int, message: str) -> bytes:
        """The body of a refusal the HTTP server answers itself on a completion route, in its API's error shape
        (:func:`pdproxy.apis.streams.refusal_json`)."""
        return api_streams.refusal_json(Api(route), status, message)

    def edge_refused(self, route: str, status: int, message: str, client_request_id: str | None) -> str | None:
        """A generation request the HTTP server refused before handing it over (``pdproxy/http/server.py``: a
        missing key's 401, 413, 408, 431, 400, the pending-body budget's 503): counted in ``pdproxy_requests_total``
        and ``pdproxy_rejections_total`` and written to the request log under the client's ``X-Request-Id``, as
        the refusals answered here are (:class:`~pdproxy.errors.EdgeRefused` names its outcome and rejection).
        Returns the id the refusal answers with (the client's, else the one logged), None if recording failed."""
        try:
            err = EdgeRefused(status, message)
            ctx = RequestContext(request_id=new_request_id(client_request_id), client_request_id=client_request_id,
                                 api_label=Api(route).label)
            ctx.gaps = self.metrics.started(ctx.api_label)
        except Exception:                  # observability must never break the server's refusal
            log.exception("recording a refusal on %s failed", route)
            return None
        ctx.status, ctx.outcome, ctx.rejection, ctx.error = status, err.outcome, err.rejection, message
        self._finished(ctx, None)
        return client_request_id or ctx.request_id

    async def handle_completion(self, route: str, ex: Exchange) -> None:
        """A ``POST`` to one of the four generation routes (``route``: an :class:`~pdproxy.apis.request.Api` value)
        on one :class:`pdproxy.http.server.Exchange` (its body already read whole, within ``max_body_bytes``)."""
        api = Api(route)
        state, director = self.state, self.director
        client_id = ex.header(b"x-request-id")
        ctx = RequestContext(request_id=new_request_id(client_id), client_request_id=client_id, api_label=api.label,
                             client_headers=ex.headers)
        out = Responder(ex, ctx, [(b"x-request-id", (client_id or ctx.request_id).encode("latin-1"))], api)
        ctx.gaps = self.metrics.started(ctx.api_label)
        with _RequestEnd(self, ctx) as end:       # recorded however it ends, refused or served
            try:
                if state is None or director is None or state.shutting_down:
                    raise ShuttingDown()
                ctx.authorization = self._check_auth(ex.header)
                require_json(ex.header(b"content-type"))
                req = end.req = parse_request(ex.body, api, self.settings.max_json_depth,
                                              self.settings.max_json_items)
                ctx.model = req.model
                fault = client_handle_fault(req.body)
                if fault is not None:     # vllm_xargs.kv_transfer_params...: not cut out, refused
                    raise BadRequest(f"{fault} is set by pdproxy, never by a client", param=fault.split(".")[0])
            except ProxyError as err:
                ctx.outcome = err.outcome
                ctx.rejection = rejection_of(err)
                out.error_nowait(err)
                return
            end.in_flight(state)
            await self._serve_until_disconnect(director, req, ctx, out, ex)

    def _finished(self, ctx: RequestContext, req: ProxyRequest | None) -> None:
        """Per-request metrics and the request-log line (pdproxy/ops/metrics.py, pdproxy/ops/reqlog.py); never raises."""
        if ctx.timeline.finished_at is None:
            ctx.timeline.finished_at = time.monotonic()
        try:
            self.metrics.observe(ctx, ctx.rejection)
            self.request_log.emit(ctx, req, ctx.rejection)
        except Exception:  # observability must never break a request
            log.exception("recording request %s failed", ctx.request_id)

    async def _serve_until_disconnect(self, director: Director, req: ProxyRequest, ctx: RequestContext,
                                      out: Responder, ex: Exchange) -> None:
        """Run the director in this task, cancelling it as soon as the client disconnects (the connection's
        ``on_disconnect``, :func:`~pdproxy.app.disconnect.cancel_on_disconnect`), and send errors the way still open
        to us."""
        dropped = False
        try:
            dropped = await cancel_on_disconnect(director.serve(req, ctx, out), exchange_disconnect(ex),
                                                 lambda: out.ended)  # after the last byte it is only "complete"
        except asyncio.CancelledError:                                # cancelled from outside
            ctx.outcome = "cancelled"  # the server is stopping now (forced shutdown): say so, briefly — a 503
            if not out.ended:          # with Retry-After when nothing was sent yet, else the stream's error event
                with contextlib.suppress(Exception):
                    out.error_nowait(ShuttingDown())
            raise
        except ProxyError as err:
            ctx.outcome = err.outcome
            ctx.rejection = rejection_of(err)
            out.error_nowait(err)
        except Exception as exc:  # a bug, not an upstream condition: still answer, never hang
            log.exception("request %s failed", ctx.request_id)
            ctx.outcome = "internal_error"
            out.error_nowait(InternalError(exc))
        finally:
            if dropped:
                ctx.outcome = "client_disconnected"
            elif not out.ended and out.started:
                out.end_nowait()


def build_control_app(proxy: PDProxyApp) -> FastAPI:
    """FastAPI app for the control plane; its lifespan builds and tears down the proxy's state."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        """Start-up top to bottom on one exit stack; shutdown is the same lines in reverse (also when a start-up
        step raises: what started before it is stopped)."""
        def forget() -> None:
            proxy.state = None
            proxy.director = None

        async with contextlib.AsyncExitStack() as stack:
            stack.callback(forget)                                  # last out: the routes answer 503 from here on
            state = await stack.enter_async_context(ProxyState.build(proxy.settings, proxy.share))
            director = state.director()
            stack.push_async_callback(director.aclose)              # background KV release legs (bounded)
            stack.callback(setattr, state, "shutting_down", True)   # first out: refuse new work
            proxy.state, proxy.director = state, director
            proxy.metrics.follow_releases(director.kv_release)  # pdproxy_kv_release_legs_total
            state.live_streams.observer = proxy.metrics.continuations  # pdproxy_continuation*
            gc_policy = GcPolicy(proxy.settings.gc_full_interval_s,  # no full-collection pauses mid-ramp, young
                                 proxy.settings.gc_young_threshold)  # collections every few hundred requests
            gc_policy.start()
            stack.callback(gc_policy.stop)
            stack.enter_context(proxy.request_log)
            yield

    # openapi: served below, with the access of the debug routes; no redirect of "/path/" to "/path" (Starlette's
    # redirect names the client's Host: a shared cache would keep a redirect to a host of the client's choosing)
    app = FastAPI(title="pdproxy", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, redirect_slashes=False)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        """The OpenAPI description (it lists the admin routes): access as ``/debug/load`` (``debug_routes``)."""
        check_debug_access(proxy.settings, request)
        return Response(orjson.dumps(app.openapi()), media_type="application/json")

    @app.get("/docs", include_in_schema=False)
    async def docs(request: Request) -> Response:
        """Swagger UI over ``/openapi.json``: access as ``/debug/load`` (``debug_routes``)."""
        check_debug_access(proxy.settings, request)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="pdproxy")

    def state() -> ProxyState:
        if proxy.state is None:
            raise ShuttingDown()
        return proxy.state

    app.include_router(build_admin_router(state))  # /admin/endpoints: list/add/drain/remove (pdproxy/app/admin.py)

    @app.exception_handler(ProxyError)
    async def _proxy_error(_: Request, err: ProxyError) -> Response:
        return Response(err.body_bytes(), status_code=err.status_code, headers=err.headers,
                        media_type="application/json")

    def ready() -> tuple[bool, str | None, dict[str, dict[str, int]]]:
        """Whether requests can be served now — not shutting down, started, at least one usable prefiller and
        decoder — the reason when not, and each role's ``{"healthy", "total"}`` endpoints."""
        st = state()
        roles = {role.value: {"healthy": len(st.pool.available(role)), "total": len(st.pool.endpoints(role))}
                 for role in (Role.PREFILL, Role.DECODE)}
        reason = ("shutting down" if st.shutting_down else "starting" if proxy.unready else
                  next((f"no healthy {r} engine" for r, n in roles.items() if not n["healthy"]), None))
        return reason is None, reason, roles

    @app.get("/health")
    async def health(request: Request) -> Response:
        """200 when at least one prefiller and one decoder are healthy; 503 otherwise (or when shutting down); 508
        Loop Detected to a pdproxy's probe (``Via: 1.1 pdproxy``: pdproxy/http/engine_headers.py), which has
        been given this pdproxy as an engine."""
        if names_pdproxy(request.headers.get("via")):
            return Response(orjson.dumps(error_body(508, "this is a pdproxy, not a vLLM engine: give pdproxy the "
                                                         "engines' URLs", error_type="LoopDetected")),
                            status_code=508, media_type="application/json")
        ok = ready()[0]
        return Response(status_code=200 if ok else 503, headers={} if ok else {"retry-after": "1"})

    @app.get("/ping")
    @app.post("/ping")
    async def ping(request: Request) -> Response:
        """vLLM's SageMaker health check (``vllm/entrypoints/serve/sagemaker/api_router.py``: ``GET`` and ``POST``,
        its ``/health``): :func:`health`'s answer."""
        return await health(request)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        """vllm-router's probe of a serving prefill/decode pair: :func:`health`'s answer (a healthy prefiller and
        decoder, each judged by its ``/health`` probes and its requests' outcomes: ``docs/health.md``)."""
        return await health(request)

    @app.get("/readiness")
    async def readiness() -> Response:
        """vllm-router's readiness probe: :func:`health`'s status with ``{"status": "ready" | "not_ready",
        "reason"?, "prefill": {"healthy", "total"}, "decode": {...}}``."""
        ok, reason, roles = ready()
        body: dict[str, Any] = {"status": "ready" if ok else "not_ready"}
        if reason is not None:
            body["reason"] = reason
        return Response(orjson.dumps({**body, **roles}), status_code=200 if ok else 503,
                        headers={} if ok else {"retry-after": "1"}, media_type="application/json")

    @app.get("/healthcheck")
    async def healthcheck() -> Response:
        """The vLLM-Ascend example proxy's status route (``examples/disaggregated_prefill_v1/
        load_balance_proxy_server_example.py``): 200 while the process answers, ``{"status": "ok",
        "prefill_instances": N, "decode_instances": N, "request_num": N}`` — the configured engines of each role and
        the requests in flight, as it answers.  Whether they are usable is :func:`health`'s (``/health``)."""
        st = state()
        body = {"status": "ok", "prefill_instances": len(st.pool.endpoints(Role.PREFILL)),
                "decode_instances": len(st.pool.endpoints(Role.DECODE)), "request_num": st.in_flight}
        return Response(orjson.dumps(body), media_type="application/json")

    @app.get("/liveness")
    async def liveness() -> Response:
        """vllm-router's liveness probe: 200 ``OK`` while the process answers (engines being down, or a drain,
        must not get the proxy restarted)."""
        return Response(b"OK", media_type="text/plain")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus exposition of pdproxy's own metrics and the engines' gauges (pdproxy/ops/metrics.py); behind
        ``metrics_key`` when it is set (401 without it, as a missing or wrong client key)."""
        key = proxy.settings.metrics_key
        if key:
            auth = request.headers.get("authorization") or ""
            given = auth[7:] if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                raise Unauthorized("invalid or missing metrics key", redact=False)
        return Response(proxy.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """The union of the models the engines serve, as vLLM lists them — LoRA adapters with their ``parent`` —
        but those no request can be served for (only prefillers serve them:
        :meth:`pdproxy.engines.models.ServedModels.servable`), each with the longest context pdproxy serves for it:
        a request must fit a prefiller and a decoder (:meth:`pdproxy.engines.models.ServedModels.cards`).  When the engines refuse
        pdproxy's own key (``--api-key`` without ``engine_api_key``) and list nothing to it, the answer is the
        engines' own for the client's key: pdproxy passes client credentials through, so one engine's
        ``/v1/models`` answers with them (its list, or its 401); otherwise a 503 naming ``engine_api_key``.  With
        ``api_keys`` set it needs a client key, as every ``/v1`` route (vLLM's ``--api-key`` guards it too)."""
        auth = proxy._check_auth(lambda name: request.headers.get(name.decode("latin-1")))
        st = state()
        cards = st.served.cards(st.settings.max_model_len)
        refusing = st.served.refusing() if not cards else []
        if refusing:
            if st.settings.engine_api_key or not st.headers.forward_client_authorization:
                raise NoEndpointAvailable("engine", "the engines refuse pdproxy's calls to /v1/models (HTTP 401/"
                                                    "403): set engine_api_key to the engines' --api-key")
            status, body = await st.engines.models_as_client(refusing[0], st.headers.authorization(auth))
            return Response(body, status_code=status, media_type="application/json")
        if not cards and st.settings.model_name:
            cards = [{"id": st.settings.model_name, "object": "model", "owned_by": "vllm",
                      "max_model_len": st.settings.max_model_len}]
        return Response(orjson.dumps({"object": "list", "data": cards}), media_type="application/json")

    @app.get("/debug/load")
    async def debug_load(request: Request) -> dict[str, Any]:
        """Per-endpoint in-flight requests/tokens and health (all zero when idle; with ``--workers N`` summed over
        the workers), per prefiller the prefill ledger's ``prefill_inflight_tokens`` (dispatched, unanswered),
        ``kv_held_tokens`` (in flight or pinned, whole blocks) and budget now (``prefill_budget_tokens``: the
        setting, or ``prefill_budget_s`` × the measured ``prefill_tokens_per_s`` when more; the rate is None until
        measured, and with ``--workers N`` the answering worker's), admission's counters; with ``--workers N`` also
        the answering ``worker`` and each worker's row (``pid``, ``ready``, ``waiting`` in its prefill queue,
        ``requests`` it holds).  Who may read it: setting ``debug_routes`` (:func:`pdproxy.app.admin.check_debug_access`:
        by default open on loopback without ``api_keys``, else behind the admin key)."""
        st = state()
        check_debug_access(st.settings, request)

        def endpoint(e: Endpoint) -> dict[str, Any]:
            load = st.pool.load(e)
            out: dict[str, Any] = {"name": e.name, "role": e.role.value, "dp_rank": e.dp_rank,
                                   "requests": load.requests, "tokens": load.tokens, "healthy": load.healthy,
                                   "draining": load.draining}
            if e.role is Role.PREFILL:
                out["prefill_inflight_tokens"] = st.ledger.inflight_tokens(e)
                out["kv_held_tokens"] = st.ledger.kv_held_tokens(e)
                out["prefill_budget_tokens"] = st.ledger.budget(e)
                out["prefill_tokens_per_s"] = st.ledger.measured_rate(e)
            return out

        body: dict[str, Any] = {"in_flight": st.in_flight, "admission": st.admission.snapshot(),
                                "endpoints": [endpoint(e) for e in st.pool.endpoints()]}
        if st.share is not None:
            board = st.share.board
            body["worker"] = st.share.row
            body["workers"] = [{"row": r, "pid": board.owner(r)[0], "ready": board.owner(r)[1],
                                "waiting": board.waiting(r), "requests": board.row_totals(r)[0]}
                               for r in range(board.rows)]
        return body

    @app.get("/debug/prefix")
    @app.post("/debug/prefix")          # one route per method: one OpenAPI operation id each
    async def debug_prefix(request: Request) -> Response:
        """Which endpoint holds how much of a prompt: POST a chat or completions body (``messages`` → chat), or
        ``GET ?prompt=TEXT`` (a completions prompt).  Answers ``{"prefix_routing", "keys", "prompt_tokens",
        "blocks", "endpoints": [{"name", "role", "dp_rank", "cached_tokens", "source", "publisher_live",
        "block_size"}]}``; nothing is sent to an engine but, without a local tokenizer, ``/tokenize``.  Access as
        ``/debug/load``; the body is read within ``max_body_bytes`` and ``max_json_depth``.  A prompt's keys carry
        its ``cache_salt`` and LoRA adapter, as the engines' do: the answer for a salted prompt is only ever
        given to a caller naming the same salt."""
        st = state()
        check_debug_access(st.settings, request)
        authorization = None if st.settings.api_keys else request.headers.get("authorization")
        if request.method == "POST":
            raw = await read_body(request, st.settings.max_body_bytes)
            shape = load_json(raw, st.settings.max_json_depth, st.settings.max_json_items)
            api = Api.CHAT if isinstance(shape, dict) and "messages" in shape else Api.COMPLETIONS
        else:
            prompt = request.query_params.get("prompt")
            if not prompt:
                raise BadRequest("give the prompt as ?prompt=TEXT, or POST a completion request body",
                                 param="prompt")
            raw = orjson.dumps({"prompt": prompt, "model": request.query_params.get("model")})
            api = Api.COMPLETIONS
        req = parse_request(raw, api, st.settings.max_json_depth, st.settings.max_json_items)
        if req.fault is not None:           # a body the engines would refuse: nothing to explain (its 400)
            raise req.fault
        ctx = RequestContext(request_id=new_request_id(None), client_request_id=None, api_label=api.label,
                             authorization=authorization, model=req.model)
        return Response(orjson.dumps(await st.prefix.explain(req, ctx)), media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: Exception) -> Response:
        """Starlette's own refusals (404 for an unknown path, 405 with ``Allow`` for a known path's other methods)
        in vLLM's JSON envelope, not FastAPI's ``{"detail": ...}``."""
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        kind = "MethodNotAllowed" if status == 405 else None
        headers = exc.headers
        if status == 405:     # Starlette names the first route's methods only (GET of GET/POST/DELETE /admin/endpoints)
            kept = {k: v for k, v in (headers or {}).items() if k.lower() != "allow"}   # Starlette's "Allow": replaced
            headers = {**kept, "allow": ", ".join(served_methods(app, request.scope))}
        return Response(orjson.dumps(error_body(status, str(exc.detail), error_type=kind)), status_code=status,
                        media_type="application/json", headers=headers)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, __: Exception) -> Response:
        """A route that failed unexpectedly: vLLM's JSON envelope (docs/limits.md), then the connection closes
        (Starlette re-raises the error after this answer; the server logs it)."""
        return Response(orjson.dumps(error_body(500, "internal error in pdproxy while handling the request")),
                        status_code=500, media_type="application/json", headers={"connection": "close"})

    return app


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def served_methods(app: FastAPI, scope: Mapping[str, Any]) -> list[str]:
    """The methods of :data:`_METHODS` that one of ``app``'s routes serves at the path of the request ``scope``
    (an ASGI HTTP scope): a 405's ``Allow`` (RFC 9110 §15.5.6), e.g. ``["GET", "POST", "DELETE"]``."""
    return [m for m in _METHODS
            if any(r.matches({**scope, "method": m})[0] is Match.FULL for r in app.router.routes)]


def create_app(settings: Settings) -> PDProxyApp:
    """Build the proxy ASGI app (state is created when the server runs the lifespan)."""
    return PDProxyApp(settings)
