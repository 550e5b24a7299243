"""LoadBoard: one load view across the worker processes of ``pdproxy serve --workers N``, with no IPC per request.

Each worker process has its own event loop, pool and leases.  Without sharing, worker A would route as if
worker B's requests did not exist, and two workers would pile onto the same decoder.  The board is a small
table of int64 cells in a memory-mapped file that every worker maps::

    header : MAGIC, VERSION, rows, endpoints, fingerprint, 0, 0, 0
    row r  : owner_pid, ready, then (in-flight requests, in-flight tokens) per endpoint

Rules that make it lock-free:

- every worker owns exactly one row and is the **only writer** of that row (its leases add and subtract there);
- readers (the scheduler's scores) **sum a column** over all rows;
- cells are 8-byte aligned int64; an aligned 8-byte store or load is one instruction on x86-64 and arm64, so a
  reader never sees a torn value — at worst a sum a few microseconds old, which any balancer's view is anyway;
- the supervisor (:mod:`pdproxy.workers`) zeroes the row of a worker that died, since its leases died with it.

Units: requests are counts, tokens are tokens (the same quantities :class:`pdproxy.pool.EndpointLoad` keeps).
Endpoints are identified by position in ``Settings.all_endpoints()``; a fingerprint of their names guards
against a worker started with different settings.  Endpoints added later through the admin API are not on
the board and keep a per-worker count.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import zlib
from pathlib import Path
from typing import Any

from pdproxy.endpoints import Endpoint
from pdproxy.pool import EndpointLoad, EndpointPool

MAGIC = 0x5044_5058_4C42_0001  # "PDPXLB" + version
_HEADER = 8
_ROW_META = 2  # owner_pid, ready
_CELL = 8


def fingerprint(endpoints: list[Endpoint]) -> int:
    """A 32-bit checksum of the endpoint list (roles and names, in order)."""
    return zlib.crc32("\n".join(f"{e.role.value} {e.name}" for e in endpoints).encode())


class LoadBoard:
    """The memory-mapped table (see module docstring).  Use as a context manager; ``close()`` unmaps.

    ``rows``: worker slots; ``endpoints``: the endpoint list every worker routes over.
    Raises ``ValueError`` from :meth:`attach` when the file does not match ``endpoints``.
    """

    def __init__(self, path: Path, endpoints: list[Endpoint], rows: int, *, create: bool) -> None:
        self.path = Path(path)
        self.endpoints = list(endpoints)
        self.rows = rows
        self.row_cells = _ROW_META + 2 * len(self.endpoints)
        size = (_HEADER + rows * self.row_cells) * _CELL
        if create:
            with open(self.path, "wb") as f:
                f.truncate(size)
        with open(self.path, "r+b") as f:
            if os.fstat(f.fileno()).st_size != size:
                raise ValueError(f"load board {self.path} was made for other settings (not {len(self.endpoints)} "
                                 f"endpoints × {rows} rows)")
            self._mm = mmap.mmap(f.fileno(), size)
        self.cells: Any = memoryview(self._mm).cast("q")
        if create:
            for i, v in enumerate((MAGIC, 1, rows, len(self.endpoints), fingerprint(self.endpoints))):
                self.cells[i] = v
        elif (self.cells[0], self.cells[2], self.cells[3], self.cells[4]) != (
                MAGIC, rows, len(self.endpoints), fingerprint(self.endpoints)):
            self.close()
            raise ValueError(f"load board {self.path} was made for other settings (endpoints or workers differ)")

    @classmethod
    def create(cls, path: Path, endpoints: list[Endpoint], rows: int) -> LoadBoard:
        """Create (or overwrite) the board file, all cells zero."""
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
        """Unmap (idempotent).  Views handed out earlier must not be used afterwards."""
        if self.cells is not None:
            self.cells.release()
            self.cells = None
            self._mm.close()

    # --- layout -----------------------------------------------------------------------------------------------
    def _base(self, row: int) -> int:
        if not 0 <= row < self.rows:
            raise IndexError(f"row {row} outside 0..{self.rows - 1}")
        return _HEADER + row * self.row_cells

    def cell(self, row: int, endpoint_index: int, field: int) -> int:
        """Absolute cell index of ``field`` (0 = requests, 1 = tokens) of one endpoint in one row."""
        return self._base(row) + _ROW_META + 2 * endpoint_index + field

    # --- supervisor side --------------------------------------------------------------------------------------
    def claim(self, row: int, pid: int) -> None:
        """Give ``row`` to process ``pid``, zeroed (a fresh worker holds no leases)."""
        base = self._base(row)
        for i in range(base + _ROW_META, base + self.row_cells):
            self.cells[i] = 0
        self.cells[base + 1] = 0
        self.cells[base] = pid

    def set_owner(self, row: int, pid: int) -> None:
        """Record the pid owning ``row`` (after :meth:`clear`, once the worker process exists)."""
        self.cells[self._base(row)] = pid

    def clear(self, row: int) -> None:
        """Zero a dead worker's row: its leases died with it."""
        self.claim(row, 0)

    def mark_ready(self, row: int) -> None:
        """Flag ``row``'s worker as serving (set by the worker once uvicorn started).  Raises ``IndexError`` for
        a row outside the board."""
        self.cells[self._base(row) + 1] = 1

    def owner(self, row: int) -> tuple[int, bool]:
        """``(owner pid, ready)`` of a row (pid 0 = free)."""
        base = self._base(row)
        return int(self.cells[base]), bool(self.cells[base + 1])

    def row_totals(self, row: int) -> tuple[int, int]:
        """``(in-flight requests, in-flight tokens)`` summed over the endpoints of one worker's row."""
        base = self._base(row) + _ROW_META
        values = self.cells[base:base + 2 * len(self.endpoints)]
        return sum(values[0::2]), sum(values[1::2])

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

    @property  # type: ignore[override]
    def requests(self) -> int:
        """In-flight requests this worker holds on the endpoint (shared-memory cell; 0 once the board is unmapped)."""
        return self._get(self._ri)

    @requests.setter
    def requests(self, value: int) -> None:
        """Write this worker's in-flight request count (ignored once the board is unmapped)."""
        self._set(self._ri, value)

    @property  # type: ignore[override]
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
    row (read-only); every other attribute reads and writes the local :class:`RowLoad`."""

    __slots__ = ("_cells", "_local", "_rcells", "_tcells")

    def __init__(self, local: RowLoad, cells: Any, requests_cells: tuple[int, ...],
                 tokens_cells: tuple[int, ...]) -> None:
        object.__setattr__(self, "_local", local)
        object.__setattr__(self, "_cells", cells)
        object.__setattr__(self, "_rcells", requests_cells)
        object.__setattr__(self, "_tcells", tokens_cells)

    @property  # type: ignore[override]
    def requests(self) -> int:
        """In-flight requests on the endpoint summed over every worker's row (read-only)."""
        return sum(map(self._cells.__getitem__, self._rcells))

    @property  # type: ignore[override]
    def tokens(self) -> int:
        """In-flight tokens on the endpoint summed over every worker's row (read-only)."""
        return sum(map(self._cells.__getitem__, self._tcells))

    def __getattr__(self, name: str) -> Any:  # unset inherited slots (healthy, draining, …) → the local row
        return getattr(object.__getattribute__(self, "_local"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("requests", "tokens"):
            raise AttributeError(f"{name} is a sum over workers; leases change it through their own row")
        setattr(self._local, name, value)


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
            local = RowLoad(board.cells, board.cell(row, i, 0), board.cell(row, i, 1))
            self._loads[e] = local
            rows = range(board.rows)
            self._views[e] = TotalLoad(local, board.cells, tuple(board.cell(r, i, 0) for r in rows),
                                       tuple(board.cell(r, i, 1) for r in rows))

    def load(self, endpoint: Endpoint) -> EndpointLoad:
        """The all-worker :class:`TotalLoad` of ``endpoint`` (the process-local load for one added after start).
        Raises ``KeyError`` for an unknown endpoint."""
        view = self._views.get(endpoint)
        return view if view is not None else self._loads[endpoint]

    def remove(self, endpoint: Endpoint) -> None:
        """Forget ``endpoint`` and its all-worker view; an unknown endpoint is ignored."""
        super().remove(endpoint)
        self._views.pop(endpoint, None)
