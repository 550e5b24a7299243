"""WorkerShare: what one worker of ``pdproxy serve --workers N`` shares with the others, handed to its state.

:meth:`ProxyState.build <pdproxy.app.state.ProxyState.build>` asks it for the parts that live on the load board
(pdproxy/workers/board.py) instead of in the process:

- the pool (:class:`~pdproxy.workers.board.SharedEndpointPool`: in-flight requests and tokens, summed over workers);
- the prefill ledger's counts (:class:`~pdproxy.workers.ledger.BoardLedgerCounts`: one budget, one KV-pool guard,
  one decoder reservation for all workers, grants re-checked inside the board's lock);
- the breakers (:class:`~pdproxy.workers.breaker.BoardBreaker`: one state per endpoint for all workers);
- the wake-ups (:class:`~pdproxy.workers.wakeup.WakeChannels`): a release here wakes the other workers that have waiters.

What stays per worker: the health probes and ``healthy`` flags, engine info, the prefill queue's waiters (each
worker orders its own), the request path itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pdproxy.endpoints import Endpoint
from pdproxy.engines.breaker import CircuitBreaker, Clock
from pdproxy.engines.pool import EndpointPool
from pdproxy.scheduling.queue import PrefillLedger
from pdproxy.workers.board import WAITING, LoadBoard, SharedEndpointPool
from pdproxy.workers.breaker import BoardBreaker
from pdproxy.workers.ledger import BoardLedgerCounts
from pdproxy.workers.wakeup import WakeChannels


class WorkerShare:
    """Worker ``row``'s view of ``board`` and the wake-up FIFOs ``wake`` (see module docstring)."""

    def __init__(self, board: LoadBoard, row: int, wake: WakeChannels) -> None:
        self.board = board
        self.row = row
        self.wake = wake
        self._cells: Any = board.cells
        self._waiting = [(r, board.row_cell(r, WAITING)) for r in range(board.rows) if r != row]

    def pool(self, endpoints: list[Endpoint]) -> SharedEndpointPool:
        """The worker's pool on the board.  Raises ``ValueError`` when ``endpoints`` are not the board's."""
        return self.board.pool(endpoints, self.row)

    def ledger_counts(self) -> BoardLedgerCounts:
        """The prefill ledger's counts on the board (this worker's row)."""
        return BoardLedgerCounts(self.board, self.row, self.wake_waiting)

    def make_breaker(self, endpoint: Endpoint, *, failure_threshold: int, open_s: float, max_open_s: float,
                     clock: Clock) -> CircuitBreaker:
        """``endpoint``'s shared breaker (a per-worker one for an endpoint not on the board)."""
        index = self.board.index(endpoint)
        if index is None:
            return CircuitBreaker(failure_threshold=failure_threshold, open_s=open_s, max_open_s=max_open_s,
                                  clock=clock)
        return BoardBreaker(self.board, index, self.row, failure_threshold=failure_threshold, open_s=open_s,
                            max_open_s=max_open_s, clock=clock)

    def connect(self, pool: EndpointPool, ledger: PrefillLedger) -> None:
        """Wake the other workers' waiters whenever this worker gives capacity back (a lease or a slot)."""
        pool.add_release_listener(self.wake_waiting)
        ledger.add_listener(self.wake_waiting)

    def wake_waiting(self) -> None:
        """Wake every other worker whose queue has waiters (one cell read per worker; a write per waiting one)."""
        cells = self._cells
        try:
            for row, cell in self._waiting:
                if cells[cell] > 0:
                    self.wake.wake(row)
        except ValueError:            # the board is unmapped (worker exiting)
            return

    def listen(self, on_wake: Callable[[], None]) -> None:
        """Run ``on_wake()`` (the queue's re-check) when another worker wakes this one; needs the running loop."""
        self.wake.listen(on_wake)

    def close(self) -> None:
        """Stop listening and close the FIFOs (the board itself is closed by its owner)."""
        self.wake.close()
