"""Log lines never stop the event loop: :class:`pdproxy.ops.linesink.LineSink` on real pipes and files, and
``pdproxy serve`` (the real command, default logging: INFO with a request line per request) whose stderr — or
stdout, with ``--request-log-path -`` — nobody reads: before the sink, every request stopped after ~100."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import tty
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from pdproxy.ops.linesink import PIPE_BUF, LineSink
from pdproxy.ops.logs import SinkHandler
from tests.conftest import Fleet
from tests.support import free_port, wait_until

pytestmark = pytest.mark.timeout(60)


def _note(n: int) -> bytes:
    return b"dropped %d\n" % n


@contextlib.contextmanager
def _pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    try:
        yield r, w
    finally:
        os.close(r)
        os.close(w)


def _pipe_room(w: int) -> int:
    return fcntl.fcntl(w, 1032)  # F_GETPIPE_SZ: the pipe's buffer in bytes


def _read_all(r: int, until: bytes) -> bytes:
    """Everything the pipe gives until ``until`` has been read (the writer thread may still be writing)."""
    out = bytearray()
    while until not in out:
        ready, _, _ = select.select([r], [], [], 10.0)
        assert ready, f"nothing more on the pipe after {len(out)} bytes"
        out += os.read(r, 1 << 16)
    return bytes(out)


def _read_reports(r: int, dropped: int) -> tuple[list[bytes], list[int]]:
    """Read until the pipe's drop reports (``dropped N``) add up to ``dropped``: the other lines, and each report's
    count.  A report comes whenever the writer thread has emptied the queue after drops, so a producer that
    outruns the writer thread, then falls behind it (CPU contention decides) gets several reports in one episode,
    each after the lines kept before it."""
    out = bytearray()
    while True:
        lines = bytes(out).splitlines(keepends=True)
        counts = [int(x.split()[1]) for x in lines if x.startswith(b"dropped ") and x.endswith(b"\n")]
        if sum(counts) >= dropped and out.endswith(b"\n"):
            return [x for x in lines if not x.startswith(b"dropped ")], counts
        ready, _, _ = select.select([r], [], [], 10.0)
        assert ready, f"nothing more on the pipe after {len(out)} bytes (reports so far: {counts})"
        out += os.read(r, 1 << 16)


def _line(i: int, size: int = 100) -> bytes:
    """Line ``i``: ``size`` bytes with its newline."""
    head = b"line %06d " % i
    return head + b"x" * (size - len(head) - 1) + b"\n"


def test_a_pipe_gets_its_lines_from_the_writer_thread_in_order() -> None:
    with _pipe() as (r, w):
        sink = LineSink(w, max_buffer_bytes=1 << 16, dropped_line=_note)
        assert sink.write(b"one\n") and sink.write(b"two\n")
        assert _read_all(r, b"two\n") == b"one\ntwo\n"
        assert sink.dropped == 0 and sink.close()


def test_an_unread_pipe_holds_then_drops_and_counts_and_the_reader_gets_every_kept_line_whole() -> None:
    with _pipe() as (r, w):
        room = _pipe_room(w)
        sink = LineSink(w, max_buffer_bytes=20_000, dropped_line=_note)
        n = (room + 20_000) // 100 + 300          # more than the pipe and the buffer hold together
        results = [sink.write(_line(i)) for i in range(n)]   # returns: a blocking write would hang this test
        assert sink.held_bytes <= 20_000
        kept = [i for i, ok in enumerate(results) if ok]
        dropped = [i for i, ok in enumerate(results) if not ok]
        assert dropped and sink.dropped == len(dropped) and len(kept) + len(dropped) == n
        lines, counts = _read_reports(r, len(dropped))
        assert sum(counts) == len(dropped)        # once the queue emptied: how many were lost
        assert lines == [_line(i) for i in kept]   # in order, each whole
        # a second episode reports its own drops, not the running total
        assert sink.write(_line(0)) and _read_all(r, _line(0)) == _line(0)
        results = [sink.write(_line(i)) for i in range(n)]
        again = results.count(False)
        assert again and sink.dropped == len(dropped) + again
        lines, counts = _read_reports(r, again)
        assert sum(counts) == again and lines == [_line(i) for i, ok in enumerate(results) if ok]
        sink.close()


def test_a_line_longer_than_pipe_buf_keeps_its_place() -> None:
    with _pipe() as (r, w):
        sink = LineSink(w, max_buffer_bytes=1 << 20, dropped_line=_note)
        big = b"b" * (3 * PIPE_BUF) + b"\n"
        assert sink.write(big) and sink.write(b"small\n")  # the small one goes behind the big one, not around it
        assert _read_all(r, b"small\n") == big + b"small\n"
        sink.close()


def test_a_line_larger_than_the_buffer_is_taken_alone_and_dropped_behind_others_with_a_report() -> None:
    with _pipe() as (r, w):
        room = _pipe_room(w)
        sink = LineSink(w, max_buffer_bytes=8192, dropped_line=_note)
        huge = b"h" * (room + 50_000) + b"\n"   # more than the pipe and the buffer: nothing else is queued
        assert sink.write(huge)
        wait_until(lambda: sink.held_bytes == 0, 10, 0.01, "the writer thread to take the huge line")
        first = b"f" * 8000 + b"\n"
        assert sink.write(first)                   # the queue was empty: taken
        assert not sink.write(b"y" * 9000 + b"\n")   # behind it: past the buffer, dropped
        # nothing else is ever written: the report still comes once the queue has emptied
        assert _read_all(r, _note(1)) == huge + first + _note(1)
        assert sink.close()


def test_a_regular_file_is_written_by_the_caller_whatever_the_size(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        sink = LineSink(fd, max_buffer_bytes=4096, dropped_line=_note)
        big = b"p" * 100_000 + b"\n"
        assert sink.write(big) and sink.write(b"end\n")
        assert (tmp_path / "log").read_bytes() == big + b"end\n"   # on disk when write() returns
        assert sink.close()
    finally:
        os.close(fd)


def test_close_writes_what_is_queued_and_a_closed_sink_takes_nothing() -> None:
    with _pipe() as (r, w):
        room = _pipe_room(w)
        sink = LineSink(w, max_buffer_bytes=1 << 20, dropped_line=_note)
        n = room // 100 + 50
        assert all(sink.write(_line(i)) for i in range(n))
        assert sink.held_bytes > 0
        got = bytearray()
        reader = threading.Thread(target=lambda: got.extend(_read_all(r, _line(n - 1))))
        reader.start()
        assert sink.close(timeout_s=10)
        reader.join(10)
        assert bytes(got).splitlines(keepends=True) == [_line(i) for i in range(n)]
        assert not sink.write(b"late\n") and sink.dropped == 1


def test_lines_lost_to_a_closed_reader_are_counted_and_said_once() -> None:
    r, w = os.pipe()
    os.close(r)
    errors: list[OSError] = []
    try:
        sink = LineSink(w, max_buffer_bytes=1 << 16, dropped_line=_note, on_error=errors.append)
        assert all(sink.write(_line(i)) for i in range(100))   # queued: the caller never meets the error
        assert sink.close(timeout_s=10)
        assert sink.dropped == 100 and isinstance(sink.error, BrokenPipeError)
        assert len(errors) == 1 and isinstance(errors[0], BrokenPipeError)
    finally:
        os.close(w)


def test_a_write_reentered_on_the_same_thread_neither_deadlocks_nor_loses_lines(tmp_path: Path) -> None:
    """A signal handler (SIGTERM's drain logs) or a finalizer may log from inside ``write`` on the same thread:
    here a real SIGALRM every 0.2 ms logs through the sink the main thread is writing 20,000 lines to."""
    path = tmp_path / "log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    sink = LineSink(fd, max_buffer_bytes=1 << 20, dropped_line=_note)
    fired = [0]

    def on_alarm(signum: int, frame: object) -> None:
        fired[0] += 1
        sink.write(b"signal\n")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.0002, 0.0002)
    try:
        for i in range(20_000):
            sink.write(_line(i, 40))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
        sink.close()
        os.close(fd)
    lines = path.read_bytes().splitlines(keepends=True)
    assert fired[0] > 0 and lines.count(b"signal\n") == fired[0]
    assert [x for x in lines if x != b"signal\n"] == [_line(i, 40) for i in range(20_000)]


def test_a_terminal_nobody_reads_never_holds_the_caller() -> None:
    """``poll()`` says a pty is writable while ``write()`` blocks: lines to a terminal go through the thread."""
    master, slave = pty.openpty()
    try:
        tty.setraw(slave)
        sink = LineSink(slave, max_buffer_bytes=16_384, dropped_line=_note)
        results = [sink.write(_line(i)) for i in range(2_000)]   # ~200 KB: far more than a pty buffers
        kept = [i for i, ok in enumerate(results) if ok]
        assert results.count(False) == sink.dropped > 0
        out = _read_all(master, _note(sink.dropped))
        assert out.splitlines(keepends=True) == [_line(i) for i in kept] + [_note(sink.dropped)]
        assert sink.close()
    finally:
        os.close(master)
        os.close(slave)


def test_another_writer_filling_the_same_pipe_never_holds_the_caller() -> None:
    """Workers and the supervisor share stderr: another process may fill the pipe between any check and a
    write; the caller never writes to a pipe itself, so it never waits for the reader."""
    r, w = os.pipe()
    flood = subprocess.Popen([sys.executable, "-c", f"import os\nwhile True: os.write({w}, b'z' * 3000)"],
                             pass_fds=(w,))
    sink = LineSink(w, max_buffer_bytes=1 << 16, dropped_line=_note)
    try:
        for i in range(5_000):
            sink.write(_line(i, 1000))   # a caller held by the full pipe would hang here
        assert sink.dropped > 0
    finally:
        flood.kill()
        flood.wait(10)
        os.close(r)                      # the writer thread, blocked on the full pipe, fails at once (EPIPE)...
        assert sink.close(timeout_s=10)  # ...and ends before `w` is closed: its number is not reused under it
        os.close(w)


_WRITER = """
import os, sys
from pdproxy.ops.linesink import LineSink
sink = LineSink(1, max_buffer_bytes=1 << 24, dropped_line=lambda n: b"dropped %d\\n" % n)
tag = sys.argv[1].encode()
for i in range(1500):
    sink.write(tag + b" %06d " % i + b"x" * 990 + b"\\n")
assert sink.close(timeout_s=60)
"""


def test_lines_of_two_processes_sharing_a_pipe_never_interleave() -> None:
    """Writes of at most PIPE_BUF bytes are atomic: each process's queued lines are joined up to that size only."""
    with _pipe() as (r, w):
        procs = [subprocess.Popen([sys.executable, "-c", _WRITER, tag], stdout=w, cwd=Path(__file__).parents[2])
                 for tag in ("A", "B")]
        out = bytearray()
        while True:   # a slow reader: small reads keep the pipe full while both write
            ready, _, _ = select.select([r], [], [], 30.0)
            assert ready
            out += os.read(r, 512)
            if out.count(b"\n") >= 3000:
                break
        for p in procs:
            assert p.wait(30) == 0
    lines = bytes(out).splitlines()
    for tag in (b"A", b"B"):
        mine = [x for x in lines if x.startswith(tag + b" ")]
        assert mine == [tag + b" %06d " % i + b"x" * 990 for i in range(1500)]
    assert len(lines) == 3000


def test_the_handler_takes_no_lock_a_finalizer_could_hold_against_its_sink() -> None:
    """A thread holding the handler's lock (``logging.shutdown``, or a finalizer on the sink's writer thread that
    logs while the caller waits for the sink) never holds another thread's record."""
    with _pipe() as (r, w):
        handler = SinkHandler(w, 1 << 16)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log = logging.getLogger("test_linesink.lock")
        log.addHandler(handler)
        log.propagate = False
        held, release = threading.Event(), threading.Event()

        def hold() -> None:
            handler.acquire()
            held.set()
            release.wait(30)
            handler.release()

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert held.wait(10)
            caller = threading.Thread(target=log.warning, args=("through",))
            caller.start()
            caller.join(10)          # the base class's handle() waits here until the holder lets go
            assert not caller.is_alive()
            assert _read_all(r, b"through\n") == b"through\n"
        finally:
            release.set()
            holder.join(10)
            log.removeHandler(handler)
            handler.close()


_PYTHON_REPORTS = """
import gc, sys, threading, warnings
from pdproxy.ops.logs import configure_logging
from pdproxy.settings import load_settings
configure_logging(load_settings(log_buffer_bytes=65536))
warnings.simplefilter("always")
class Bad:
    def __del__(self):
        raise RuntimeError("in __del__")
import logging
for i in range(1500):
    warnings.warn(f"warning {i}")
    Bad()
    gc.collect(0)
    t = threading.Thread(target=lambda: 1 / 0)
    t.start()
    t.join()
    logging.getLogger("x").warning("%d", "not a number")   # a record that fails to format
print("done", flush=True)
"""


def test_python_s_own_reports_go_through_the_sink_and_never_hold_the_caller() -> None:
    """Warnings, exceptions ignored in ``__del__``, uncaught thread exceptions and records that fail to format
    are written by the handler's sink too: with nobody reading stderr the program still ends."""
    proc = subprocess.Popen([sys.executable, "-c", _PYTHON_REPORTS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=Path(__file__).parents[2])
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert _read_all(proc.stdout.fileno(), b"done\n") == b"done\n"   # stderr never read meanwhile
        err = _read_all(proc.stderr.fileno(), b" log lines dropped")
        assert b"py.warnings" in err and b"warning 0" in err
        assert b"Exception ignored" in err and b"in __del__" in err
        assert b"uncaught exception in thread" in err and b"ZeroDivisionError" in err
        assert b"--- logging error in record from x" in err
    finally:
        proc.kill()
        proc.wait(10)


# --- pdproxy serve whose log nobody reads -------------------------------------------------------------------------

def _serve(sims: Fleet, port: int, *args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pdproxy", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--prefill", sims.prefillers[0].url, "--decode", sims.decoders[0].url, "--log-buffer-bytes", "32768",
           *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


@pytest.mark.parametrize("where", ["stderr", "stdout"])
def test_serve_keeps_answering_while_nobody_reads_its_log(sims: Fleet, where: str) -> None:
    port = free_port()
    proc = _serve(sims, port, *(["--request-log-path", "-"] if where == "stdout" else []))
    url = f"http://127.0.0.1:{port}"
    # request lines (~500 bytes each) for twice the pipe's buffer and the sink's 32 KiB together
    n = max(600, 4 * (fcntl.fcntl(proc.stderr.fileno(), 1032) + 32768) // 500) if proc.stderr else 600
    try:
        def up() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url + "/health", timeout=1).status_code == 200
            return False

        wait_until(up, 30, 0.1, "pdproxy serve")
        with httpx.Client(timeout=5) as client:   # a frozen loop fails the first request past the pipe's room
            for i in range(n):
                r = client.post(url + "/v1/completions", headers={"X-Request-Id": f"q{i}"},
                                json={"model": "sim-model", "prompt": "hello there", "max_tokens": 2})
                assert r.status_code == 200, r.text
            assert client.get(url + "/metrics").status_code == 200
        pipe = proc.stdout if where == "stdout" else proc.stderr
        assert pipe is not None
        mark = b"log_lines_dropped" if where == "stdout" else b" log lines dropped"
        out = _read_all(pipe.fileno(), mark)
        out += _read_all(pipe.fileno(), b"\n") if not out.endswith(b"\n") else b""
    finally:
        proc.kill()
        proc.wait(10)
    lines = out.splitlines()
    requests = [x for x in lines if b'"event":"request"' in x]
    notes = [x for x in lines if mark in x]
    assert len(notes) == 1
    if where == "stdout":   # the request log's own JSON line
        note = orjson.loads(notes[0])
        dropped = note["dropped"]
        assert note["event"] == "log_lines_dropped"
        rows = [orjson.loads(x) for x in requests]   # each one whole
        ids = [row["client_request_id"] for row in rows]
    else:                   # a WARNING through the text log format, the request lines in it as they are
        assert b"WARNING pdproxy " in notes[0] and b" log lines dropped" in notes[0]
        dropped = int(notes[0].split(b" log lines dropped")[0].rsplit(b" ", 1)[1])
        ids = [orjson.loads(x[x.index(b"{"):])["client_request_id"] for x in requests]
    assert 0 < dropped < n and len(ids) < n
    assert ids == sorted(ids, key=lambda s: int(s[1:]))   # in order, none twice
    assert len(ids) + dropped >= n   # every request line written or counted (stderr also carries other lines)


def test_drops_reported_whenever_the_queue_empties_add_up_and_keep_their_place() -> None:
    """The producer outruns the writer thread (drops while the pipe still has room), the queue then empties (one
    report), and a second run of drops later gets its own: every kept line in order, the reports after the lines
    kept before them, their counts adding up (the CI run that read only the last report waited for a count that
    never came)."""
    with _pipe() as (r, w):
        sink = LineSink(w, max_buffer_bytes=2_000, dropped_line=_note)
        sent: list[bytes] = []
        for episode in range(2):
            with sink._lock:                       # the writer thread cannot take the queue meanwhile
                results = [sink.write(_line(100 * episode + i)) for i in range(40)]
            assert results.count(False) == 20      # 2,000 bytes held: 20 lines kept, 20 dropped
            sent += [_line(100 * episode + i) for i, ok in enumerate(results) if ok]
            wait_until(lambda: sink.held_bytes == 0, 10, 0.01, "the writer thread to empty the queue")
        out = _read_all(r, _line(119) + _note(20))
        assert out == b"".join(sent[:20]) + _note(20) + b"".join(sent[20:]) + _note(20)
        assert sink.dropped == 40
        sink.close()
