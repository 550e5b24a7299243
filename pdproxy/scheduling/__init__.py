"""Routing: which endpoint takes a request, decided in one pipeline per role — filters → scorers → picker.

The shape is llm-d's inference scheduler (a scheduling profile of filters, weighted scorers and a picker) with
independent prefill and decode profiles as PD needs.  Why a package of four small modules rather than one: each
stage is what later work extends on its own — a served-model or LoRA rule is a filter
(:mod:`~pdproxy.scheduling.filters`), prefix-cache affinity is a scorer input (:class:`PrefixHints` read by
:class:`~pdproxy.scheduling.scorers.UncachedPromptTokens`), the tie-break across replicas is the picker
(:mod:`~pdproxy.scheduling.picker`) — while :mod:`~pdproxy.scheduling.scheduler` keeps the policy, the
:class:`Profile` of each role, on one screen.

Public API::

    scheduler = Scheduler.standard(pool, health=health, infos=infos, limits=limits, ledger=ledger)
    request = PickRequest.of(proxy_request, request_id, hints=PrefixHints(cached_tokens={...}, routing_key=b"..."))
    endpoint = scheduler.pick(Role.PREFILL, request, exclude=tried)          # or raises a 503 / 404
    scheduler.require(Role.DECODE, request)                                 # fail fast before the prefill
    scheduler.eligible(Role.PREFILL, request, capacity=False)               # could any take it, capacity aside?

Costs are in tokens where the quantity is tokens (prefill: uncached prompt tokens + in-flight prefill tokens);
see :mod:`~pdproxy.scheduling.scorers`.
"""

from __future__ import annotations

from pdproxy.scheduling.filters import Filter
from pdproxy.scheduling.picker import LeastCost, Picker, PowerOfTwo, Score, rendezvous_weight
from pdproxy.scheduling.request import NO_HINTS, PickRequest, PrefixHints
from pdproxy.scheduling.scheduler import Profile, Scheduler, standard_profiles
from pdproxy.scheduling.scorers import Scorer, Weighted

__all__ = ["NO_HINTS", "Filter", "LeastCost", "PickRequest", "Picker", "PowerOfTwo", "PrefixHints", "Profile",
           "Scheduler", "Score", "Scorer", "Weighted", "rendezvous_weight", "standard_profiles"]
