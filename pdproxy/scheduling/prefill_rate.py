"""A prefiller's measured prefill rate: the tokens it reported computing per second it had a prefill in flight.

The prefill budget (:class:`~pdproxy.scheduling.queue.PrefillLedger`) bounds the prefill work queued on one
prefiller, because vLLM runs a started chunked prefill to its end before newer prompts
(``vllm/v1/core/sched/scheduler.py::schedule`` serves RUNNING requests first): what a newly arrived prompt waits for
there is *time*, the queued tokens divided by the prefiller's rate.  ``prefill_budget_tokens`` states it in tokens;
``prefill_budget_s`` states it in seconds of this measured rate, and the larger of the two applies, so a prefiller
that computes a 64K-token prompt in milliseconds is not made to take one at a time (``docs/request-cost.md``).

What is measured, per prefiller and per process:

- *busy time*: the wall time during which at least one prefill this process dispatched there was unanswered
  (overlapping prefills count once);
- *computed tokens*: of the answered prefills whose answer says what was computed — the engine's
  ``usage.prompt_tokens`` and its cached tokens (``usage.prompt_tokens_details.cached_tokens``; vLLM reports them
  with ``--enable-prompt-tokens-details``) — the prompt minus the cached part, the prompt clamped to pdproxy's own
  count of it and the cached part to [0, prompt].  An answer without both counts, a failure or an abandoned
  prefill adds its time and no tokens: a prompt the engine had cached is answered in milliseconds, and only the
  engine knows it had (pdproxy's prefix index can miss it: other workers, other clients, an expired entry).

Both sums are halved while the busy time is over :data:`WINDOW_S`, so the rate follows the last 8–16 s of work; a
prefiller idle for :data:`STALE_S` is measured afresh (a restarted or reconfigured engine).  What still leans high:
a rate measured on short prompts, applied to long ones (attention grows faster than the prompt); the KV-pool and
decoder checks of the ledger bound what any budget lets in.
"""

from __future__ import annotations

WINDOW_S = 8.0
"""Seconds of busy time the sums are kept under by halving (the rate's memory: about the last 8–16 s of work)."""
MIN_PREFILLS = 4
"""Answered, measured prefills before a rate is reported (one quick answer is not a rate)."""
STALE_S = 60.0
"""A prefiller idle this long (seconds) is measured afresh."""


def computed_tokens(own_tokens: int, prompt_tokens: int | None, cached_tokens: int | None) -> int | None:
    """Tokens a prefill computed, from its answer's ``prompt_tokens`` and ``cached_tokens`` (engine counts; None:
    not reported), the prompt clamped to ``own_tokens`` (pdproxy's count of it, when positive) and the cached part
    to [0, prompt]; None when either count is missing."""
    if prompt_tokens is None or cached_tokens is None:
        return None
    prompt = max(0, prompt_tokens if own_tokens <= 0 else min(prompt_tokens, own_tokens))
    return prompt - min(max(0, cached_tokens), prompt)


class PrefillRate:
    """Busy time and computed tokens of one prefiller, fed by :class:`~pdproxy.scheduling.queue.PrefillSlot`:
    :meth:`started` when a prefill is granted, :meth:`finished` once when it ends — ``tokens`` computed
    (:func:`computed_tokens`), or None (failed, abandoned, not reported).  ``now``: seconds of
    ``time.monotonic()``."""

    __slots__ = ("_busy_s", "_inflight", "_since", "_tokens", "prefills")

    def __init__(self) -> None:
        self._busy_s = 0.0
        self._tokens = 0.0
        self._inflight = 0
        self._since = 0.0
        self.prefills = 0
        """Measured prefills since the prefiller was last measured afresh (not halved)."""

    def _advance(self, now: float) -> None:
        if self._inflight > 0:
            self._busy_s += max(0.0, now - self._since)
        self._since = now

    def _trim(self) -> None:
        while self._busy_s > WINDOW_S:
            self._busy_s *= 0.5
            self._tokens *= 0.5

    def started(self, now: float) -> None:
        """A prefill was dispatched (its slot granted) at ``now``."""
        if self._inflight == 0 and self.prefills and now - self._since > STALE_S:
            self._busy_s = self._tokens = 0.0
            self.prefills = 0
        self._advance(now)
        self._inflight += 1

    def finished(self, tokens: int | None, now: float) -> None:
        """A prefill started earlier ended at ``now``: answered after computing ``tokens`` tokens, or without a
        measure (``tokens`` None)."""
        self._advance(now)
        self._inflight = max(0, self._inflight - 1)
        if tokens is not None:
            self._tokens += max(0, tokens)
            self.prefills += 1
        self._trim()

    def tokens_per_s(self, now: float | None = None) -> float | None:
        """Computed tokens per busy second, or None before :data:`MIN_PREFILLS` measured prefills, with no busy
        time measured, or (given ``now``) when the prefiller has been idle for :data:`STALE_S` (its next prefill
        starts a fresh measure)."""
        if self.prefills < MIN_PREFILLS or self._busy_s <= 0.0:
            return None
        if now is not None and self._inflight == 0 and now - self._since > STALE_S:
            return None
        return self._tokens / self._busy_s
