"""Property: whatever the engines do, whenever clients leave and however concurrent requests interleave, the real
director (pdproxy/pd/director.py, its legs, the prefill queue and the relay, served by the app's completion handler)
holds exactly the leases its pattern says — one per engine leg in flight, plus the prefiller's while its request
holds an unconsumed KV handle (:func:`held`) — so no load counter ever goes negative and every one ends at zero;
and every KV handle a prefiller handed out gets exactly one fate: pulled by a decoder, rejected by one (vLLM frees
it), or released by a release leg.  Every client still connected at the end got a whole response (a stream ends
with ``data: [DONE]``).

Hypothesis draws each request's script — streamed or not, the outcomes of its prefill legs and of its decode legs
(answer, refusal, reset, timeout, 4xx/5xx, a hang, a stream broken before or after its first event, an error
event, a prefiller that finished the request or gave no handle) — and a list of actions: open one of the engines'
pending steps (every step of every fake engine waits at its own gate, tests/middle/fake_upstream.py
``stepping``), disconnect a client, or pause / resume a client's transport.  Then every remaining step is let
through, and clients still waiting on a hung engine leave.  Nothing waits on a clock (the loop runs until quiet
between actions) and request ids are made deterministic, so an example replays exactly.
"""

from __future__ import annotations

import asyncio
import itertools
import types
from collections import Counter
from dataclasses import dataclass
from unittest import mock

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import pdproxy.timeline
from pdproxy.http.client import Disconnected
from tests.middle.fake_upstream import (
    Answer,
    Call,
    FakeUpstream,
    Hang,
    Outcome,
    Refuse,
    Reset,
    Status,
    Stream,
    TimeOut,
    completion,
    error_event,
    handle_id,
)
from tests.middle.rig import DECODERS, PREFILLERS, Rig, Sent, settle

PREFILL = ("ok", "refuse", "reset", "timeout", "500", "503", "400", "hang", "finished", "no handle")
DECODE = ("ok", "refuse", "reset", "timeout", "503", "400", "hang", "broken early", "broken late", "error event",
          "eof early")
ACTIONS = ("go", "go", "go", "leave", "pause", "resume")


def prefill_outcome(name: str) -> Outcome:
    return {"ok": Answer, "refuse": Refuse, "reset": Reset, "timeout": TimeOut, "hang": Hang,
            "500": lambda: Status(500), "503": lambda: Status(503), "400": lambda: Status(400),
            "finished": lambda: Answer(body=completion("ended", finish="stop", completion_tokens=1), handle=False),
            "no handle": lambda: Answer(handle=False)}[name]()


def decode_outcome(name: str, stream: bool) -> Outcome:
    common = {"refuse": Refuse, "reset": Reset, "timeout": TimeOut, "hang": Hang, "503": lambda: Status(503),
              "400": lambda: Status(400)}
    if name in common:
        return common[name]()
    if not stream:
        return Status(500) if name == "error event" else Reset() if name.endswith("early") else Answer()
    return {"ok": lambda: Stream(events=2),
            "broken early": lambda: Stream(events=0, end=Disconnected("engine reset")),
            "broken late": lambda: Stream(events=2, end=Disconnected("engine reset")),
            "error event": lambda: Stream(events=[error_event(500)]),
            "eof early": lambda: Stream(events=0, end="eof")}[name]()


@dataclass
class Script:
    stream: bool
    prefill: list[str]
    decode: list[str]


scripts = st.lists(st.builds(Script, stream=st.booleans(),
                             prefill=st.lists(st.sampled_from(PREFILL), min_size=1, max_size=3),
                             decode=st.lists(st.sampled_from(DECODE), min_size=1, max_size=3)),
                   min_size=1, max_size=4)
actions = st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 63)), max_size=40)


def held(rig: Rig, live: set[str]) -> Counter[str]:
    """The leases the director should hold now, per endpoint URL, from what the engines saw: one per leg in
    flight (prefill — also one whose client left, awaited for its KV handle —, decode, release), one per prefiller
    whose KV handle its request still holds — given out to a request still running, neither pulled nor rejected nor
    released, and not given up after a decoder that had it failed (only a refused decoder leaves the handle
    intact) — and one per prefiller whose handle a release leg in flight is freeing (the KV is still there)."""
    fake = rig.fake
    out: Counter[str] = Counter()
    handed_by = {handle_id(c.handle): c.endpoint.url for c in fake.calls if c.kind == "prefill"}
    for c in fake.calls:
        if c.open or holds_handle(fake, c, live):
            out[c.endpoint.url] += 1
        if c.kind == "release" and c.open and c.handle_in in handed_by:
            out[handed_by[c.handle_in]] += 1
    return out


def holds_handle(fake: FakeUpstream, c: Call, live: set[str]) -> bool:
    """``c`` is a prefill answered with a handle that its running request still holds."""
    h = handle_id(c.handle)
    if c.kind != "prefill" or c.key not in live or h is None or fake.fates[h]:
        return False
    return not any(d.handle_in == h and d.received and not d.open for d in fake.of("decode", c.key))


def check_loads(rig: Rig, sent: list[Sent]) -> None:
    expected = held(rig, {s.key for s in sent if not s.task.done()})
    for e in rig.state.pool.endpoints():
        load = rig.state.pool.load(e)
        assert load.requests >= 0 and load.tokens >= 0, (e.name, load)
        assert load.requests == expected[e.url], (e.name, load, expected, rig.fake.calls)


async def run(drawn: list[Script], steps: list[tuple[str, int]]) -> None:
    # 2 + 2 engines, one prefill at a time per prefiller: requests queue for slots and share engines
    # a prefill whose client left is awaited for prefill_cancel_grace_s (clock time; the only wait on a clock)
    rig = Rig(prefill=PREFILLERS[:2], decode=DECODERS[:2], stepping=True, prefill_budget_tokens=1, prefill_budget_s=0,
              prefill_cancel_grace_s=0.02)
    fake = rig.fake
    for i, s in enumerate(drawn):
        fake.script(f"r{i}", prefill=[prefill_outcome(p) for p in s.prefill],
                    decode=[decode_outcome(d, s.stream) for d in s.decode])
    sent = [rig.send(f"r{i}", stream=s.stream) for i, s in enumerate(drawn)]
    ended = False
    try:
        await settle()
        for kind, i in steps:
            client = sent[i % len(sent)].client
            if kind == "go":
                closed = [g for g in fake.pending if not g.is_open]
                if closed:
                    closed[i % len(closed)].open()
            elif kind == "leave":
                client.disconnect()
            elif kind == "pause":
                client.pause()
            else:
                client.resume()
            await settle()
            check_loads(rig, sent)
        for s in sent:
            s.client.resume()
        for _ in range(1000):                     # let everything through; who waits on a hung engine leaves
            await settle()
            check_loads(rig, sent)
            closed = [g for g in fake.pending if not g.is_open]
            live = [s for s in sent if not s.task.done()]
            if closed:
                for g in closed:
                    g.open()
            elif live:
                live[0].client.disconnect()
            elif not rig.director.kv_release._tasks:
                break
            else:                                 # a prefill awaited after its client left: the grace runs out
                await asyncio.wait(list(rig.director.kv_release._tasks), timeout=0.05)
        else:
            raise AssertionError(f"the run did not end: pending={fake.pending} calls={fake.calls}")
        ended = True
    finally:
        await rig.close(check=False, abandon=not ended)
    # a release leg can find no decoder to go to (every one refused, their breakers open): the handle then stays
    # pinned until the connector's timeout, and the releaser counts it — that is the only leak allowed
    leaked = [n for n, f in fake.fates.items() if not f]
    assert len(leaked) == rig.director.kv_release.failed, (fake.fates, fake.calls)
    assert all(len(f) <= 1 for f in fake.fates.values()), (fake.fates, fake.calls)
    if not leaked:
        rig.check()
    else:
        assert rig.state.pool.idle() and not rig.negative and rig.state.queue.idle(), rig.state.pool.totals()
    event(f"release legs: {bool(fake.of('release'))}")
    event(f"waited for a prefill slot: {rig.state.queue.stats.waited_total > 0}")
    event(f"a client left: {any(s.client.gone for s in sent)}")
    event(f"a decoder failover: {any(len(fake.of('decode', s.key)) > 1 for s in sent)}")
    event(f"a handle left pinned (no decoder for its release leg): {bool(leaked)}")
    for s, script in zip(sent, drawn, strict=True):  # every client still there got a whole response
        c = s.client
        if c.gone:
            continue
        assert c.finished and c.status, (s.key, c.status, c.pieces)
        if c.status == 200 and script.stream:
            assert c.events()[-1] == b"[DONE]", (s.key, c.events())


@settings(max_examples=75, deadline=None)
@given(drawn=scripts, steps=actions)
@pytest.mark.timeout(60)
def test_the_director_keeps_every_counter_and_kv_handle_balanced(drawn: list[Script],
                                                                 steps: list[tuple[str, int]]) -> None:
    ids = itertools.count()
    deterministic = types.SimpleNamespace(urandom=lambda n: next(ids).to_bytes(n, "big"))  # the request ids
    with mock.patch.object(pdproxy.timeline, "os", deterministic):
        asyncio.run(run(drawn, steps))
