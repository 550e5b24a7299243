"""One simulator process: DP ranks, their HTTP listeners (aiohttp.web), vLLM's routes and the control API.

Use :func:`running_sim` (an async context manager) in tests and tools::

    async with running_sim(SimConfig(port=0, role="prefill")) as sim:
        sim.base_urls  # ["http://127.0.0.1:<port>"]

Listeners: one per DP rank (``--port`` + k or ``--dp-ports``; "external DP", as vLLM-Ascend's
``launch_online_dp.py``). With ``dp_single_port``, a single listener fronts every rank ("internal DP").
Every listener honours the ``X-data-parallel-rank`` header (``generate/base/serving.py::
_get_data_parallel_rank``). Without the header, a rank listener uses its own rank, and the single listener
picks the rank with the lowest ``waiting * 4 + running`` (``core_client.py::DPLBAsyncMPClient``).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``POST /tokenize``, ``POST /detokenize``, ``GET /health``, ``GET|POST /ping``, ``GET /version``,
``GET /metrics``, ``GET /load``, ``POST /reset_prefix_cache``, and those of ``api_routes.py`` (Responses,
Messages, render, generate, pooling, audio; FastAPI's 404 for the rest). The control API is under ``/sim/``:
``received``, ``reset``, ``state``, ``faults``, ``kv/pull`` and ``kv/release``. ``/sim/reset`` is process-wide: it clears
records, faults, prefix-cache hashes and pinned KV (pins and their expiry).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import secrets
import socket
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson
from aiohttp import web

from pdproxy.sim import api_routes, completion, connector
from pdproxy.sim.config import SimConfig
from pdproxy.sim.faults import FaultBook
from pdproxy.sim.metrics import UNCOUNTED_HANDLERS, render_metrics
from pdproxy.sim.models import ModelRegistry, parse_lora_modules
from pdproxy.sim.outputs import TokenTable
from pdproxy.sim.protocol import SimHTTPError, error_body
from pdproxy.sim.runner import RankEngine
from pdproxy.sim.scheduler import EngineRequest
from pdproxy.tokens import load_tokenizer, prompt_token_ids

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

DP_RANK_HEADER = "X-data-parallel-rank"
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
"""Paths ``--api-key`` protects (vLLM 0.32 ``GUARDED_PREFIX``)."""
_INVALID = object()


@dataclass(slots=True)
class Listener:
    """One HTTP listening port: the rank it serves (None = all ranks) and its pending faults."""

    port: int
    rank: int | None
    faults: FaultBook
    site: web.TCPSite | None = None
    runner: web.AppRunner | None = None
    held_socket: socket.socket | None = field(default=None, repr=False)


class ListenError(Exception):
    """A listening port the simulator cannot bind (in use, not allowed): one line for the user, naming the port
    and the flag that chose it (``pdproxy sim`` prints it and exits 1, as ``pdproxy serve`` and ``demo`` do)."""


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type="application/json")


class SimServer:
    """All ranks and listeners of one simulator process (see the module docstring)."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer)
        base = config.engine_id or str(uuid.uuid4())
        self.ranks = [RankEngine(config, k, connector.engine_id_for(base, k), self.session)
                      for k in range(config.data_parallel_size)]
        ports = config.rank_ports()
        self.listeners = [Listener(port, None if config.dp_single_port else k, FaultBook(config.seed + k))
                          for k, port in enumerate(ports)]
        self.records: deque[dict[str, Any]] = deque(maxlen=config.record_limit)
        self.advertised_host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "") else config.host
        self._session: aiohttp.ClientSession | None = None
        self._word_offset = config.seed
        self.models = ModelRegistry(config.served_model_name, config.max_model_len,
                                    parse_lora_modules(config.lora_modules))
        self.token_table = TokenTable(self.tokenizer, config.held_back)
        self.fingerprint = f"vllm-{config.version}-{secrets.token_hex(4)}"
        self.http_requests: dict[tuple[str, str, str], int] = {}
        self._stack = contextlib.AsyncExitStack()
        self.kv_event_publishers: list[Any] = []
        for listener in self.listeners:
            for spec in config.faults:
                listener.faults.add(spec)

    # ---- lifecycle -----------------------------------------------------------------------------------------
    async def __aenter__(self) -> SimServer:
        await self._stack.__aenter__()
        try:
            self._session = await self._stack.enter_async_context(aiohttp.ClientSession())
            for rank in self.ranks:
                await self._stack.enter_async_context(rank)
            await self._start_kv_events()
            for listener in self.listeners:
                await self._start_listener(listener)
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._stack.aclose()

    async def _start_kv_events(self) -> None:
        """One KV event publisher per rank when ``--kv-events-config`` enables them (``sim/kv_publisher.py``)."""
        if not self.config.kv_events_config:
            return
        from pdproxy.sim.kv_publisher import SimKVEventPublisher, parse_kv_events_config

        cfg = parse_kv_events_config(self.config.kv_events_config)
        if not cfg.enabled:
            return
        for rank in self.ranks:
            publisher = SimKVEventPublisher(cfg, rank.dp_rank, self.config.kv_events_encoding)
            await self._stack.enter_async_context(publisher)
            rank.core.pool.event_sink = publisher.sink
            self.kv_event_publishers.append(publisher)

    def _listen_error(self, listener: Listener, exc: OSError) -> ListenError:
        """The :class:`ListenError` for ``listener``'s port that ``exc`` refused, with the flag that chose it."""
        cfg, port = self.config, listener.port
        if cfg.dp_ports and not cfg.dp_single_port:
            hint = "`pdproxy sim --dp-ports P0 P1 ...` (one port per data-parallel rank)"
        elif cfg.data_parallel_size > 1 and not cfg.dp_single_port:
            hint = "`pdproxy sim --port P` (data-parallel rank k listens on P+k)"
        else:
            hint = "`pdproxy sim --port P`"
        if exc.errno == errno.EADDRINUSE:
            return ListenError(f"port {port} is already in use; stop what holds it or choose another port with "
                               f"{hint}")
        return ListenError(f"cannot listen on {cfg.host}:{port}: {exc.strerror or exc}; choose another host or "
                           f"port with `--host H` / {hint}")

    async def _start_listener(self, listener: Listener) -> None:
        try:
            await self._bind_listener(listener)
        except OSError as exc:
            raise self._listen_error(listener, exc) from None

    async def _bind_listener(self, listener: Listener) -> None:
        if self.config.refuse_connections:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._stack.callback(sock.close)
            sock.bind((self.config.host, listener.port))
            listener.held_socket = sock
            listener.port = sock.getsockname()[1]
        else:
            guards = [self._authenticate] if self.config.api_key else []
            app = web.Application(client_max_size=1 << 30, middlewares=[*guards, self._count_request])
            self._add_routes(app, listener)
            runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5)
            await runner.setup()
            self._stack.push_async_callback(runner.cleanup)
            site = web.TCPSite(runner, self.config.host, listener.port, reuse_address=True)
            await site.start()
            listener.runner, listener.site = runner, site
            # asyncio's or uvloop's Server (not a subclass of asyncio.Server): both have ``sockets``
            sockets = getattr(site._server, "sockets", None)
            if sockets:
                listener.port = sockets[0].getsockname()[1]
        if listener.rank is not None:
            self.ranks[listener.rank].port = listener.port
        else:
            for rank in self.ranks:
                rank.port = listener.port

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """vLLM's ``--api-key`` check (``vllm/entrypoints/serve/middleware/authenticate.py``): paths under
        ``GUARDED_PREFIXES`` need ``Authorization: Bearer <key>``; OPTIONS and other paths pass."""
        if request.method != "OPTIONS" and request.path.startswith(GUARDED_PREFIXES):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not any(secrets.compare_digest(token, k) for k in self.config.api_key):
                return web.Response(status=401, body=b'{"error":"Unauthorized"}', content_type="application/json")
        return await handler(request)

    @web.middleware
    async def _count_request(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """``http_requests_total{handler,method,status}`` as vLLM's HTTP instrumentation counts it."""
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else None
        counted = path is not None and path not in UNCOUNTED_HANDLERS and not path.startswith("/sim/")
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            if counted and status != 499:
                key = (str(path), request.method, f"{status // 100}xx")
                self.http_requests[key] = self.http_requests.get(key, 0) + 1

    @property
    def ports(self) -> list[int]:
        """The bound port of each listener (resolved when the config asked for port 0)."""
        return [listener.port for listener in self.listeners]

    @property
    def base_urls(self) -> list[str]:
        """``http://host:port`` of each listener."""
        return [f"http://{self.advertised_host}:{port}" for port in self.ports]

    def session(self) -> aiohttp.ClientSession:
        """The client session used for KV pulls and releases."""
        assert self._session is not None, "SimServer not started"
        return self._session

    # ---- helpers used by the completion handler ------------------------------------------------------------
    def next_word_offset(self) -> int:
        """A per-request offset into the generated word list (deterministic sequence from ``--seed``)."""
        self._word_offset += 7
        return self._word_offset

    def pinned_block_ids(self, rank: RankEngine, ereq: EngineRequest) -> list[int]:
        """Block ids pinned for ``ereq`` on ``rank``."""
        pin = rank.core.pins.get(ereq.request_id)
        return list(pin.blocks) if pin else []

    @staticmethod
    def last_token_id(ereq: EngineRequest) -> int:
        """A stable id for the prefiller's sampled token (Mooncake's ``last_token_id``)."""
        return 256 + (hash(ereq.request_id) & 0xFFFF)

    def _rank_for(self, listener: Listener, headers: Any) -> RankEngine:
        value = headers.get(DP_RANK_HEADER)
        if value is not None:
            try:
                k = int(value)
            except ValueError:
                k = -1
            if not 0 <= k < len(self.ranks):
                raise SimHTTPError(400, f"invalid {DP_RANK_HEADER}: {value!r} (data_parallel_size="
                                        f"{len(self.ranks)})")
            return self.ranks[k]
        if listener.rank is not None:
            return self.ranks[listener.rank]
        return min(self.ranks, key=lambda r: len(r.core.waiting) * 4 + len(r.core.running))

    def _served(self, listener: Listener) -> list[RankEngine]:
        return self.ranks if listener.rank is None else [self.ranks[listener.rank]]

    # ---- routes ------------------------------------------------------------------------------------------------
    def _add_routes(self, app: web.Application, listener: Listener) -> None:
        async def chat(request: web.Request) -> web.StreamResponse:
            return await self._completion(listener, request, "chat")

        async def completions(request: web.Request) -> web.StreamResponse:
            return await self._completion(listener, request, "completions")

        async def received(request: web.Request) -> web.Response:
            every = request.query.get("all") == "1"
            items = [r for r in self.records if every or r["port"] == listener.port]
            return _json({"requests": items})

        async def faults(request: web.Request) -> web.Response:
            if request.method == "GET":
                return _json({"faults": listener.faults.pending()})
            try:
                added = listener.faults.add(orjson.loads(await request.read()))
            except (ValueError, orjson.JSONDecodeError) as exc:
                return web.Response(status=400, body=error_body(str(exc), "BadRequestError", 400),
                                    content_type="application/json")
            return _json({"added": [f.spec() for f in added], "faults": listener.faults.pending()})

        r = app.router
        if self.config.runner == "generate":
            r.add_post("/v1/chat/completions", chat)
            r.add_post("/v1/completions", completions)
        r.add_get("/v1/models", self._models)
        r.add_post("/tokenize", self._tokenize)
        r.add_post("/detokenize", lambda req: self._detokenize(listener, req))
        r.add_get("/health", lambda req: self._health(listener, req))
        r.add_route("*", "/ping", lambda req: self._health(listener, req))
        r.add_get("/version", lambda _req: self._version())
        r.add_get("/metrics", lambda _req: self._metrics(listener))
        r.add_get("/load", lambda _req: self._load(listener))
        r.add_post("/reset_prefix_cache", lambda _req: self._reset_prefix_cache())
        r.add_get("/sim/received", received)
        r.add_post("/sim/reset", lambda _req: self._reset())
        r.add_get("/sim/state", lambda _req: self._state(listener))
        r.add_route("*", "/sim/faults", faults)
        r.add_post(connector.PULL_PATH, self._kv_pull)
        r.add_post(connector.RELEASE_PATH, self._kv_release)
        api_routes.add_routes(self, app, listener)

    async def _completion(self, listener: Listener, request: web.Request, api: str) -> web.StreamResponse:
        async def run(raw: bytes, payload: Any, rank: RankEngine, fault: Any) -> web.StreamResponse:
            return await completion.handle_completion(self, listener, request, api,  # type: ignore[arg-type]
                                                      raw, payload, rank, fault)

        return await self.serve_generation(listener, request, run)

    async def serve_generation(self, listener: Listener, request: web.Request, run: Any) -> web.StreamResponse:
        """Record a generation request, pick its DP rank, apply pre-response faults, then ``await run(raw, body,
        rank, fault)`` (``body``: the decoded JSON, or the raw bytes when they are not JSON)."""
        raw = await request.read()
        try:
            body: Any = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = _INVALID
        try:
            rank = self._rank_for(listener, request.headers)
        except SimHTTPError as exc:
            completion.notify_rejected(self, self.ranks[listener.rank or 0], body)
            return web.Response(status=exc.status_code, body=exc.body(), content_type="application/json")
        self.records.append({"path": request.path, "headers": {k.lower(): v for k, v in request.headers.items()},
                             "body": None if body is _INVALID else body, "raw_len": len(raw),
                             "dp_rank": rank.dp_rank, "port": listener.port})
        fault = listener.faults.match(request.path)
        try:
            if fault is not None:
                early = await completion.pre_response_fault(fault, request)
                if early is not None:
                    if early.status >= 400:
                        completion.notify_rejected(self, rank, body)
                    return early
            payload = raw if body is _INVALID else body
            result: web.StreamResponse = await run(raw, payload, rank, fault)
            return result
        except ConnectionResetError:  # the client left; aiohttp drops this response quietly
            return web.Response(status=499)

    async def _models(self, _request: web.Request) -> web.Response:
        return _json(self.models.cards())

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
            api: Literal["chat", "completions"] = (
                "chat" if isinstance(body, dict) and "messages" in body else "completions")
            ids = prompt_token_ids(self.tokenizer, body, api)
        except (orjson.JSONDecodeError, ValueError, AttributeError) as exc:
            return web.Response(status=400, body=error_body(str(exc), "BadRequestError", 400),
                                content_type="application/json")
        return _json({"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids,
                      "token_strs": None})

    async def _detokenize(self, listener: Listener, request: web.Request) -> web.StreamResponse:
        """vLLM's ``{"tokens"}`` → ``{"prompt": text}``; under a fault given ``"path": "/detokenize"``:
        ``refuse`` / ``hang`` / ``status``."""
        fault = listener.faults.match(request.path)
        if fault is not None and (early := await completion.pre_response_fault(fault, request)) is not None:
            return early
        try:
            ids = orjson.loads(await request.read())["tokens"]
            if ids and ids[-1] in self.token_table.held_ids:   # --held-back: ends inside a character
                return _json({"prompt": self.tokenizer.decode(ids[:-1]) + "\ufffd"})
            return _json({"prompt": self.tokenizer.decode(ids)})
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            return web.Response(status=400, body=error_body(str(exc), "BadRequestError", 400),
                                content_type="application/json")

    async def _health(self, listener: Listener, request: web.Request) -> web.StreamResponse:
        """200; under a fault given ``"path": "/health"`` (pdproxy/sim/faults.py): late by ``delay_s``
        (``slow_health``), or ``refuse`` / ``hang`` / ``status`` (vLLM answers 503 when its engine core is dead)."""
        fault = listener.faults.match(request.path)
        if fault is not None and fault.kind == "slow_health":
            await asyncio.sleep(float(fault.params.get("delay_s", 2.0)))
        elif fault is not None and (early := await completion.pre_response_fault(fault, request)) is not None:
            return early
        return web.Response(status=200)

    async def _load(self, listener: Listener) -> web.Response:
        """vLLM's ``/load``: ``{"server_load": <requests in flight>}``."""
        return _json({"server_load": sum(len(rk.core.running) + len(rk.core.waiting) for rk in self._served(listener))})

    async def _version(self) -> web.Response:
        return _json({"version": self.config.version})

    async def _metrics(self, listener: Listener) -> web.Response:
        cfg = self.config
        info = {"block_size": str(cfg.block_size), "num_gpu_blocks": str(cfg.num_gpu_blocks),
                "num_gpu_blocks_override": str(cfg.num_gpu_blocks_override), "num_cpu_blocks": "None",
                "enable_prefix_caching": str(cfg.enable_prefix_caching), "cache_dtype": "auto",
                "gpu_memory_utilization": "0.9", "kv_cache_size_tokens": str(cfg.kv_cache_size_tokens)}
        ranks = [(rk.dp_rank, rk.core.gauges(), rk.core.stats) for rk in self._served(listener)]
        text = render_metrics(cfg.served_model_name, info, ranks, with_nixl=cfg.kv_connector == "nixl",
                              http_requests=self.http_requests)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def _reset_prefix_cache(self) -> web.Response:
        for rank in self.ranks:
            rank.reset()
        return web.Response(status=200)

    async def _reset(self) -> web.Response:
        self.records.clear()
        for listener in self.listeners:
            listener.faults.clear()
        for rank in self.ranks:
            rank.reset()
            rank.clear_pins()
        return _json({"reset": True})

    @staticmethod
    def _rank_state(rank: RankEngine) -> dict[str, Any]:
        g = rank.core.gauges()
        return {"dp_rank": rank.dp_rank, "port": rank.port, "running": g.running,
                "waiting": g.waiting_capacity + g.waiting_deferred, "waiting_capacity": g.waiting_capacity,
                "waiting_deferred": g.waiting_deferred, "kv_blocks_total": rank.core.pool.num_blocks,
                "kv_blocks_used": rank.core.pool.num_used, "pinned_blocks": g.pinned_blocks,
                "pinned_requests": g.pinned_requests, "active_streams": rank.active_streams,
                "aborted": rank.core.num_aborted, "finished": rank.core.num_finished,
                "steps": rank.core.num_steps, "preemptions": rank.core.stats.num_preemptions,
                "kv_capacity_waits": rank.core.stats.kv_capacity_waits}

    async def _state(self, listener: Listener) -> web.Response:
        states = [self._rank_state(rk) for rk in self.ranks]
        served = [states[rk.dp_rank] for rk in self._served(listener)]
        out: dict[str, Any] = {k: sum(s[k] for s in served) for k in served[0] if k not in ("dp_rank", "port")}
        if self.kv_event_publishers:  # KV event batches published (the next batch's sequence number)
            for state, publisher in zip(states, self.kv_event_publishers, strict=True):
                state["kv_events_published"] = publisher.published
            out["kv_events_published"] = sum(s["kv_events_published"] for s in served)
        if len(self.ranks) > 1:
            out["ranks"] = states
        return _json(out)

    def _rank_of_engine(self, engine_id: Any) -> list[RankEngine]:
        matches = [rk for rk in self.ranks if rk.engine_id == engine_id]
        return matches or self.ranks

    async def _kv_pull(self, request: web.Request) -> web.Response:
        params = orjson.loads(await request.read())
        rid = params.get("remote_request_id")
        for rank in self._rank_of_engine(params.get("remote_engine_id")):
            if rank.start_pull(rid):
                return _json({"remote_request_id": rid, "ok": True})
        return web.Response(status=404, body=error_body(f"unknown or expired KV for request {rid}", "NotFoundError",
                                                        404), content_type="application/json")

    async def _kv_release(self, request: web.Request) -> web.Response:
        params = orjson.loads(await request.read())
        rid = params.get("remote_request_id")
        released = any(rank.release_pin(rid) for rank in self._rank_of_engine(params.get("remote_engine_id")))
        return _json({"remote_request_id": rid, "released": released})


@contextlib.asynccontextmanager
async def running_sim(config: SimConfig) -> AsyncIterator[SimServer]:
    """Start a simulator in the running loop (real sockets on ``config.host``); stop it on exit."""
    async with SimServer(config) as server:
        yield server
