"""Pickers: the one endpoint among the scored candidates.

- :class:`LeastCost` (the default): the lowest score; ties broken by rendezvous (highest-random-weight) hashing of
  the request's routing key with each endpoint's name.  The hash is the same in every process, so independent
  pdproxy replicas that see the same scores send the same prompt (its first block is the routing key when a
  prefix index knows it) to the same prefiller, and requests without one (the key is then their request id)
  spread evenly over tied endpoints.  Within one process the load is exact — a lease is taken right after the
  pick, before any other request is scored — so the minimum has no stale-load herd to avoid.
- :class:`PowerOfTwo`: two candidates sampled at random, the lower score wins, ties at random.  It spreads load
  when many routers score from stale or partial load figures, at the cost of replica agreement and of prefix
  affinity (the sample may miss the endpoint holding the prefix); setting ``routing_picker = "power_of_two"``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Protocol

from pdproxy.endpoints import Endpoint
from pdproxy.scheduling.request import PickRequest

Score = tuple[float, ...]
"""A candidate's cost per tier (lower is better; compared as a tuple, tier 0 first)."""


class Picker(Protocol):
    """Chooses one of ``candidates`` (non-empty) given their ``scores`` (same order).  ``name``: its setting value."""

    name: str

    def __call__(self, request: PickRequest, candidates: Sequence[Endpoint], scores: Sequence[Score]) -> Endpoint:
        """The chosen endpoint; never raises for a non-empty ``candidates``."""
        ...


_MASK = (1 << 64) - 1


def stable_hash(data: bytes) -> int:
    """A 64-bit hash of ``data``, identical in every process and Python version (BLAKE2b, not ``hash()``, which
    ``PYTHONHASHSEED`` changes)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def mix64(x: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit integers whose every output bit depends on every input bit."""
    z = (x + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def rendezvous_weight(key: bytes, endpoint: Endpoint) -> int:
    """The highest-random-weight hash of ``key`` and ``endpoint.name``: ``mix64(stable_hash(key) ^
    stable_hash(name))``, a 64-bit integer identical in every process (:class:`LeastCost` keeps the names'
    hashes: :func:`_weight` of the two hashes)."""
    return _weight(stable_hash(key), stable_hash(endpoint.name.encode()))


def _weight(key_hash: int, name_hash: int) -> int:
    return mix64(key_hash ^ name_hash)


class LeastCost:
    """The lowest score; ties go to the tied endpoint with the highest :func:`rendezvous_weight` for
    ``request.routing_key`` (see the module docstring).  Endpoint names' hashes are kept per picker."""

    name = "least_cost"

    def __init__(self) -> None:
        self._name_hash: dict[str, int] = {}

    def _endpoint_hash(self, endpoint: Endpoint) -> int:
        name = endpoint.name
        h = self._name_hash.get(name)
        if h is None:
            if len(self._name_hash) > 65_536:          # endpoints come and go (admin API): stay bounded
                self._name_hash.clear()
            h = self._name_hash[name] = stable_hash(name.encode())
        return h

    def __call__(self, request: PickRequest, candidates: Sequence[Endpoint], scores: Sequence[Score]) -> Endpoint:
        best = min(scores)
        tied = [c for c, s in zip(candidates, scores, strict=True) if s == best]
        if len(tied) == 1:
            return tied[0]
        key = stable_hash(request.routing_key)
        return max(tied, key=lambda e: _weight(key, self._endpoint_hash(e)))


class PowerOfTwo:
    """Power of two choices: sample two distinct candidates with ``rng``, keep the lower score, ties at random."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def __call__(self, request: PickRequest, candidates: Sequence[Endpoint], scores: Sequence[Score]) -> Endpoint:
        if len(candidates) == 1:
            return candidates[0]
        i, j = self.rng.sample(range(len(candidates)), 2)
        if scores[i] == scores[j]:
            return candidates[i] if self.rng.random() < 0.5 else candidates[j]
        return candidates[i] if scores[i] < scores[j] else candidates[j]


PICKER_NAMES = (LeastCost.name, PowerOfTwo.name)
"""The values of the ``routing_picker`` setting."""
