"""Log lines to a file descriptor without the event loop ever waiting on the reader.

A ``write()`` to a pipe, terminal or socket whose reader has stopped (a terminal paused with Ctrl-S, an ssh
session that hung, ``| less`` not scrolled, a container log driver that fell behind) blocks once the kernel's
buffer is full: written from the event loop, one log line per request froze every request and stream after ~100
requests.  :class:`LineSink` is what the process's log handler (:mod:`pdproxy.ops.logs`) and the request log
(:mod:`pdproxy.ops.reqlog`) write through:

- to a **regular file** a line is written at once, by the caller (a local file takes it from the page cache; a
  file system that hangs — a stuck NFS mount — would still hold the caller: not handled);
- to **anything else** (pipe, terminal, socket, device) the caller only queues the line; one writer thread writes
  the queue in order, blocking there as long as the reader makes it, joining queued lines into writes of at most
  ``PIPE_BUF`` (4,096) bytes — POSIX writes that many bytes to a pipe in one piece, so lines up to that size from
  several processes sharing a pipe (``--workers N``) never interleave (longer ones may, as they always could);
- the queue holds at most ``max_buffer_bytes`` bytes (a single line larger than that is taken when the queue is
  empty: it exists in memory anyway); a line that does not fit is dropped and counted (:attr:`LineSink.dropped`),
  and once the queue has emptied one line saying how many were dropped (``dropped_line(n)``) is written — as
  journald and rsyslog report what their rate limits suppressed, and as Docker's ``mode: non-blocking`` log
  driver drops past its ``max-buffer-size``; lines lost to a write error (the reader closed the pipe) are counted
  too, and ``on_error`` is told once.

Re-entrant writes are safe: a signal handler (SIGTERM's drain logs) or a finalizer run by the garbage collector
may log from inside :meth:`LineSink.write` on the same thread (the lock is re-entrant and no counter is read
across a call).

Cost on the caller per line: one ``write()`` (files), or a lock, an append and a wake-up (the rest).
"""

from __future__ import annotations

import collections
import os
import select
import stat
import threading
from collections.abc import Callable

PIPE_BUF = 4096  # POSIX: a write of at most this many bytes to a pipe is atomic (Linux: 4,096)


class LineSink:
    """Writes whole lines (bytes ending in ``\\n``) to ``fd`` (see module docstring).  ``fd`` stays the caller's
    (never closed here).  Thread-safe and re-entrant; :meth:`close` writes what is queued within ``timeout_s``."""

    def __init__(self, fd: int, *, max_buffer_bytes: int, dropped_line: Callable[[int], bytes],
                 on_error: Callable[[OSError], None] | None = None) -> None:
        self.fd = fd
        self.max_buffer_bytes = max_buffer_bytes
        self.dropped_line = dropped_line
        self.on_error = on_error
        self.dropped = 0          # lines dropped since the start (a running total)
        self.error: OSError | None = None  # the first write error (a closed reader, a full disk), if any
        self._unreported = 0      # dropped lines not yet reported by a dropped_line
        try:
            self._direct = stat.S_ISREG(os.fstat(fd).st_mode)
        except OSError:
            self._direct = False
        self._room = select.poll()   # the writer thread's wait on a non-blocking descriptor (any fd number)
        self._room.register(fd, select.POLLOUT)
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._held: collections.deque[bytes] = collections.deque()
        self._held_bytes = 0
        self._busy = False        # the writer thread has lines in hand: later lines queue behind them
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pdproxy-log-writer", daemon=True)
        self._thread.start()

    @property
    def held_bytes(self) -> int:
        """Bytes queued for the writer thread now."""
        return self._held_bytes

    def write(self, line: bytes) -> bool:
        """Write ``line`` (a regular file) or queue it (module docstring); False when it was dropped (the queue
        is full, the sink is closed, or a file write failed)."""
        with self._lock:
            if self._closed:
                self.dropped += 1
                return False
            if not (self._direct and not self._held and not self._busy):
                return self._queue(line)
            try:
                n = os.write(self.fd, line)
            except OSError as exc:        # a full disk, a file system gone: nothing to wait for
                error, first = exc, self._failed(exc, 1)
            else:
                if n == len(line):
                    return True
                return self._queue(line[n:])   # a short write (a full disk): the rest is queued
        if first and self.on_error is not None:
            self.on_error(error)          # outside the lock: it logs, through a handler of its own
        return False

    def _queue(self, line: bytes) -> bool:
        """Queue ``line`` for the writer thread, or drop it past the bound; the lock is held."""
        size = len(line)
        held = self._held_bytes
        if held and held + size > self.max_buffer_bytes:
            self.dropped += 1
            self._unreported += 1
            self._wake.notify()           # the writer reports it once the queue has emptied
            return False
        self._held_bytes = held + size    # stored before the next call: a re-entrant write reads it fresh
        self._held.append(line)
        self._wake.notify()
        return True

    def close(self, timeout_s: float = 2.0) -> bool:
        """Take no more lines; give the writer thread up to ``timeout_s`` seconds to write what is queued (a
        reader that never comes back loses it).  True when everything was written (the writer thread ended)."""
        with self._lock:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _failed(self, exc: OSError, lines: int) -> bool:
        """``lines`` lines were lost to ``exc``: counted; True for the first error (``on_error`` is told of it,
        by the caller, outside the lock)."""
        self.dropped += lines
        first = self.error is None
        self.error = exc
        return first

    def _take(self) -> tuple[bytes, int]:
        """Queued lines from the front, joined up to ``PIPE_BUF`` bytes (one longer line alone), and how many;
        the lock is held."""
        first = self._held.popleft()
        size = len(first)
        if size >= PIPE_BUF or not self._held:
            self._held_bytes -= size
            return first, 1
        parts = [first]
        while self._held and size + len(self._held[0]) <= PIPE_BUF:
            nxt = self._held.popleft()
            parts.append(nxt)
            size += len(nxt)
        self._held_bytes -= size
        return b"".join(parts), len(parts)

    def _run(self) -> None:
        """The writer thread: write queued lines in order (blocking here as long as the reader makes it), and
        the dropped-lines report whenever the queue has emptied after drops (formatted outside the lock, which a
        logging handler's own lock is taken before)."""
        while True:
            with self._lock:
                while not self._held and not self._unreported:
                    self._busy = False
                    if self._closed:
                        return
                    self._wake.wait()
                self._busy = True         # a regular file's callers queue behind what is in hand
                report = 0
                if self._held:
                    data, lines = self._take()
                else:
                    report, self._unreported = self._unreported, 0
            if report:
                try:
                    data, lines = self.dropped_line(report), 0
                except Exception:         # a formatter that failed: the count still goes out
                    data, lines = b"%d log lines dropped\n" % report, 0
            view = memoryview(data)
            while view:
                try:
                    n = os.write(self.fd, view)
                except BlockingIOError:   # a descriptor someone made non-blocking: wait for room here
                    self._room.poll(1000)
                    continue
                except OSError as exc:    # the reader closed its end: this piece is lost, and counted
                    with self._lock:
                        first = self._failed(exc, lines)
                    if first and self.on_error is not None:
                        try:
                            self.on_error(exc)
                        except Exception:
                            pass          # the writer thread outlives a failing error report
                    break
                view = view[n:]
