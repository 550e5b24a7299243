"""Property: whenever a streaming client leaves around its prefill — the request just sent, the prefiller still
computing, or the prefiller done with the KV pinned and its answer on the way — the prefiller's own pinned KV
(the simulator's ``/sim/state``) returns to zero, and so do pdproxy's load counters, long before the connector's
pin timeout (120 s here) — and while the engine holds KV, pdproxy's own ``kv_held_tokens`` is not zero.

The window that used to leak: the engine finished the prefill and pinned the KV, pdproxy had not read the answer
yet, the client left, the answer was dropped unread and no release leg was sent.  The simulated prefiller holds
its answer back after pinning (fault ``hold_answer``) so that window is wide enough to land in; hypothesis draws the
phase the client leaves in, a jitter after it, and a short prompt (prefilled within ``prefill_cancel_grace_s``)
or a long one (still computing when the grace ends: pdproxy closes the connection and the engine aborts).
Phases are observed on the engine and the proxy, never guessed from a clock.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, example, given, reject, settings
from hypothesis import strategies as st

from pdproxy.endpoints import Role
from pdproxy.tokens import sim_prompt
from tests.reliability.harness import CHAT
from tests.support import ProxyThread, SimProcess, running, wait_until

pytestmark = pytest.mark.timeout(90)

SHORT, LONG = 1000, 15000        # prompt tokens: 0.2 s and 3 s of prefill at 5,000 tokens/s
GRACE_S = 2.0                    # prefill_cancel_grace_s: 4x a short prefill + its held answer (a loaded machine's
                                 # margin), 1 s short of a long one's prefill (still computing when it ends)
ANSWER_HELD_S = 0.3              # the prefiller holds its answer this long after pinning the KV (fault "slow")
PHASES = ("sent", "prefilling", "pinned, answer unread")


@pytest.fixture(scope="module")
def rig() -> Iterator[tuple[SimProcess, SimProcess, ProxyThread]]:
    args = ("--served-model-name", "sim-model", "--max-model-len", "16384", "--kv-pin-timeout-s", "120")
    with running(SimProcess("prefill", *args, "--prefill-tokens-per-s", "5000", "--decode-tokens-per-s", "0"),
                 SimProcess("decode", *args, "--prefill-tokens-per-s", "0", "--decode-tokens-per-s", "200")) as (
                     prefiller, decoder):
        proxy = ProxyThread(prefill=[prefiller.url], decode=[decoder.url], retry_backoff_s=0.01,
                            prefill_cancel_grace_s=GRACE_S).start()
        try:
            yield prefiller, decoder, proxy
        finally:
            proxy.stop()


def reached(phase: str, prefiller: SimProcess, proxy: ProxyThread) -> Callable[[], bool]:
    def check() -> bool:
        if phase == "sent":
            return bool(proxy.state.in_flight)
        st_ = prefiller.state()
        if phase == "prefilling":
            return bool(st_["running"]) and not st_["pinned_blocks"]
        return bool(st_["pinned_blocks"])
    return check


async def leave(url: str, body: dict[str, Any], ready: Callable[[], bool], jitter_s: float) -> None:
    async def client() -> None:
        async with httpx.AsyncClient(timeout=30) as c, c.stream("POST", url + "/v1/chat/completions",
                                                                json=body) as resp:
            async for _ in resp.aiter_raw():
                pass

    task = asyncio.create_task(client())
    deadline = time.monotonic() + 10
    while not ready():
        if task.done():          # a loaded machine polled past a short phase: the request ended whole
            await task
            reject()
        assert time.monotonic() < deadline, "phase not reached"
        await asyncio.sleep(0.002)
    await asyncio.sleep(jitter_s)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def released(prefiller: SimProcess, decoder: SimProcess, proxy: ProxyThread, blind: list[int]) -> bool:
    """Engines and proxy idle.  Also appends to ``blind`` the engine's pinned blocks whenever pdproxy's own
    accounting (``kv_held_tokens``, read first) said nothing was held while the engine held KV."""
    (p_endpoint,) = proxy.state.pool.endpoints(Role.PREFILL)
    held = proxy.state.ledger.kv_held_tokens(p_endpoint)
    p, d = prefiller.state(), decoder.state()
    if p["pinned_blocks"] and not held:
        blind.append(p["pinned_blocks"])
    engines_idle = not (p["pinned_blocks"] or p["running"] or p["waiting"] or d["running"] or d["active_streams"])
    return engines_idle and proxy.state.pool.idle() and proxy.state.in_flight == 0


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(phase="pinned, answer unread", long_prompt=False, jitter_ms=5, seed=1)
@given(phase=st.sampled_from((*PHASES, PHASES[-1])), long_prompt=st.booleans(), jitter_ms=st.integers(0, 30),
       seed=st.integers(0, 10**9))
def test_pinned_kv_returns_to_zero_whenever_the_client_leaves(
        rig: tuple[SimProcess, SimProcess, ProxyThread], phase: str, long_prompt: bool, jitter_ms: int,
        seed: int) -> None:
    prefiller, decoder, proxy = rig
    tokens = LONG if long_prompt else SHORT
    if not prefiller.client.get("/sim/faults").json()["faults"]:   # left pending when the prefiller never saw it
        prefiller.faults({"kind": "hold_answer", "delay_s": ANSWER_HELD_S, "times": 1})
    body = {**CHAT, "messages": [{"role": "user", "content": sim_prompt(tokens, unique=True, seed=seed)}],
            "max_tokens": 64}
    asyncio.run(leave(proxy.url, body, reached(phase, prefiller, proxy), jitter_ms / 1000))
    # the bound: the grace (GRACE_S) + the rest of a short prefill + the release leg, on a loaded machine
    blind: list[int] = []
    wait_until(lambda: released(prefiller, decoder, proxy, blind), 10, 0.005,
               f"pinned KV released after leaving in phase {phase!r}: prefiller {prefiller.state()}, "
               f"proxy load {proxy.load()}")
    assert not blind, f"the prefiller held KV that pdproxy's accounting did not see: {blind}"
    event(f"phase: {phase}, long prompt: {long_prompt}")
