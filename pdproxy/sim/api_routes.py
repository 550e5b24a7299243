"""The simulator's routes beyond chat/completions, wired onto a listener's aiohttp app.

Which routes exist follows what vLLM 0.32 registers for the model's tasks
(``vllm/entrypoints/launchers/api_server/routers.py``):

* a generate model (``--runner generate``, the default): ``POST /v1/responses`` (:mod:`.responses_api`),
  ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (:mod:`.messages_api`), the render routes and
  ``/inference/v1/generate`` (:mod:`.render_api`; 403 without ``--enable-scale-out``);
* a pooling model (``--runner pooling``): the pooling routes of its ``--convert`` task (:mod:`.pooling`), and no
  generation route;
* ``--transcription``: ``/v1/audio/transcriptions`` and ``/v1/audio/translations``.

Any other path answers FastAPI's 404 ``{"detail": "Not Found"}`` (405 ``{"detail": "Method Not Allowed"}`` for a
known path with another method), as real vLLM does.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

import orjson
from aiohttp import web

from pdproxy.sim import completion, messages_api, render_api, responses_api
from pdproxy.sim.errors import SimHTTPError
from pdproxy.sim.pooling import AUDIO_ROUTES, PoolingRoutes, routes_for, transcription
from pdproxy.sim.protocol import decode_body, parse_request

if TYPE_CHECKING:
    from pdproxy.sim.runner import RankEngine
    from pdproxy.sim.server import Listener, SimServer

RENDER_ROUTES: Final = MappingProxyType({"/v1/chat/completions/render": "chat",
                                         "/v1/completions/render": "completions",
                                         "/v1/messages/render": "messages", "/v1/responses/render": "responses"})


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


def _error(exc: SimHTTPError, anthropic: bool = False) -> web.Response:
    body = exc.anthropic_body() if anthropic and exc.error_type != "Bad Request" else exc.body()
    return web.Response(status=exc.status_code, body=body, content_type="application/json")


@web.middleware
async def fastapi_not_found(request: web.Request, handler: Any) -> web.StreamResponse:
    """Unknown paths and methods answer as FastAPI does (``{"detail": ...}``)."""
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPNotFound:
        return _json({"detail": "Not Found"}, 404)
    except web.HTTPMethodNotAllowed:
        return _json({"detail": "Method Not Allowed"}, 405)


def add_routes(server: SimServer, app: web.Application, listener: Listener) -> None:
    """Register the routes of the module docstring on ``app`` (one listener of ``server``)."""
    cfg = server.config
    r = app.router
    app.middlewares.append(fastapi_not_found)
    if cfg.runner == "generate":
        def generation(run: Any) -> Any:
            async def handle(request: web.Request) -> web.StreamResponse:
                async def go(raw: bytes, body: Any, rank: RankEngine, fault: Any) -> web.StreamResponse:
                    response: web.StreamResponse = await run(server, listener, request, body, rank, fault)
                    return response

                return await server.serve_generation(listener, request, go)
            return handle

        r.add_post("/v1/responses", generation(_responses))
        r.add_post("/v1/messages", generation(_messages))
        r.add_post("/v1/messages/count_tokens", lambda request: _count_tokens(server, request))
        r.add_post("/inference/v1/generate", generation(_generate))
        for path, api in RENDER_ROUTES.items():
            r.add_post(path, _render_handler(server, api))
    else:
        routes = PoolingRoutes(server.tokenizer, server.models, cfg.embedding_size,
                               cfg.convert if cfg.convert != "none" else "embed")
        for path in routes_for(routes.convert):
            r.add_post(path, _pooling_handler(routes, path))
    if cfg.transcription:
        for path in AUDIO_ROUTES:
            r.add_post(path, lambda request: _audio(server, request))


async def _responses(server: SimServer, listener: Listener, request: web.Request, body: Any, rank: RankEngine,
                     fault: Any) -> web.StreamResponse:
    try:
        parsed = responses_api.parse_responses(body, request.headers, server.config, server.tokenizer,
                                               server.models)
    except SimHTTPError as exc:
        completion.notify_rejected(server, rank, body)
        return _error(exc)
    return await completion.run_generation(server, listener, request, parsed, responses_api.new_writer(parsed),
                                           rank, fault)


async def _messages(server: SimServer, listener: Listener, request: web.Request, body: Any, rank: RankEngine,
                    fault: Any) -> web.StreamResponse:
    try:
        parsed = messages_api.parse_messages(body, request.headers, server.config, server.tokenizer, server.models)
    except SimHTTPError as exc:
        completion.notify_rejected(server, rank, body)
        return _error(exc, anthropic=True)
    return await completion.run_generation(server, listener, request, parsed,
                                           messages_api.MessagesWriter(parsed, parsed.model), rank, fault)


async def _generate(server: SimServer, listener: Listener, request: web.Request, body: Any, rank: RankEngine,
                    fault: Any) -> web.StreamResponse:
    if not server.config.enable_scale_out:
        return _error(render_api.SCALE_OUT_DISABLED)
    try:
        parsed = render_api.parse_generate(body, request.headers, server.config, server.models)
    except SimHTTPError as exc:
        completion.notify_rejected(server, rank, body)
        return _error(exc)
    return await completion.run_generation(server, listener, request, parsed, render_api.GenerateWriter(parsed),
                                           rank, fault)


async def _count_tokens(server: SimServer, request: web.Request) -> web.Response:
    try:
        return _json(messages_api.parse_count_tokens(await request.read(), server.tokenizer, server.models))
    except SimHTTPError as exc:
        return _error(exc, anthropic=True)


def _render_handler(server: SimServer, api: str) -> Any:
    async def handle(request: web.Request) -> web.Response:
        if not server.config.enable_scale_out:
            return _error(render_api.SCALE_OUT_DISABLED)
        raw = await request.read()
        cfg, tok, models = server.config, server.tokenizer, server.models
        try:
            if api == "messages":
                parsed = messages_api.parse_messages(raw, request.headers, cfg, tok, models)
            elif api == "responses":
                parsed = responses_api.parse_responses(raw, request.headers, cfg, tok, models)
            else:
                parsed = parse_request(raw, api, {}, cfg, tok, models)  # type: ignore[arg-type]
        except SimHTTPError as exc:
            return _error(exc)
        return _json(render_api.render_answer(parsed))
    return handle


def _pooling_handler(routes: PoolingRoutes, path: str) -> Any:
    async def handle(request: web.Request) -> web.Response:
        try:
            return _json(routes.answer(path, decode_body(await request.read())))
        except SimHTTPError as exc:
            return _error(exc)
    return handle


async def _audio(server: SimServer, request: web.Request) -> web.Response:
    try:
        return await transcription(request, server.models)
    except SimHTTPError as exc:
        return _error(exc)
