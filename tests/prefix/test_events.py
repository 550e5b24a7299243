"""The index follows the engine and routing follows the index: blocks a small pool evicts (``BlockRemoved``) stop
attracting requests; a malformed event stream is counted and skipped while requests are served as before."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from pdproxy.endpoints import Role
from pdproxy.prefix.kv_events import seq_frame
from pdproxy.tokens import sim_prompt
from tests.prefix.conftest import BLOCK, Fleet, log_lines, make_proxy, start_fleet
from tests.support import running, wait_until

pytestmark = pytest.mark.timeout(120)


def held(proxy_url: str, prompt: str) -> dict[str, int]:
    """``GET /debug/prefix``: cached tokens of ``prompt`` per prefiller, as the index says."""
    r = httpx.get(proxy_url + "/debug/prefix", params={"prompt": prompt}, timeout=10)
    assert r.status_code == 200, r.text
    return {e["name"]: e["cached_tokens"] for e in r.json()["endpoints"] if e["role"] == "prefill"}


def complete(url: str, prompt: str) -> httpx.Response:
    r = httpx.post(url + "/v1/completions", json={"model": "sim-model", "prompt": prompt, "max_tokens": 1},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r


def test_evictions_on_a_small_pool_move_the_routing(tmp_path: Path) -> None:
    fleet, sims = start_fleet(2, "--num-gpu-blocks-override", "64", prefill_tokens_per_s=0)   # 1,024 tokens each
    a = sim_prompt(400, unique=True, seed=41)
    with running(*sims):
        log = tmp_path / "requests.log"
        proxy = make_proxy(fleet, log)
        try:
            for url in fleet.urls:                       # both engines compute A (straight to them)
                complete(url, a)
            full = (400 // BLOCK) * BLOCK
            wait_until(lambda: set(held(proxy.url, a + " more").values()) == {full}, 10, 0.05, "A on both")
            first = complete(proxy.url, a + sim_prompt(20, unique=True, seed=42))
            winner = first.headers["x-pdproxy-prefiller"]        # both hold A: the tie-break chose this one
            other = next(u for u in fleet.urls if u != winner)
            complete(winner, sim_prompt(900, unique=True, seed=43))   # 57 of its 64 blocks: A is evicted
            wait_until(lambda: held(proxy.url, a + " more")[winner] < full, 10, 0.05, "A's blocks removed")
            assert held(proxy.url, a + " more")[other] == full
            again = complete(proxy.url, a + sim_prompt(20, unique=True, seed=44))
            assert again.headers["x-pdproxy-prefiller"] == other         # routing follows the index
            proxy.wait_idle()
            status = proxy.state.prefix_cache.subscriber.status(winner)
            assert status.decode_errors == 0
            assert proxy.state.prefix_cache.index.stats.removed_blocks > 0
        finally:
            proxy.stop()
        lines = log_lines(log)
        assert [x["predicted_cached_tokens"] for x in lines] == [x["cached_tokens"] for x in lines]
        assert lines[-1]["cached_tokens"] == full


def test_a_malformed_event_stream_does_not_disturb_serving(sims: Fleet, tmp_path: Path) -> None:
    """The first prefiller's events come from a PUB socket the test writes garbage to (and one good batch)."""
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    target = sims.urls[0]
    events = {**sims.events, target: (port, port)}
    fleet = Fleet(sims.prefillers, sims.decoders, events)
    log = tmp_path / "requests.log"
    try:
        proxy = make_proxy(fleet, log, kv_events_replay=[])     # no replay: a gap forgets that engine
        try:
            status = proxy.state.prefix_cache.subscriber.status(target)
            bad_events = msgspec.msgpack.encode([time.time(), [{"type": "BlockStored", "block_hashes": "x"},
                                                                {"type": "Nonsense"}], 0])
            garbage = [[b"kv"], [b"kv", b"\x00\x01", b"\x92"], [b"kv", seq_frame(0), b"\xc1not msgpack"],
                       [b"kv", seq_frame(1), bad_events]]
            with httpx.Client() as client:
                for i in range(20):
                    for frames in garbage:
                        pub.send_multipart(frames)
                    body = {"model": "sim-model", "max_tokens": 4, "prompt": sim_prompt(300, unique=True, seed=i)}
                    r = client.post(proxy.url + "/v1/completions", json=body, timeout=30)
                    assert r.status_code == 200 and r.json()["choices"][0]["text"]
                    if status.decode_errors >= 4 and status.bad_events >= 1:
                        break
            assert status.decode_errors >= 4 and status.bad_events >= 1, status
            assert proxy.state.prefix_cache.is_precise(target)          # still following that publisher
            metrics = httpx.get(proxy.url + "/metrics").text
            assert f'pdproxy_kv_events_decode_errors_total{{endpoint="{target}"}}' in metrics
            others = [e for e in proxy.state.pool.endpoints(Role.PREFILL) if e.name != target]
            assert all(proxy.state.prefix_cache.is_precise(e.name) for e in others)
            proxy.wait_idle()
        finally:
            proxy.stop()
    finally:
        pub.close(0)
        ctx.term()
    assert all(x["status"] == 200 for x in log_lines(log))


def test_debug_prefix_answers_in_the_apis_shape_and_behind_the_admin_key(sims: Fleet, tmp_path: Path) -> None:
    proxy = make_proxy(sims, tmp_path / "requests.log", events=False, api_keys=["client"], admin_key="admin")
    try:
        assert httpx.get(proxy.url + "/debug/prefix", params={"prompt": "x"}).status_code == 401
        client = {"authorization": "Bearer client"}
        assert httpx.get(proxy.url + "/debug/prefix", params={"prompt": "x"}, headers=client).status_code == 401
        admin = {"authorization": "Bearer admin"}
        missing = httpx.get(proxy.url + "/debug/prefix", headers=admin)
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "prompt"
        r = httpx.post(proxy.url + "/debug/prefix", headers=admin,
                       json={"messages": [{"role": "user", "content": sim_prompt(100, unique=True, seed=5)}]})
        assert r.status_code == 200
        body = r.json()
        assert body["keys"] == "tokens" and body["prompt_tokens"] > 100 and body["blocks"] == body[
            "prompt_tokens"] // BLOCK
        assert {e["name"] for e in body["endpoints"]} == set(sims.urls)
        assert all(e["cached_tokens"] == 0 and e["source"] == "approximate" for e in body["endpoints"])
    finally:
        proxy.stop()
