"""A completion's end on the real handler (``PDProxyApp.handle_completion``) with fake engines in process: each
request is recorded exactly once (metrics, request log) however it ends — refused before it is in flight, served,
or left by its client mid-request — a request in flight is recorded before it leaves the in-flight count (an idle
proxy has logged all it served), and ``in_flight`` is back to zero (``Rig.close`` asserts it in every test)."""

from __future__ import annotations

from typing import Any

import pytest

from pdproxy.apis.request import ProxyRequest
from pdproxy.timeline import RequestContext
from tests.middle.fake_upstream import Answer, Gate
from tests.middle.rig import Rig, chat_body

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


async def test_each_request_is_recorded_once_and_before_it_leaves_the_in_flight_count() -> None:
    gate = Gate("prefilling")
    async with Rig() as rig:
        ends: list[tuple[str | None, int, bool, str | None]] = []
        finished = rig.app._finished

        def record(ctx: RequestContext, req: ProxyRequest | None) -> None:
            ends.append((ctx.client_request_id, rig.state.in_flight, req is not None, ctx.outcome))
            finished(ctx, req)

        rig.app._finished = record  # type: ignore[method-assign]
        assert (await rig.send("refused", body=b"{not json").done()).status == 400
        owned = chat_body("parsed", vllm_xargs={"kv_transfer_params": {}})    # parsed, then refused
        assert (await rig.send("parsed", body=owned).done()).status == 400
        assert (await rig.run("served")).status == 200
        rig.fake.script("left", prefill=[Answer(gate=gate)])
        left = rig.send("left")
        await gate.reached.wait()
        assert rig.state.in_flight == 1
        left.client.disconnect()
        await left.task
        assert rig.state.in_flight == 0
    expected: list[Any] = [("refused", 0, False, "bad_request"), ("parsed", 0, True, "bad_request"),
                           ("served", 1, True, "ok"), ("left", 1, True, "client_disconnected")]
    assert ends == expected
