"""BoardBreaker: one endpoint's circuit breaker shared by every worker of ``pdproxy serve --workers N``.

The state machine is :class:`pdproxy.engines.breaker.CircuitBreaker`'s, unchanged; only where its fields live differs.
State, consecutive failures, ``opened_at``, ``retry_until``, the open period and the re-open count live in the
endpoint's breaker record on the load board (pdproxy/workers/board.py); the half-open trials in flight live in the
row of the worker that took them, so the trials of a worker that died are zeroed with its row by the supervisor.
Hence a failure seen by any worker counts for all (a dead engine is found once, not once per worker), a breaker
opened in one worker is open in every worker at its next pick, and a half-open breaker admits
``half_open_trials`` trials in all, not per worker.

Reads take no lock: the scheduler's breaker filter (:meth:`BoardBreaker.can_take`, once per candidate per pick)
reads one cell while the breaker is closed.  Every transition runs inside the board's lock
(:meth:`~pdproxy.workers.board.LoadBoard.exclusive`) and re-evaluates the state there, so two workers cannot both
take the last trial slot (the loser's :meth:`on_pick` returns False and the scheduler chooses again).  The calls
that find nothing to change (``on_pick`` of a closed breaker, ``release_trial`` of one not half-open, ``probe_ok``
of one not open) return without the lock.  Time is ``time.monotonic()``, one clock for all the processes.
"""

from __future__ import annotations

import time
from types import MappingProxyType
from typing import Any, Final

from pdproxy.engines.breaker import BreakerState, CircuitBreaker, Clock
from pdproxy.workers.board import (
    B_FAILURES,
    B_OPEN_FOR_S,
    B_OPENED_AT,
    B_OPENED_TOTAL,
    B_REOPEN_COUNT,
    B_RETRY_UNTIL,
    B_STATE,
    TRIALS,
    LoadBoard,
)

_STATES = (BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN)  # cell value → state (0 = closed)
_CODES: Final = MappingProxyType({s: i for i, s in enumerate(_STATES)})


class BoardBreaker(CircuitBreaker):
    """The breaker of endpoint ``index`` on ``board``, as seen by worker ``row`` (see module docstring).  Keyword
    arguments as :class:`CircuitBreaker`'s (every worker passes the same settings); ``clock`` must be
    ``time.monotonic`` (the default) for the processes to agree."""

    __slots__ = ("_attached", "_board", "_cells", "_floats", "_own_trials", "_rec", "_trial_cells")

    def __init__(self, board: LoadBoard, index: int, row: int, *, failure_threshold: int = 3,
                 open_s: float = 3.0, max_open_s: float = 30.0, half_open_trials: int = 1,
                 clock: Clock = time.monotonic) -> None:
        self._attached = False                    # CircuitBreaker.__init__ must not reset the shared record
        self._board = board
        self._cells: Any = board.cells
        self._floats: Any = board.floats
        self._rec = board.breaker_cell(index, 0)
        self._trial_cells = board.column(index, TRIALS)
        self._own_trials = board.cell(row, index, TRIALS)
        super().__init__(failure_threshold=failure_threshold, open_s=open_s, max_open_s=max_open_s,
                         half_open_trials=half_open_trials, clock=clock)
        self._attached = True

    # --- the fields, on the board -------------------------------------------------------------------------------
    def _int(self, field: int) -> int:
        return int(self._cells[self._rec + field])

    def _set_int(self, field: int, value: int) -> None:
        if self._attached:
            self._cells[self._rec + field] = value

    def _float(self, field: int) -> float:
        return float(self._floats[self._rec + field])

    def _set_float(self, field: int, value: float) -> None:
        if self._attached:
            self._floats[self._rec + field] = value

    @property
    def state(self) -> BreakerState:
        """The shared state."""
        return _STATES[self._cells[self._rec + B_STATE]]

    @state.setter
    def state(self, value: BreakerState) -> None:
        self._set_int(B_STATE, _CODES[value])

    @property
    def consecutive_failures(self) -> int:
        """Failures in a row, counted over every worker."""
        return self._int(B_FAILURES)

    @consecutive_failures.setter
    def consecutive_failures(self, value: int) -> None:
        self._set_int(B_FAILURES, value)

    @property
    def opened_total(self) -> int:
        """Times the breaker opened (any worker)."""
        return self._int(B_OPENED_TOTAL)

    @opened_total.setter
    def opened_total(self, value: int) -> None:
        self._set_int(B_OPENED_TOTAL, value)

    @property
    def _reopen_count(self) -> int:
        return self._int(B_REOPEN_COUNT)

    @_reopen_count.setter
    def _reopen_count(self, value: int) -> None:
        self._set_int(B_REOPEN_COUNT, value)

    @property
    def opened_at(self) -> float:
        """When it last opened (``time.monotonic()`` seconds)."""
        return self._float(B_OPENED_AT)

    @opened_at.setter
    def opened_at(self, value: float) -> None:
        self._set_float(B_OPENED_AT, value)

    @property
    def retry_until(self) -> float:
        """Held open at least until then (an engine's ``Retry-After``; monotonic seconds)."""
        return self._float(B_RETRY_UNTIL)

    @retry_until.setter
    def retry_until(self, value: float) -> None:
        self._set_float(B_RETRY_UNTIL, value)

    @property
    def _open_for_s(self) -> float:
        value = self._float(B_OPEN_FOR_S)
        return value if value > 0 else self.open_s      # a fresh (zeroed) record: the first open period

    @_open_for_s.setter
    def _open_for_s(self, value: float) -> None:
        self._set_float(B_OPEN_FOR_S, value)

    @property
    def _trials(self) -> int:
        cells = self._cells
        return sum(cells[i] for i in self._trial_cells)

    @_trials.setter
    def _trials(self, value: int) -> None:
        if not self._attached:
            return
        cells = self._cells
        if value == 0:                     # a state change forgets every worker's trials
            for i in self._trial_cells:
                cells[i] = 0
        else:                              # one more or one fewer: this worker's own
            cells[self._own_trials] += value - self._trials

    # --- queries without the lock ------------------------------------------------------------------------------
    def can_take(self) -> bool:
        """True if a new request may be sent now (one cell read while closed)."""
        return self._cells[self._rec + B_STATE] == 0 or super().can_take()

    # --- transitions inside the board's lock -------------------------------------------------------------------
    def on_pick(self) -> bool:
        """:meth:`CircuitBreaker.on_pick`, decided inside the board's lock unless the breaker is closed."""
        if self._cells[self._rec + B_STATE] == 0:
            return True
        with self._board.exclusive():
            return super().on_pick()

    def release_trial(self) -> None:
        """:meth:`CircuitBreaker.release_trial` (frees this worker's trial slot), inside the lock if half-open."""
        if self.state is BreakerState.HALF_OPEN and self._cells[self._own_trials] > 0:
            with self._board.exclusive():
                super().release_trial()

    def record_success(self) -> None:
        """:meth:`CircuitBreaker.record_success`, inside the board's lock."""
        with self._board.exclusive():
            super().record_success()

    def record_failure(self, *, retry_after_s: float | None = None, hard: bool = False) -> None:
        """:meth:`CircuitBreaker.record_failure`, inside the board's lock (a failure in any worker counts)."""
        with self._board.exclusive():
            super().record_failure(retry_after_s=retry_after_s, hard=hard)

    def probe_ok(self) -> None:
        """:meth:`CircuitBreaker.probe_ok`, inside the board's lock if open."""
        if self.state is BreakerState.OPEN:
            with self._board.exclusive():
                super().probe_ok()
