"""A KV release leg sent to a decoder whose breaker admits a trial does not take that trial.

A release leg (pdproxy/pd/kv_release.py) only carries a KV handle nobody will pull to a decoder so that the
prefiller frees it; its outcome is never reported to the decoder's breaker.  So it picks its decoder without
taking a half-open breaker's one trial slot (``trial=False``): that slot is for a real request, whose answer
closes the breaker again.  Were the release to take it, nothing would ever give it back and the decoder — here the
only one — would refuse every later request.  Driven on the real director with fake engines in process
(tests/middle/rig.py), whose ``close`` also asserts that every counter is back to zero and every handle freed."""

from __future__ import annotations

import pytest

from pdproxy.engines.breaker import BreakerState
from tests.middle.fake_upstream import Gate, Stream
from tests.middle.rig import DECODERS, Rig, until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


async def test_a_release_leg_to_a_decoder_awaiting_its_trial_leaves_the_trial_to_the_next_request() -> None:
    async with Rig(decode=DECODERS[:1]) as rig:
        d0 = rig.endpoint(DECODERS[0])
        health = rig.state.health
        connecting = Gate("decoder connect")
        rig.fake.script("left", decode=[Stream(connect=connecting)])
        left = rig.send("left")
        await connecting.reached.wait()                  # prefilled; its decode leg is connecting to d0

        health.record_failure(d0, hard=True)             # meanwhile d0's breaker opens (a refused connection) ...
        assert not health.can_take(d0)
        await until(lambda: health.can_take(d0), "the probe re-admitting d0 for a trial")   # ... and awaits a trial

        left.client.disconnect()                         # the client leaves: its KV handle goes to a release leg
        await left.task
        await until(lambda: bool(rig.fake.of("release", "left")) and not rig.director.kv_release._tasks,
                    "the release leg done")
        (release,) = rig.fake.of("release", "left")
        assert release.endpoint == d0 and release.result == "answered"   # the only decoder took the release
        assert health.breaker(d0).state is not BreakerState.CLOSED       # no verdict from a release leg ...
        assert health.can_take(d0), "the release leg took the decoder's trial slot"   # ... and no trial taken

        after = await rig.run("after")                   # the trial goes to a real request, which closes it
        assert after.status == 200, after.text
        assert after.events()[-1] == b"[DONE]"
        assert [c.endpoint for c in rig.fake.of("decode", "after")] == [d0]
        assert health.breaker(d0).state is BreakerState.CLOSED
    assert left.client.status == 0 and not left.client.pieces
