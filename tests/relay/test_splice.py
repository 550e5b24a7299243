"""The relay's splice in process: a raw engine socket on one side, a recording client connection on the other
(pdproxy/pd/relay.py; transforms in pdproxy/apis/chat.py, client side in pdproxy/pd/responder.py).
Flow control, the stall cut, the end at ``[DONE]``, usage rewriting, recompute detection."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
import pytest

from pdproxy.errors import UpstreamTimeout
from pdproxy.http import sse
from pdproxy.http.client import H1Pool, H1Response
from pdproxy.pd.relay import StreamRelay
from pdproxy.pd.responder import Responder
from pdproxy.timeline import GapCounts, RequestContext
from tests.unit.rawengine import Engine, Peer, chunk, post, until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def event(obj: dict) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


TOKEN = event({"id": "c1", "choices": [{"index": 0, "text": " t", "finish_reason": None}]})
USAGE = event({"id": "c1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}})
DONE = b"data: [DONE]\n\n"


class Client:
    """A :class:`pdproxy.pd.responder.ClientConnection` that records what it was given."""

    def __init__(self) -> None:
        self.flow: object = None
        self._paused = False
        self.status = 0
        self.body: list[bytes] = []
        self.finished = False
        self.aborted = False
        self.send_timeout_s = 60.0
        self.untaken = 0       # what unsent() reports (a test moves it)

    @property
    def paused(self) -> bool:
        return self._paused

    def unsent(self) -> int:
        return self.untaken

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status

    def write(self, data: bytes) -> None:
        self.body.append(data)

    def finish(self, data: bytes = b"") -> None:
        self.body.append(data)
        self.finished = True

    def body_writer(self):  # type: ignore[no-untyped-def]
        return self.body.append

    async def drain(self) -> None:
        return None

    def abort(self) -> None:
        self.aborted = True

    def pause(self) -> None:  # what the server protocol does when the transport crosses its high-water mark
        self._paused = True
        self.flow.client_paused()  # type: ignore[attr-defined]

    def resume(self) -> None:
        self._paused = False
        self.flow.client_resumed()  # type: ignore[attr-defined]

    @property
    def text(self) -> bytes:
        return b"".join(self.body)


class Script:
    """The engine side of one stream, driven step by step by the test."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.peer: Peer | None = None

    async def __call__(self, peer: Peer) -> None:
        self.peer = peer
        await peer.request()
        while (piece := await self.queue.get()) is not None:
            await peer.send(piece)
        await peer.wait_gone()

    def send(self, data: bytes) -> None:
        self.queue.put_nowait(data)


@asynccontextmanager
async def relaying(script: Script, **kw: object) -> AsyncIterator[tuple[asyncio.Task[bool], Client, RequestContext,
                                                                         H1Response]]:
    async with Engine(script) as engine:
        pool = H1Pool(connect_timeout_s=1.0, keepalive_s=30.0)
        script.send(HEAD + chunk(TOKEN))
        resp = await post(pool, engine.key)
        ctx = RequestContext(request_id="r", client_request_id=None, api_label="completions", decoder="d")
        ctx.gaps = GapCounts((0.1, float("inf")))
        client = Client()
        options: dict[str, object] = {"cached_tokens": None, "first_event_timeout_s": 5.0, "idle_timeout_s": 5.0}
        options.update(kw)
        relay = StreamRelay(resp, Responder(client, ctx, []), ctx, **options)  # type: ignore[arg-type]
        task = asyncio.ensure_future(relay.run())
        try:
            await until(lambda: client.status == 200, "the status line")
            yield task, client, ctx, resp
        finally:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if not resp.at_eof():
                resp.close()
            else:
                resp.release()
            pool.close()
            script.send(None)  # type: ignore[arg-type]


async def test_a_client_above_its_high_water_mark_pauses_the_decoder_read_until_it_catches_up() -> None:
    script = Script()
    async with relaying(script) as (task, client, _ctx, resp):
        conn = resp._conn
        client.pause()
        assert conn.paused  # the decoder socket is no longer read
        script.send(chunk(TOKEN))
        for _ in range(50):  # the engine's bytes wait in the kernel, not in the proxy
            await asyncio.sleep(0)
        assert client.body == [TOKEN]
        client.resume()
        assert not conn.paused
        await until(lambda: len(client.body) == 2, "the held event after resume")
        script.send(chunk(DONE) + b"0\r\n\r\n")
        assert await task is False
        assert client.finished and client.text == TOKEN + TOKEN + DONE


async def test_a_paused_client_that_takes_nothing_for_the_send_timeout_is_cut() -> None:
    """Cut after ``client_send_timeout_s`` (not the decoder's 120 s idle timeout: the decoder's reservation must not
    wait that long for a client that stopped reading)."""
    script = Script()
    async with relaying(script, idle_timeout_s=60.0) as (task, client, ctx, resp):
        client.send_timeout_s = 0.2
        client.untaken = 70_000
        client.pause()
        await until(lambda: client.aborted, "the stalled client cut", timeout_s=5)
        assert not task.done()  # the server's connection_lost cancels the director's task, whose decode leg
        assert "took nothing for 0.2 s" in (ctx.error or "")  # is then closed by Upstream.open_stream (vLLM aborts)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert not resp.at_eof()  # unfinished: Upstream.open_stream closes it (the engine sees the abort)


async def test_a_paused_client_that_keeps_taking_bytes_is_not_cut() -> None:
    """A slow reader (its untaken bytes shrank since the last check) keeps its stream and the check is re-armed;
    once it took nothing for a whole ``client_send_timeout_s`` it is cut.  (The checks are called here, in place of
    the timer: no test timing.)"""
    script = Script()
    async with relaying(script, idle_timeout_s=60.0) as (task, client, ctx, _resp):
        client.send_timeout_s = 3600.0
        client.untaken = 100_000
        client.pause()
        splice = client.flow
        for _ in range(3):
            client.untaken -= 1_000
            splice.stall_timer.cancel()
            splice._stalled()                          # the check: it took some
            assert not client.aborted and splice.stall_timer is not None
        splice.stall_timer.cancel()
        splice._stalled()                              # nothing taken since the last check
        assert client.aborted and "took nothing for 3600 s" in (ctx.error or "")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_done_ends_the_client_response_before_the_decoder_ends_its_body() -> None:
    script = Script()
    async with relaying(script) as (task, client, ctx, resp):
        script.send(chunk(TOKEN + USAGE + DONE))
        await until(lambda: client.finished, "the response ended at [DONE]")
        assert not task.done()  # the decoder still owes its last chunk
        assert client.text == TOKEN + TOKEN + USAGE + DONE and client.body[-1].endswith(DONE)
        assert ctx.completion_tokens == 3
        script.send(b"0\r\n\r\n")
        assert await task is False
        assert resp.at_eof()  # the connection can go back to the pool
        assert ctx.events == 2 and sum(ctx.gaps.counts) == 1  # type: ignore[union-attr]


async def test_usage_cached_tokens_patched_and_a_forced_usage_chunk_stripped() -> None:
    script = Script()
    async with relaying(script, cached_tokens=4) as (task, client, _ctx, _resp):
        script.send(chunk(USAGE + DONE) + b"0\r\n\r\n")
        await task
    usage = orjson.loads(client.text.split(b"\n\n")[1][6:])["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}
    script = Script()
    async with relaying(script, strip_usage=True) as (task, client, _ctx, _resp):
        script.send(chunk(USAGE) + chunk(DONE) + b"0\r\n\r\n")
        await task
    assert client.text == TOKEN + DONE


async def test_events_split_across_reads_are_forwarded_whole() -> None:
    script = Script()
    async with relaying(script) as (task, client, _ctx, _resp):
        script.send(chunk(TOKEN[:7]))
        script.send(chunk(TOKEN[7:] + TOKEN[:3]))
        await until(lambda: len(client.body) == 2, "the reassembled event")
        assert client.body[1] == TOKEN
        script.send(chunk(TOKEN[3:] + DONE) + b"0\r\n\r\n")
        await task
    assert client.text == TOKEN * 3 + DONE


async def test_the_events_of_one_read_reach_the_client_as_one_write() -> None:
    """A decoder ahead of the proxy: the HTTP chunks (one per event, as vLLM writes them) of one socket read are
    one client write, in order; with the end of the message in the same read, ``[DONE]`` ends the response and
    the end of the body comes after every event (pdproxy/http/client.py ``H1Connection.data_received``)."""
    script = Script()
    async with relaying(script) as (task, client, ctx, resp):
        script.send(chunk(TOKEN) * 5)
        await until(lambda: len(client.body) >= 2, "the five events")
        assert client.body[1:] == [TOKEN * 5]
        script.send(chunk(TOKEN) + chunk(TOKEN) + chunk(USAGE) + chunk(DONE) + b"0\r\n\r\n")
        assert await task is False
        assert resp.at_eof()
    assert client.body[2:] == [TOKEN * 2 + USAGE + DONE] and client.finished
    assert ctx.completion_tokens == 3 and ctx.events == 3


@pytest.mark.parametrize("split", [True, False], ids=["own-block", "with-done"])
async def test_a_decoder_not_known_for_recomputed_is_detected_and_the_stream_ends_with_an_error(split: bool) -> None:
    detected: list[bool] = []
    recomputed = event({"id": "c1", "choices": [{"index": 0, "text": "", "finish_reason": "stop",
                                                 "stop_reason": "recomputed"}]})
    script = Script()
    async with relaying(script, on_recomputed=lambda: detected.append(True)) as (task, client, ctx, _resp):
        if split:  # the paced case: the chunk is its own write and already forwarded when usage / [DONE] come
            script.send(chunk(recomputed))
            await until(lambda: len(client.body) == 2, "the recomputed chunk relayed")
            script.send(chunk(USAGE) + chunk(DONE) + b"0\r\n\r\n")
        else:
            script.send(chunk(recomputed + DONE) + b"0\r\n\r\n")
        assert await task is False
    assert detected == [True]
    events = [e + b"\n\n" for e in client.text.split(b"\n\n") if e]
    assert events[0] == TOKEN
    assert events[1:-2] == ([recomputed] if split else [])  # nothing after that chunk, usage included
    assert b'"error"' in events[-2] and b"preempted" in events[-2] and events[-1] == DONE and client.finished
    assert ctx.outcome == "upstream_error"


async def test_decoder_reset_mid_stream_becomes_an_error_event() -> None:
    script = Script()
    async with relaying(script) as (task, client, ctx, _resp):
        await until(lambda: script.peer is not None, "the engine peer")
        assert script.peer is not None
        script.peer.reset()
        assert await task is False
    assert b'"error"' in client.text and client.text.endswith(DONE) and client.finished
    assert ctx.outcome == "upstream_error" and "mid-stream" in (ctx.error or "")


async def test_a_continuation_legs_silence_is_measured_from_its_own_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A later leg of a stream already answering (a continuation, a recompute) starts its "last write" clock when
    the leg starts, not at the stream's first token: a leg whose first block writes nothing (a Responses /
    Messages continuation's role chunk, here: every block dropped) was otherwise judged silent since the stream
    began, and cut as lost once ``stream_continuation_stall_min_s`` passed."""
    from pdproxy.apis.request import Api, parse_request
    from pdproxy.pd import relay as relay_module
    from pdproxy.pd.continuation import Resume

    monkeypatch.setattr(relay_module._Splice, "data", lambda self, chunk: None)   # a block that writes nothing

    script = Script()
    async with Engine(script) as engine:
        pool = H1Pool(connect_timeout_s=1.0, keepalive_s=30.0)
        script.send(HEAD + chunk(TOKEN))
        resp = await post(pool, engine.key)
        ctx = RequestContext(request_id="r", client_request_id=None, api_label="completions", decoder="d")
        client = Client()
        out = Responder(client, ctx, [])  # type: ignore[arg-type]
        out.start_nowait(200, [])                              # the stream answered on an earlier leg
        ctx.timeline.first_token_at = asyncio.get_running_loop().time() - 100.0
        resume = Resume.of(parse_request(b'{"model":"m","prompt":"hi","stream":true}', Api.COMPLETIONS), True)
        assert resume is not None
        resume.legs = 2
        relay = StreamRelay(resp, out, ctx, cached_tokens=None, first_event_timeout_s=5.0, idle_timeout_s=5.0,
                            resume=resume, lost_when=(20.0, 2.0))
        started = time.monotonic()
        task = asyncio.ensure_future(relay.run())
        try:
            await until(lambda: relay.splice is not None, "the leg's splice")
            assert relay.splice is not None and relay.splice.last >= started
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            resp.close()
            pool.close()
            script.send(None)  # type: ignore[arg-type]


async def test_a_read_mixing_line_endings_reaches_the_client_with_newline_endings() -> None:
    """One read holding an event framed with ``\\r\\n`` then one framed as vLLM frames it (``\\n``): the
    transforms and the client see ``\\n`` endings throughout (pdproxy/http/sse.py), as when each event came in
    a read of its own — the read's last event alone does not tell its framing."""
    script = Script()
    async with relaying(script) as (task, client, _ctx, _resp):
        script.send(chunk(TOKEN.replace(b"\n", b"\r\n")) + chunk(TOKEN) + chunk(DONE) + b"0\r\n\r\n")
        assert await task is False
    assert client.text == TOKEN * 3 + DONE and client.finished


async def test_a_long_event_over_many_reads_is_held_without_copying_and_forwarded_whole() -> None:
    """An event arriving in many reads is held as one growing buffer (sse.reassemble): the held tail is the same
    object read after read (old code re-joined it every read: a 100 MB event cost O(n²) of the event loop, 17 s,
    and held every other client up to 7 s), and the client gets the event whole, byte for byte."""
    big = event({"id": "c1", "choices": [{"index": 0, "text": "x" * 300_000, "finish_reason": None}]})
    pieces = [big[i:min(i + 16_384, len(big) - 2)] for i in range(0, len(big) - 2, 16_384)]   # all but its end
    script = Script()
    async with relaying(script) as (task, client, _ctx, resp):
        held: list[int] = []
        for piece in pieces:
            script.send(chunk(piece))
            want = sum(map(len, pieces[:len(held) + 1]))
            await until(lambda want=want: resp.sink is not None and len(resp.sink.tail) == want,  # type: ignore[misc]
                        "the piece held")
            held.append(id(resp.sink.tail))
        assert len(held) > 10 and len(set(held[1:])) == 1            # one buffer, grown in place
        assert len(client.body) == 1                                 # nothing of the event sent before its end
        script.send(chunk(big[-2:]) + chunk(DONE) + b"0\r\n\r\n")
        await task
    assert client.text == TOKEN + big + DONE and client.finished


async def test_an_event_that_never_ends_is_cut_at_the_limit_with_an_error_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder writing an event without its end (``data: `` and bytes, no blank line) is cut once the event
    passes :data:`pdproxy.http.sse.MAX_EVENT_BYTES`: the client gets the SSE error event and ``[DONE]`` (old code:
    held it all, without bound, until the decoder closed)."""
    monkeypatch.setattr(sse, "MAX_EVENT_BYTES", 100_000)
    script = Script()
    async with relaying(script) as (task, client, ctx, _resp):
        script.send(chunk(b"data: " + b"y" * 50_000))
        for _ in range(4):
            script.send(chunk(b"y" * 20_000))
        assert await task is False
    assert client.finished and client.text.startswith(TOKEN) and client.text.endswith(DONE)
    error = orjson.loads(client.text[len(TOKEN):-len(DONE)].removeprefix(b"data: "))["error"]
    assert "more than 100000 bytes without its end" in error["message"]
    assert ctx.outcome == "upstream_error" and b"yyy" not in client.text


async def test_keep_alive_comments_do_not_keep_a_silent_decoder_alive() -> None:
    """A decoder (or something in front of it) that sends only SSE comments after its first event is a decoder
    generating nothing: the comments are passed on, but ``idle_timeout_s`` goes on counting and the stream ends
    with the error event (old code: every comment reset the silence, and the request never ended)."""
    script = Script()
    async with relaying(script, idle_timeout_s=0.3) as (task, client, ctx, _resp):
        for _ in range(60):                     # 3 s of comments, 10× the idle timeout
            if task.done():
                break
            script.send(chunk(b": keep-alive\n\n"))
            await asyncio.sleep(0.05)
        assert task.done(), "the comments kept the stream open"
        assert await task is False
    events = [e for e in client.text.split(b"\n\n") if e]
    assert events[0] + b"\n\n" == TOKEN and events[1] == b": keep-alive" and events[-1] + b"\n\n" == DONE
    assert b'"error"' in events[-2] and ctx.outcome == "upstream_error"


async def test_keep_alive_comments_are_not_a_first_event() -> None:
    """Comments before the first event neither start the client's response nor stop the first-event timeout:
    the decoder that sends only comments is a decoder that sent no event (old code: the 200 went out with the
    first comment and the request never ended)."""
    script = Script()
    async with Engine(script) as engine:
        pool = H1Pool(connect_timeout_s=1.0, keepalive_s=30.0)
        script.send(HEAD + chunk(b": keep-alive\n\n"))
        resp = await post(pool, engine.key)
        ctx = RequestContext(request_id="r", client_request_id=None, api_label="completions", decoder="d")
        client = Client()
        relay = StreamRelay(resp, Responder(client, ctx, []), ctx, cached_tokens=None,  # type: ignore[arg-type]
                            first_event_timeout_s=0.3, idle_timeout_s=5.0)
        task = asyncio.ensure_future(relay.run())
        for _ in range(60):
            if task.done():
                break
            script.send(chunk(b": keep-alive\n\n"))
            await asyncio.sleep(0.05)
        with pytest.raises(UpstreamTimeout, match=r"no event within 0\.3 s"):
            await task
        assert client.status == 0 and not client.body
        resp.close()
        pool.close()
        script.send(None)  # type: ignore[arg-type]
