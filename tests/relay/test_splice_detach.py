"""When a relayed stream ends — normally, or because its client left — the splice detaches from both sides.

The streaming phase of the relay (pdproxy/pd/relay.py ``_Splice``) is the client connection's ``flow`` listener
and the decoder response's body ``sink``, and keeps an idle timer (and, while the client is paused, a stall
timer).  Once the relay is over it must leave none of that behind (``_Splice.stop``): the connection's ``flow`` and
the response's ``sink`` unset, every timer cancelled — otherwise a later flow-control callback or a timer firing
reaches a finished request (a stall timer aborts the connection), and the response ↔ splice ↔ connection cycle
outlives the stream.  Driven on the real director with fake engines in process (tests/middle/rig.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.middle.fake_upstream import FakeResponse, Gate, Stream
from tests.middle.rig import Rig, settle

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


def timers(splice: Any) -> list[asyncio.TimerHandle]:
    return [t for t in (splice.idle_timer, splice.stall_timer) if t is not None]


async def test_a_stream_that_ends_leaves_no_flow_listener_sink_or_timer() -> None:
    second = Gate("second event")
    async with Rig() as rig:
        rig.fake.script("r", decode=[Stream(events=3, gates={1: second})])
        sent = rig.send("r")
        await second.reached.wait()
        (decode,) = rig.fake.of("decode", "r")
        resp = decode.response
        assert isinstance(resp, FakeResponse)
        splice = sent.client.flow                         # the splice, while the stream runs
        assert splice is not None and resp.sink is splice
        armed = timers(splice)
        assert armed, "the idle timer runs while streaming"
        second.open()
        client = await sent.done()
        assert client.status == 200 and client.events()[-1] == b"[DONE]"
        assert client.flow is None, "the finished stream's splice still listens to the client's flow control"
        assert resp.sink is None, "the decoder response still hands its body to the finished splice"
        assert all(t.cancelled() for t in armed), "a timer of the finished stream is still armed"
        assert not timers(splice)


@pytest.mark.parametrize("paused", [False, True], ids=["reading", "paused"])
async def test_a_stream_whose_client_leaves_leaves_no_flow_listener_or_timer(paused: bool) -> None:
    second = Gate("second event")
    async with Rig() as rig:
        rig.fake.script("r", decode=[Stream(events=5, gates={1: second})])
        sent = rig.send("r")
        await second.reached.wait()
        splice = sent.client.flow
        assert splice is not None
        if paused:                                        # the client's transport is full: the stall timer runs
            sent.client.pause()
            assert splice.stall_timer is not None
        armed = timers(splice)
        assert len(armed) == (2 if paused else 1)
        sent.client.disconnect()
        await sent.task
        await settle()
        (decode,) = rig.fake.of("decode", "r")
        assert decode.response is not None and decode.response.ended == "closed"
        assert sent.client.flow is None, "the abandoned stream's splice still listens to the client's flow control"
        assert all(t.cancelled() for t in armed), "a timer of the abandoned stream is still armed"
        assert not timers(splice)
        assert not sent.client.aborted
