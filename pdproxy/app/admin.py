"""Admin API: list, add, drain and remove prefillers/decoders at runtime.

Mounted on the control app under ``/admin``; every route needs the admin key (setting ``admin_key``), sent as
``Authorization: Bearer <key>`` or ``X-Admin-Key: <key>``.  Client API keys (``api_keys``) never open it; with
no ``admin_key`` configured the admin API answers 403 (it is off).  Errors use vLLM's envelope (403 is typed
``PermissionDeniedError``, as OpenAI's clients name it).

Routes (JSON bodies; an endpoint is addressed by ``url`` + ``role``; a URL configured with ``dp_size > 1``
stands for all its internal-DP ranks):

- ``GET /admin/endpoints`` → ``{"endpoints": [{"name", "url", "role", "dp_rank", "state", "healthy",
  "draining", "leaving", "requests", "tokens", "breaker", "consecutive_failures", "opened_total", "retry_in_s",
  "max_model_len", "kv_pool_tokens", "models"}]}`` (``models``: the ids it serves, empty while unknown);
  ``state`` is ``active``, ``draining`` (no new work, requests still in
  flight), ``drained`` (no new work, idle: it stays listed until removed or undrained) or ``leaving`` (removed
  without ``force``: it goes once idle);
- ``POST /admin/endpoints`` ``{"url", "role", "dp_size"?: 1, "models"?: []}`` (``models`` pins it to those
  model ids, as ``models`` in the config file: pdproxy/engines/models.py) → 201 with the new entries (probed once: a
  reachable engine takes traffic at once, an unreachable one when its ``/health`` answers); 409 if present;
- ``POST /admin/endpoints/drain`` ``{"url", "role"}`` → 202: no new work, in-flight requests finish, the
  endpoint stays (``draining``, then ``drained``); with ``"migrate": true`` a decoder's continuable streams move
  to other decoders now (``migrated``: how many; docs/stream-continuation.md);
- ``POST /admin/endpoints/undrain`` ``{"url", "role"}`` → 200: takes work again (also a ``leaving`` one);
- ``DELETE /admin/endpoints`` ``{"url", "role", "force"?: false}`` → 202 ``{"leaving": [...], "removed": [...]}``
  (drain, then it leaves once idle; an idle one is removed at once) or,
  with ``force``, 200 (removed now; in-flight leases release harmlessly, pdproxy/engines/pool.py).  Removing the last
  endpoint of a role (every request would then answer 503) is refused with 409 unless ``force`` is set.

Membership changes live in this process only: they are lost on restart (the configuration is read again), and
with ``--workers N`` each worker has its own membership, so an admin call reaches one worker.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, ValidationError

from pdproxy.app.state import ProxyState
from pdproxy.endpoints import Endpoint, Role, expand, normalize_url
from pdproxy.engines.control import EngineInfo
from pdproxy.errors import BadRequest, Conflict, Forbidden, NotFound


class EndpointRef(BaseModel):
    """An admin request body naming endpoints: ``url`` + ``role`` (+ options of the route)."""

    url: str
    role: Role
    dp_size: int = Field(1, ge=1, le=1024)
    force: bool = False
    migrate: bool = False           # drain only: move the decoder's live streams (docs/stream-continuation.md)
    models: list[str] = []          # add only: pin the endpoint to these model ids (as the config's ``models``)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def check_admin_key(state: ProxyState, request: Request) -> None:
    """Raise :class:`Forbidden` unless the request carries the configured admin key (constant-time compare)."""
    key = state.settings.admin_key
    if not key:
        raise Forbidden("the admin API is off: start pdproxy with --admin-key (PDPROXY_ADMIN_KEY)", redact=False)
    auth = request.headers.get("authorization") or ""
    given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-admin-key", "")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise Forbidden("invalid or missing admin key", redact=False)


async def _body(request: Request) -> EndpointRef:
    try:
        ref = EndpointRef.model_validate_json(await request.body())
        ref.url = normalize_url(ref.url)
    except (ValidationError, ValueError) as exc:
        raise BadRequest(f"invalid admin request: {exc}", param="body", redact=False) from None
    return ref


def _matching(state: ProxyState, ref: EndpointRef) -> list[Endpoint]:
    found = [e for e in state.pool.endpoints(ref.role) if e.url == ref.url]
    if not found:
        raise NotFound(f"no {ref.role.value} endpoint {ref.url}", redact=False)
    return found


def _drain(state: ProxyState, ref: EndpointRef) -> list[Endpoint]:
    """Mark the endpoints of ``ref`` draining: no new work; they stay in the pool."""
    found = _matching(state, ref)
    for e in found:
        state.pool.load(e).draining = True
    return found


def _others_remain(state: ProxyState, ref: EndpointRef) -> bool:
    """Whether the role keeps an endpoint (another URL, not already leaving) once ``ref`` goes."""
    return any(e.url != ref.url and e not in state.health.leaving for e in state.pool.endpoints(ref.role))


def endpoint_state(state: ProxyState, endpoint: Endpoint) -> str:
    """``active``, ``draining``, ``drained`` or ``leaving`` (see module docstring)."""
    load = state.pool.load(endpoint)
    if endpoint in state.health.leaving:
        return "leaving"
    if load.draining:
        return "draining" if load.requests else "drained"
    return "active"


def describe(state: ProxyState, endpoint: Endpoint) -> dict[str, Any]:
    """One endpoint's row of ``GET /admin/endpoints`` (see module docstring)."""
    load = state.pool.load(endpoint)
    info = state.infos.get(endpoint) or EngineInfo()
    return {"name": endpoint.name, "url": endpoint.url, "role": endpoint.role.value, "dp_rank": endpoint.dp_rank,
            "state": endpoint_state(state, endpoint), "healthy": load.healthy, "draining": load.draining,
            "leaving": endpoint in state.health.leaving, "requests": load.requests, "tokens": load.tokens,
            **state.health.snapshot(endpoint), "max_model_len": info.max_model_len,
            "kv_pool_tokens": info.kv_pool_tokens, "models": sorted(state.served.ids(endpoint) or ())}


def build_admin_router(get_state: Callable[[], ProxyState]) -> APIRouter:
    """The ``/admin`` routes; ``get_state`` returns the running proxy's state (raises when shutting down)."""
    router = APIRouter(prefix="/admin")

    def authorized(request: Request) -> ProxyState:
        state = get_state()
        check_admin_key(state, request)
        return state

    @router.get("/endpoints")
    async def list_endpoints(request: Request) -> Response:
        state = authorized(request)
        return _json({"endpoints": [describe(state, e) for e in state.pool.endpoints()]})

    @router.post("/endpoints")
    async def add_endpoint(request: Request) -> Response:
        state = authorized(request)
        ref = await _body(request)
        new = expand([ref.url], ref.role, ref.dp_size)
        if any(e.url == ref.url for e in state.pool.endpoints(ref.role)):
            raise Conflict(f"{ref.role.value} endpoint {ref.url} already exists", redact=False)
        state.served.pin(ref.role, ref.url, ref.models)   # empty clears a pin a removed namesake left
        for e in new:
            state.pool.add(e)
            state.pool.load(e).healthy = False  # until its first probe answers
            state.infos[e] = EngineInfo()
        for e in new:
            await state.health.probe(e)
        return _json({"added": [describe(state, e) for e in new]}, 201)

    @router.post("/endpoints/drain")
    async def drain_endpoint(request: Request) -> Response:
        state = authorized(request)
        ref = await _body(request)
        found = _drain(state, ref)
        moved = sum(state.live_streams.migrate(e.name) for e in found) if ref.migrate else 0
        return _json({"draining": [describe(state, e) for e in found], "migrated": moved}, 202)

    @router.post("/endpoints/undrain")
    async def undrain_endpoint(request: Request) -> Response:
        state = authorized(request)
        ref = await _body(request)
        found = _matching(state, ref)
        for e in found:
            state.pool.load(e).draining = False
            state.health.leaving.discard(e)
        return _json({"endpoints": [describe(state, e) for e in found]})

    @router.delete("/endpoints")
    async def remove_endpoint(request: Request) -> Response:
        state = authorized(request)
        ref = await _body(request)
        found = _matching(state, ref)
        if not ref.force and not _others_remain(state, ref):
            raise Conflict(f"{ref.url} is the last {ref.role.value} endpoint: without it every request answers "
                           "503; send \"force\": true to remove it anyway", param="force", redact=False)
        if not ref.force:
            for e in _drain(state, ref):
                state.health.leave_when_idle(e)
            present = set(state.pool.endpoints())
            return _json({"leaving": [e.name for e in found if e in present],       # goes once idle
                          "removed": [e.name for e in found if e not in present]}, 202)  # was idle: gone now
        for e in found:
            state.health.remove(e)
        return _json({"removed": [e.name for e in found]})

    return router
