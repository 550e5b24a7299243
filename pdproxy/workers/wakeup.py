"""Wake-ups between the workers of ``pdproxy serve --workers N``: one named pipe per worker in the run directory.

A worker's prefill queue re-checks its waiters synchronously when this worker releases capacity (its own lease
and slot releases).  A release in another worker frees the same shared capacity (pdproxy/workers/ledger.py) but
is not seen by this worker's listeners, so each worker reads a FIFO ``wake.<row>``; a worker that released
capacity writes one byte to the FIFO of every other worker whose board row says it has waiters (a cell read per
other worker when none waits: no system call on the common path), and the reader's event loop runs the queue's
re-check (:meth:`~pdproxy.scheduling.queue.PrefillQueue.notify`) once per batch of bytes.  The queue's poll stays the
safety net for a lost wake-up.

Costs (loadtest/workers_bench.py, busy 2-core machine): a wake is one non-blocking ``write`` (≈ 1 µs) in the
releasing worker and an event-loop reader callback plus a ``read`` in the woken one; the waiting request in the
other process is granted ≈ 0.08 ms after the release at p50 (≈ 3 ms at p99), against the poll's 250 ms.  A full
pipe (64 KiB of unread wakes) drops the byte, which loses nothing since the reader re-checks everything anyway.  The reader opens its FIFO read-write, so it
never sees end-of-file when writers come and go; a writer whose reader is gone (``ENXIO``/``EPIPE``) drops the
wake and reopens next time (the replacement worker reads the same FIFO).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path


def fifo_path(run_dir: Path, row: int) -> Path:
    """Where worker ``row``'s wake-up FIFO lives."""
    return run_dir / f"wake.{row}"


def create_fifos(run_dir: Path, rows: int) -> None:
    """Make one FIFO per worker row in ``run_dir`` (the supervisor does, before spawning workers)."""
    for row in range(rows):
        path = fifo_path(run_dir, row)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        os.mkfifo(path, 0o600)


class WakeChannels:
    """The wake-up FIFOs of ``rows`` workers in ``run_dir``, used by worker ``row`` (None: the supervisor, which
    only writes).  :meth:`listen` starts reading this worker's FIFO on the running loop; :meth:`wake` writes to
    another worker's; :meth:`close` closes everything (idempotent)."""

    def __init__(self, run_dir: Path, rows: int, row: int | None) -> None:
        self.run_dir = Path(run_dir)
        self.rows = rows
        self.row = row
        self._writers: dict[int, int] = {}
        self._reader: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.sent = 0
        self.received = 0

    def listen(self, on_wake: Callable[[], None]) -> None:
        """Call ``on_wake()`` on the running loop whenever another worker wakes this one (bytes coalesced)."""
        assert self.row is not None, "the supervisor has no FIFO of its own"
        fd = os.open(fifo_path(self.run_dir, self.row), os.O_RDWR | os.O_NONBLOCK)
        self._reader = fd
        self._loop = asyncio.get_running_loop()

        def readable() -> None:              # level-triggered: bytes left over call it again
            try:
                os.read(fd, 65536)
            except BlockingIOError:
                return
            self.received += 1
            on_wake()

        self._loop.add_reader(fd, readable)

    def wake(self, row: int) -> None:
        """Wake worker ``row`` (one byte into its FIFO); never raises and never blocks."""
        fd = self._writers.get(row)
        if fd is None:
            try:
                fd = os.open(fifo_path(self.run_dir, row), os.O_WRONLY | os.O_NONBLOCK)
            except OSError:                   # ENXIO: nobody reads it (worker starting or gone); ENOENT: stopping
                return
            self._writers[row] = fd
        try:
            os.write(fd, b"\0")
            self.sent += 1
        except BlockingIOError:               # full: plenty of wakes pending already
            pass
        except OSError as exc:                # EPIPE: its reader died; reopen next time
            if exc.errno in (errno.EPIPE, errno.EBADF):
                self._writers.pop(row, None)
                with contextlib.suppress(OSError):
                    os.close(fd)

    def wake_all(self) -> None:
        """Wake every worker but this one."""
        for row in range(self.rows):
            if row != self.row:
                self.wake(row)

    def close(self) -> None:
        """Stop reading and close every FIFO descriptor."""
        if self._reader is not None:
            if self._loop is not None and not self._loop.is_closed():
                with contextlib.suppress(Exception):
                    self._loop.remove_reader(self._reader)
            with contextlib.suppress(OSError):
                os.close(self._reader)
            self._reader = None
            self._loop = None
        for fd in self._writers.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._writers.clear()
