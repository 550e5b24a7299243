"""Log lines never stop the event loop: :class:`pdproxy.ops.linesink.LineSink` on real pipes and files, and
``pdproxy serve`` (the real command, default logging: INFO with a request line per request) whose stderr — or
stdout, with ``--request-log-path -`` — nobody reads: before the sink, every request stopped after ~100."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from pdproxy.ops.linesink import PIPE_BUF, LineSink
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


def _line(i: int, size: int = 100) -> bytes:
    head = b"line %06d " % i
    return head + b"x" * (size - len(head) - 1) + b"\n"


def test_a_read_pipe_gets_each_line_at_once_from_the_caller() -> None:
    with _pipe() as (r, w):
        sink = LineSink(w, max_buffer_bytes=1 << 16, dropped_line=_note)
        assert sink.write(b"one\n") and sink.write(b"two\n")
        assert os.read(r, 100) == b"one\ntwo\n"   # written by the calls themselves: no thread was needed
        assert sink._thread is None and sink.held_bytes == 0 and sink.dropped == 0
        sink.close()


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
        out = _read_all(r, b"dropped ")
        out += _read_all(r, b"\n") if not out.endswith(b"\n") else b""
        lines = out.splitlines(keepends=True)
        assert lines[-1] == _note(len(dropped))   # once the reader caught up: how many were lost
        assert lines[:-1] == [_line(i) for i in kept]   # in order, each whole
        assert sink.write(b"after\n")
        assert _read_all(r, b"after\n") == b"after\n"
        sink.close()


def test_a_line_longer_than_pipe_buf_waits_for_the_thread_and_keeps_its_place() -> None:
    with _pipe() as (r, w):
        sink = LineSink(w, max_buffer_bytes=1 << 20, dropped_line=_note)
        big = b"b" * (3 * PIPE_BUF) + b"\n"
        assert sink.write(big) and sink.write(b"small\n")  # the small one goes behind the big one, not around it
        assert _read_all(r, b"small\n") == big + b"small\n"
        sink.close()


def test_a_regular_file_is_written_at_once_whatever_the_size(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        sink = LineSink(fd, max_buffer_bytes=4096, dropped_line=_note)
        big = b"p" * 100_000 + b"\n"
        assert sink.write(big) and sink.write(b"end\n")
        assert (tmp_path / "log").read_bytes() == big + b"end\n"
        assert sink._thread is None
        sink.close()
    finally:
        os.close(fd)


def test_close_writes_what_is_held_and_a_closed_sink_takes_nothing() -> None:
    with _pipe() as (r, w):
        room = _pipe_room(w)
        sink = LineSink(w, max_buffer_bytes=1 << 20, dropped_line=_note)
        n = room // 100 + 50
        assert all(sink.write(_line(i)) for i in range(n))
        assert sink.held_bytes > 0
        got = bytearray()
        reader = threading.Thread(target=lambda: got.extend(_read_all(r, _line(n - 1))))
        reader.start()
        sink.close(timeout_s=10)
        reader.join(10)
        assert bytes(got).splitlines(keepends=True) == [_line(i) for i in range(n)]
        assert not sink.write(b"late\n") and sink.dropped == 1


def test_a_broken_descriptor_is_an_error_not_a_wait() -> None:
    r, w = os.pipe()
    os.close(r)
    try:
        sink = LineSink(w, max_buffer_bytes=4096, dropped_line=_note)
        assert not sink.write(b"x\n")
        assert isinstance(sink.error, BrokenPipeError) and sink.dropped == 1
        sink.close()
    finally:
        os.close(w)


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
    n = 600   # ~300 KB of request lines: more than the pipe (64 KiB) and the buffer (32 KiB) together
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
