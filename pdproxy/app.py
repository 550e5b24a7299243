"""The ASGI application: a raw ASGI path for the two completion routes, FastAPI for everything else.

Why two paths: FastAPI's ``StreamingResponse`` plus httpx cost ~460 µs of proxy CPU per relayed event and
~8.5 ms per PD request on this machine kind, against ~45 µs and ~340 µs for raw ASGI plus aiohttp (issue 2,
README "Performance"); the upstream legs have since moved to :mod:`pdproxy.h1client` (≈ 27–33 µs per paced event,
≈ 340–390 µs per PD request with every feature on: loadtest/RESULTS.md).  The control plane (models, health,
version, metrics, admin) is not on the hot path and keeps FastAPI's conveniences.

``create_app(settings)`` builds a :class:`PDProxyApp`; its state (``ProxyState``) is created in the lifespan,
inside the running event loop, and torn down there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from pdproxy import __version__
from pdproxy.admin import build_admin_router, check_admin_key
from pdproxy.director import Director
from pdproxy.endpoints import Endpoint, Role
from pdproxy.errors import Forbidden, PayloadTooLarge, ProxyError, ShuttingDown, Unauthorized, error_body
from pdproxy.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pdproxy.metrics import ProxyMetrics, rejection_of
from pdproxy.protocol import Api, ProxyRequest, parse_request
from pdproxy.relay import Responder
from pdproxy.reqlog import RequestLog
from pdproxy.settings import Settings
from pdproxy.state import ProxyState
from pdproxy.timeline import RequestContext, new_request_id

if TYPE_CHECKING:
    from pdproxy.worker_share import WorkerShare

log = logging.getLogger("pdproxy")

COMPLETION_ROUTES = {"/v1/chat/completions": Api.CHAT, "/v1/completions": Api.COMPLETIONS}


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return None


class PDProxyApp:
    """Top-level ASGI app.  ``state`` is None outside the lifespan."""

    def __init__(self, settings: Settings, *, share: WorkerShare | None = None) -> None:
        self.settings = settings
        self.state: ProxyState | None = None
        self.director: Director | None = None
        self.unready = False  # /health answers 503 (shutdown_delay_s: draining soon, still serving)
        self.share = share
        self.metrics = ProxyMetrics(lambda: self.state)
        self.request_log = RequestLog(settings)
        self.control = build_control_app(self)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            api = COMPLETION_ROUTES.get(scope["path"].rstrip("/"))
            if api is not None:
                if scope["method"] == "POST":
                    await self.handle_completion(api, scope, receive, send)
                else:
                    body = orjson.dumps(error_body(405, "Method Not Allowed", error_type="MethodNotAllowed"))
                    await send({"type": "http.response.start", "status": 405,
                                "headers": [(b"content-type", b"application/json"), (b"allow", b"POST"),
                                            (b"content-length", str(len(body)).encode())]})
                    await send({"type": "http.response.body", "body": body})
                return
        await self.control(scope, receive, send)

    async def _read_body(self, receive: Any, scope: dict[str, Any]) -> bytes:
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

    def _check_auth(self, scope: dict[str, Any]) -> str | None:
        auth = _header(scope, b"authorization")
        keys = self.settings.api_keys
        if keys:
            token = auth[7:] if auth and auth[:7].lower() == "bearer " else None
            if token is None or not any(hmac.compare_digest(token.encode(), k.encode()) for k in keys):
                raise Unauthorized("invalid or missing API key")
        return auth

    async def handle_completion(self, api: Api, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """Raw ASGI handler for ``POST /v1/completions`` and ``/v1/chat/completions``."""
        state, director = self.state, self.director
        client_id = _header(scope, b"x-request-id")
        ctx = RequestContext(request_id=new_request_id(client_id), client_request_id=client_id, api_label=api.label,
                             client_headers=scope["headers"])
        out = Responder(send, ctx, [(b"x-request-id", (client_id or ctx.request_id).encode("latin-1"))])
        req: ProxyRequest | None = None
        ctx.observe_gap = self.metrics.started(ctx.api_label)
        try:
            try:
                if state is None or director is None or state.shutting_down:
                    raise ShuttingDown()
                ctx.authorization = self._check_auth(scope)
                raw = await self._read_body(receive, scope)
                req = parse_request(raw, api)
                ctx.model = req.model
            except asyncio.CancelledError:
                ctx.outcome = "client_disconnected"
                return
            except ProxyError as err:
                ctx.outcome = err.outcome
                ctx.rejection = rejection_of(err)
                await out.error(err)
                return
            state.in_flight += 1
            try:
                await self._serve_until_disconnect(director, req, ctx, out, receive)
            finally:
                state.in_flight -= 1
        finally:
            self._finished(ctx, req)

    def _finished(self, ctx: RequestContext, req: ProxyRequest | None) -> None:
        """Per-request metrics and the request-log line (pdproxy/metrics.py, pdproxy/reqlog.py); never raises."""
        if ctx.timeline.finished_at is None:
            ctx.timeline.finished_at = time.monotonic()
        try:
            self.metrics.observe(ctx, ctx.rejection)
            self.request_log.emit(ctx, req, ctx.rejection)
        except Exception:  # observability must never break a request
            log.exception("recording request %s failed", ctx.request_id)

    async def _serve_until_disconnect(self, director: Director, req: Any, ctx: RequestContext, out: Responder,
                                      receive: Any) -> None:
        """Run the director in this task, cancelling it as soon as the client disconnects (uvicorn's ``receive``
        returns ``http.disconnect`` when the connection drops), and send errors the way still open to us.

        The director runs inline and a done-callback on the pending ``receive()`` cancels this task: one task
        per request instead of two plus an ``asyncio.wait`` (loadtest/RESULTS.md, per-request CPU)."""
        task = asyncio.current_task()
        disconnect = asyncio.ensure_future(receive())
        dropped = False

        def on_disconnect(_: asyncio.Future[Any]) -> None:
            nonlocal dropped
            if not out.ended and task is not None and not dropped:  # after the last byte it is only "complete"
                dropped = True
                task.cancel()

        disconnect.add_done_callback(on_disconnect)
        try:
            await director.serve(req, ctx, out)
        except asyncio.CancelledError:
            if not dropped or (task is not None and task.cancelling() > 1):  # also cancelled from outside
                ctx.outcome = "cancelled"  # the server is stopping now (forced shutdown): say so, briefly
                if out.started and not out.ended:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(out.error(ShuttingDown()), 0.5)
                raise
        except ProxyError as err:
            if not dropped:
                ctx.outcome = err.outcome
                ctx.rejection = rejection_of(err)
                await out.error(err)
        except Exception as exc:  # a bug, not an upstream condition: still answer, never hang
            if not dropped:
                log.exception("request %s failed", ctx.request_id)
                ctx.outcome = "internal_error"
                await out.error(ProxyError(f"internal error in pdproxy: {exc.__class__.__name__}"))
        finally:
            disconnect.remove_done_callback(on_disconnect)
            disconnect.cancel()
            if dropped:
                ctx.outcome = "client_disconnected"
                if task is not None and task.cancelling():
                    task.uncancel()


def build_control_app(proxy: PDProxyApp) -> FastAPI:
    """FastAPI app for the control plane; its lifespan builds and tears down the proxy's state."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state = ProxyState.build(proxy.settings, proxy.share)
        await state.start()
        proxy.state = state
        proxy.director = Director.from_state(state)
        try:
            with proxy.request_log:
                yield
        finally:
            state.shutting_down = True
            if proxy.director is not None:
                await proxy.director.aclose()  # background KV release legs (bounded)
            await state.stop()
            proxy.state = None
            proxy.director = None

    app = FastAPI(title="pdproxy", version=__version__, lifespan=lifespan)

    def state() -> ProxyState:
        if proxy.state is None:
            raise ShuttingDown()
        return proxy.state

    app.include_router(build_admin_router(state))  # /admin/endpoints: list/add/drain/remove (pdproxy/admin.py)

    @app.exception_handler(ProxyError)
    async def _proxy_error(_: Request, err: ProxyError) -> Response:
        return Response(err.body_bytes(), status_code=err.status_code, headers=err.headers,
                        media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        """200 when at least one prefiller and one decoder are healthy; 503 otherwise (or when shutting down)."""
        st = state()
        ok = not st.shutting_down and not proxy.unready and bool(st.pool.available(Role.PREFILL)) and bool(st.pool.available(Role.DECODE))
        return Response(status_code=200 if ok else 503, headers={} if ok else {"retry-after": "1"})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus exposition of pdproxy's own metrics and the engines' gauges (pdproxy/metrics.py); behind
        ``metrics_key`` when it is set (403 otherwise)."""
        key = proxy.settings.metrics_key
        if key:
            auth = request.headers.get("authorization") or ""
            given = auth[7:] if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(given.encode(), key.encode()):
                raise Forbidden("invalid or missing metrics key", redact=False)
        return Response(proxy.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> Response:
        """The models the decoders serve, as vLLM lists them (with ``max_model_len``, the smallest across the
        engines that serve the model, since a request must fit both its prefiller and its decoder)."""
        st = state()
        merged: dict[str, dict[str, Any]] = {}
        for info in st.infos.values():
            for card in info.models:
                mid = card.get("id")
                if not isinstance(mid, str):
                    continue
                entry = merged.setdefault(mid, dict(card))
                mml = card.get("max_model_len")
                if isinstance(mml, int) and (not isinstance(entry.get("max_model_len"), int)
                                             or mml < entry["max_model_len"]):
                    entry["max_model_len"] = mml
        if st.settings.max_model_len:
            for entry in merged.values():
                entry["max_model_len"] = st.settings.max_model_len
        if not merged and st.settings.model_name:
            merged[st.settings.model_name] = {"id": st.settings.model_name, "object": "model", "owned_by": "vllm",
                                              "max_model_len": st.settings.max_model_len}
        return Response(orjson.dumps({"object": "list", "data": list(merged.values())}),
                        media_type="application/json")

    @app.get("/debug/load")
    async def debug_load(request: Request) -> dict[str, Any]:
        """Per-endpoint in-flight requests/tokens and health (all zero when idle; with ``--workers N`` summed over
        the workers), per prefiller the prefill ledger's ``prefill_inflight_tokens`` (dispatched, unanswered) and
        ``kv_held_tokens`` (in flight or pinned, whole blocks), admission's counters; with ``--workers N`` also the
        answering ``worker`` and each worker's row (``pid``, ``ready``, ``waiting`` in its prefill queue,
        ``requests`` it holds).  Open when pdproxy enforces no client keys (a trusted network); behind the admin
        key when ``api_keys`` is set (403 without it, or when no ``admin_key`` is configured)."""
        st = state()
        if st.settings.api_keys:
            check_admin_key(st, request)

        def endpoint(e: Endpoint) -> dict[str, Any]:
            load = st.pool.load(e)
            out: dict[str, Any] = {"name": e.name, "role": e.role.value, "dp_rank": e.dp_rank,
                                   "requests": load.requests, "tokens": load.tokens, "healthy": load.healthy,
                                   "draining": load.draining}
            if e.role is Role.PREFILL:
                out["prefill_inflight_tokens"] = st.ledger.inflight_tokens(e)
                out["kv_held_tokens"] = st.ledger.kv_held_tokens(e)
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

    @app.exception_handler(404)
    async def _not_found(_: Request, __: Exception) -> Response:
        return Response(orjson.dumps(error_body(404, "Not Found")), status_code=404, media_type="application/json")

    return app


def create_app(settings: Settings) -> PDProxyApp:
    """Build the proxy ASGI app (state is created when the server runs the lifespan)."""
    return PDProxyApp(settings)
