"""LoadBoard: what the worker processes of ``pdproxy serve --workers N`` share, with no IPC per request.

Each worker process has its own event loop, pool, prefill queue and leases.  Without sharing, worker A would route
as if worker B's requests did not exist, admit its own prefill budget, and find a dead engine on its own.  The
board is a small table of 8-byte cells in a memory-mapped file that every worker maps::

    header          : MAGIC, VERSION, rows, endpoints, fingerprint, grant_epoch, 0, 0
    row r           : owner_pid, ready, waiting, head_base, pending_decode,
                      then per endpoint: requests, tokens, inflight_tokens, inflight_requests,
                                         unleased_tokens, unleased_requests, trials
    breaker e       : state, consecutive_failures, opened_total, reopen_count, opened_at, retry_until, open_for_s

- a **row** belongs to one worker, which is its **only writer**; readers **sum a column** over all rows.  Load
  (``requests``, ``tokens``: :class:`SharedEndpointPool`), the prefill ledger's reservations (``inflight_*``,
  ``unleased_*``, ``pending_decode``: :mod:`pdproxy.workers.ledger`), the half-open ``trials`` a worker holds
  (:mod:`pdproxy.workers.breaker`), and its prefill queue's ``waiting`` count and ``head_base`` (the ordering key of
  its first blocked waiter) live there;
- a **breaker record** per endpoint is shared by all workers: it is written only inside :meth:`LoadBoard.exclusive`
  (rare: failures and state changes) and read without it; so is the header's ``grant_epoch``, counted up by every
  prefill grant (:mod:`pdproxy.workers.ledger`);
- cells are 8-byte aligned int64 (or float64: ``head_base``, ``opened_at``, ``retry_until``, ``open_for_s``); an
  aligned 8-byte store or load is one instruction on x86-64 and arm64, so a reader never sees a torn value — at
  worst a sum a few microseconds old;
- :meth:`LoadBoard.exclusive` is an ``flock`` on the board file: the kernel drops it when its holder dies, so a
  killed worker never leaves it held.  The grant path takes it once per prefill grant (≈ 1 µs uncontended);
- the supervisor (:mod:`pdproxy.app.supervisor`) zeroes the row of a worker that died, since its leases, reservations and
  trials died with it.

Units: requests are counts, tokens are tokens, times are ``time.monotonic()`` seconds (``CLOCK_MONOTONIC`` is one
clock for every process of the machine).  Endpoints are identified by position in ``Settings.all_endpoints()``; a
fingerprint of their names guards against a worker started with different settings.  Endpoints added later through
the admin API are not on the board and keep per-worker counts.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import zlib
from pathlib import Path
from typing import Any

from pdproxy.endpoints import Endpoint
from pdproxy.engines.pool import EndpointLoad, EndpointPool

MAGIC = 0x5044_5058_4C42_0002  # "PDPXLB" + layout version
_HEADER = 8
GRANT_EPOCH = 5            # header cell
_CELL = 8

# Row cells (offset from the row's first cell).
OWNER_PID, READY, WAITING, HEAD_BASE, PENDING_DECODE = range(5)
_ROW_META = 5
# Per-endpoint cells in a row (offset from the endpoint's first cell in that row).
REQUESTS, TOKENS, INFLIGHT_TOKENS, INFLIGHT_REQUESTS, UNLEASED_TOKENS, UNLEASED_REQUESTS, TRIALS = range(7)
_ENDPOINT_CELLS = 7
# Shared breaker record per endpoint (offset from the record's first cell); the last three are float64.
B_STATE, B_FAILURES, B_OPENED_TOTAL, B_REOPEN_COUNT, B_OPENED_AT, B_RETRY_UNTIL, B_OPEN_FOR_S = range(7)
_BREAKER_CELLS = 7


class BoardLock:
    """``flock`` on the board file as a re-entrant context manager (a class, not a generator: it is on the grant
    path).  The kernel releases it if the holding process dies."""

    __slots__ = ("_depth", "_fd")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._depth = 0

    def __enter__(self) -> None:
        if self._depth == 0:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._depth += 1

    def __exit__(self, *exc: object) -> None:
        self._depth -= 1
        if self._depth == 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)


def fingerprint(endpoints: list[Endpoint]) -> int:
    """A 32-bit checksum of the endpoint list (roles and names, in order)."""
    return zlib.crc32("\n".join(f"{e.role.value} {e.name}" for e in endpoints).encode())


class LoadBoard:
    """The memory-mapped table (see module docstring).  Use as a context manager; ``close()`` unmaps.

    ``rows``: worker slots; ``endpoints``: the endpoint list every worker routes over.  ``cells`` (int64) and
    ``floats`` (float64) are two views of the same cells.  Raises ``ValueError`` from :meth:`attach` when the file
    does not match ``endpoints``.
    """

    def __init__(self, path: Path, endpoints: list[Endpoint], rows: int, *, create: bool) -> None:
        self.path = Path(path)
        self.endpoints = list(endpoints)
        self.rows = rows
        self.row_cells = _ROW_META + _ENDPOINT_CELLS * len(self.endpoints)
        self._breakers_at = _HEADER + rows * self.row_cells
        size = (self._breakers_at + _BREAKER_CELLS * len(self.endpoints)) * _CELL
        if create:
            with open(self.path, "wb") as f:
                f.truncate(size)
        self._fd = os.open(self.path, os.O_RDWR)       # kept open: mmap and the exclusive() lock
        if os.fstat(self._fd).st_size != size:
            os.close(self._fd)
            raise ValueError(f"load board {self.path} was made for other settings (not {len(self.endpoints)} "
                             f"endpoints × {rows} rows)")
        self._mm = mmap.mmap(self._fd, size)
        self.cells: Any = memoryview(self._mm).cast("q")
        self.floats: Any = memoryview(self._mm).cast("d")
        self._lock = BoardLock(self._fd)
        if create:
            for i, v in enumerate((MAGIC, 1, rows, len(self.endpoints), fingerprint(self.endpoints))):
                self.cells[i] = v
        elif (self.cells[0], self.cells[2], self.cells[3], self.cells[4]) != (
                MAGIC, rows, len(self.endpoints), fingerprint(self.endpoints)):
            self.close()
            raise ValueError(f"load board {self.path} was made for other settings (endpoints or workers differ)")

    @classmethod
    def create(cls, path: Path, endpoints: list[Endpoint], rows: int) -> LoadBoard:
        """Create (or overwrite) the board file, all cells zero (every breaker closed)."""
        return cls(path, endpoints, rows, create=True)

    @classmethod
    def attach(cls, path: Path, endpoints: list[Endpoint], rows: int) -> LoadBoard:
        """Map an existing board.  Raises ``ValueError`` if it was made for other endpoints or rows."""
        return cls(path, endpoints, rows, create=False)

    def __enter__(self) -> LoadBoard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmap and close (idempotent).  Views handed out earlier must not be used afterwards (they raise
        ``ValueError``, which the row writers swallow)."""
        if self.cells is not None:
            self.cells.release()
            self.floats.release()
            self.cells = self.floats = None
            self._mm.close()
            os.close(self._fd)

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran."""
        return self.cells is None

    # --- layout -----------------------------------------------------------------------------------------------
    def _base(self, row: int) -> int:
        if not 0 <= row < self.rows:
            raise IndexError(f"row {row} outside 0..{self.rows - 1}")
        return _HEADER + row * self.row_cells

    def row_cell(self, row: int, field: int) -> int:
        """Absolute cell index of a row field (``WAITING``, ``HEAD_BASE``, ``PENDING_DECODE`` …)."""
        return self._base(row) + field

    def cell(self, row: int, endpoint_index: int, field: int) -> int:
        """Absolute cell index of ``field`` (``REQUESTS``, ``TOKENS``, ``INFLIGHT_TOKENS`` …) of one endpoint in one
        row."""
        return self._base(row) + _ROW_META + _ENDPOINT_CELLS * endpoint_index + field

    def column(self, endpoint_index: int, field: int) -> tuple[int, ...]:
        """The cell of ``field`` of one endpoint in every row (what a reader sums)."""
        return tuple(self.cell(r, endpoint_index, field) for r in range(self.rows))

    def breaker_cell(self, endpoint_index: int, field: int) -> int:
        """Absolute cell index of ``field`` (``B_STATE`` … ``B_OPEN_FOR_S``) of one endpoint's shared breaker."""
        if not 0 <= endpoint_index < len(self.endpoints):
            raise IndexError(f"endpoint {endpoint_index} outside 0..{len(self.endpoints) - 1}")
        return self._breakers_at + _BREAKER_CELLS * endpoint_index + field

    def index(self, endpoint: Endpoint) -> int | None:
        """Position of ``endpoint`` on the board; None for one that is not on it (added through the admin API)."""
        try:
            return self.endpoints.index(endpoint)
        except ValueError:
            return None

    # --- the one lock -----------------------------------------------------------------------------------------
    def exclusive(self) -> BoardLock:
        """The board's cross-process lock, for a ``with`` block (``flock(LOCK_EX)`` on the board file; re-entrant
        within a process; blocks the calling thread while another process holds it).  For check-then-publish
        sections only: a prefill grant, a breaker transition."""
        return self._lock

    # --- supervisor side --------------------------------------------------------------------------------------
    def claim(self, row: int, pid: int) -> None:
        """Give ``row`` to process ``pid``, zeroed (a fresh worker holds no leases, reservations or trials)."""
        base = self._base(row)
        for i in range(base + 1, base + self.row_cells):
            self.cells[i] = 0
        self.cells[base + OWNER_PID] = pid

    def set_owner(self, row: int, pid: int) -> None:
        """Record the pid owning ``row`` (after :meth:`clear`, once the worker process exists)."""
        self.cells[self._base(row) + OWNER_PID] = pid

    def clear(self, row: int) -> None:
        """Zero a dead worker's row: its leases, reservations, trials and waiters died with it."""
        self.claim(row, 0)

    def mark_ready(self, row: int) -> None:
        """Flag ``row``'s worker as serving (set by the worker once uvicorn started).  Raises ``IndexError`` for
        a row outside the board."""
        self.cells[self._base(row) + READY] = 1

    def owner(self, row: int) -> tuple[int, bool]:
        """``(owner pid, ready)`` of a row (pid 0 = free)."""
        base = self._base(row)
        return int(self.cells[base + OWNER_PID]), bool(self.cells[base + READY])

    def row_totals(self, row: int) -> tuple[int, int]:
        """``(in-flight requests, in-flight tokens)`` summed over the endpoints of one worker's row."""
        cells = self.cells
        n = len(self.endpoints)
        return (sum(cells[self.cell(row, i, REQUESTS)] for i in range(n)),
                sum(cells[self.cell(row, i, TOKENS)] for i in range(n)))

    def waiting(self, row: int) -> int:
        """Requests waiting in worker ``row``'s prefill queue (as it last published)."""
        return int(self.cells[self._base(row) + WAITING])

    # --- worker side ------------------------------------------------------------------------------------------
    def pool(self, endpoints: list[Endpoint], row: int) -> SharedEndpointPool:
        """The pool a worker uses: its leases write ``row``; its scheduler reads sums over all rows."""
        if fingerprint(endpoints) != fingerprint(self.endpoints):
            raise ValueError("worker endpoints differ from the load board's")
        return SharedEndpointPool(self, endpoints, row)


class RowLoad(EndpointLoad):
    """An endpoint's load in this worker's row: ``requests`` / ``tokens`` live in shared memory (single writer);
    the other fields (health, draining, lifetime counters) stay process-local."""

    __slots__ = ("_cells", "_ri", "_ti")

    def __init__(self, cells: Any, requests_cell: int, tokens_cell: int) -> None:
        self._cells = cells
        self._ri = requests_cell
        self._ti = tokens_cell
        super().__init__(requests=int(cells[requests_cell]), tokens=int(cells[tokens_cell]))  # keep the row as is

    @property
    def requests(self) -> int:
        """In-flight requests this worker holds on the endpoint (shared-memory cell; 0 once the board is unmapped)."""
        return self._get(self._ri)

    @requests.setter
    def requests(self, value: int) -> None:
        """Write this worker's in-flight request count (ignored once the board is unmapped)."""
        self._set(self._ri, value)

    @property
    def tokens(self) -> int:
        """In-flight tokens this worker holds on the endpoint (shared-memory cell; 0 once the board is unmapped)."""
        return self._get(self._ti)

    @tokens.setter
    def tokens(self, value: int) -> None:
        """Write this worker's in-flight token count (ignored once the board is unmapped)."""
        self._set(self._ti, value)

    # A lease released after the board was unmapped (worker exiting) has nothing left to account for.
    def _get(self, cell: int) -> int:
        try:
            return int(self._cells[cell])
        except ValueError:
            return 0

    def _set(self, cell: int, value: int) -> None:
        with contextlib.suppress(ValueError):
            self._cells[cell] = value


class TotalLoad(EndpointLoad):
    """What the scheduler, admission and ``/metrics`` see: ``requests`` / ``tokens`` summed over every worker's
    row (read-only: leases change them through their own row); every other field is the local :class:`RowLoad`'s
    (plain properties: the routing filters read ``healthy`` and ``draining`` for every candidate of every pick)."""

    __slots__ = ("_cells", "_local", "_rcells", "_tcells")
    _cells: Any
    _local: RowLoad
    _rcells: tuple[int, ...]
    _tcells: tuple[int, ...]

    def __init__(self, local: RowLoad, cells: Any, requests_cells: tuple[int, ...],
                 tokens_cells: tuple[int, ...]) -> None:
        self._local = local
        self._cells = cells
        self._rcells = requests_cells
        self._tcells = tokens_cells

    @property
    def requests(self) -> int:
        """In-flight requests on the endpoint summed over every worker's row (read-only)."""
        return int(sum(map(self._cells.__getitem__, self._rcells)))

    @requests.setter
    def requests(self, value: int) -> None:
        raise AttributeError("requests is a sum over workers; leases change it through their own row")

    @property
    def tokens(self) -> int:
        """In-flight tokens on the endpoint summed over every worker's row (read-only)."""
        return int(sum(map(self._cells.__getitem__, self._tcells)))

    @tokens.setter
    def tokens(self, value: int) -> None:
        raise AttributeError("tokens is a sum over workers; leases change it through their own row")

    @property
    def healthy(self) -> bool:
        """This worker's health flag for the endpoint (its own probes)."""
        return self._local.healthy

    @healthy.setter
    def healthy(self, value: bool) -> None:
        self._local.healthy = value

    @property
    def draining(self) -> bool:
        """This worker's draining flag (admin API)."""
        return self._local.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._local.draining = value

    @property
    def leased_total(self) -> int:
        """Leases this worker took on the endpoint (lifetime)."""
        return self._local.leased_total

    @leased_total.setter
    def leased_total(self, value: int) -> None:
        self._local.leased_total = value

    @property
    def released_total(self) -> int:
        """Leases this worker released on the endpoint (lifetime)."""
        return self._local.released_total

    @released_total.setter
    def released_total(self, value: int) -> None:
        self._local.released_total = value


class SharedEndpointPool(EndpointPool):
    """:class:`EndpointPool` whose in-flight counts are shared by all workers through a :class:`LoadBoard`.

    ``lease()`` (inherited) updates this worker's row; ``load(e)`` returns the all-worker :class:`TotalLoad`, so
    scores, admission budgets, ``/debug/load`` and ``/metrics`` show one consistent view.  ``idle()`` and
    ``totals()`` stay per worker (what this process still holds).
    """

    def __init__(self, board: LoadBoard, endpoints: list[Endpoint], row: int) -> None:
        super().__init__(endpoints)
        self.board = board
        self.row = row
        self._views: dict[Endpoint, TotalLoad] = {}
        for i, e in enumerate(endpoints):
            local = RowLoad(board.cells, board.cell(row, i, REQUESTS), board.cell(row, i, TOKENS))
            self._loads[e] = local
            self._views[e] = TotalLoad(local, board.cells, board.column(i, REQUESTS), board.column(i, TOKENS))

    def load(self, endpoint: Endpoint) -> EndpointLoad:
        """The all-worker :class:`TotalLoad` of ``endpoint`` (the process-local load for one added after start).
        Raises ``KeyError`` for an unknown endpoint."""
        view = self._views.get(endpoint)
        return view if view is not None else self._loads[endpoint]

    def remove(self, endpoint: Endpoint) -> None:
        """Forget ``endpoint`` and its all-worker view; an unknown endpoint is ignored."""
        super().remove(endpoint)
        self._views.pop(endpoint, None)
