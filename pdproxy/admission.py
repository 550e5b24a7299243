"""Admission: count the prompt, check it against the engines' real limits, and (later) queue large prefills.

This first version estimates prompt tokens for routing and checks nothing; see issue 4 for the full design.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pdproxy.endpoints import Endpoint
from pdproxy.protocol import ProxyRequest
from pdproxy.timeline import RequestContext


def estimate_prompt_tokens(req: ProxyRequest) -> int:
    """Upper bound on prompt tokens for a byte-level BPE: UTF-8 bytes of the body (tokens ≤ bytes)."""
    return len(req.raw)


class Admission:
    """Decides whether a request may enter, and which endpoints it fits."""

    async def admit(self, req: ProxyRequest, ctx: RequestContext) -> None:
        """Count ``req.prompt_tokens``; raise ``PromptTooLong`` / ``Overloaded`` when it cannot be served."""
        req.prompt_tokens = estimate_prompt_tokens(req)
        ctx.prompt_tokens = req.prompt_tokens
        ctx.timeline.admitted_at = time.monotonic()

    def fits_prefiller(self, req: ProxyRequest) -> Callable[[Endpoint], bool] | None:
        return None

    def fits_decoder(self, req: ProxyRequest) -> Callable[[Endpoint], bool] | None:
        return None
