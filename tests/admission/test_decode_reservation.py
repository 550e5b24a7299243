"""A prefill's reservation of decoder KV ends when its decode leg takes the decoder's lease.

The prefill queue holds back a prefill until the decoders' free KV (their pool minus what the decode leases hold,
minus the reservations of prefills not yet decoding) has room for it (pdproxy/scheduling/queue.py, "Decoder
capacity").  Once a request's decode leg holds its lease on a decoder, that lease counts its KV, so the prefill's
reservation must be gone (pdproxy/pd/decode.py calls ``PrefillSlot.decode_started``): otherwise the request is
counted twice for as long as it decodes, and a prefill that fits beside it is held back.  Driven on the real
director with fake engines in process (tests/middle/rig.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tests.middle.fake_upstream import Answer, Gate, Stream
from tests.middle.rig import DECODERS, PREFILLERS, Rig, chat_body, until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


async def until_timed(cond: Callable[[], object], what: str, timeout_s: float = 5.0) -> None:
    """Wait (polling the loop) until ``cond()`` holds; for conditions that need the clock to move."""
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)
    assert cond(), what


async def test_a_decoding_request_holds_no_reservation_and_does_not_hold_back_the_next_prefill() -> None:
    async with Rig(prefill=PREFILLERS[:1], decode=DECODERS[:1]) as rig:
        p0, d0 = rig.endpoint(PREFILLERS[0]), rig.endpoint(DECODERS[0])
        pool, ledger = rig.state.pool, rig.state.ledger

        prefilling, decoding = Gate("a's prefill"), Gate("a's second event")
        rig.fake.script("a", prefill=[Answer(gate=prefilling)], decode=[Stream(events=3, gates={1: decoding})])
        a = rig.send("a")
        await prefilling.reached.wait()
        prompt = pool.load(p0).tokens                      # the prefill lease: the prompt's tokens
        assert prompt > 0 and ledger.pending_decode == prompt + 1   # reserved on the decoders until decoding
        prefilling.open()
        await decoding.reached.wait()                      # a's decode leg holds its lease and is streaming
        assert len(a.client.events()) == 1
        assert ledger.pending_decode == 0, "the decoding request still holds its prefill's decoder reservation"
        held = pool.load(d0).tokens                        # a's decode lease: prompt + its output (8)
        assert held > prompt

        # a decoder KV pool with room for one more prompt beside a, not for a counted twice plus that prompt
        need = prompt + 1
        rig.state.infos[d0].kv_pool_tokens = held + need + need // 2
        await until_timed(lambda: rig.state.limits.of(d0).kv_pool_tokens == held + need + need // 2,
                          "the decoder's KV pool seen by the limits")

        b = rig.send("b")                                  # the same prompt size as a
        await until(lambda: bool(rig.fake.of("prefill", "b")), "b's prefill sent while a decodes")
        assert rig.state.queue.depth == 0
        assert not decoding.is_open                        # a is still decoding
        decoding.open()
        assert (await a.done()).status == 200
        assert (await b.done()).status == 200
    assert a.client.events()[-1] == b"[DONE]" and b.client.events()[-1] == b"[DONE]"
    assert rig.state.queue.stats.waited_total == 0         # b never waited for a slot


@pytest.mark.parametrize("reserved", [1024, 8000])
async def test_large_max_tokens_count_only_the_reserved_output_so_they_cannot_lock_others_out(reserved: int) -> None:
    """Three requests asking 8,000 output tokens each decode on a decoder whose pool holds their prompts and
    1,024 output tokens each with room to spare: a fourth request's prefill goes out at once (vLLM allocates output
    as it generates; an attacker's large ``max_tokens`` once held the whole pool while it stood free).  Counting the
    whole limit (``decode_reserved_output_tokens`` 8,000) holds it back until one of them ends."""
    async with Rig(prefill=PREFILLERS[:1], decode=DECODERS[:1], decode_reserved_output_tokens=reserved) as rig:
        p0, d0 = rig.endpoint(PREFILLERS[0]), rig.endpoint(DECODERS[0])
        pool = rig.state.pool
        gates = [Gate(f"h{i}'s second event") for i in range(3)]
        prefilling = Gate("h0's prefill")
        for i, gate in enumerate(gates):
            rig.fake.script(f"h{i}", prefill=[Answer(gate=prefilling if i == 0 else None)],
                            decode=[Stream(events=3, gates={1: gate})])
        hogs = [rig.send("h0", body=chat_body("h0", max_tokens=8000))]
        await prefilling.reached.wait()
        prompt = pool.load(p0).tokens                     # the prefill lease: the prompt (the same size for all)
        prefilling.open()
        hogs += [rig.send(f"h{i}", body=chat_body(f"h{i}", max_tokens=8000)) for i in (1, 2)]
        for gate in gates:
            await gate.reached.wait()                     # all three decoding, their leases held
        assert prompt > 0 and pool.load(d0).tokens == 3 * (prompt + min(8000, reserved))
        pool_tokens = 3 * (prompt + 1024) + 4 * (prompt + 1)       # under 3 × 8,000 tokens of output
        rig.state.infos[d0].kv_pool_tokens = pool_tokens
        await until_timed(lambda: rig.state.limits.of(d0).kv_pool_tokens == pool_tokens,
                          "the decoder's KV pool seen by the limits")

        victim = rig.send("v", body=chat_body("v", max_tokens=4))
        if reserved == 1024:
            await until(lambda: bool(rig.fake.of("prefill", "v")), "the victim's prefill sent while all decode")
            assert (await victim.done()).status == 200
            assert all(not h.task.done() for h in hogs)     # served while every large request still decodes
            assert rig.state.queue.stats.waited_total == 0
        else:
            await until(lambda: rig.state.queue.depth == 1, "the victim waits for decoder KV")
            assert not rig.fake.of("prefill", "v")
        for gate in gates:
            gate.open()
        for h in hogs:
            assert (await h.done()).status == 200
        assert (await victim.done()).status == 200
        assert pool.load(d0).tokens == 0
