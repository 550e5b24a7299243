"""The scheduler: one profile per role — filters → weighted scorers → picker — behind one ``pick`` entry point.

Every choice of an endpoint in pdproxy goes through :meth:`Scheduler.pick`: the decode leg's decoder, the
``/tokenize`` engine, the KV release leg's decoder — or its twin :meth:`Scheduler.try_pick` (the same choice, None
instead of a refusal): the prefill queue's grant of a prefiller.  A routing policy is therefore changed in one
place, the :class:`Profile` of its role (:func:`standard_profiles` builds the default ones; see
:mod:`pdproxy.scheduling.filters`, :mod:`~pdproxy.scheduling.scorers`, :mod:`~pdproxy.scheduling.picker` for each
part).
"""

from __future__ import annotations

import functools
import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineInfo
from pdproxy.engines.health import HealthMonitor
from pdproxy.engines.limits import Limits
from pdproxy.engines.models import ServedModels
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import NoEndpointAvailable, ProxyError
from pdproxy.scheduling import filters as f
from pdproxy.scheduling import scorers as s
from pdproxy.scheduling.picker import PICKER_NAMES, LeastCost, Picker, PowerOfTwo, Score
from pdproxy.scheduling.request import PickRequest

log = logging.getLogger("pdproxy.scheduling")

if TYPE_CHECKING:
    from pdproxy.scheduling.queue import PrefillLedger


@dataclass(frozen=True)
class Profile:
    """How one role's endpoints are chosen: ``filters`` run in order, then ``scorers`` (weighted, by tier), then
    ``picker``."""

    role: Role
    filters: tuple[f.Filter, ...]
    scorers: tuple[s.Weighted, ...]
    picker: Picker
    tiers: tuple[int, ...] = field(init=False)
    plan: tuple[tuple[s.Scorer, float, int], ...] = field(init=False, repr=False)
    static_filters: tuple[f.Filter, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        tiers = tuple(sorted({w.tier for w in self.scorers}))
        object.__setattr__(self, "tiers", tiers)
        object.__setattr__(self, "plan", tuple((w.scorer, w.weight, tiers.index(w.tier)) for w in self.scorers))
        object.__setattr__(self, "static_filters", tuple(r for r in self.filters if not r.capacity))


def standard_profiles(pool: EndpointPool, *, health: HealthMonitor | None = None,
                      infos: Mapping[Endpoint, EngineInfo] | None = None, limits: Limits | None = None,
                      ledger: PrefillLedger | None = None, picker: Picker | str = LeastCost.name,
                      seed: int | None = None, served: ServedModels | None = None,
                      prefill_resolution_tokens: float = 0.0) -> dict[Role, Profile]:
    """pdproxy's routing policy.  Filters whose input is not given are left out (``health``: the breaker filter;
    ``infos``: the served-model filter, on ``served`` when given (the operator's pins) or on ``infos`` alone;
    ``limits``: the limits filter; ``ledger``: the prefill-room filter), so
    unit tests can build a scheduler from a bare pool.  ``picker``: a :class:`Picker` or its setting name
    (``"least_cost"``, ``"power_of_two"``; ``seed`` seeds the latter's sampling); ``prefill_resolution_tokens``:
    the step in which queued prefill work is counted (:class:`~pdproxy.scheduling.scorers.QueuedPrefillTokens`;
    setting ``prefill_cost_resolution_tokens``).

    - prefill — filters: healthy, not draining, breaker, serves model, fits limits, DP rank, affinity, prefill
      room; cost: tier 0 = uncached prompt tokens + queued prefill tokens (the ledger's uncached in-flight tokens;
      the pool's in-flight tokens without a ledger), tier 1 = in-flight prefill requests;
    - decode — the same filters but prefill room; cost: tier 0 = in-flight decode requests, tier 1 = the tokens
      they hold + the prompt tokens the decoder would pull (uncached there).
    """
    def make_picker() -> Picker:
        if not isinstance(picker, str):
            return picker
        if picker == LeastCost.name:
            return LeastCost()
        if picker == PowerOfTwo.name:
            return PowerOfTwo(random.Random(seed))
        raise ValueError(f"unknown routing picker {picker!r}; one of {', '.join(PICKER_NAMES)}")

    def role_filters(role: Role) -> tuple[f.Filter, ...]:
        # the model first: a model whose engines are all down is a 503 (try again), never vLLM's 404 (no such model)
        chain: list[f.Filter] = []
        if served is not None or infos is not None:
            chain.append(f.ServesModel(served if served is not None else ServedModels(infos or {})))
        chain += [f.Healthy(pool, infos), f.NotDraining(pool)]
        if health is not None:
            chain.append(f.BreakerClosed(health))
        if limits is not None:
            chain.append(f.FitsLimits(limits, role))
        chain.append(f.OnDpRank())
        if role is Role.PREFILL:
            chain.append(f.Affinity())
        if role is Role.PREFILL and ledger is not None:
            chain.append(f.HasPrefillRoom(ledger))
        return tuple(chain)

    inflight_tokens, inflight_requests = s.InflightTokens(pool), s.InflightRequests(pool)
    queued: s.Scorer = (s.QueuedPrefillTokens(ledger, prefill_resolution_tokens) if ledger is not None
                        else inflight_tokens)
    return {
        Role.PREFILL: Profile(Role.PREFILL, role_filters(Role.PREFILL),
                              (s.Weighted(s.UncachedPromptTokens()), s.Weighted(queued),
                               s.Weighted(inflight_requests, tier=1)), make_picker()),
        Role.DECODE: Profile(Role.DECODE, role_filters(Role.DECODE),
                             (s.Weighted(inflight_requests), s.Weighted(inflight_tokens, tier=1),
                              s.Weighted(s.UncachedPromptTokens(), tier=1)), make_picker()),
    }


_TRIAL_RACES = 3
"""Picks tried in a row when the chosen endpoint's breaker refuses it at the last moment (another worker took its
half-open trial between the filter and the pick) before answering 503."""


class Scheduler:
    """Chooses endpoints of ``pool`` by ``profiles`` (one per role).  ``health``, when given, gets each pick
    (:meth:`HealthMonitor.on_pick`: a half-open breaker's trial slot) and sets ``Retry-After`` on a 503."""

    def __init__(self, pool: EndpointPool, profiles: Mapping[Role, Profile], *,
                 health: HealthMonitor | None = None) -> None:
        self.pool = pool
        self.profiles = dict(profiles)
        self.health = health
        self.debug = log.isEnabledFor(logging.DEBUG)    # read once: --log-level is set before the proxy starts

    @classmethod
    def standard(cls, pool: EndpointPool, *, health: HealthMonitor | None = None,
                 infos: Mapping[Endpoint, EngineInfo] | None = None, limits: Limits | None = None,
                 ledger: PrefillLedger | None = None, picker: Picker | str = LeastCost.name,
                 seed: int | None = None, served: ServedModels | None = None,
                 prefill_resolution_tokens: float = 0.0) -> Scheduler:
        """A scheduler with :func:`standard_profiles` (same arguments)."""
        return cls(pool, standard_profiles(pool, health=health, infos=infos, limits=limits, ledger=ledger,
                                           picker=picker, seed=seed, served=served,
                                           prefill_resolution_tokens=prefill_resolution_tokens), health=health)

    def _filter(self, role: Role, request: PickRequest, exclude: Sequence[Endpoint],
                capacity: bool) -> tuple[list[Endpoint], Callable[[], ProxyError] | None]:
        """The candidates that pass, and (when none does) what makes the refusal: built only by a caller that
        raises it (the prefill queue's grants try a full prefiller several times per request and raise nothing)."""
        candidates = self.pool.endpoints(role)
        if not candidates:
            return [], functools.partial(NoEndpointAvailable, role.value, "none is configured")
        if exclude:
            candidates = [e for e in candidates if e not in exclude]
            if not candidates:
                return [], functools.partial(NoEndpointAvailable, role.value,
                                             "all candidates failed for this request")
        profile = self.profiles[role]
        for rule in profile.filters if capacity else profile.static_filters:
            candidates = rule(request, candidates)
            if not candidates:
                return [], functools.partial(rule.refusal, role, request)
        return candidates, None

    def _refuse(self, role: Role, error: ProxyError) -> ProxyError:
        if isinstance(error, NoEndpointAvailable) and self.health is not None:
            error.headers["retry-after"] = str(self.health.retry_after_s(self.pool.endpoints(role)))
        return error

    def eligible(self, role: Role, request: PickRequest, exclude: Sequence[Endpoint] = (), *,
                 capacity: bool = True) -> list[Endpoint]:
        """The endpoints of ``role`` that pass every filter of its profile (``capacity=False``: all but the
        capacity filters, i.e. those that could take ``request`` once capacity frees up), minus ``exclude``."""
        return self._filter(role, request, exclude, capacity)[0]

    def retry_exclusion(self, role: Role, request: PickRequest, failed: Sequence[Endpoint],
                        banned: Sequence[Endpoint]) -> Sequence[Endpoint]:
        """The endpoints a retry of ``request`` leaves out: ``failed`` (those that failed it already) while another
        endpoint of ``role`` could take it (capacity aside), else only ``banned`` (those never to be tried again,
        a subset of ``failed``).  A failure is a preference, not a ban — as Envoy's ``previous_hosts`` retry
        predicate — so a lone engine (or the last ones left) is tried again and its breaker decides, rather than
        the request being refused with a 503 while an engine that could serve it is up."""
        if failed and not self.eligible(role, request, failed, capacity=False):
            return banned
        return failed

    def require(self, role: Role, request: PickRequest, exclude: Sequence[Endpoint] = ()) -> None:
        """Raise at once when no endpoint of ``role`` could ever take ``request`` (capacity aside): the first
        filter's refusal that ruled every one out — :class:`NoEndpointAvailable` (503 + ``Retry-After``) or
        :class:`~pdproxy.errors.ModelNotFound` (404)."""
        candidates, refusal = self._filter(role, request, exclude, False)
        if not candidates:
            assert refusal is not None
            raise self._refuse(role, refusal())

    def score(self, role: Role, request: PickRequest, candidates: Sequence[Endpoint]) -> list[Score]:
        """Each candidate's cost per tier of ``role``'s profile (weighted sums; same order as ``candidates``)."""
        profile = self.profiles[role]
        rows: list[list[float] | None] = [None] * len(profile.tiers)
        for scorer, weight, tier in profile.plan:
            costs = scorer(request, candidates)
            if weight != 1.0:
                costs = [weight * c for c in costs]
            row = rows[tier]
            rows[tier] = costs if row is None else [a + b for a, b in zip(row, costs, strict=True)]
        return list(zip(*(row or [0.0] * len(candidates) for row in rows), strict=True))

    def pick_engine(self, request: PickRequest, exclude: Sequence[Endpoint] = ()) -> Endpoint:
        """An engine for a call about the model rather than a leg (``/tokenize``, ``/detokenize``): a prefiller,
        else a decoder (both run the model), minus ``exclude``; no breaker trial taken (``trial=False``: the outcome
        is not reported).  Raises the decoders' refusal (:meth:`pick`) when neither role has one."""
        try:
            return self.pick(Role.PREFILL, request, exclude, trial=False)
        except NoEndpointAvailable:
            return self.pick(Role.DECODE, request, exclude, trial=False)

    def pick(self, role: Role, request: PickRequest, exclude: Sequence[Endpoint] = (), *,
             capacity: bool = True, trial: bool = True) -> Endpoint:
        """The endpoint of ``role`` for ``request``: filters (all, or all but the capacity ones when ``capacity``
        is False), minus ``exclude``, then scores, then the picker.  With ``trial`` the health monitor hears of the
        pick (a half-open breaker's trial slot is taken; the caller then reports the leg's verdict with
        ``HealthMonitor.record_*``, or gives an unused pick back with :meth:`unpick`); ``trial=False`` for calls
        whose outcome is not reported (``/tokenize``).  Should the breaker refuse the chosen endpoint after all
        (with ``--workers N`` another worker may have taken its trial since the filter read it), it chooses again.

        Raises :class:`NoEndpointAvailable` (503, ``Retry-After`` = seconds until a breaker re-admits) or
        :class:`~pdproxy.errors.ModelNotFound` (404) when no candidate is left: the refusal of the first filter
        that left none.
        """
        endpoint, refusal = self._choose(role, request, exclude, capacity, trial)
        if endpoint is None:
            raise self._refuse(role, refusal() if refusal is not None
                               else NoEndpointAvailable(role.value, f.BreakerClosed.reason))
        return endpoint

    def try_pick(self, role: Role, request: PickRequest, exclude: Sequence[Endpoint] = (), *,
                 trial: bool = True) -> Endpoint | None:
        """:meth:`pick` (every filter, a breaker trial taken unless ``trial`` is False), or None where it would
        raise: no error is built (the prefill queue's grant attempts, most of which find the prefillers full; the
        release legs' retries)."""
        return self._choose(role, request, exclude, True, trial)[0]

    def _choose(self, role: Role, request: PickRequest, exclude: Sequence[Endpoint], capacity: bool,
                trial: bool) -> tuple[Endpoint | None, Callable[[], ProxyError] | None]:
        for _ in range(_TRIAL_RACES):
            candidates, refusal = self._filter(role, request, exclude, capacity)
            if not candidates:
                return None, refusal
            if len(candidates) == 1:
                endpoint = candidates[0]
                scores: list[Score] = []
            else:
                scores = self.score(role, request, candidates)
                endpoint = self.profiles[role].picker(request, candidates, scores)
            if not trial or self.health is None or self.health.on_pick(endpoint):
                if self.debug:
                    self._log_pick(role, request, endpoint, candidates, scores, exclude)
                return endpoint, None
        return None, None

    @staticmethod
    def _log_pick(role: Role, request: PickRequest, endpoint: Endpoint, candidates: Sequence[Endpoint],
                  scores: Sequence[Score], exclude: Sequence[Endpoint]) -> None:
        """The DEBUG line of one pick: the request, the endpoint chosen, each candidate's cost per tier of the
        role's profile (lower wins; ``docs/migrating.md`` "Policies"), and those left out as already failed."""
        costs = ", ".join(f"{e.name}={'/'.join(f'{c:g}' for c in score)}"     # no scores: the only candidate
                          for e, score in zip(candidates, scores, strict=False))
        log.debug("request %s: %s on %s (prompt %s tokens%s; costs %s%s)", request.request_id or "-", role.value,
                  endpoint.name, request.prompt_tokens, f", dp_rank {request.dp_rank}" if request.dp_rank is not None
                  else "", costs or "the only candidate",
                  f"; failed it already: {', '.join(e.name for e in exclude)}" if exclude else "",
                  extra={"event": "pick", "role": role.value, "endpoint": endpoint.name})

    def unpick(self, endpoint: Endpoint) -> None:
        """A pick made with ``trial`` that will not be used (the prefill queue's grant lost a race for the room):
        give its half-open trial slot back, if it took one."""
        if self.health is not None:
            self.health.record_neutral(endpoint)
