"""Per-endpoint circuit breaker: closed → open → half-open → closed, on an injectable clock.

Why: vLLM-Ascend's example PD proxy (``examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py``)
has no node-failure detection or isolation: a dead prefiller is picked again and again.  The breaker counts *consecutive* failures that are the engine's fault
(refused/reset connections, timeouts, 5xx) — a 4xx (over-length prompt, bad request) is the request's fault and
is never recorded here.

States:

- ``CLOSED``: traffic flows; ``failure_threshold`` consecutive failures → ``OPEN``.
- ``OPEN``: no traffic for ``open_s`` seconds (doubled after each failed trial, capped at ``max_open_s``); an
  engine that answers ``Retry-After: n`` is held open at least ``n`` seconds.  After the wait — or as soon as an
  active ``/health`` probe succeeds (:meth:`CircuitBreaker.probe_ok`) — the breaker lets trial traffic in.
- ``HALF_OPEN``: at most ``half_open_trials`` requests in flight at once; one success → ``CLOSED``, one
  failure → ``OPEN`` again.  A trial with no verdict after ``trial_timeout_s`` (:data:`TRIAL_TIMEOUT_S`) no longer
  holds its slot: the next pick takes a new trial.  Every leg gives its verdict (or its trial back) on every exit
  path, so this only bounds what a defect there would cost (a lone engine refused to every client until restart).

Time is seconds from ``clock()`` (default ``time.monotonic``), so tests drive it with a fake clock and never
sleep.  Not thread-safe: one event loop owns it, and no method awaits.  With ``--workers N`` one breaker per
endpoint is shared by every worker (:mod:`pdproxy.workers.breaker`: the same state machine, its fields on the load
board, transitions under the board's lock).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

Clock = Callable[[], float]

TRIAL_TIMEOUT_S = 60.0
"""Seconds a half-open trial holds its slot without a verdict (module docstring): about the longest a leg takes to
tell whether an engine serves (a long prompt's prefill, a stream's first event), so a slow trial is rarely doubled
and a lost one costs a minute of 503s, not the process's life."""


class BreakerState(enum.StrEnum):
    """Circuit state (values used as metric labels and in ``/admin/endpoints``)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """One endpoint's breaker (see module docstring).

    ``failure_threshold``: consecutive failures that open a closed breaker (≥ 1); ``open_s``: first open period
    in seconds; ``max_open_s``: cap of the doubling open period; ``half_open_trials``: concurrent trial requests
    allowed while half-open; ``trial_timeout_s``: seconds a trial holds its slot without a verdict; ``clock``:
    monotonic seconds.  ``opened_at``: when the breaker last opened, or (half-open) when its newest trial began.
    """

    __slots__ = ("_clock", "_open_for_s", "_reopen_count", "_trials", "consecutive_failures", "failure_threshold",
                 "half_open_trials", "max_open_s", "open_s", "opened_at", "opened_total", "retry_until", "state",
                 "trial_timeout_s")

    def __init__(self, *, failure_threshold: int = 3, open_s: float = 3.0, max_open_s: float = 30.0,
                 half_open_trials: int = 1, trial_timeout_s: float = TRIAL_TIMEOUT_S,
                 clock: Clock = time.monotonic) -> None:
        if failure_threshold < 1 or open_s <= 0 or half_open_trials < 1 or trial_timeout_s <= 0:
            raise ValueError("failure_threshold and half_open_trials must be ≥ 1, open_s and trial_timeout_s > 0")
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.max_open_s = max(max_open_s, open_s)
        self.half_open_trials = half_open_trials
        self.trial_timeout_s = trial_timeout_s
        self._clock = clock
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.opened_at = 0.0
        self.opened_total = 0
        self.retry_until = 0.0
        self._open_for_s = open_s
        self._reopen_count = 0
        self._trials = 0

    # --- queries (no side effects) --------------------------------------------------------------------------
    def can_take(self) -> bool:
        """True if a new request may be sent now (closed; open past its wait; half-open with a free trial)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            return self._clock() >= self._reopen_at()
        return self._trials < self.half_open_trials or self._trials_lost()

    def _trials_lost(self) -> bool:
        """Half-open, and its newest trial began ``trial_timeout_s`` ago with no verdict yet."""
        return self._clock() - self.opened_at >= self.trial_timeout_s

    def _reopen_at(self) -> float:
        return max(self.opened_at + self._open_for_s, self.retry_until)

    def seconds_until_retry(self) -> float:
        """Seconds until an open breaker admits a trial (0 when it already would)."""
        if self.state is not BreakerState.OPEN:
            return 0.0
        return max(0.0, self._reopen_at() - self._clock())

    # --- transitions ------------------------------------------------------------------------------------------
    def on_pick(self) -> bool:
        """The scheduler chose this endpoint: an open breaker past its wait becomes half-open and the pick
        takes a trial slot (released by :meth:`record_success` / :meth:`record_failure` / :meth:`release_trial`).
        Returns False, taking nothing, when the breaker does not let a request in now (:meth:`can_take` is False:
        with a breaker shared by several processes, another one may have taken the trial since it was asked)."""
        if self.state is BreakerState.OPEN:
            if self._clock() < self._reopen_at():
                return False
            self.state = BreakerState.HALF_OPEN
            self._trials = 0
        if self.state is BreakerState.HALF_OPEN:
            if self._trials >= self.half_open_trials and not self._trials_lost():
                return False
            # a trial with no verdict in trial_timeout_s is taken for lost (module docstring) but still counted:
            # should it end after all, its release frees its own slot, not the new trial's
            self._trials += 1
            self.opened_at = self._clock()
        return True

    def release_trial(self) -> None:
        """A trial ended without a verdict (client left, 4xx): free its slot, keep the state."""
        if self.state is BreakerState.HALF_OPEN and self._trials > 0:
            self._trials -= 1

    def record_success(self) -> None:
        """The engine served a request (or a half-open trial passed): close the breaker."""
        self.consecutive_failures = 0
        self._trials = 0
        self._reopen_count = 0
        self._open_for_s = self.open_s
        self.state = BreakerState.CLOSED

    def record_failure(self, *, retry_after_s: float | None = None, hard: bool = False) -> None:
        """The engine failed a request (transport error, timeout, 5xx).  ``retry_after_s``: the engine's
        ``Retry-After`` in seconds, which holds the breaker open at least that long (opening it at once).
        ``hard``: proof the engine is down (TCP connection refused: nothing listens), which opens it at once."""
        now = self._clock()
        self.consecutive_failures += 1
        if retry_after_s is not None and retry_after_s > 0:
            self.retry_until = max(self.retry_until, now + min(retry_after_s, self.max_open_s))
        if self.state is BreakerState.HALF_OPEN:
            self._reopen_count += 1
            self._open_for_s = min(self.open_s * (2 ** self._reopen_count), self.max_open_s)
            self._open(now)
        elif self.state is BreakerState.CLOSED and (self.consecutive_failures >= self.failure_threshold
                                                     or self.retry_until > now or hard):
            self._open(now)

    def probe_ok(self) -> None:
        """An active ``/health`` probe succeeded: an open breaker may admit a trial now (re-admission within one
        probe interval of recovery), unless the engine asked to be left alone with ``Retry-After``."""
        if self.state is BreakerState.OPEN:
            self.opened_at = min(self.opened_at, self._clock() - self._open_for_s)

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self.opened_at = now
        self.opened_total += 1
        self._trials = 0
