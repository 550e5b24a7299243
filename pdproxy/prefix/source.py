"""The seam between the request path and prefix-cache knowledge: :class:`PrefixSource` (what the director and
the prefill leg call) and :class:`NoPrefix` (the default: nothing known, pure load routing).  The implementation
is :class:`pdproxy.prefix.routing.PrefixRouter`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Protocol

from pdproxy.apis.request import ProxyRequest
from pdproxy.endpoints import Endpoint
from pdproxy.scheduling import NO_HINTS, PrefixHints
from pdproxy.timeline import RequestContext


class PrefixSource(Protocol):
    """Where a request's :class:`~pdproxy.scheduling.PrefixHints` come from (a prefix index), and what it is told
    about the prefills that follow."""

    async def hints(self, req: ProxyRequest, ctx: RequestContext) -> PrefixHints:
        """Which endpoints hold how much of ``req``'s prompt (called once per P→D pair, after admission)."""
        ...

    def prefilling(self, req: ProxyRequest, ctx: RequestContext,
                   endpoint: Endpoint) -> AbstractContextManager[None]:
        """Held around one prefill attempt of ``req`` on ``endpoint`` (the prefill leg enters it when the queue
        granted the slot and leaves it when the prefiller answered — its ``cached_tokens`` then in ``ctx`` — or
        failed, by an exception)."""
        ...


class NoPrefix:
    """No prefix index: every pick sees :data:`~pdproxy.scheduling.NO_HINTS` (pure load routing)."""

    async def hints(self, req: ProxyRequest, ctx: RequestContext) -> PrefixHints:
        """Always :data:`~pdproxy.scheduling.NO_HINTS`."""
        return NO_HINTS

    @contextlib.contextmanager
    def prefilling(self, req: ProxyRequest, ctx: RequestContext, endpoint: Endpoint) -> Iterator[None]:
        """Nothing to note."""
        yield
