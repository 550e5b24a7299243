"""The spliced body handed over once per socket read (pdproxy/http/client.py ``H1Connection.data_received``):
what a :class:`pdproxy.http.client.BodySink` is told, in which order, when a read also holds the message's end, a
parse error, trailers, or the connection's end, and when the sink itself fails.  A raw engine socket on one side
(tests/unit/rawengine.py); every test on asyncio and on uvloop."""

from __future__ import annotations

import asyncio

import pytest

from pdproxy.http.client import H1Response, ProtocolError, TransportError
from tests.unit.rawengine import Peer, chunk, post, serving, until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EV = b'data: {"choices":[{"text":" t"}]}\n\n'


class Sink:
    """Records every call, in order: ``("data", bytes)``, ``("eof", None)``, ``("fail", exc)``."""

    def __init__(self, on_data: object = None) -> None:
        self.calls: list[tuple[str, object]] = []
        self.on_data = on_data

    def data(self, chunk: bytes) -> None:
        self.calls.append(("data", chunk))
        if callable(self.on_data):
            self.on_data(chunk)

    def eof(self) -> None:
        self.calls.append(("eof", None))

    def fail(self, exc: TransportError) -> None:
        self.calls.append(("fail", exc))

    @property
    def ended(self) -> bool:
        return any(kind != "data" for kind, _ in self.calls)


class Stepper:
    """An engine script the test drives: ``send`` writes one piece; ``None`` ends with a clean close (FIN)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def __call__(self, peer: Peer) -> None:
        await peer.request()
        while (piece := await self.queue.get()) is not None:
            await peer.send(piece)
        peer.writer.close()
        await peer.wait_gone()


async def spliced(pool, key, script: Stepper, sink: Sink, head: bytes = HEAD) -> H1Response:  # type: ignore[no-untyped-def]
    script.queue.put_nowait(head)
    resp = await post(pool, key)
    resp.splice(sink)  # type: ignore[arg-type]
    return resp


async def test_a_read_with_events_and_the_message_end_gives_one_piece_then_eof() -> None:
    script = Stepper()
    async with serving(script) as (engine, pool):
        sink = Sink()
        resp = await spliced(pool, engine.key, script, sink)
        script.queue.put_nowait(chunk(EV) * 3 + b"0\r\nX-Trailer: t\r\n\r\n")
        await until(lambda: sink.ended, "the end")
        assert sink.calls == [("data", EV * 3), ("eof", None)]
        resp.release()
        assert len(pool.idle.get(engine.key, [])) == 1


async def test_a_close_delimited_body_ending_at_fin_gives_its_bytes_then_eof() -> None:
    script = Stepper()
    async with serving(script) as (engine, pool):
        sink = Sink()
        resp = await spliced(pool, engine.key, script, sink,
                             head=b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        script.queue.put_nowait(EV * 2)
        script.queue.put_nowait(None)
        await until(lambda: sink.ended, "the end")
        assert sink.calls == [("data", EV * 2), ("eof", None)]
        resp.release()


async def test_a_parse_error_after_good_chunks_in_one_read_gives_them_first_then_fail() -> None:
    script = Stepper()
    async with serving(script) as (engine, pool):
        sink = Sink()
        resp = await spliced(pool, engine.key, script, sink)
        script.queue.put_nowait(chunk(EV) * 2 + b"zz\r\nnot hex\r\n")
        await until(lambda: sink.ended, "the failure")
        assert [k for k, _ in sink.calls] == ["data", "fail"] and sink.calls[0][1] == EV * 2
        assert isinstance(sink.calls[1][1], ProtocolError)
        resp.close()


@pytest.mark.parametrize("tail", [b"", b"zz\r\nnot hex\r\n"], ids=["events", "events-then-a-parse-error"])
async def test_a_sink_that_raises_fails_the_response_as_a_protocol_error(tail: bytes) -> None:
    """A sink's ``data`` raising (a transform tripping over an engine's malformed event) fails the response with a
    :class:`ProtocolError` — as when the sink was called from the parser's own callback — and nothing escapes
    the protocol's ``data_received`` into the event loop's exception handler."""
    loop = asyncio.get_running_loop()
    escaped: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: escaped.append(context))
    script = Stepper()
    try:
        async with serving(script) as (engine, pool):
            def boom(chunk: bytes) -> None:
                raise ValueError("a malformed event")
            sink = Sink(on_data=boom)
            resp = await spliced(pool, engine.key, script, sink)
            script.queue.put_nowait(chunk(EV) * 2 + tail)
            await until(lambda: sink.ended, "the failure")
            assert [k for k, _ in sink.calls] == ["data", "fail"]
            assert isinstance(sink.calls[1][1], ProtocolError), sink.calls[1][1]
            await asyncio.sleep(0)
            assert not escaped, escaped
            resp.close()
    finally:
        loop.set_exception_handler(None)


async def test_a_sink_that_closes_the_response_in_its_data_call_hears_nothing_more() -> None:
    script = Stepper()
    async with serving(script) as (engine, pool):
        holder: list[H1Response] = []
        sink = Sink(on_data=lambda chunk: holder[0].close())
        resp = await spliced(pool, engine.key, script, sink)
        holder.append(resp)
        script.queue.put_nowait(chunk(EV) * 2 + b"0\r\n\r\n")
        await until(lambda: resp._conn.closed, "the connection closed")
        for _ in range(5):
            await asyncio.sleep(0)
        assert sink.calls == [("data", EV * 2)]


async def test_the_next_request_on_a_reused_connection_never_reaches_the_last_sink() -> None:
    async def two(peer: Peer) -> None:
        await peer.request()
        await peer.send(HEAD + chunk(EV) + b"0\r\n\r\n")
        await peer.request()
        await peer.send(HEAD, chunk(b"second") + b"0\r\n\r\n")
        await peer.wait_gone()
    async with serving(two) as (engine, pool):
        first = Sink()
        resp = await post(pool, engine.key)
        resp.splice(first)  # type: ignore[arg-type]
        await until(lambda: first.ended, "the first response's end")
        resp.release()
        assert len(pool.idle.get(engine.key, [])) == 1
        resp2 = await post(pool, engine.key)
        assert await resp2.read() == b"second"
        resp2.release()
        assert first.calls == [("data", EV), ("eof", None)]
