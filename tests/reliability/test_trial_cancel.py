"""A half-open breaker's one trial request, cancelled mid-leg (the client left), gives the trial back.

An engine whose breaker opened and was re-admitted by a good ``/health`` probe lets exactly one trial request in
(pdproxy/engines/breaker.py).  When that request's client leaves during the prefill leg (pdproxy/pd/prefill.py)
or the decode leg (pdproxy/pd/decode.py), the leg says nothing of the engine's health: the trial slot must be
freed (``HealthMonitor.record_neutral``), or the engine — here the only prefiller, or the only decoder — would
never take a request again.  Driven on the real director with fake engines in process (tests/middle/rig.py), whose
``close`` also asserts that every counter is back to zero."""

from __future__ import annotations

import pytest

from pdproxy.endpoints import Endpoint
from pdproxy.engines.breaker import BreakerState
from tests.middle.fake_upstream import Answer, Gate, Stream
from tests.middle.rig import DECODERS, PREFILLERS, Rig, until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


async def half_open_ready(rig: Rig, endpoint: Endpoint) -> None:
    """Open ``endpoint``'s breaker (a refused connection opens it at once) and wait for the probe that follows to
    re-admit it: its one trial is free."""
    health = rig.state.health
    health.record_failure(endpoint, hard=True)
    assert not health.can_take(endpoint)
    await until(lambda: health.can_take(endpoint), "the probe re-admitting the engine for a trial")


async def test_a_prefillers_trial_request_whose_client_leaves_mid_prefill_frees_the_trial() -> None:
    async with Rig(prefill=PREFILLERS[:1]) as rig:
        p0 = rig.endpoint(PREFILLERS[0])
        health = rig.state.health
        await half_open_ready(rig, p0)

        prefilling = Gate("the trial's prefill")
        rig.fake.script("trial", prefill=[Answer(gate=prefilling)])
        trial = rig.send("trial")
        await prefilling.reached.wait()
        assert health.breaker(p0).state is BreakerState.HALF_OPEN
        assert not health.can_take(p0)                                 # the one trial is in flight
        trial.client.disconnect()
        await trial.task
        prefilling.open()
        assert health.can_take(p0), "the cancelled trial still holds the half-open prefiller's trial slot"

        after = await rig.run("after")
        assert after.status == 200, after.text
        assert [c.endpoint for c in rig.fake.of("prefill", "after")] == [p0]
        assert health.breaker(p0).state is BreakerState.CLOSED          # the next request was the trial, and passed
    assert trial.client.status == 0 and not trial.client.pieces


async def test_a_decoders_trial_request_whose_client_leaves_mid_decode_frees_the_trial() -> None:
    async with Rig(decode=DECODERS[:1]) as rig:
        d0 = rig.endpoint(DECODERS[0])
        health = rig.state.health
        await half_open_ready(rig, d0)

        first_event = Gate("the trial's first event")
        rig.fake.script("trial", decode=[Stream(gates={0: first_event})])
        trial = rig.send("trial")
        await first_event.reached.wait()
        assert health.breaker(d0).state is BreakerState.HALF_OPEN
        assert not health.can_take(d0)                                 # the one trial is in flight
        trial.client.disconnect()
        await trial.task
        assert health.can_take(d0), "the cancelled trial still holds the half-open decoder's trial slot"

        after = await rig.run("after")
        assert after.status == 200, after.text
        assert after.events()[-1] == b"[DONE]"
        assert [c.endpoint for c in rig.fake.of("decode", "after")] == [d0]
        assert health.breaker(d0).state is BreakerState.CLOSED
    (release,) = rig.fake.of("release", "trial")                       # the trial's unpulled KV was freed
    assert release.endpoint == d0
    assert trial.client.status == 0 and not trial.client.pieces
