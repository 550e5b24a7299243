"""Log lines to a file descriptor without ever blocking the event loop on it.

A ``write()`` to a pipe whose reader has stopped (a terminal paused with Ctrl-S, ``| less`` not scrolled, a
container log driver that fell behind) blocks once the pipe's buffer (64 KiB on Linux) is full: written from the
event loop, one log line per request froze every request and stream after ~100 requests.  :class:`LineSink`
is what the process's log handler (:mod:`pdproxy.ops.logs`) and the request log (:mod:`pdproxy.ops.reqlog`)
write through:

- a line is written at once, by the caller, while nothing is held back and the descriptor takes it without
  waiting: a regular file always; a pipe or socket when ``poll()`` says it is writable and the line is at most
  ``PIPE_BUF`` (4,096) bytes — POSIX writes that many bytes to a pipe in one piece, and only when there is room;
- otherwise the line is held, in order, in a buffer of at most ``max_buffer_bytes`` bytes that one writer thread
  empties (blocking there, never on the loop), joining held lines into writes of at most ``PIPE_BUF`` bytes so
  that lines of several processes sharing a pipe (``--workers N``) never interleave;
- a line that does not fit the buffer is dropped and counted (:attr:`LineSink.dropped`); when the buffer has
  been emptied again, one line saying how many were dropped (``dropped_line(n)``) is written — as journald and
  rsyslog report what their rate limits suppressed, and as Docker's ``mode: non-blocking`` log driver drops past
  its ``max-buffer-size``.

Cost on the loop per line: one ``poll()`` (pipes only) and one ``write()``, as before; nothing when held.
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
    (never closed here).  Thread-safe; :meth:`close` writes what is held within ``timeout_s`` seconds."""

    def __init__(self, fd: int, *, max_buffer_bytes: int, dropped_line: Callable[[int], bytes]) -> None:
        self.fd = fd
        self.max_buffer_bytes = max_buffer_bytes
        self.dropped_line = dropped_line
        self.dropped = 0          # lines dropped since the start (a running total)
        self._unreported = 0      # dropped lines not yet reported by a dropped_line
        self.error: OSError | None = None  # the last write error (a closed descriptor, a full disk), if any
        try:
            self._regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except OSError:
            self._regular = False
        self._poll = select.poll()
        self._poll.register(fd, select.POLLOUT)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._held: collections.deque[bytes] = collections.deque()
        self._held_bytes = 0
        self._busy = False        # the writer thread has lines in hand: later lines wait behind them
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def held_bytes(self) -> int:
        """Bytes held for the writer thread now."""
        return self._held_bytes

    def write(self, line: bytes) -> bool:
        """Write ``line`` now or hold it (module docstring); False when it was dropped (buffer full, or closed)."""
        with self._lock:
            if self._closed:
                self.dropped += 1
                return False
            if not self._held and not self._busy and (
                    self._regular or (len(line) <= PIPE_BUF and self._poll.poll(0))):
                try:
                    n = os.write(self.fd, line)
                except BlockingIOError:   # a descriptor someone made non-blocking: hold the line instead
                    n = 0
                except OSError as exc:
                    self.error = exc      # a closed or broken descriptor, a full disk: nothing to wait for
                    self.dropped += 1
                    return False
                if n == len(line):
                    return True
                line = line[n:]           # a short write (a full disk, a non-blocking pipe): the rest is held
            if self._held_bytes + len(line) > self.max_buffer_bytes:
                self.dropped += 1
                self._unreported += 1
                return False
            self._held.append(line)
            self._held_bytes += len(line)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pdproxy-log-writer", daemon=True)
                self._thread.start()
            self._wake.notify()
            return True

    def close(self, timeout_s: float = 2.0) -> None:
        """Take no more lines; give the writer thread up to ``timeout_s`` seconds to write what is held (a reader
        that never comes back loses it)."""
        with self._lock:
            self._closed = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _take(self) -> bytes:
        """Held lines from the front, joined up to ``PIPE_BUF`` bytes (one longer line alone); lock held."""
        first = self._held.popleft()
        size = len(first)
        if size >= PIPE_BUF or not self._held:
            self._held_bytes -= size
            return first
        parts = [first]
        while self._held and size + len(self._held[0]) <= PIPE_BUF:
            nxt = self._held.popleft()
            parts.append(nxt)
            size += len(nxt)
        self._held_bytes -= size
        return b"".join(parts)

    def _run(self) -> None:
        """The writer thread: write held lines in order, blocking here as long as the reader makes it."""
        while True:
            with self._lock:
                while not self._held and not self._closed:
                    if self._unreported:
                        note, self._unreported = self.dropped_line(self._unreported), 0
                        self._held.append(note)
                        self._held_bytes += len(note)
                        break
                    self._busy = False
                    self._wake.wait()
                if not self._held:
                    self._busy = False
                    return    # closed and empty
                self._busy = True
                data = self._take()
            view = memoryview(data)
            while view:
                try:
                    n = os.write(self.fd, view)
                except BlockingIOError:
                    select.select([], [self.fd], [], 1.0)
                    continue
                except OSError as exc:
                    self.error = exc  # the descriptor is gone: this piece is lost, as a write failed on the loop
                    break
                view = view[n:]
