"""Choosing endpoints: filter → score → pick, with separate prefill and decode policies.

The shape follows llm-d's inference scheduler (filters, scorers, a picker) and sglang's gateway (independent
P and D policies).  Scores are computed from the pool's own accounting (tokens, not request bytes):

- prefill score: in-flight prefill **tokens** on the prefiller (its queued work, so a 120K-token prefill
  steers small prompts elsewhere);
- decode score: in-flight decode requests, then in-flight tokens (KV held).

The picker is power-of-two-choices over the filtered candidates with a random tie-break, which avoids the
herd effect of a strict minimum when many requests arrive between load updates.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from pdproxy.endpoints import Endpoint, Role
from pdproxy.errors import NoEndpointAvailable
from pdproxy.pool import EndpointLoad, EndpointPool

Score = Callable[[EndpointLoad], tuple[float, ...]]


class Picker(Protocol):
    """A selection strategy: picks one of ``candidates`` (non-empty) by ``score`` (a tuple per endpoint,
    lower is better), using ``rng`` for sampling and ties.  See :func:`power_of_two`, :func:`least_loaded`."""

    def __call__(self, candidates: Sequence[Endpoint], score: Callable[[Endpoint], tuple[float, ...]],
                 rng: random.Random) -> Endpoint: ...


def prefill_score(load: EndpointLoad) -> tuple[float, ...]:
    """Lower is better: (in-flight prefill tokens, in-flight prefill requests)."""
    return (load.tokens, load.requests)


def decode_score(load: EndpointLoad) -> tuple[float, ...]:
    """Lower is better: (in-flight decode requests, in-flight tokens held)."""
    return (load.requests, load.tokens)


def power_of_two(candidates: Sequence[Endpoint], score: Callable[[Endpoint], tuple[float, ...]],
                 rng: random.Random) -> Endpoint:
    """Sample two distinct candidates, keep the lower score; ties broken at random."""
    if len(candidates) == 1:
        return candidates[0]
    a, b = rng.sample(list(candidates), 2)
    sa, sb = score(a), score(b)
    if sa == sb:
        return a if rng.random() < 0.5 else b
    return a if sa < sb else b


def least_loaded(candidates: Sequence[Endpoint], score: Callable[[Endpoint], tuple[float, ...]],
                 rng: random.Random) -> Endpoint:
    """The minimum score; ties broken at random."""
    best = min(score(c) for c in candidates)
    return rng.choice([c for c in candidates if score(c) == best])


class Scheduler:
    """Picks a prefiller and a decoder for a request from the pool's current state.

    ``filters`` are extra predicates (``(endpoint) -> bool``) applied after the pool's health/draining filter,
    e.g. admission's "the prompt fits this engine's limits".  Raises :class:`NoEndpointAvailable` when nothing
    is left.
    """

    def __init__(self, pool: EndpointPool, *, picker: Picker = power_of_two, seed: int | None = None) -> None:
        self.pool = pool
        self.picker = picker
        self.rng = random.Random(seed)

    def choose(self, role: Role, *, exclude: Sequence[Endpoint] = (),
               fits: Callable[[Endpoint], bool] | None = None) -> Endpoint:
        """One endpoint of ``role`` among the available ones (healthy, not draining), not in ``exclude`` and
        passing ``fits``, by the picker over :func:`prefill_score` / :func:`decode_score`.  Raises
        :class:`NoEndpointAvailable` when no candidate is left."""
        candidates = [e for e in self.pool.available(role) if e not in exclude and (fits is None or fits(e))]
        if not candidates:
            detail = "all candidates failed for this request" if exclude else ""
            raise NoEndpointAvailable(role.value, detail)
        score_fn = prefill_score if role is Role.PREFILL else decode_score
        loads = self.pool.load
        return self.picker(candidates, lambda e: score_fn(loads(e)), self.rng)

    def choose_prefiller(self, **kw: object) -> Endpoint:
        """:meth:`choose` for ``Role.PREFILL`` (same keywords and errors)."""
        return self.choose(Role.PREFILL, **kw)  # type: ignore[arg-type]

    def choose_decoder(self, **kw: object) -> Endpoint:
        """:meth:`choose` for ``Role.DECODE`` (same keywords and errors)."""
        return self.choose(Role.DECODE, **kw)  # type: ignore[arg-type]
