"""Jittered exponential backoff between retries of a leg (the director's failure policy, pdproxy/pd/director.py)."""

from __future__ import annotations

import asyncio
import random


class Backoff:
    """Sleep ``base_s · 2^(attempt-1)`` seconds before retry ``attempt`` (≥ 1), capped at ``max_s``, times a
    uniform jitter of 0.5–1.5 drawn from ``rng``."""

    def __init__(self, base_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self.base_s = base_s
        self.max_s = max_s
        self.rng = rng or random.Random()

    def delay_s(self, attempt: int) -> float:
        """The delay (seconds) before retry ``attempt``."""
        return min(self.base_s * 2.0 ** (attempt - 1), self.max_s) * self.rng.uniform(0.5, 1.5)

    async def sleep(self, attempt: int) -> None:
        """Wait :meth:`delay_s` seconds (nothing when it is 0)."""
        delay = self.delay_s(attempt)
        if delay > 0:
            await asyncio.sleep(delay)
