"""The relay's splice in compiled code (pdproxy/pd/splice.py, pdproxy/pd/_splice.c) and the compiled chunk writer
(pdproxy/http/_chunked.c): both are the ones in use when built, and they do what the Python ones do — on generated
decoder reads (whole events, events split across reads, ``\\r\\n`` framing, keep-alive comments, the transform's
trigger, ``[DONE]`` with and without its space, bytes after the end, a client that is gone) the same writes reach
the client, the same response end, the same ``prev``, held tail, write count, ITL buckets and total (read from the
splice's ``clock``); fields changed by the code the splice calls raise what the Python step raises."""

from __future__ import annotations

import asyncio
import os
import types
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdproxy.http import server, sse
from pdproxy.pd import relay, splice
from pdproxy.timeline import GapCounts

try:
    from pdproxy.pd import _splice
except ImportError:  # pragma: no cover - the assertion below says why this fails
    _splice = None  # type: ignore[assignment]
try:
    from pdproxy.http import _chunked
except ImportError:  # pragma: no cover - the assertion below says why this fails
    _chunked = None  # type: ignore[assignment]

pytestmark = pytest.mark.timeout(120)
COMPILED = "the compiled splice is not built (see the first test)"


def test_the_compiled_splice_and_chunk_writer_are_built_and_in_use() -> None:
    """`pip install` (make install / make test) builds both; without them every relayed event costs the Python
    step (~60 bytecodes) and a Python frame for its chunk framing."""
    if os.environ.get("PDPROXY_NO_EXTENSIONS"):
        assert splice.SpliceBase is splice.PySpliceBase
        assert server._chunk_writer is server._py_chunk_writer
        return
    assert _splice is not None, "pdproxy/pd/_splice.c was not built: run `make install` (needs a C compiler)"
    assert _chunked is not None, "pdproxy/http/_chunked.c was not built: run `make install` (needs a C compiler)"
    assert relay._Splice.__mro__[1] is _splice.SpliceBase
    assert server._chunk_writer is _chunked.ChunkWriter


@pytest.mark.skipif(_chunked is None, reason="the compiled chunk writer is not built (see the first test)")
@pytest.mark.parametrize("size", [0, 1, 15, 16, 255, 16383, 16384, 70000])
def test_the_compiled_chunk_writer_writes_what_write_chunk_writes(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    got: list[Any] = []
    want: list[Any] = []
    _chunked.ChunkWriter(got.append)(data)
    server._py_chunk_writer(want.append)(data)
    assert [tuple(g) for g in got] == [tuple(w) for w in want] == [(b"%x\r\n" % size, data, b"\r\n")]
    assert got[0][1] is data, "the body is passed on, not copied"


@pytest.mark.skipif(_chunked is None, reason="the compiled chunk writer is not built (see the first test)")
def test_the_compiled_chunk_writer_passes_errors_on() -> None:
    def broken(parts: Any) -> None:
        raise ConnectionResetError("gone")

    with pytest.raises(ConnectionResetError):
        _chunked.ChunkWriter(broken)(b"abc")
    with pytest.raises(TypeError):
        _chunked.ChunkWriter(print)(b"a", b"b")  # type: ignore[call-arg]


class _Upper:
    """A transform whose trigger is ``usage`` (as chat's usage rewrite): ``feed`` rewrites it."""

    trigger = b"usage"
    recomputed = False

    def feed(self, block: bytes, prev: bytes) -> bytes:
        return block.replace(b"usage", b"USAGE")

    def ending(self, block: bytes, prev: bytes) -> bytes:
        return block + b": ending\n\n"


class _Every(_Upper):
    """A transform fed every block (trigger ``b""``, as a continuable stream's record), dropping some."""

    trigger = b""

    def feed(self, block: bytes, prev: bytes) -> bytes:
        return b"" if b'"a":[1]' in block else block.replace(b"x", b"X")


TRANSFORMS = {"none": lambda: None, "usage": _Upper, "every": _Every}


def _splice_class(base: type) -> type:
    """relay._Splice's methods on ``base`` (compiled or Python); ``data`` is the base's (without the C parts
    ``_Splice`` binds ``data`` to its ``_slow``, which would hide the compiled one under test)."""
    ns = {k: v for k, v in vars(relay._Splice).items()
          if k not in ("__dict__", "__weakref__", "data") and not isinstance(v, types.MemberDescriptorType)}
    return type(f"Splice_{base.__module__}", (base,), ns)


class _Out:
    def __init__(self, log: list[Any]) -> None:
        self.log = log
        self.ended = False
        self.done_sent = False
        self.conn = types.SimpleNamespace(body_writer=lambda: self.write, flow=None, paused=False)

    def write(self, data: bytes) -> None:
        self.log.append(("write", bytes(data)))

    def end_nowait(self, data: bytes = b"") -> None:
        if not self.ended:
            self.ended = True
            self.log.append(("end", bytes(data)))


def _run(base: type, reads: list[bytes], transform: Any, gone_at: int | None) -> tuple[Any, ...]:
    loop = asyncio.new_event_loop()
    try:
        log: list[Any] = []
        out = _Out(log)
        ctx = types.SimpleNamespace(gaps=GapCounts((0.5, 1.0, float("inf"))),
                                    timeline=types.SimpleNamespace(last_token_at=None))
        rel = types.SimpleNamespace(resp=types.SimpleNamespace(loop=loop), out=out, ctx=ctx, done_event=sse.DONE_EVENT,
                                    idle_timeout_s=None, lost_when=None)
        s = _splice_class(base)(rel, transform, b"", 0.0)
        ticks = iter(range(1 << 20))
        s.clock = lambda: next(ticks) ** 2 * 0.1    # gaps of 0.1, 0.3, 0.5, …: every bucket, the same in both
        outcome: list[str] = []
        for i, read in enumerate(reads):
            if i == gone_at:
                s.client_gone()
            try:
                s.data(read)
            except Exception as exc:   # both must fail alike (the decoder connection then breaks the stream)
                outcome.append(type(exc).__name__)
                break
        return (log, outcome, s.prev, bytes(s.tail), s.writes, ctx.gaps.counts, ctx.gaps.total, s.last, s.ending,
                out.done_sent)
    finally:
        loop.close()


_PIECES = st.sampled_from([
    b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b'data: {"x":1}\n\n', b"data: {\"x\":2}\r\n\r\n",
    b": keep-alive\n\n", b'data: {"usage":{"prompt_tokens":3}}\n\n', sse.DONE_EVENT, sse.DONE_EVENT_NO_SPACE,
    b'data: {"a":[1]}\n\n', b"event: x\ndata: y\n\n", b"data: partial", b"\n", b"\n\n", b"\r", b":", b"",
    b'data: {"error": {"message": "x"}}\n\n'])


@st.composite
def _reads(draw: st.DrawFn) -> list[bytes]:
    stream = b"".join(draw(st.lists(_PIECES, min_size=1, max_size=12)))
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    return [r for r in reads if r]


@pytest.mark.skipif(_splice is None, reason=COMPILED)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reads=_reads(), kind=st.sampled_from(sorted(TRANSFORMS)), gone_at=st.one_of(st.none(), st.integers(0, 6)))
@example(reads=[b'data: {"x":1}\n\n', b'data: {"x":1}\n\n', sse.DONE_EVENT], kind="none", gone_at=None)
@example(reads=[b'data: {"x":1}\n\ndata: [DONE]\n\n', b'data: {"x":1}\n\n'], kind="usage", gone_at=None)
@example(reads=[b'data: {"x":1}\n\n', b'data: {"usage":1}\n\n', b"data:[DONE]\n\n"], kind="usage", gone_at=1)
@example(reads=[b'data: {"x":1}\n\n', b'data: {"a":[1]}\n\n', b": c\n\n", sse.DONE_EVENT], kind="every",
         gone_at=None)
def test_compiled_and_python_splices_agree(reads: list[bytes], kind: str, gone_at: int | None) -> None:
    py = _run(splice.PySpliceBase, reads, TRANSFORMS[kind](), gone_at)
    c = _run(_splice.SpliceBase, reads, TRANSFORMS[kind](), gone_at)
    assert c == py


@pytest.mark.skipif(_splice is None, reason=COMPILED)
def test_the_compiled_splice_counts_each_gap_once_into_its_bucket() -> None:
    """The common read takes the compiled path (no ``_slow`` or ``_emit``), its gap lands in the bucket bisect_left
    names, and the end event is left to ``_emit``."""
    slow_calls: list[bytes] = []
    emit_calls: list[bytes] = []

    class Counted(_splice_class(_splice.SpliceBase)):  # type: ignore[misc]
        __slots__ = ()

        def _slow(self, chunk: bytes) -> None:
            slow_calls.append(chunk)
            super()._slow(chunk)

        def _emit(self, chunk: bytes) -> None:
            emit_calls.append(chunk)
            super()._emit(chunk)

    loop = asyncio.new_event_loop()
    try:
        log: list[Any] = []
        out = _Out(log)
        gaps = GapCounts((1e-9, 3600.0, float("inf")))
        ctx = types.SimpleNamespace(gaps=gaps, timeline=types.SimpleNamespace(last_token_at=None))
        rel = types.SimpleNamespace(resp=types.SimpleNamespace(loop=loop), out=out, ctx=ctx, done_event=sse.DONE_EVENT,
                                    idle_timeout_s=None, lost_when=None)
        s = Counted(rel, None, b"", 0.0)
        for _ in range(3):
            s.data(b'data: {"x":1}\n\n')
        assert slow_calls == emit_calls == []
        assert s.writes == 3 and gaps.counts == [0, 2, 0] and 0 < gaps.total < 3600
        assert log == [("write", b'data: {"x":1}\n\n')] * 3
        s.data(sse.DONE_EVENT)
        assert slow_calls == [] and emit_calls == [sse.DONE_EVENT] and out.ended and log[-1] == ("end", sse.DONE_EVENT)
        s.data(b'data: {"x":1}\n\n')      # after the end: dropped, as the Python step drops it
        s.data(b"data: {\"x\":1}\r\n\r\n")  # reframed: the Python step
        assert len(log) == 4 and s.writes == 4 and slow_calls == [b"data: {\"x\":1}\r\n\r\n"]
    finally:
        loop.close()


_HOSTILE = ["feed_del_out", "feed_del_write", "clock_del_write", "counts_add_clears", "counts_setitem_del_gaps",
            "bounds_is_a_list", "bounds_item_mutates"]

_SCRIPT = r'''
import sys
from tests.relay import test_splice_compiled as t
from pdproxy.pd import splice, _splice
t.hostile_case(sys.argv[1], splice.PySpliceBase if sys.argv[2] == "py" else _splice.SpliceBase)
'''


def hostile_case(case: str, base: type) -> None:
    """One hostile mutation of a splice's fields from inside the calls it makes (a reviewer's cases): prints what
    the third read does.  Run in a child process: a memory error in the compiled splice kills it, not the test."""
    ev = b'data: {"x":1}\n\n'
    holder: list[Any] = []

    class Every(_Upper):
        trigger = b""

        def feed(self, block: bytes, prev: bytes) -> bytes:
            if case == "feed_del_out":
                del holder[0].out
            if case == "feed_del_write":
                del holder[0].write
            return block

    loop = asyncio.new_event_loop()
    out = _Out([])
    ctx = types.SimpleNamespace(gaps=GapCounts((0.5, 1.0, float("inf"))),
                                timeline=types.SimpleNamespace(last_token_at=None))
    rel = types.SimpleNamespace(resp=types.SimpleNamespace(loop=loop), out=out, ctx=ctx, done_event=sse.DONE_EVENT,
                                idle_timeout_s=None, lost_when=None)
    s = _splice_class(base)(rel, Every() if case.startswith("feed") else None, b"", 0.0)
    holder.append(s)
    if case == "clock_del_write":
        def clock() -> float:
            if hasattr(s, "write"):
                del s.write
            return 5.0
        s.clock = clock
    if case == "counts_add_clears":
        class Evil(int):
            def __add__(self, other: Any) -> int:
                s.counts.clear()
                return int(self) + other
        s.counts = [Evil(0), Evil(0), Evil(0)]
    if case == "counts_setitem_del_gaps":
        class Gone(list):  # type: ignore[type-arg]
            def __setitem__(self, i: Any, v: Any) -> None:
                if hasattr(s, "gaps"):
                    del s.gaps
                list.__setitem__(self, i, v)
        s.counts = Gone([0, 0, 0])
    if case == "bounds_is_a_list":
        s.bounds = [0.5, 1.0, float("inf")]
    if case == "bounds_item_mutates":
        class Shrinks:
            def __float__(self) -> float:
                bounds.clear()
                bounds.extend([0.0] * 100_000)
                return 0.5

            def __lt__(self, other: Any) -> bool:
                return float(self) < other

            def __gt__(self, other: Any) -> bool:
                return float(self) > other
        bounds = [Shrinks(), 1.0, float("inf")]
        s.bounds = bounds
    try:
        for _ in range(3):
            s.data(ev)
        print("ok", s.writes, sum(s.counts))
    except Exception as exc:
        print("raised", type(exc).__name__)
    finally:
        loop.close()


@pytest.mark.skipif(_splice is None, reason=COMPILED)
@pytest.mark.parametrize("case", _HOSTILE)
def test_fields_changed_during_its_own_calls_raise_as_the_python_splice_does(case: str) -> None:
    """A field deleted or a list resized by code the splice calls (the transform, the clock, an int or list
    subclass) raises what the Python step raises — never a crash of the process (exit -11) or a wrong count."""
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parents[2])
    got = {}
    for impl in ("py", "c"):
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, case, impl], capture_output=True, timeout=60, cwd=root,
                              env={**os.environ, "PYTHONPATH": root})
        assert proc.returncode == 0, f"{impl}: exit {proc.returncode}: {proc.stderr.decode()[-2000:]}"
        got[impl] = proc.stdout.decode().strip()
    assert got["c"] == got["py"]
