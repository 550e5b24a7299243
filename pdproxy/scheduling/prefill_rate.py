"""A prefiller's measured prefill rate: the tokens it computed per second it had a prefill in flight.

The prefill budget (:class:`~pdproxy.scheduling.queue.PrefillLedger`) bounds the prefill work queued on one
prefiller, because vLLM runs a started chunked prefill to its end before newer prompts
(``vllm/v1/core/sched/scheduler.py::schedule`` serves RUNNING requests first): what a newly arrived prompt waits for
there is *time*, the queued tokens divided by the prefiller's rate.  ``prefill_budget_tokens`` states it in tokens;
``prefill_budget_s`` states it in seconds of this measured rate, and the larger of the two applies, so a prefiller
that computes a 64K-token prompt in milliseconds is not made to take one at a time (``docs/request-cost.md``).

What is measured, per prefiller and per process: *busy time*, the wall time during which at least one prefill
dispatched by this process was unanswered (overlapping prefills count once), and the tokens computed by the
prefills that succeeded (the engine's ``usage.prompt_tokens`` minus its reported cached tokens, or pdproxy's own
estimates when the engine reports none).  A failed or abandoned prefill adds its time and no tokens.  Both sums
are halved whenever the busy time passes :data:`WINDOW_S`, so the rate follows the last few seconds of work.
Every error leans low (time the answer waited in a socket, another worker's prefills, a failure), and a low rate
only leaves the token budget in force.
"""

from __future__ import annotations

WINDOW_S = 8.0
"""Seconds of busy time after which the sums are halved (the rate's memory: about the last 8–16 s of work)."""
MIN_PREFILLS = 4
"""Succeeded prefills measured before a rate is reported (one quick answer is not a rate)."""


class PrefillRate:
    """Busy time and computed tokens of one prefiller, fed by :class:`~pdproxy.scheduling.queue.PrefillSlot`:
    :meth:`started` when a prefill is granted, :meth:`finished` once when it is answered (``tokens`` computed) or
    fails (``tokens`` None).  ``now``: seconds of ``time.monotonic()``."""

    __slots__ = ("_busy_s", "_inflight", "_since", "_tokens", "prefills")

    def __init__(self) -> None:
        self._busy_s = 0.0
        self._tokens = 0.0
        self._inflight = 0
        self._since = 0.0
        self.prefills = 0
        """Succeeded prefills measured so far (not halved)."""

    def _advance(self, now: float) -> None:
        if self._inflight > 0:
            self._busy_s += now - self._since
            if self._busy_s > WINDOW_S:
                self._busy_s *= 0.5
                self._tokens *= 0.5
        self._since = now

    def started(self, now: float) -> None:
        """A prefill was dispatched (its slot granted) at ``now``."""
        self._advance(now)
        self._inflight += 1

    def finished(self, tokens: int | None, now: float) -> None:
        """A prefill started earlier ended at ``now``: answered after computing ``tokens`` tokens, or failed or
        abandoned (``tokens`` None)."""
        self._advance(now)
        self._inflight = max(0, self._inflight - 1)
        if tokens is not None:
            self._tokens += max(0, tokens)
            self.prefills += 1

    def tokens_per_s(self) -> float | None:
        """Computed tokens per busy second, or None before :data:`MIN_PREFILLS` succeeded prefills (or with no busy
        time measured)."""
        if self.prefills < MIN_PREFILLS or self._busy_s <= 0.0:
            return None
        return self._tokens / self._busy_s
