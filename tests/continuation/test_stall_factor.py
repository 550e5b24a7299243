"""A continuable stream's decoder counts as lost only after a silence of ``stall_factor`` × the stream's own mean
inter-token time, never less than ``stall_min_s``.

With ``--stream-continuation`` the stall sweep (pdproxy/pd/continuation.py ``LiveStreams.sweep``) asks each live
stream whether its decoder is lost (pdproxy/pd/relay.py ``_Splice.check_lost``).  A stream whose decoder is simply
slow — every gap longer than ``stall_min_s``, but steady — must not be cut: its limit is ``factor`` × its mean gap.
A silence past that limit is a loss (here: the fake decoder sends no token ids, so the stream is not continued and
the client gets the loss as an error event).  Time is a fake clock for the relay and the sweep (the sweep is called
by the test), so nothing waits on the wall clock; the real director and relay run on fake engines in process
(tests/middle/rig.py)."""

from __future__ import annotations

import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest

import pdproxy.pd.continuation
import pdproxy.pd.relay
from tests.middle.fake_upstream import Gate, Stream
from tests.middle.rig import DECODERS, Rig, Sent, settle, until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]

FACTOR = 10.0
MIN_S = 1.0
SETTINGS: dict[str, Any] = {"stream_continuation": True, "stream_continuation_stall_factor": FACTOR,
            "stream_continuation_stall_min_s": MIN_S}


class Clock:
    """``time.monotonic`` plus an offset the test moves forward."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[Clock]:
    c = Clock()
    fake = types.SimpleNamespace(monotonic=c.monotonic)
    monkeypatch.setattr(pdproxy.pd.relay, "time", fake)
    monkeypatch.setattr(pdproxy.pd.continuation, "time", fake)
    yield c


def events_at(sent: Sent, n: int) -> Callable[[], bool]:
    return lambda: len(sent.client.events()) >= n


def errors(sent: Sent) -> list[dict[str, object]]:
    return [orjson.loads(e)["error"] for e in sent.client.events() if e.startswith(b'{"error"')]


async def start_paced(rig: Rig, clock: Clock, gates: dict[int, Gate], gap_s: float) -> Sent:
    """A stream whose first inter-token gap is ``gap_s`` (under ``MIN_S``); returns once the client has 2 events
    and the decoder waits at ``gates[2]``."""
    rig.fake.script("r", decode=[Stream(events=5, gates=gates)])
    sent = rig.send("r")
    await gates[1].reached.wait()
    await until(events_at(sent, 1), "the first event at the client")
    clock.advance(gap_s)
    gates[1].open()
    await gates[2].reached.wait()
    await until(events_at(sent, 2), "the second event at the client")
    return sent


async def test_a_steady_stream_slower_than_the_minimum_but_within_its_factor_is_not_lost(clock: Clock) -> None:
    gates = {i: Gate(f"event {i}") for i in (1, 2, 3)}
    async with Rig(decode=DECODERS[:2], **SETTINGS) as rig:
        live = rig.director.decode.live
        sent = await start_paced(rig, clock, gates, 0.5)            # mean gap 0.5 s: limit max(1, 10 × 0.5) = 5 s
        for i in (2, 3):
            clock.advance(3.0)                                        # silent 3 s: over MIN_S, under the limit
            live.sweep()
            await settle()                                            # a loss would reach the client now
            assert not errors(sent), f"a steady stream was declared lost after event {i}: {errors(sent)}"
            assert sum(live.count(rig.endpoint(url).name) for url in DECODERS[:2]) == 1   # still relayed
            gates[i].open()
            await until(events_at(sent, i + 1), f"event {i} at the client")
        client = await sent.done()
    events = client.events()
    assert client.status == 200 and events[-1] == b"[DONE]" and len(events) == 6 and not errors(sent)
    (decode,) = rig.fake.of("decode", "r")                          # one leg: never cut, never continued
    assert decode.response is not None and decode.response.ended == "released"


async def test_a_silence_past_the_factor_of_the_streams_gap_is_a_lost_decoder(clock: Clock) -> None:
    gates = {i: Gate(f"event {i}") for i in (1, 2)}
    async with Rig(decode=DECODERS[:2], **SETTINGS) as rig:
        live = rig.director.decode.live
        sent = await start_paced(rig, clock, gates, 0.5)            # limit 5 s
        clock.advance(4.0)
        live.sweep()
        await settle()
        assert not errors(sent)
        clock.advance(16.0)                                           # silent 20 s: far past 10 × the mean gap
        live.sweep()
        client = await sent.done()
        gates[2].open()
    (error,) = errors(sent)
    assert "no token for" in str(error["message"])
    assert client.events()[-1] == b"[DONE]" and len(client.events()) == 4   # 2 tokens, the error, [DONE]
    (decode,) = rig.fake.of("decode", "r")
    assert decode.response is not None and decode.response.ended == "closed"   # the lost leg was dropped
