"""Filters: which endpoints of a role may take a request at all.

A filter maps the candidates (a list of endpoints) to those it keeps, in order; the scheduler runs a role's filters
one after the other (:class:`~pdproxy.scheduling.scheduler.Profile`).  When a filter leaves none, its
:meth:`Filter.refusal` is the error the pick raises, so the client learns the first reason that ruled every
endpoint out (503 + ``Retry-After`` for "not now", 404 for a model nobody serves).

``capacity`` marks filters that reject for *now* (a full prefill budget or KV pool): the prefill queue asks
"is there an endpoint that could take this request once capacity frees up?" by skipping them
(``Scheduler.eligible(..., capacity=False)``), and waits instead of failing.

The filters, in the order the standard profiles run them (:func:`pdproxy.scheduling.scheduler.standard_profiles`):

- :class:`Healthy` — the endpoint's last health probe passed (``EndpointLoad.healthy``, :mod:`pdproxy.engines.health`);
- :class:`NotDraining` — the admin API has not drained it (``EndpointLoad.draining``);
- :class:`BreakerClosed` — its circuit breaker lets a request in (:mod:`pdproxy.engines.breaker`);
- :class:`ServesModel` — it serves the request's ``model`` per its ``/v1/models`` and the operator's pins
  (:mod:`pdproxy.engines.models`; an unknown model list accepts);
- :class:`FitsLimits` — the prompt fits its ``max_model_len`` and KV pool (:mod:`pdproxy.engines.limits`);
- :class:`OnDpRank` — it is the DP rank the request is pinned to, if any;
- :class:`Affinity` (prefill only) — the prefiller a fan-out sibling's prompt was just computed on, when it is
  still among the candidates (soft: otherwise all stay);
- :class:`HasPrefillRoom` (prefill only, ``capacity``) — the prompt's uncached tokens fit its prefill budget and
  the whole prompt the KV it has free (:class:`~pdproxy.scheduling.queue.PrefillLedger`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineInfo
from pdproxy.engines.health import HealthMonitor
from pdproxy.engines.limits import Limits
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import NoEndpointAvailable, ProxyError
from pdproxy.scheduling.request import PickRequest

if TYPE_CHECKING:
    from pdproxy.engines.models import ServedModels
    from pdproxy.scheduling.queue import PrefillLedger


class Filter(Protocol):
    """One eligibility rule.  ``name``: a short label (logs, tests); ``capacity``: True when it rejects only until
    capacity frees up (see the module docstring)."""

    name: str
    capacity: bool

    def __call__(self, request: PickRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        """The candidates this rule keeps (same order); never raises."""
        ...

    def refusal(self, role: Role, request: PickRequest) -> ProxyError:
        """The error for a pick where this filter left no candidate of ``role``."""
        ...


class _Rule:
    """Shared defaults: not a capacity filter; an empty result is a 503 ``NoEndpointAvailable`` with ``reason``."""

    name = "rule"
    capacity = False
    reason = "none can take the request"

    def refusal(self, role: Role, request: PickRequest) -> ProxyError:
        """A 503 naming this filter's reason (the scheduler adds ``Retry-After``)."""
        return NoEndpointAvailable(role.value, self.reason)


class Healthy(_Rule):
    """Endpoints whose last probe passed.  With ``infos``, a refusal says when the engines refused pdproxy's
    control-plane calls for want of an API key (HTTP 401/403: ``engine_api_key`` unset or wrong)."""

    name = "healthy"
    reason = "every one fails its health checks (GET /health, /v1/models)"

    def __init__(self, pool: EndpointPool, infos: Mapping[Endpoint, EngineInfo] | None = None) -> None:
        self.pool = pool
        self.infos = infos

    def __call__(self, request: PickRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        load = self.pool.load
        return [e for e in candidates if load(e).healthy]

    def refusal(self, role: Role, request: PickRequest) -> ProxyError:
        """503; names the API key when an engine of ``role`` answered ``/v1/models`` with 401 or 403."""
        infos = self.infos or {}
        if any(info.auth_failed for e, info in infos.items() if e.role is role):
            return NoEndpointAvailable(role.value, "the engines refuse pdproxy's calls to /v1/models (HTTP 401/403): "
                                                   "set engine_api_key to the engines' --api-key")
        return super().refusal(role, request)


class NotDraining(_Rule):
    """Endpoints the admin API has not drained."""

    name = "not_draining"
    reason = "every one is draining"

    def __init__(self, pool: EndpointPool) -> None:
        self.pool = pool

    def __call__(self, request: PickRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        load = self.pool.load
        return [e for e in candidates if not load(e).draining]


class BreakerClosed(_Rule):
    """Endpoints whose circuit breaker lets a request in (closed, or half-open with its trial slot free)."""

    name = "breaker"
    reason = ("every one's circuit breaker is open after failures, or half-open with its one trial request in "
              "flight")

    def __init__(self, health: HealthMonitor) -> None:
        self.health = health

    def __call__(self, request: PickRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        can_take = self.health.can_take
        return [e for e in candidates if can_take(e)]


class ServesModel(_Rule):
    """Endpoints that serve ``request.model`` (:class:`~pdproxy.engines.models.ServedModels`: the ids its
    ``/v1/models`` listed — served model names and LoRA adapters alike — narrowed to the operator's pins).  A
    request without ``model``, or an endpoint whose model list is not known (never refreshed, or empty), passes."""

    name = "serves_model"

    def __init__(self, served: ServedModels) -> None:
        self.served_models = served

    def served(self, endpoint: Endpoint) -> list[str] | None:
        """The model ids ``endpoint`` serves; None when unknown."""
        ids = self.served_models.ids(endpoint)
        return sorted(ids) if ids is not None else None

    def __call__(self, request: PickRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        model = request.model
        if not model:
            return candidates
        serves = self.served_models.serves
        return [e for e in candidates if serves(e, model)]

    def refusal(self, role: Role, request: PickRequest) -> ProxyError:
        """404 in vLLM's words, listing the base models the endpoints of ``role`` serve."""
        return self.served_models.not_found(request.model or "", role)


class FitsLimits(_Rule):
    """Endpoints of ``role`` whose ``max_model_len`` and KV pool admit the prompt
    (:meth:`~pdproxy.engines.limits.EngineLimits.allowed_prompt`; ``request.limit_tokens`` tokens, plus the output the
    role must hold — a decoder's output for a ``request.whole`` request on any role).  A request whose prompt is not
    counted yet passes."""

    name = "fits_limits"
    reason = "none of the others has the room (max_model_len, KV pool) for this prompt"

    def __init__(self, limits: Limits, role: Role) -> None:
        self.limits = limits
        self.role = role

    def __call__(self, request: PickRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        tokens = request.limit_tokens
        if tokens is None:
            return candidates
        limits = self.limits
        table, clamp, out = limits.table(), limits.clamp, request.max_output_tokens
        role = Role.DECODE if request.whole else self.role
        kept = []
        for e in candidates:
            lim = table.get(e) or limits.of(e)
            allowed = lim.allowed_prompt(role, out, clamp)
            if allowed is None or tokens <= allowed:
                kept.append(e)
        return kept


class OnDpRank(_Rule):
    """Endpoints of DP rank ``request.dp_rank`` when the request is pinned to one (``Endpoint.dp_rank``: the
    internal-DP rank addressed by ``X-data-parallel-rank``, or an external-DP port's rank); all when it is not."""

    name = "dp_rank"

    def __call__(self, request: PickRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        rank = request.dp_rank
        if rank is None:
            return candidates
        return [e for e in candidates if e.dp_rank == rank]

    def refusal(self, role: Role, request: PickRequest) -> ProxyError:
        """503: no usable endpoint of ``role`` is that rank."""
        return NoEndpointAvailable(role.value, f"none of the others is DP rank {request.dp_rank}")


class Affinity(_Rule):
    """The endpoint ``request.affinity`` names, when it passed the filters before this one; every candidate when
    it did not or when there is none (a soft preference, never a refusal).  A fan-out sibling (``n > 1``,
    :mod:`pdproxy.pd.fanout`) names the prefiller that has just computed the same prompt: its prefill there is a
    prefix-cache hit, which the cost scorers cannot see while the first sequence's KV is still pinned there (its
    lease counts as in-flight prefill tokens).  Not a capacity filter: the sibling waits for that prefiller's room
    rather than recompute the prompt elsewhere."""

    name = "affinity"

    def __call__(self, request: PickRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        preferred = request.affinity
        if preferred is None or preferred not in candidates:
            return candidates
        return [preferred]


class HasPrefillRoom(_Rule):
    """Prefillers with room for the prompt now: the tokens it would compute there (the prompt minus what
    ``request.hints`` says the prefiller holds) fit the per-prefiller budget, and the whole prompt fits the
    prefiller's free KV (:meth:`~pdproxy.scheduling.queue.PrefillLedger.has_room`).  A capacity filter: the prefill
    queue waits for it."""

    name = "prefill_room"
    capacity = True
    reason = "every one's prefill budget or KV pool is full"

    def __init__(self, ledger: PrefillLedger) -> None:
        self.ledger = ledger

    def __call__(self, request: PickRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        tokens = request.prompt_tokens
        if tokens is None:
            return candidates
        has_room, cached = self.ledger.has_room, request.hints.cached
        return [e for e in candidates if has_room(e, tokens, max(0, tokens - cached(e)))]
