"""EndpointPool: the proxy's own load accounting per endpoint, and leases that release exactly once.

Per endpoint it keeps in-flight requests and in-flight tokens (prefill: prompt tokens being prefilled;
decode: prompt + expected output tokens held in the decoder's KV), the health flag written by ``health.py``
and a draining flag written by the admin API.  A :class:`Lease` is taken for every pick and released on every
exit path — success, error, cancellation — by its context manager; ``release()`` is idempotent, so an early
release (the prefill lease ends at the decoder's first byte) and the context manager's exit never release twice.
Release listeners (:meth:`EndpointPool.add_release_listener`; the prefill queue registers one) are called after
each first release, so whoever waits for freed capacity hears of it at once instead of on its next poll.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass

from pdproxy.endpoints import Endpoint, Role

log = logging.getLogger("pdproxy.pool")


@dataclass(slots=True)
class EndpointLoad:
    """Mutable load state of one endpoint (requests: count; tokens: tokens; lifetime counters for tests)."""

    requests: int = 0
    tokens: int = 0
    healthy: bool = True
    draining: bool = False
    leased_total: int = 0
    released_total: int = 0


ReleaseListener = Callable[[], None]
"""Called (synchronously, no arguments) after a lease gave its load back; must not await or release leases."""


class Lease:
    """One pick of one endpoint, holding ``tokens`` of its load until released (exactly once).  ``listeners``
    (the pool's live list) are called after the release; an exception from one propagates from ``release()``
    after the load is already given back."""

    __slots__ = ("_listeners", "_load", "endpoint", "released", "tokens")

    def __init__(self, endpoint: Endpoint, load: EndpointLoad, tokens: int,
                 listeners: Sequence[ReleaseListener] = ()) -> None:
        self.endpoint = endpoint
        self.tokens = tokens
        self._load = load
        self._listeners = listeners
        self.released = False
        load.requests += 1
        load.tokens += tokens
        load.leased_total += 1

    def release(self) -> None:
        """Give the load back, then tell the release listeners (the prefill queue); later calls do nothing.
        Never raises: it runs in ``finally`` blocks and a failing listener is logged, not propagated."""
        if self.released:
            return
        self.released = True
        self._load.requests -= 1
        self._load.tokens -= self.tokens
        self._load.released_total += 1
        for listener in self._listeners:
            try:
                listener()
            except Exception:
                log.exception("a lease-release listener failed")


class EndpointPool:
    """All endpoints with their load.  Single event loop; no awaits inside, so no locks are needed."""

    def __init__(self, endpoints: list[Endpoint]) -> None:
        self._loads: dict[Endpoint, EndpointLoad] = {e: EndpointLoad() for e in endpoints}
        self._release_listeners: list[ReleaseListener] = []

    def add_release_listener(self, listener: ReleaseListener) -> None:
        """Call ``listener()`` after every lease of this pool is released (once per lease, in this process only:
        other workers' releases on a shared board are not seen).  Leases already out hear it too."""
        self._release_listeners.append(listener)

    def remove_release_listener(self, listener: ReleaseListener) -> None:
        """Stop calling ``listener``; an unknown one is ignored."""
        with suppress(ValueError):
            self._release_listeners.remove(listener)

    def __contains__(self, endpoint: object) -> bool:
        """Whether ``endpoint`` is in the pool now (one lookup: what a request's path asks)."""
        return endpoint in self._loads

    def endpoints(self, role: Role | None = None) -> list[Endpoint]:
        """Every endpoint (healthy or not), optionally only those of ``role``, in insertion order."""
        return [e for e in self._loads if role is None or e.role is role]

    def load(self, endpoint: Endpoint) -> EndpointLoad:
        """The live :class:`EndpointLoad` of ``endpoint``.  Raises ``KeyError`` for an unknown endpoint."""
        return self._loads[endpoint]

    def available(self, role: Role) -> list[Endpoint]:
        """Endpoints of ``role`` that may take new work (healthy and not draining)."""
        return [e for e, s in self._loads.items() if e.role is role and s.healthy and not s.draining]

    def add(self, endpoint: Endpoint) -> None:
        """Add an endpoint (admin API); raises ``ValueError`` if it is already present."""
        if endpoint in self._loads:
            raise ValueError(f"endpoint {endpoint.name} ({endpoint.role.value}) already exists")
        self._loads[endpoint] = EndpointLoad()

    def remove(self, endpoint: Endpoint) -> None:
        """Forget an endpoint.  Outstanding leases keep their own reference and release harmlessly."""
        self._loads.pop(endpoint, None)

    @contextmanager
    def lease(self, endpoint: Endpoint, tokens: int) -> Iterator[Lease]:
        """Hold ``tokens`` of load on ``endpoint`` for the ``with`` block (released on any exit)."""
        load = self._loads.get(endpoint) or EndpointLoad()
        lease = Lease(endpoint, load, tokens, self._release_listeners)
        try:
            yield lease
        finally:
            lease.release()

    def totals(self) -> dict[str, tuple[int, int]]:
        """``{endpoint name: (in-flight requests, in-flight tokens)}`` — all zero when the proxy is idle."""
        return {f"{e.role.value}:{e.name}": (s.requests, s.tokens) for e, s in self._loads.items()}

    def idle(self) -> bool:
        """True when no endpoint has in-flight requests or tokens."""
        return all(s.requests == 0 and s.tokens == 0 for s in self._loads.values())
