"""The engine's word overrides pdproxy's memory at once: after a prefiller's ``AllBlocksCleared``, a restart or a
``BlockRemoved`` (even one naming hashes pdproxy never learnt), the prompts pdproxy recently prefilled there stop
counting as cached there — routing goes to the prefiller that really holds the conversation's prefix instead of an
empty cache.  And requests with the same ``cache_salt`` find each other's blocks (only theirs), keyed as vLLM keys
them.  Simulated prefillers publishing KV events on loopback, plus the index and the settling record on their own."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pdproxy.prefix.index import PrefixIndex, block_keys
from pdproxy.prefix.kv_events import removed, stored
from pdproxy.prefix.routing import InflightPrefixes
from pdproxy.tokens import sim_prompt
from tests.prefix.conftest import make_proxy, start_fleet
from tests.support import ProxyThread, SimProcess, running, wait_until

pytestmark = pytest.mark.timeout(120)

E = "http://e:1"
TOKS = list(range(1, 41))                     # 10 blocks of 4


def held(proxy: ProxyThread, prompt: str) -> dict[str, int]:
    """``GET /debug/prefix``: what pdproxy predicts cached for ``prompt`` per prefiller (index + settling)."""
    r = httpx.get(proxy.url + "/debug/prefix", params={"prompt": prompt}, timeout=10)
    assert r.status_code == 200, r.text
    return {e["name"]: e["cached_tokens"] for e in r.json()["endpoints"] if e["role"] == "prefill"}


def complete(url: str, prompt: str) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r


# ------------------------------------------------------------------------------------- unit: index and settling
def test_a_removed_batch_mixing_unknown_hashes_names_the_known_blocks() -> None:
    index = PrefixIndex()
    told: list[tuple[str, frozenset[int] | None]] = []
    index.on_drop = lambda endpoint, keys: told.append((endpoint, keys))
    index.apply(E, [stored(list(range(100, 110)), None, TOKS, 4)])
    keys = block_keys(TOKS, 4).keys
    index.apply(E, [removed([999, 103, 888, 105])])             # two hashes the index never learnt
    assert told == [(E, frozenset({keys[3], keys[5]}))]
    assert index.match(block_keys(TOKS, 4)) == {E: 12}
    index.apply(E, [removed([777])])                            # nothing known: nothing to tell
    assert len(told) == 1
    index.forget(E)
    assert told[-1] == (E, None)


def test_settling_credit_ends_where_the_engine_says() -> None:
    now = [0.0]
    flying = InflightPrefixes(settle_s=5.0, clock=lambda: now[0])
    keys = block_keys(TOKS, 4)
    flying.add(E, keys)
    flying.remove(E, keys, answered=True)
    assert flying.match(keys, E) == 36                           # settling: counted as cached there
    flying.drop(E, frozenset({keys.keys[3]}))                    # the fourth block evicted: the run stops there
    assert flying.match(keys, E) == 12
    flying.drop("http://other:1")                                # another engine's word changes nothing here
    assert flying.match(keys, E) == 12
    running_keys = block_keys(TOKS[:20], 4)
    flying.add(E, running_keys)                                  # in flight: the engine stores it after the clear
    flying.drop(E)
    assert flying.match(keys, E) == 20 and len(flying) == 1
    flying.remove(E, running_keys)
    assert flying.match(keys, E) == 0 and len(flying) == 0
    now[0] = 10.0
    assert flying.match(keys, E) == 0


def test_same_cache_salt_matches_only_the_same_salt() -> None:
    """vLLM hashes the salt into the first block's extra keys and its events list it there
    (``vllm/v1/core/kv_cache_utils.py``: ``generate_block_hash_extra_keys``, ``to_event_extra_keys``)."""
    index = PrefixIndex()
    index.apply(E, [stored(list(range(100, 110)), None, TOKS, 4, extra_keys=[("tenant-a",)] + [None] * 9)])
    index.apply("http://lora:1", [stored(list(range(100, 110)), None, TOKS, 4, lora_name="ad",
                                         extra_keys=[("ad", "tenant-a")] + [("ad",)] * 9)])
    assert index.match(block_keys(TOKS, 4, cache_salt="tenant-a"), [E]) == {E: 36}
    assert index.match(block_keys(TOKS, 4, "ad", cache_salt="tenant-a"), ["http://lora:1"]) == {"http://lora:1": 36}
    assert index.match(block_keys(TOKS, 4, cache_salt="tenant-b"), [E]) == {E: 0}
    assert index.match(block_keys(TOKS, 4), [E]) == {E: 0}      # an unsalted prompt never meets salted blocks
    index.apply("http://plain:1", [stored(list(range(100, 110)), None, TOKS, 4)])
    assert index.match(block_keys(TOKS, 4, cache_salt="tenant-a"), ["http://plain:1"]) == {"http://plain:1": 0}


# ----------------------------------------------------------------------------------- through the simulator
SHARED = sim_prompt(320, unique=True, seed=61)                 # tokens: 320 (one per word)
TURN1 = SHARED + sim_prompt(160, unique=True, seed=62)          # 480
TURN2 = TURN1 + sim_prompt(160, unique=True, seed=63)           # 640
TURN3 = TURN2 + sim_prompt(40, unique=True, seed=64)            # 680


def _conversation_on_a(proxy: ProxyThread, a: str, b: str) -> None:
    """B holds the shared start (straight to it), A the first turn; the second turn goes through pdproxy to A."""
    complete(b, SHARED)
    complete(a, TURN1)
    wait_until(lambda: held(proxy, TURN1 + " more") == {a: 480, b: 320}, 10, 0.05, "both engines' blocks")
    assert complete(proxy.url, TURN2).headers["x-pdproxy-prefiller"] == a


@pytest.mark.parametrize("how", ["reset_prefix_cache", "restart"])
def test_a_cleared_or_restarted_prefiller_stops_attracting_the_conversation(tmp_path: Path, how: str) -> None:
    fleet, sims = start_fleet(2, prefill_tokens_per_s=0)
    with running(*sims):
        proxy = make_proxy(fleet, tmp_path / "requests.log")
        a_sim = fleet.prefillers[0]
        a, b = fleet.urls
        again: SimProcess | None = None
        try:
            _conversation_on_a(proxy, a, b)
            index = proxy.state.prefix_cache.index
            if how == "reset_prefix_cache":
                httpx.post(a + "/reset_prefix_cache", timeout=10).raise_for_status()   # AllBlocksCleared
            else:
                a_sim.stop()           # a new process on the same ports: its event sequence starts again at 0
                again = SimProcess(a_sim.role, *a_sim.args[8:], port=a_sim.port).start()
                complete(a, sim_prompt(40, unique=True, seed=65))   # its first batch tells pdproxy
            wait_until(lambda: index.entries(a) <= 2, 15, 0.02, "the index emptied")
            assert held(proxy, TURN3)[a] == 0              # at once: no credit for what pdproxy sent it before
            assert held(proxy, TURN3)[b] == 320
            assert complete(proxy.url, TURN3).headers["x-pdproxy-prefiller"] == b
            proxy.wait_idle()
        finally:
            proxy.stop()
            if again is not None:
                again.stop()


def test_blocks_a_small_pool_evicts_stop_counting_at_once(tmp_path: Path) -> None:
    fleet, sims = start_fleet(2, "--num-gpu-blocks-override", "64", prefill_tokens_per_s=0)   # 1,024 tokens each
    with running(*sims):
        proxy = make_proxy(fleet, tmp_path / "requests.log")
        a, b = fleet.urls
        try:
            _conversation_on_a(proxy, a, b)
            filler = sim_prompt(900, unique=True, seed=66)
            complete(a, filler)                                  # 57 of its 64 blocks: the conversation is evicted
            wait_until(lambda: held(proxy, filler + " more")[a] == 896, 10, 0.02, "the filler stored")
            assert proxy.state.prefix_cache.index.stats.removed_blocks > 0
            assert held(proxy, TURN3)[a] < 320   # at once, not after the settling time
            assert complete(proxy.url, TURN3).headers["x-pdproxy-prefiller"] == b
            proxy.wait_idle()
        finally:
            proxy.stop()


def test_routing_keys_salted_requests_by_their_salt(tmp_path: Path) -> None:
    """pdproxy's own record (no KV events): a salted prompt it prefilled counts as cached for the same salt only."""
    fleet, sims = start_fleet(1, prefill_tokens_per_s=0)
    with running(*sims):
        proxy = make_proxy(fleet, tmp_path / "requests.log", events=False, prefix_routing="approximate")
        try:
            body = {"model": "sim-model", "prompt": SHARED, "max_tokens": 1, "cache_salt": "tenant-a"}
            assert httpx.post(proxy.url + "/v1/completions", json=body, timeout=60).status_code == 200

            def predicted(**change: object) -> int:
                r = httpx.post(proxy.url + "/debug/prefix", json={**body, "prompt": SHARED + " more", **change},
                               timeout=10)
                assert r.status_code == 200, r.text
                return int(r.json()["endpoints"][0]["cached_tokens"])

            wait_until(lambda: predicted() == 320, 10, 0.05, "the salted prompt recorded")
            assert predicted(cache_salt="tenant-b") == 0 and predicted(cache_salt=None) == 0
            proxy.wait_idle()
        finally:
            proxy.stop()
