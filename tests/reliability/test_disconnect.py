"""Client disconnects in each phase: soon after the client left, every upstream connection is closed, every lease
released and the prefiller's pinned KV freed.  "Soon" is measured against what a release that did not happen
would wait for: within 4 s where the engines' work would end in 6–8 s (the slow pair's prefills, streams and
queue; 1 s was missed once with other test runs loading both cores), within 15 s where it would never end (a hung
decoder) or only at the engine's pin timeout (480 s).

Each test starts 16 concurrent streaming requests, waits until all of them are in the phase under test (observed
on the engines and the proxy, never by sleeping), drops every client connection, and then polls — with a 2 s
deadline — the simulators' ``/sim/state`` (running, waiting, active streams, pinned blocks) and the proxy's load
counters.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pdproxy.tokens import sim_prompt
from tests.reliability.harness import CHAT, Fleet4
from tests.support import ProxyThread, SimProcess, sampling, wait_until

pytestmark = pytest.mark.timeout(40)

N = 16
BEFORE_THE_WORK_ENDS_S = 4.0
"""The release bound where the engines' own work would end 6–8 s after the clients left (the slow pair)."""
LONG_BEFORE_S = 15.0
"""The release bound where nothing else would free the engines before the pin timeout (480 s) or ever."""


def chat(prompt_tokens: int, max_tokens: int, seed: int) -> dict[str, Any]:
    return {**CHAT, "messages": [{"role": "user", "content": sim_prompt(prompt_tokens, unique=True, seed=seed)}],
            "max_tokens": max_tokens}


async def _client(url: str, body: dict[str, Any], events: list[int], i: int) -> None:
    async with httpx.AsyncClient(timeout=30) as client, \
            client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        async for chunk in resp.aiter_raw():
            events[i] += chunk.count(b"data:")


def leave_when(url: str, bodies: list[dict[str, Any]], ready: Callable[[list[int]], bool]) -> float:
    """Start one streaming client per body, wait until ``ready(events per client)``, then drop every client
    connection.  Returns the monotonic time the clients left."""
    async def main() -> float:
        events = [0] * len(bodies)
        tasks = [asyncio.create_task(_client(url, b, events, i)) for i, b in enumerate(bodies)]
        deadline = time.monotonic() + 15
        while not ready(events):
            assert time.monotonic() < deadline, f"phase not reached: events={events}"
            assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
            await asyncio.sleep(0.02)
        for t in tasks:
            t.cancel()
        left = time.monotonic()
        await asyncio.gather(*tasks, return_exceptions=True)
        return left
    return asyncio.run(main())


def engine(sim: SimProcess) -> dict[str, Any]:
    return sim.state()


def assert_released(proxy: ProxyThread, sims: list[SimProcess], left_at: float, within_s: float) -> None:
    """Within ``within_s`` of ``left_at``: no engine request or stream left, no pinned KV, proxy idle."""
    def clean() -> bool:
        for s in sims:
            st = s.state()
            if st["running"] or st["waiting"] or st["active_streams"] or st["pinned_blocks"]:
                return False
        st = proxy.state
        return st is not None and st.pool.idle() and st.in_flight == 0
    remaining = within_s - (time.monotonic() - left_at)
    wait_until(clean, max(remaining, 0.05), 0.02, "engines and proxy released after the clients left "
                                                  f"({[s.state() for s in sims]}, load={proxy.load()})")


def slow_proxy(slow_pair: tuple[SimProcess, SimProcess], **settings: Any) -> ProxyThread:
    """A proxy in front of the slow prefiller and decoder (their recordings cleared)."""
    for s in slow_pair:
        s.reset()
    return ProxyThread(prefill=[slow_pair[0].url], decode=[slow_pair[1].url], **settings).start()


def test_disconnect_during_prefill(slow_pair: tuple[SimProcess, SimProcess]) -> None:
    prefiller, decoder = slow_pair
    aborted_before = engine(prefiller)["aborted"]
    proxy = slow_proxy(slow_pair)
    try:
        bodies = [chat(2000, 8, seed) for seed in range(N)]  # 16 × 2000 tokens at 4000 tokens/s: ~8 s of prefill
        left = leave_when(proxy.url, bodies, lambda _ev: proxy.state.in_flight == N
                          and engine(prefiller)["running"] > 0)
        assert_released(proxy, [prefiller, decoder], left, BEFORE_THE_WORK_ENDS_S)
        st = engine(prefiller)
        # every prefill was aborted, or — finished within prefill_cancel_grace_s — released by a release leg
        releases = decoder.completions_received()
        assert all(r["body"]["max_tokens"] == 1 and r["body"]["kv_transfer_params"] for r in releases)
        assert st["aborted"] - aborted_before + len(releases) == len(prefiller.completions_received())
    finally:
        proxy.stop()


def test_disconnect_in_the_gap_between_prefill_and_decode(fleet4: Fleet4) -> None:
    """The client leaves after the prefill answered and before the decode leg: the prefiller's pinned KV is freed
    by a release leg (the decoder receives the handle with max_tokens 1 and tells the prefiller), not after the
    engine's pin timeout."""
    proxy = fleet4.proxy()
    try:
        director = proxy.app.director
        assert director is not None
        paused: list[str] = []

        async def pause_before_decode(*_a: Any, **_kw: Any) -> bool:
            paused.append("x")
            await asyncio.Event().wait()  # until cancelled by the client's disconnect
            return False

        director.decode.run = pause_before_decode  # type: ignore[method-assign]
        pinned_while_paused: list[int] = []

        def all_paused(_ev: list[int]) -> bool:
            if len(paused) < N:
                return False
            pinned_while_paused.append(fleet4.pinned())
            return True

        left = leave_when(proxy.url, [chat(300, 8, s) for s in range(N)], all_paused)
        assert pinned_while_paused[-1] > 0  # every prefill answered and pinned its KV
        assert_released(proxy, fleet4.all, left, LONG_BEFORE_S)
        legs = [r["body"] for s in fleet4.decoders for r in s.completions_received()]
        assert len(legs) == N and all(b["max_tokens"] == 1 and b["stream"] is False for b in legs)
        assert all(b["kv_transfer_params"]["do_remote_prefill"] for b in legs)
    finally:
        proxy.stop()


def test_disconnect_while_decoder_has_not_answered(fleet4: Fleet4) -> None:
    """The decoder holds the request without a first event (hung); the client leaves: the decode connection is
    closed and the prefiller's KV released."""
    decoder = fleet4.decoders[0]
    proxy = fleet4.proxy(decode=[decoder.url])
    try:
        decoder.faults({"kind": "hang", "times": N})
        left = leave_when(proxy.url, [chat(300, 8, s) for s in range(N)],
                          lambda _ev: len(decoder.completions_received()) == N)
        assert_released(proxy, fleet4.all, left, LONG_BEFORE_S)
    finally:
        proxy.stop()


def test_disconnect_mid_stream(slow_pair: tuple[SimProcess, SimProcess]) -> None:
    prefiller, decoder = slow_pair
    aborted_before = engine(decoder)["aborted"]
    proxy = slow_proxy(slow_pair)
    try:
        bodies = [chat(100, 400, seed) for seed in range(N)]  # 400 tokens at 50 tokens/s: ~8 s streams
        left = leave_when(proxy.url, bodies, lambda ev: all(n >= 3 for n in ev))
        assert_released(proxy, [prefiller, decoder], left, BEFORE_THE_WORK_ENDS_S)
        assert engine(decoder)["aborted"] - aborted_before == N
    finally:
        proxy.stop()


def test_disconnect_while_waiting_in_the_prefill_queue(slow_pair: tuple[SimProcess, SimProcess]) -> None:
    """Requests held in pdproxy's prefill queue (a per-prefiller budget of in-flight prefill tokens)
    leave it when their clients go: nothing of theirs reaches an engine afterwards and the counters drain."""
    prefiller, decoder = slow_pair
    proxy = slow_proxy(slow_pair, prefill_budget_tokens=2000, prefill_budget_s=0)
    try:
        queue = proxy.state.admission.queue
        bodies = [chat(1500, 8, seed) for seed in range(N)]  # one fits the budget at a time: 15 wait
        left = leave_when(proxy.url, bodies, lambda _ev: queue.depth >= N - 2
                          and engine(prefiller)["running"] > 0)
        assert_released(proxy, [prefiller, decoder], left, BEFORE_THE_WORK_ENDS_S)
        assert queue.depth == 0
        # Nobody waiting was dispatched after leaving.  The clients' closes reach pdproxy one by one: the running
        # prefill's cancel frees its budget, and a waiter whose close is still unread in its socket may be granted
        # in that loop turn (seen once in CI under load: 2 prefills).  A waiter that stayed queued after leaving
        # would be dispatched as the budget frees, one after another, up to all N.
        dispatched = len(prefiller.completions_received())
        assert 1 <= dispatched <= 3, dispatched
    finally:
        proxy.stop()


def test_a_prefill_left_running_keeps_its_budget_until_the_engine_answers(
        slow_pair: tuple[SimProcess, SimProcess]) -> None:
    """A client that leaves while its prefill runs does not stop the engine computing it (its answer is drained
    for ``prefill_cancel_grace_s``): the prefill stays dispatched and unanswered, so its budget is not handed to
    the next waiter until the engine answered — else every client that times out and retries stacks one more
    prefill on a prefiller already over its budget."""
    prefiller, decoder = slow_pair
    proxy = slow_proxy(slow_pair, prefill_budget_tokens=2000, prefill_budget_s=0, prefill_cancel_grace_s=10)
    try:
        queue = proxy.state.admission.queue

        async def main() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                big = asyncio.create_task(client.post(proxy.url + "/v1/chat/completions",
                                                      json=chat(8000, 4, seed=1)))   # ~2 s of prefill
                await asyncio.to_thread(wait_until, lambda: engine(prefiller)["running"] > 0, 10, 0.02, "big prefill")
                small = asyncio.create_task(client.post(proxy.url + "/v1/chat/completions",
                                                        json=chat(1000, 4, seed=2)))
                await asyncio.to_thread(wait_until, lambda: queue.depth == 1, 10, 0.02, "small one queued")
                big.cancel()                                 # its client leaves; the engine still computes it
                await asyncio.gather(big, return_exceptions=True)
                resp = await small
                assert resp.status_code == 200, resp.text

        with sampling(lambda: (lambda s: s["running"] + s["waiting"])(engine(prefiller))) as on_engine:
            asyncio.run(main())
        assert max(on_engine) == 1     # the small prompt waited for the big one's answer, not for its client
        assert len(prefiller.completions_received()) == 2
        assert_released(proxy, [prefiller, decoder], time.monotonic(), LONG_BEFORE_S)
    finally:
        proxy.stop()
