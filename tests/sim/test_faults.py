"""Fault injection (POST /sim/faults): each kind, counting, listing, validation."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest

from pdproxy.sim.config import SimConfig
from pdproxy.sim.faults import FaultBook, slice_event
from pdproxy.sim.server import SimServer, running_sim
from tests.sim.helpers import eventually, get_json, post, sse_data, sse_json
from tests.sim.rawhttp import raw_post

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "stream": True}


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with running_sim(SimConfig(port=0)) as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def add(http: aiohttp.ClientSession, sim: SimServer, *specs: dict) -> None:
    status, text, _ = await post(http, sim.base_urls[0] + "/sim/faults", list(specs))
    assert status == 200, text


async def test_status_fault_counts_requests_and_sets_retry_after(sim: SimServer, http: aiohttp.ClientSession) -> None:
    await add(http, sim, {"kind": "status", "status": 503, "retry_after": 7, "on_request": 2})
    url = sim.base_urls[0] + "/v1/completions"
    got = [await post(http, url, {"prompt": "x", "max_tokens": 1}) for _ in range(3)]
    assert [g[0] for g in got] == [200, 503, 200]
    assert got[1][2]["Retry-After"] == "7" and json.loads(got[1][1])["error"]["code"] == 503
    assert (await get_json(http, sim.base_urls[0] + "/sim/faults"))["faults"] == []


async def test_status_fault_with_custom_body_and_path_filter(sim: SimServer, http: aiohttp.ClientSession) -> None:
    body = {"error": {"message": "nope", "type": "BadRequestError", "param": None, "code": 400}}
    await add(http, sim, {"kind": "status", "status": 400, "body": body, "path": "/v1/chat", "times": 2})
    assert (await post(http, sim.base_urls[0] + "/v1/completions", {"prompt": "x", "max_tokens": 1}))[0] == 200
    for _ in range(2):
        status, text, _ = await post(http, sim.base_urls[0] + "/v1/chat/completions", CHAT)
        assert status == 400 and json.loads(text) == body
    assert (await post(http, sim.base_urls[0] + "/v1/chat/completions", CHAT))[0] == 200


async def test_health_answers_a_status_fault_given_its_path(sim: SimServer, http: aiohttp.ClientSession) -> None:
    """``/health`` takes the faults given ``"path": "/health"`` (a dead engine core's 503), generation routes not."""
    await add(http, sim, {"kind": "status", "status": 503, "path": "/health", "times": 2})
    statuses = []
    for _ in range(3):
        async with http.get(sim.base_urls[0] + "/health") as resp:
            statuses.append(resp.status)
    assert statuses == [503, 503, 200]
    assert (await post(http, sim.base_urls[0] + "/v1/completions", {"prompt": "x", "max_tokens": 1}))[0] == 200


async def test_refuse_closes_without_a_response(sim: SimServer, http: aiohttp.ClientSession) -> None:
    await add(http, sim, {"kind": "refuse", "on_request": 1})
    got = await raw_post(sim.ports[0], "/v1/completions", {"prompt": "x"})
    assert got.eof_before_head or (got.reset and not got.head)
    state = await get_json(http, sim.base_urls[0] + "/sim/state")
    assert state["finished"] == 0 and state["running"] == 0


async def test_hang_never_answers_and_holds_no_engine_work(sim: SimServer, http: aiohttp.ClientSession) -> None:
    await add(http, sim, {"kind": "hang", "on_request": 1})
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(sim.base_urls[0] + "/v1/completions", json={"prompt": "x"},
                             timeout=aiohttp.ClientTimeout(total=0.3)) as resp:
            await resp.read()
    state = await get_json(http, sim.base_urls[0] + "/sim/state")
    assert state["running"] == state["waiting"] == state["kv_blocks_used"] == 0
    assert (await post(http, sim.base_urls[0] + "/v1/completions", {"prompt": "x", "max_tokens": 1}))[0] == 200


async def test_headers_then_stall(sim: SimServer, http: aiohttp.ClientSession) -> None:
    await add(http, sim, {"kind": "headers_then_stall"})
    async with http.post(sim.base_urls[0] + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200 and resp.headers["Content-Type"] == "text/event-stream"
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(resp.content.read(1), 0.3)


async def test_reset_after_events(sim: SimServer, http: aiohttp.ClientSession) -> None:
    await add(http, sim, {"kind": "reset_after_events", "events": 3, "on_request": 1})
    got = await raw_post(sim.ports[0], "/v1/chat/completions", CHAT)
    assert got.status == 200 and not got.complete and got.reset
    assert got.body.count(b"data: ") == 3 and b"[DONE]" not in got.body

    async def aborted() -> dict:
        state = await get_json(http, sim.base_urls[0] + "/sim/state")
        return state if state["kv_blocks_used"] == 0 and state["active_streams"] == 0 else {}

    await eventually(aborted, what="engine cleaned up after reset")


async def test_close_without_done(sim: SimServer, http: aiohttp.ClientSession) -> None:
    await add(http, sim, {"kind": "close_without_done", "events": 2, "on_request": 1})
    got = await raw_post(sim.ports[0], "/v1/chat/completions", CHAT)
    assert got.status == 200 and got.complete and not got.reset
    assert got.body.count(b"data: ") == 2 and b"[DONE]" not in got.body
    again = await raw_post(sim.ports[0], "/v1/chat/completions", CHAT)
    assert again.body.endswith(b"data: [DONE]\n\n")


async def test_slow_fault_stretches_every_gap(sim: SimServer, http: aiohttp.ClientSession) -> None:
    await add(http, sim, {"kind": "slow", "factor": 3, "min_gap_s": 0.05, "on_request": 1})
    loop = asyncio.get_running_loop()
    started = loop.time()
    _, text, _ = await post(http, sim.base_urls[0] + "/v1/chat/completions", {**CHAT, "max_tokens": 3})
    slow_s = loop.time() - started
    assert len(sse_json(text)) >= 2
    assert slow_s >= 0.1 * 2  # at least two stretched gaps of >= (3 - 1) * 0.05 s


@pytest.mark.parametrize("mode", ["byte", "crlf", "data", "utf8"])
async def test_slice_modes_split_writes_but_keep_the_stream(sim: SimServer, http: aiohttp.ClientSession,
                                                            mode: str) -> None:
    await add(http, sim, {"kind": "slice", "mode": mode, "on_request": 1})
    got = await raw_post(sim.ports[0], "/v1/chat/completions", {**CHAT, "max_tokens": 12})
    assert got.status == 200 and got.complete
    chunks, body = got.chunks, got.body
    if mode == "byte":
        assert all(len(c) == 1 for c in chunks)
    elif mode == "crlf":
        assert body.endswith(b"data: [DONE]\r\n\r\n") and b"\n\n" not in body.replace(b"\r\n\r\n", b"")
        assert any(c.endswith(b"\r") for c in chunks) and b"\n\r" in chunks
    elif mode == "data":
        assert chunks.count(b"da") == body.count(b"data: ")
    else:
        assert any(c[-1] >= 0xC0 for c in chunks)  # a chunk ends inside a multi-byte character
    normal = body.replace(b"\r\n", b"\n").decode()
    assert sse_data(normal)[-1] == "[DONE]"


async def test_recomputed_fault_ends_after_k_tokens(sim: SimServer, http: aiohttp.ClientSession) -> None:
    await add(http, sim, {"kind": "recomputed", "tokens": 2, "on_request": 1})
    _, text, _ = await post(http, sim.base_urls[0] + "/v1/completions",
                            {"prompt": "x", "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}})
    events = sse_json(text)
    last = events[-2]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"], last["text"]) == ("stop", "recomputed", "")
    assert events[-1]["usage"]["completion_tokens"] == 2
    assert "".join(e["choices"][0]["text"] for e in events[:-1]).count(" ") == 2
    state = await get_json(http, sim.base_urls[0] + "/sim/state")
    assert state["kv_blocks_used"] == 0 and state["running"] == 0


async def test_fault_validation_and_listing(sim: SimServer, http: aiohttp.ClientSession) -> None:
    status, _, _ = await post(http, sim.base_urls[0] + "/sim/faults", {"kind": "explode"})
    assert status == 400
    status, _, _ = await post(http, sim.base_urls[0] + "/sim/faults", {"kind": "slice", "mode": "words"})
    assert status == 400
    await add(http, sim, {"kind": "status", "status": 500, "on_request": 3})
    await post(http, sim.base_urls[0] + "/v1/completions", {"prompt": "x", "max_tokens": 1})
    pending = (await get_json(http, sim.base_urls[0] + "/sim/faults"))["faults"]
    assert pending == [{"kind": "status", "status": 500, "on_request": 3, "times": 1, "seen": 1, "fired": 0}]
    await post(http, sim.base_urls[0] + "/sim/reset", {})
    assert (await get_json(http, sim.base_urls[0] + "/sim/faults"))["faults"] == []


def test_random_faults_are_reproducible_from_the_seed() -> None:
    def run(seed: int) -> list[bool]:
        book = FaultBook(seed)
        book.add({"kind": "status", "probability": 0.5})
        return [book.match("/v1/completions") is not None for _ in range(40)]

    assert run(1) == run(1) and 0 < sum(run(1)) < 40


def test_slice_event_pieces_reassemble() -> None:
    event = 'data: {"x": "café"}\n\n'.encode()
    for mode in ("byte", "data", "utf8"):
        assert b"".join(slice_event(event, mode)) == event
    assert b"".join(slice_event(event, "crlf")) == event.replace(b"\n", b"\r\n")
