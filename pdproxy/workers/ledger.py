"""BoardLedgerCounts: the prefill ledger's counts on the shared load board, so N workers keep one budget.

:class:`~pdproxy.scheduling.queue.PrefillLedger` checks a prompt against a prefiller's budget, its KV pool and the
decoders' free KV using counts kept by a :class:`~pdproxy.scheduling.queue.LedgerCounts`.  Here those counts are
cells of this worker's row of the board (pdproxy/workers/board.py: ``inflight_tokens``/``inflight_requests``,
``unleased_tokens``/``unleased_requests`` per endpoint, ``pending_decode`` per row), written only by this worker and
summed over every row by the readers, so every worker's room check sees what all workers dispatched.

**The bound.**  A worker's pick reads the board's grant epoch, then the totals, without a lock; its grant then
takes the board's lock (``flock``: :meth:`LoadBoard.exclusive`, :meth:`~pdproxy.scheduling.queue.PrefillLedger.
try_hold`), re-checks the room for the chosen prefiller if the epoch moved (another grant happened since the
totals were read), publishes its reservation and counts the epoch up.  Every increase of these counts happens
inside that lock after a check that read every row since the last grant; decreases (releases, the supervisor
zeroing a dead worker's row) happen anywhere and only make room.  So for each prefiller, across all workers:

- prefill tokens dispatched and unanswered ≤ the budget (``prefill_budget_tokens``, or ``prefill_budget_s`` of the
  prefiller's rate as the granting worker measured it — :mod:`pdproxy.scheduling.prefill_rate`, per process), except
  one prompt larger than the budget alone on an otherwise idle prefiller (the single-process rule);
- prompt KV in flight or pinned (whole blocks) ≤ the prefiller's KV pool, with the same idle exception; the
  unleased → leased hand-over takes the lease before giving the unleased count back and readers read the unleased
  count first, so a prompt is never missing from both (it is briefly in both: a conservative over-count);
- decoder tokens reserved by dispatched prefills ≤ the decoders' free KV as the pool's decode leases show it.

That holds exactly as long as the worker's stores reach the other workers in program order, which x86-64 (TSO)
guarantees; on weaker memory models the unlocked hand-over may be seen reordered for an instant (one prompt
under-counted on one prefiller for nanoseconds).  Releases are seen by other workers within one wake-up
(:mod:`pdproxy.workers.wakeup`) or one queue poll.

Endpoints not on the board (added through the admin API) fall back to per-worker counts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from pdproxy.endpoints import Endpoint
from pdproxy.scheduling.queue import LedgerCounts
from pdproxy.workers.board import (
    GRANT_EPOCH,
    HEAD_BASE,
    INFLIGHT_REQUESTS,
    INFLIGHT_TOKENS,
    PENDING_DECODE,
    UNLEASED_REQUESTS,
    UNLEASED_TOKENS,
    WAITING,
    LoadBoard,
)


class BoardLedgerCounts(LedgerCounts):
    """The ledger's counts for worker ``row`` of ``board`` (see module docstring).  ``wake_others``: called when
    this worker's first blocked waiter moved on (other workers' waiters held behind it may go now)."""

    concurrent = True

    def __init__(self, board: LoadBoard, row: int, wake_others: Callable[[], None] = lambda: None) -> None:
        super().__init__()
        self._board = board
        self._row = row
        self._cells: Any = board.cells
        self._floats: Any = board.floats
        self._wake_others = wake_others
        self._lock = board.exclusive()
        self._own: dict[Endpoint, int] = {}                  # first cell of the endpoint in this row
        self._cols: dict[Endpoint, tuple[int, ...]] = {}     # first cell of the endpoint in every row
        for i, e in enumerate(board.endpoints):
            self._own[e] = board.cell(row, i, 0)
            self._cols[e] = tuple(board.cell(r, i, 0) for r in range(board.rows))
        self._pending_own = board.row_cell(row, PENDING_DECODE)
        self._pending_all = tuple(board.row_cell(r, PENDING_DECODE) for r in range(board.rows))
        self._waiting_own = board.row_cell(row, WAITING)
        self._head_own = board.row_cell(row, HEAD_BASE)
        self._heads_others = tuple(board.row_cell(r, HEAD_BASE) for r in range(board.rows) if r != row)

    # --- this worker's share (its row; a release after the board is unmapped has nothing left to count)
    def _add(self, cell: int, tokens: int, requests: int) -> None:
        cells = self._cells
        try:
            cells[cell] += tokens
            cells[cell + 1] += requests
        except ValueError:
            pass

    def add_inflight(self, endpoint: Endpoint, tokens: int, requests: int) -> None:
        """Add (or remove) dispatched prompt tokens/requests on ``endpoint`` in this worker's row."""
        base = self._own.get(endpoint)
        if base is None:
            super().add_inflight(endpoint, tokens, requests)
        else:
            self._add(base + INFLIGHT_TOKENS, tokens, requests)

    def add_unleased(self, endpoint: Endpoint, tokens: int, requests: int) -> None:
        """Add (or remove) granted-but-not-leased prompt tokens/requests on ``endpoint`` in this worker's row."""
        base = self._own.get(endpoint)
        if base is None:
            super().add_unleased(endpoint, tokens, requests)
        else:
            self._add(base + UNLEASED_TOKENS, tokens, requests)

    def add_pending_decode(self, tokens: int) -> None:
        """Add (or remove) decoder tokens reserved by this worker's dispatched prefills."""
        try:
            self._cells[self._pending_own] += tokens
        except ValueError:
            pass

    def own_idle(self) -> bool:
        """True when this worker's row holds no reservation (and no per-worker count for an added endpoint)."""
        cells = self._cells
        fields = (INFLIGHT_TOKENS, INFLIGHT_REQUESTS, UNLEASED_TOKENS, UNLEASED_REQUESTS)
        return (super().own_idle() and cells[self._pending_own] == 0
                and not any(cells[base + f] for base in self._own.values() for f in fields))

    # --- totals over every worker
    def _sum(self, endpoint: Endpoint, field: int) -> tuple[int, int] | None:
        bases = self._cols.get(endpoint)
        if bases is None:
            return None
        cells = self._cells
        tokens = requests = 0
        for base in bases:
            tokens += cells[base + field]
            requests += cells[base + field + 1]
        return tokens, requests

    def inflight(self, endpoint: Endpoint) -> tuple[int, int]:
        """``(tokens, requests)`` dispatched to ``endpoint`` and unanswered, all workers."""
        total = self._sum(endpoint, INFLIGHT_TOKENS)
        return total if total is not None else super().inflight(endpoint)

    def unleased(self, endpoint: Endpoint) -> tuple[int, int]:
        """``(tokens, requests)`` granted on ``endpoint`` and not leased yet, all workers."""
        total = self._sum(endpoint, UNLEASED_TOKENS)
        return total if total is not None else super().unleased(endpoint)

    def pending_decode(self) -> int:
        """Decoder tokens reserved by dispatched prefills not yet decoding, all workers."""
        cells = self._cells
        return int(sum(cells[i] for i in self._pending_all)) + super().pending_decode()

    # --- grants and the queue across workers
    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """The board's lock: a grant re-checks the totals and publishes its reservation inside it."""
        return self._lock

    def epoch(self) -> int:
        """The board's grant epoch (header cell, counted up inside the lock by every grant of every worker)."""
        return int(self._cells[GRANT_EPOCH])

    def granted(self) -> None:
        """Count one grant on the board's epoch (inside the lock, after the reservation's cells)."""
        self._cells[GRANT_EPOCH] += 1

    def publish_queue(self, waiting: int, head_base: float | None) -> None:
        """Publish this worker's queue (``waiting`` requests; the ordering base of its first blocked waiter, or
        None); wake the other workers when that head moved on, since their waiters may have been held behind it."""
        try:
            old = self._floats[self._head_own]
            new = 0.0 if head_base is None else head_base + 1.0     # 0.0 (a zeroed row) = nothing blocked
            self._cells[self._waiting_own] = waiting
            self._floats[self._head_own] = new
        except ValueError:
            return
        if old and (not new or new > old):
            self._wake_others()

    def ahead_elsewhere(self, base: float) -> bool:
        """True when another worker's first blocked waiter has a smaller ordering base than ``base`` (it goes
        first: this worker does not grant ahead of it)."""
        floats = self._floats
        mark = base + 1.0
        for i in self._heads_others:
            head = floats[i]
            if head and head < mark:
                return True
        return False
