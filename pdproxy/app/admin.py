"""Admin API: list, add, drain and remove prefillers/decoders at runtime.

Mounted on the control app under ``/admin``; every route needs the admin key (setting ``admin_key``), sent as
``Authorization: Bearer <key>`` or ``X-Admin-Key: <key>``.  A missing or wrong key — a client API key
(``api_keys``) included: it never opens it — is a 401 (``AuthenticationError``), as vLLM's ``--api-key`` and
pdproxy's own ``api_keys`` answer a missing or invalid credential; with no ``admin_key`` configured the admin API
answers 403 (it is off: no credential opens it).  Errors use vLLM's envelope (403 is typed
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
  reachable engine takes traffic at once, an unreachable one when its ``/health`` answers); 409 if present, or
  if a remove took it out while that first probe waited, or if it is a pdproxy (its ``/health`` answers pdproxy's
  probe 508 Loop Detected: pdproxy/http/engine_headers.py) — then it is not kept;
- ``POST /admin/endpoints/drain`` ``{"url", "role"}`` → 202: no new work, in-flight requests finish, the
  endpoint stays (``draining``, then ``drained``); with ``"migrate": true`` a decoder's continuable streams move
  to other decoders now (``migrated``: how many; docs/stream-continuation.md);
- ``POST /admin/endpoints/undrain`` ``{"url", "role"}`` → 200: takes work again (also a ``leaving`` one);
- ``DELETE /admin/endpoints`` ``{"url", "role", "force"?: false}`` → 202 ``{"leaving": [...], "removed": [...]}``
  (drain, then it leaves once idle; an idle one is removed at once) or,
  with ``force``, 200 (removed now; in-flight leases release harmlessly, pdproxy/engines/pool.py).  Removing the last
  endpoint of a role (every request would then answer 503) is refused with 409 unless ``force`` is set.  What
  prefix routing knew of a removed endpoint goes with it (its index entries and their metric series), so an engine
  added later at the same address starts from nothing.

**Where an endpoint may be added** (setting ``admin_endpoint_allow``): the URL's host must be an IP address in
one of the allowed networks or a host name on the list; by default the configured engines' host names and the
/24 (IPv4) or /64 (IPv6) around their addresses.  A refused URL is answered 403 before anything is sent to it, so
the engine API key (``engine_api_key``, sent on every probe) never reaches a host the operator did not allow — a
cloud metadata address, a loopback port of another service (``docs/threat-model.md``).

**Bodies** are read up to ``max_body_bytes`` (413 beyond) and parsed with the limits of every route.

Membership changes live in this process only: they are lost on restart (the configuration is read again).  With
``--workers N`` (N > 1) each worker has its own membership and an admin call reaches one worker, so the routes
that change it (add, drain, undrain, remove) answer 409 and change nothing — a drain that one worker of N obeyed
would be answered as done while the others kept sending the endpoint new work; ``GET`` still lists (one worker's
view: the configured endpoints, the load of all).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final
from urllib.parse import urlsplit

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from pdproxy.apis.request import load_json_object
from pdproxy.app.state import ProxyState
from pdproxy.endpoints import Endpoint, Role, engine_identity, expand, normalize_url
from pdproxy.engines.control import LOOP_FAILURE, EngineInfo
from pdproxy.errors import BadRequest, Conflict, Forbidden, NotFound, PayloadTooLarge, Unauthorized
from pdproxy.settings import Settings, is_loopback_host

log = logging.getLogger("pdproxy.admin")


class EndpointRef(BaseModel):
    """An admin request body naming endpoints: ``url`` + ``role`` (+ the options of its route, :data:`OPTIONS`).
    Any other field — one the API does not have (``dp_rank``), or another route's — is refused (400), so a call is
    never silently wider than asked; the options take their JSON types only (``"force": "yes"`` is refused)."""

    model_config = ConfigDict(extra="forbid")

    url: StrictStr
    role: Role
    dp_size: StrictInt = Field(1, ge=1, le=1024)    # add only
    force: StrictBool = False       # remove only
    migrate: StrictBool = False     # drain only: move the decoder's live streams (docs/stream-continuation.md)
    models: list[StrictStr] = []    # add only: pin the endpoint to these model ids (as the config's ``models``)


OPTIONS: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType({"add": ("dp_size", "models"), "drain": ("migrate",),
                                                                  "undrain": (), "remove": ("force",)})
"""The fields each route takes besides ``url`` and ``role``."""


def _json(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def check_admin_key(settings: Settings, request: Request) -> None:
    """Raise :class:`Unauthorized` (401) unless the request carries the configured admin key (constant-time
    compare); :class:`Forbidden` (403) when none is configured (the admin API is off)."""
    key = settings.admin_key
    if not key:
        raise Forbidden("the admin API is off: start pdproxy with --admin-key (PDPROXY_ADMIN_KEY)", redact=False)
    auth = request.headers.get("authorization") or ""
    given = auth[7:] if auth[:7].lower() == "bearer " else request.headers.get("x-admin-key", "")
    if not hmac.compare_digest(given.encode(), key.encode()):
        raise Unauthorized("invalid or missing admin key", redact=False)


def debug_routes_open(settings: Settings) -> bool:
    """Whether the operator surfaces (``/debug/*``, ``/docs``, ``/openapi.json``) answer without the admin key
    (setting ``debug_routes``): ``open``; or ``auto`` while pdproxy listens on loopback only and enforces no
    ``api_keys`` (no one else can reach it, or everyone who can may generate anyway)."""
    mode = settings.debug_routes
    return mode == "open" or (mode == "auto" and not settings.api_keys and is_loopback_host(settings.host))


def check_debug_access(settings: Settings, request: Request) -> None:
    """Raise unless ``request`` may use an operator surface (:func:`debug_routes_open`, else the admin key:
    :func:`check_admin_key`'s 401); :class:`Forbidden` when ``debug_routes: off`` (it refuses everyone) or the admin
    key they need is not configured."""
    if settings.debug_routes == "off":
        raise Forbidden("the debug routes are off (debug_routes: off)", redact=False)
    if debug_routes_open(settings):
        return
    if not settings.admin_key:
        raise Forbidden("the debug routes need the admin key when pdproxy listens beyond loopback or enforces "
                        "api_keys, and none is configured (--admin-key; or debug_routes: open)", redact=False)
    check_admin_key(settings, request)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, read as it streams in and refused past ``limit`` bytes (``max_body_bytes``):
    :class:`PayloadTooLarge` (413), at once when ``Content-Length`` says so."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def endpoint_allow_list(settings: Settings) -> tuple[list[Network], frozenset[str]]:
    """``(networks, host names)`` where the admin API may add an engine: ``admin_endpoint_allow`` (CIDR networks,
    single addresses, host names), or when it is empty the configured engines' host names and the /24 (IPv4) or
    /64 (IPv6) network of each engine address."""
    networks: list[Network] = []
    names: set[str] = set()
    if settings.admin_endpoint_allow:
        for item in settings.admin_endpoint_allow:
            try:
                networks.append(ipaddress.ip_network(item.strip("[]"), strict=False))
            except ValueError:
                names.add(item.lower().rstrip("."))
        return networks, frozenset(names)
    for e in settings.all_endpoints():
        host = (urlsplit(e.url).hostname or "").lower()
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            names.add(host.rstrip("."))
            continue
        networks.append(ipaddress.ip_network(f"{addr}/{24 if addr.version == 4 else 64}", strict=False))
    return networks, frozenset(names)


def check_endpoint_allowed(settings: Settings, url: str) -> None:
    """Raise :class:`Forbidden` (``param: url``) unless ``url``'s host is allowed (:func:`endpoint_allow_list`).
    A name is matched as written, never resolved here: list it in ``admin_endpoint_allow`` to allow it."""
    host = (urlsplit(url).hostname or "").lower().rstrip(".")
    networks, names = endpoint_allow_list(settings)
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        allowed = host in names
    else:
        allowed = any(addr in net for net in networks)
    if not allowed:
        raise Forbidden(f"{url} is outside the networks and hosts engines may be added from (admin_endpoint_allow: "
                        f"{', '.join(settings.admin_endpoint_allow) or 'the configured engines’ networks'})",
                        param="url", redact=False)


async def _body(request: Request, settings: Settings, route: str) -> EndpointRef:
    """The body of admin ``route`` (an :data:`OPTIONS` key) as an :class:`EndpointRef`, its URL normalised.
    Raises :class:`BadRequest` (400) for a body that is not one JSON object, a field the route does not take, a
    value of the wrong type, or a DP rank's name (``url#dpN``) where an engine URL is due."""
    raw = await read_body(request, settings.max_body_bytes)
    try:
        obj = load_json_object(raw, settings.max_json_depth, settings.max_json_items)
    except BadRequest as exc:                 # not JSON: the admin API's words; past a limit: the limit's
        if "pdproxy's max_json" in exc.message:
            raise BadRequest(f"invalid admin request: {exc.message}", param="body", redact=False) from None
        raise BadRequest('invalid admin request: the body must be one JSON object, e.g. {"url": '
                         '"http://host:port", "role": "decode"}', param="body", redact=False) from None
    other = sorted(set(obj) & (set(EndpointRef.model_fields) - {"url", "role", *OPTIONS[route]}))
    if other:
        raise BadRequest(f"invalid admin request: {', '.join(other)}: not a field of this route (it takes url, "
                         f"role{''.join(', ' + o for o in OPTIONS[route])})", param=other[0], redact=False)
    try:
        ref = EndpointRef.model_validate(obj)
    except ValidationError as exc:            # pydantic's own words, without its documentation links
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}"
                             for e in exc.errors(include_url=False, include_context=False, include_input=False))
        raise BadRequest(f"invalid admin request: {problems}", param="body", redact=False) from None
    base, dp, rank = ref.url.partition("#dp")
    if dp and rank.isdigit():                 # a name GET /admin/endpoints lists for one internal-DP rank
        raise BadRequest(f"invalid admin request: {ref.url} names one DP rank; the admin API addresses an engine "
                         f"URL with all its ranks: give {base}", param="url", redact=False)
    try:
        ref.url = normalize_url(ref.url)
    except ValueError as exc:
        raise BadRequest(f"invalid admin request: {exc}", param="body", redact=False) from None
    return ref


def _audit(request: Request, action: str, ref: EndpointRef, endpoints: list[Endpoint]) -> None:
    """One log line per membership change (``event: admin_change``): what, which endpoints, from which client
    address — the admin API's audit trail."""
    peer = request.client.host if request.client is not None else None
    names = [e.name for e in endpoints]
    pins = f", pinned to {', '.join(ref.models)}" if ref.models else ""
    log.info("admin: %s %s endpoint %s (%s)%s from %s", action, ref.role.value, ref.url,
             ", ".join(names) or "none", pins, peer or "?",
             extra={"event": "admin_change", "action": action, "role": ref.role.value, "url": ref.url,
                    "endpoints": names, "models": list(ref.models), "client": peer})


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
            **state.health.snapshot(endpoint).fields(), "max_model_len": info.max_model_len,
            "kv_pool_tokens": info.kv_pool_tokens, "models": sorted(state.served.ids(endpoint) or ())}


def build_admin_router(get_state: Callable[[], ProxyState]) -> APIRouter:
    """The ``/admin`` routes; ``get_state`` returns the running proxy's state (raises when shutting down)."""
    router = APIRouter(prefix="/admin")

    def authorized(request: Request) -> ProxyState:
        state = get_state()
        check_admin_key(state.settings, request)
        return state

    def may_change(request: Request) -> ProxyState:
        """:func:`authorized`, and one process serving: a change reaches every worker (module docstring)."""
        state = authorized(request)
        workers = state.settings.workers
        if workers > 1:
            raise Conflict(f"with --workers {workers} each worker keeps its own endpoint list and this call would "
                           "change one worker's only: change the configuration and restart, or run --workers 1 to "
                           "change endpoints at runtime", redact=False)
        return state

    @router.get("/endpoints")
    async def list_endpoints(request: Request) -> Response:
        state = authorized(request)
        return _json({"endpoints": [describe(state, e) for e in state.pool.endpoints()]})

    @router.post("/endpoints")
    async def add_endpoint(request: Request) -> Response:
        state = may_change(request)
        ref = await _body(request, state.settings, "add")
        check_endpoint_allowed(state.settings, ref.url)     # before anything (the engine key) is sent to it
        new = expand([ref.url], ref.role, ref.dp_size)
        if any(engine_identity(e.url) == engine_identity(ref.url) for e in state.pool.endpoints(ref.role)):
            raise Conflict(f"{ref.role.value} endpoint {ref.url} already exists", redact=False)
        state.served.pin(ref.role, ref.url, ref.models)   # empty clears a pin a removed namesake left
        for e in new:
            state.pool.add(e)
            state.pool.load(e).healthy = False  # until its first probe answers
            state.infos[e] = EngineInfo()
        _audit(request, "add", ref, new)
        for e in new:
            await state.health.probe(e)
        present = set(state.pool.endpoints(ref.role))      # a call may have removed it while the probe waited
        if not any(e in present for e in new):
            raise Conflict(f"{ref.role.value} endpoint {ref.url} was removed while its first probe ran",
                           redact=False)
        if any(state.engines.health_failure(e) == LOOP_FAILURE for e in new):   # a pdproxy, maybe this one
            for e in new:
                if e in present:
                    state.health.remove(e)
            _audit(request, "remove", ref, [e for e in new if e in present])   # the add's line has its undoing
            raise Conflict(f"{ref.url} is a pdproxy, not a vLLM engine (its /health answered 508 Loop Detected to "
                           "pdproxy's probe): give the engines' own URLs", redact=False)
        return _json({"added": [describe(state, e) for e in new if e in present]}, 201)

    @router.post("/endpoints/drain")
    async def drain_endpoint(request: Request) -> Response:
        state = may_change(request)
        ref = await _body(request, state.settings, "drain")
        found = _drain(state, ref)
        _audit(request, "drain (streams migrated)" if ref.migrate else "drain", ref, found)
        moved = sum(state.live_streams.migrate(e.name) for e in found) if ref.migrate else 0
        return _json({"draining": [describe(state, e) for e in found], "migrated": moved}, 202)

    @router.post("/endpoints/undrain")
    async def undrain_endpoint(request: Request) -> Response:
        state = may_change(request)
        ref = await _body(request, state.settings, "undrain")
        found = _matching(state, ref)
        for e in found:
            state.pool.load(e).draining = False
            state.health.leaving.discard(e)
        _audit(request, "undrain", ref, found)
        return _json({"endpoints": [describe(state, e) for e in found]})

    @router.delete("/endpoints")
    async def remove_endpoint(request: Request) -> Response:
        state = may_change(request)
        ref = await _body(request, state.settings, "remove")
        found = _matching(state, ref)
        if not ref.force and not _others_remain(state, ref):
            raise Conflict(f"{ref.url} is the last {ref.role.value} endpoint: without it every request answers "
                           "503; send \"force\": true to remove it anyway", param="force", redact=False)
        _audit(request, "remove (forced)" if ref.force else "remove (once idle)", ref, found)
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
