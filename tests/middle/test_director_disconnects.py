"""The client leaves in each phase of a request, on the real director and relay with fake engines in process
(tests/middle/fake_upstream.py): the handler's task is cancelled the way the server does it
(``flow.client_gone()`` then ``on_disconnect()``), and then every engine exchange is over (a pending leg aborted,
a stream closed), a release leg frees each KV handle no decoder consumed, nothing more reaches the client, and —
asserted by ``Rig.close`` in every test — the pool, the prefill queue and its ledger are back to zero."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from tests.middle.fake_upstream import Answer, Gate, Hang, Reset, Stream, handle_id
from tests.middle.rig import PREFILLERS, Rig, settle, until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


def no_breaker_verdict(rig: Rig) -> None:
    """The client leaving says nothing about an engine: no failure counted anywhere."""
    for e in rig.state.pool.endpoints():
        assert rig.state.health.breaker(e).consecutive_failures == 0, e.name


async def test_leaving_while_queued_for_a_prefill_slot() -> None:
    ahead = Gate("ahead's prefill")
    async with Rig(prefill=PREFILLERS[:1], prefill_budget_tokens=1, prefill_budget_s=0) as rig:   # one prefill at a time
        rig.fake.script("ahead", prefill=[Answer(gate=ahead)])
        first = rig.send("ahead")
        await ahead.reached.wait()
        queued = rig.send("queued")
        await until(lambda: rig.state.queue.depth == 1, "the second request waiting for a slot")
        queued.client.disconnect()
        await queued.task
        assert rig.state.queue.depth == 0 and rig.state.queue.stats.waited_total == 1
        assert not rig.fake.of(key="queued")                           # no engine heard of it
        assert queued.client.status == 0 and not queued.client.pieces
        ahead.open()
        assert (await first.done()).status == 200                      # the request ahead is unaffected
    assert [c.kind for c in rig.fake.of(key="ahead")] == ["prefill", "decode"]


@pytest.mark.parametrize("where", ["connecting", "prefilling"])
async def test_leaving_during_the_prefill_leg(where: str) -> None:
    gate = Gate(where)
    async with Rig() as rig:
        rig.fake.script("r", prefill=[Answer(connect=gate) if where == "connecting" else Answer(gate=gate)])
        sent = rig.send("r")
        await gate.reached.wait()
        sent.client.disconnect()
        await sent.task
    (leg,) = rig.fake.of("prefill", "r")
    assert leg.result == "aborted" and leg.received == (where == "prefilling")
    assert not rig.fake.of("decode") and not rig.fake.of("release")   # no handle was ever given out
    assert not rig.fake.fates
    assert sent.client.status == 0 and not sent.client.pieces
    no_breaker_verdict(rig)


async def test_leaving_between_the_prefill_and_the_decode_leg() -> None:
    connecting = Gate("decoder connect")
    async with Rig() as rig:
        rig.fake.script("r", decode=[Stream(connect=connecting)])
        sent = rig.send("r")
        await connecting.reached.wait()
        assert rig.state.pool.load(rig.fake.of("prefill", "r")[0].endpoint).requests == 1   # the KV pinned
        sent.client.disconnect()
        await sent.task
    (decode,) = rig.fake.of("decode", "r")
    assert decode.result == "aborted" and not decode.received
    (release,) = rig.fake.of("release", "r")
    assert release.handle_in == decode.handle_in == rig.fake.handles_of("r")[0]
    assert release.endpoint != decode.endpoint                          # avoids the decoder it was meant for
    assert sent.client.status == 0 and not sent.client.pieces
    no_breaker_verdict(rig)


@pytest.mark.parametrize("where", ["before the status line", "before the first event"])
async def test_leaving_before_the_decoders_first_event(where: str) -> None:
    first_event = Gate("first event")
    async with Rig() as rig:
        rig.fake.script("r", decode=[Hang() if where == "before the status line" else Stream(gates={0: first_event})])
        sent = rig.send("r")
        if where == "before the status line":
            await until(lambda: bool(rig.fake.of("decode", "r")), "the decode leg sent")
        else:
            await first_event.reached.wait()
        sent.client.disconnect()
        await sent.task
    (decode,) = rig.fake.of("decode", "r")
    if where == "before the status line":
        assert decode.result == "aborted" and decode.response is None
    else:
        assert decode.response is not None and decode.response.ended == "closed"   # vLLM sees the abort
        assert decode.response.taken == []
    (release,) = rig.fake.of("release", "r")                            # the KV was never pulled: freed
    assert release.handle_in == decode.handle_in
    assert sent.client.status == 0 and not sent.client.pieces          # the status line waits for an event
    no_breaker_verdict(rig)


@pytest.mark.parametrize("paused", [False, True], ids=["reading", "paused"])
async def test_leaving_mid_stream(paused: bool) -> None:
    third = Gate("third event")
    async with Rig() as rig:
        rig.fake.script("r", decode=[Stream(events=5, gates={2: third})])
        sent = rig.send("r")
        await third.reached.wait()
        await until(lambda: len(sent.client.events()) == 2, "two events at the client")
        (decode,) = rig.fake.of("decode", "r")
        assert decode.response is not None
        if paused:                                    # the client's transport is full: the decoder is not read
            sent.client.pause()
            assert decode.response.paused
            third.open()
            await settle()
            assert len(sent.client.events()) == 2                     # the third event waits at the engine
        sent.client.disconnect()
        await sent.task
    assert sent.client.status == 200 and len(sent.client.events()) == 2 and not sent.client.finished
    assert decode.response.ended == "closed"
    assert not rig.fake.of("release")                                   # the decoder had pulled the KV
    assert rig.fake.fates[decode.handle_in or 0] == ["pulled"]
    no_breaker_verdict(rig)


async def test_leaving_during_a_json_answer() -> None:
    body = Gate("the JSON body")
    async with Rig() as rig:
        rig.fake.script("r", decode=[Answer(body_gate=body)])
        sent = rig.send("r", stream=False)
        await body.reached.wait()
        (prefill,) = rig.fake.of("prefill", "r")
        assert rig.state.pool.load(prefill.endpoint).requests == 0      # the status line gave the KV lease back
        sent.client.disconnect()
        await sent.task
    (decode,) = rig.fake.of("decode", "r")
    assert decode.response is not None and decode.response.ended == "closed"
    assert not rig.fake.of("release")                                   # consumed at the status line
    assert sent.client.status == 0 and not sent.client.pieces
    no_breaker_verdict(rig)


async def test_leaving_during_the_new_prefill_after_a_decoder_failed() -> None:
    again = Gate("second prefill")
    async with Rig() as rig:
        rig.fake.script("r", prefill=[Answer(), Answer(gate=again)], decode=[Reset()])
        sent = rig.send("r")
        await again.reached.wait()
        sent.client.disconnect()
        await sent.task
    p1, p2 = rig.fake.of("prefill", "r")
    assert p1.result == "answered" and p2.result == "aborted"
    (release,) = rig.fake.of("release", "r")
    assert release.handle_in == handle_id(p1.handle)                    # the failed decoder's handle freed
    assert len(rig.fake.of("decode", "r")) == 1
    assert sent.client.status == 0


async def test_leaving_after_done_lets_the_decoder_finish_its_body() -> None:
    end = Gate("end of body")
    async with Rig() as rig:
        rig.fake.script("r", decode=[Stream(events=2, gates={3: end})])   # 2 events, [DONE], then the end
        sent = rig.send("r")
        await end.reached.wait()
        assert sent.client.finished and sent.client.events()[-1] == b"[DONE]"
        sent.client.disconnect()                     # after the last byte: a complete response, not a cancel
        assert not sent.task.done()
        end.open()
        await sent.task
    (decode,) = rig.fake.of("decode", "r")
    assert decode.response is not None and decode.response.ended == "released"   # pooled, not aborted


async def test_a_client_that_stops_reading_is_cut_and_the_decoder_closed() -> None:
    third = Gate("third event")

    async def eventually(cond: Callable[[], bool], within_s: float = 5.0) -> None:
        deadline = time.monotonic() + within_s
        while not cond():
            assert time.monotonic() < deadline, "not reached"
            await asyncio.sleep(0.01)

    async with Rig(client_send_timeout_s=0.1) as rig:   # the decoder's idle timeout stays 120 s: not what cuts it
        rig.fake.script("r", decode=[Stream(events=5, gates={2: third})])
        sent = rig.send("r")
        await third.reached.wait()
        sent.client.pause()                           # and never resumes (nor takes a byte)
        await eventually(lambda: sent.client.aborted)
        await sent.task
    (decode,) = rig.fake.of("decode", "r")
    assert decode.response is not None and decode.response.ended == "closed"
    assert sent.client.gone and not rig.fake.of("release")
