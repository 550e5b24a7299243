"""Scorers: what sending a request to each candidate would cost, lower is better.

A scorer returns one cost per candidate, in its own unit (named in its docstring); a profile weights them
(:class:`Weighted`) and adds the weighted costs of the same ``tier``.  Tiers compare in order: tier 1 only breaks
ties of tier 0, and what is still tied after the last tier goes to the picker's tie-break
(:mod:`pdproxy.scheduling.picker`).

Prefill cost, tier 0, in tokens: ``uncached prompt tokens + queued prefill tokens``
(:class:`UncachedPromptTokens` + :class:`QueuedPrefillTokens`, or :class:`InflightTokens` without a ledger).  Both
are tokens the prefiller must compute before this prompt's first token, so a prefix hit on a prefiller busy with a
120K-token prefill loses to a miss on an idle one, and a prefix every prefiller holds (one system prompt for all
users) adds the same to each, so that traffic spreads by load.  Tier 1: in-flight prefill requests.

Decode cost: tier 0 in-flight decode requests (:class:`InflightRequests`: the batch the decoder steps through),
tier 1 the tokens they hold in its KV (:class:`InflightTokens`) plus the prompt tokens the decoder would pull
(:class:`UncachedPromptTokens`: vLLM's NixlConnector pulls only the blocks a decoder lacks, ``docs/kv-events.md``;
decoders appear in the hints only where their own KV events say what they hold).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdproxy.endpoints import Endpoint
from pdproxy.engines.pool import EndpointPool
from pdproxy.scheduling.request import PickRequest

if TYPE_CHECKING:
    from pdproxy.scheduling.queue import PrefillLedger


class Scorer(Protocol):
    """One cost.  ``name``: a short label (debug output, tests)."""

    name: str

    def __call__(self, request: PickRequest, candidates: Sequence[Endpoint]) -> list[float]:
        """One cost per candidate (same order, ≥ 0, in the scorer's unit); never raises."""
        ...


@dataclass(frozen=True, slots=True)
class Weighted:
    """A scorer in a profile: its costs are multiplied by ``weight`` and added to the other scorers of ``tier``."""

    scorer: Scorer
    weight: float = 1.0
    tier: int = 0


class UncachedPromptTokens:
    """Prompt tokens the endpoint would have to compute (tokens): ``prompt_tokens − hints.cached(endpoint)``, never
    below 0.  Without hints (:data:`~pdproxy.scheduling.request.NO_HINTS`) the same for every endpoint; 0 for a
    request whose prompt is not counted."""

    name = "uncached_prompt_tokens"

    def __call__(self, request: PickRequest, candidates: Sequence[Endpoint]) -> list[float]:
        tokens = request.prompt_tokens or 0
        cached = request.hints.cached
        return [float(max(0, tokens - cached(e))) for e in candidates]


class InflightTokens:
    """Tokens the pool's leases hold on the endpoint (tokens, over every worker on a shared load board).  On a
    prefiller: prompts dispatched and not yet pulled by their decoder (the prefill leases, released at the
    decoder's first event), i.e. its queued prefill work; on a decoder: prompt + expected output of the requests it
    decodes (the KV they hold)."""

    name = "inflight_tokens"

    def __init__(self, pool: EndpointPool) -> None:
        self.pool = pool

    def __call__(self, request: PickRequest, candidates: Sequence[Endpoint]) -> list[float]:
        load = self.pool.load
        return [float(load(e).tokens) for e in candidates]


class QueuedPrefillTokens:
    """Prefill work queued on the prefiller (tokens): prompts dispatched to it and not answered yet, counted as
    the tokens it computes for them — each prompt minus what it had cached (the ledger's in-flight tokens,
    :meth:`~pdproxy.scheduling.queue.PrefillLedger.inflight_tokens`).  Unlike the pool's leases (held until the
    decoder starts, and the whole prompt: the KV pinned), this is the work ahead of a new prompt's first token.
    ``resolution`` (tokens; 0 = exact): counted in whole steps of it, rounded down, so prefillers whose queues differ
    by less than a step tie on load and the next tier (in-flight requests), then the picker's tie-break, decide —
    otherwise the prefiller that answered last would take every small prompt; prefix hits are not rounded."""

    name = "queued_prefill_tokens"

    def __init__(self, ledger: PrefillLedger, resolution: float = 0.0) -> None:
        self.ledger = ledger
        self.resolution = resolution

    def __call__(self, request: PickRequest, candidates: Sequence[Endpoint]) -> list[float]:
        inflight = self.ledger.inflight_tokens
        step = self.resolution
        if step > 0:
            return [math.floor(inflight(e) / step) * step for e in candidates]
        return [float(inflight(e)) for e in candidates]


class InflightRequests:
    """Requests the pool's leases hold on the endpoint (requests; over every worker on a shared load board)."""

    name = "inflight_requests"

    def __init__(self, pool: EndpointPool) -> None:
        self.pool = pool

    def __call__(self, request: PickRequest, candidates: Sequence[Endpoint]) -> list[float]:
        load = self.pool.load
        return [float(load(e).requests) for e in candidates]
