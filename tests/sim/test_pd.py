"""The PD connector model over real loopback HTTP: a simulated prefiller and decoder in one event loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
import pytest

from pdproxy.sim.config import SimConfig
from pdproxy.sim.server import SimServer, running_sim
from pdproxy.tokens import sim_prompt
from tests.sim.helpers import eventually, get_json, post, prefill, sse_data

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def state(http: aiohttp.ClientSession, sim: SimServer) -> dict:
    return dict(await get_json(http, sim.base_urls[0] + "/sim/state"))


async def test_nixl_params_shape_like_vllm_032(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, role="prefill", engine_id="eng")) as p:
        body = await prefill(http, p.base_urls[0], 100, request_id="abc123")
        params = body["kv_transfer_params"]
        assert body["id"] == "cmpl-abc123" and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 1
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == "eng_dp0" and params["remote_host"] == "127.0.0.1"
        assert params["remote_port"] == p.ports[0] and params["tp_size"] == 1 and params["remote_num_tokens"] == 100
        assert isinstance(params["remote_block_ids"], list) and len(params["remote_block_ids"][0]) == 7
        assert params["remote_request_id"].startswith("cmpl-abc123-0-") and len(params["remote_request_id"]) == 22
        assert {"remote_blocks_expiry_time", "dcp_size", "pp_size", "transfer_mode"} <= set(params)
        s = await state(http, p)
        assert (s["pinned_requests"], s["pinned_blocks"], s["kv_blocks_used"]) == (1, 7, 7)


async def test_chat_prefill_request_id_and_mooncake_shape(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, role="prefill", kv_connector="mooncake")) as p:
        status, text, _ = await post(http, p.base_urls[0] + "/v1/chat/completions", {
            "messages": [{"role": "user", "content": sim_prompt(40)}], "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True}}, **{"X-Request-Id": "q"})
        params = json.loads(text)["kv_transfer_params"]
        assert status == 200 and params["remote_request_id"].startswith("chatcmpl-q-")
        assert isinstance(params["remote_block_ids"][0], int) and params["num_prompt_blocks"] == len(
            params["remote_block_ids"]) and params["remote_block_size"] == 16
        assert {"remote_pcp_size", "remote_dcp_size", "remote_ptp_size", "remote_multi_nodes_meta_mapping",
                "last_token_id"} <= set(params)


async def test_decoder_pulls_frees_the_pin_and_reports_cached_tokens(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, role="prefill")) as p, \
            running_sim(SimConfig(port=0, role="decode")) as d:
        params = (await prefill(http, p.base_urls[0], 100))["kv_transfer_params"]
        status, text, _ = await post(http, d.base_urls[0] + "/v1/completions", {
            "prompt": sim_prompt(100), "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True},
            "kv_transfer_params": params}, **{"X-Request-Id": "r1"})
        events = [json.loads(e) for e in sse_data(text)[:-1]]
        assert status == 200 and events[-1]["usage"]["completion_tokens"] == 6
        # vLLM 0.32 (NIXL) reports 0 here after a pull; vLLM-Ascend (Mooncake) reports local + external hits
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        ps, ds = await state(http, p), await state(http, d)
        assert (ps["pinned_requests"], ps["kv_blocks_used"]) == (0, 0)
        assert (ds["kv_blocks_used"], ds["finished"]) == (0, 1)


@pytest.mark.parametrize("stream", [False, True])
async def test_expired_or_unknown_kv_fails_like_a_failed_pull(http: aiohttp.ClientSession, stream: bool) -> None:
    async with running_sim(SimConfig(port=0, role="prefill", kv_pin_timeout_s=0.05)) as p, \
            running_sim(SimConfig(port=0, role="decode")) as d:
        params = (await prefill(http, p.base_urls[0], 100))["kv_transfer_params"]

        async def expired() -> bool:
            return (await state(http, p))["pinned_requests"] == 0

        await eventually(expired, what="pin expiry")
        status, text, _ = await post(http, d.base_urls[0] + "/v1/completions", {
            "prompt": sim_prompt(100), "max_tokens": 6, "stream": stream, "kv_transfer_params": params})
        error = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                           "code": 500}}
        if stream:
            data = sse_data(text)
            assert status == 200 and json.loads(data[-2]) == error and data[-1] == "[DONE]"
        else:
            assert status == 500 and json.loads(text) == error
        assert (await state(http, d))["kv_blocks_used"] == 0
        async with http.get(p.base_urls[0] + "/metrics") as resp:
            assert 'vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="sim-model"} 1.0' in await resp.text()


async def test_wrong_prefiller_port_fails_the_pull(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, role="prefill")) as p, \
            running_sim(SimConfig(port=0, role="decode")) as d:
        params = (await prefill(http, p.base_urls[0], 20))["kv_transfer_params"]
        status, _, _ = await post(http, d.base_urls[0] + "/v1/completions", {
            "prompt": sim_prompt(20), "max_tokens": 2, "kv_transfer_params": {**params, "remote_port": d.ports[0]}})
        assert status == 500


async def test_decoder_400_before_the_pull_releases_the_prefillers_pin(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, role="prefill")) as p, \
            running_sim(SimConfig(port=0, role="decode", max_model_len=100)) as d:
        params = (await prefill(http, p.base_urls[0], 100))["kv_transfer_params"]
        # vLLM 0.32 clamps max_tokens to the room left: a prompt of exactly max_model_len is what D refuses
        status, text, _ = await post(http, d.base_urls[0] + "/v1/completions", {
            "prompt": sim_prompt(100), "max_tokens": 100, "kv_transfer_params": params})
        assert status == 400 and json.loads(text)["error"]["param"] == "max_tokens"

        async def released() -> bool:
            return (await state(http, p))["pinned_requests"] == 0

        await eventually(released, what="pin released after decoder rejection")


async def test_decoder_abort_while_waiting_for_blocks_releases_the_pin(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, role="prefill")) as p, \
            running_sim(SimConfig(port=0, role="decode", num_gpu_blocks_override=4, max_model_len=1000)) as d:
        params = (await prefill(http, p.base_urls[0], 100))["kv_transfer_params"]
        async with http.post(d.base_urls[0] + "/v1/completions", json={
                "prompt": sim_prompt(100), "max_tokens": 2, "stream": True, "kv_transfer_params": params}) as resp:
            assert resp.status == 200  # SSE headers are sent at once; the request waits for KV capacity

            async def waiting() -> bool:
                return (await state(http, d))["waiting_capacity"] == 1

            await eventually(waiting, what="decoder request waiting for capacity")
            resp.close()

        async def released() -> bool:
            return (await state(http, p))["pinned_requests"] == 0 and (await state(http, d))["aborted"] == 1

        await eventually(released, what="pin released after decoder abort")


async def test_deferred_while_pulling_is_visible(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, role="prefill")) as p, \
            running_sim(SimConfig(port=0, role="decode", kv_transfer_tokens_per_s=1000)) as d:
        params = (await prefill(http, p.base_urls[0], 1000))["kv_transfer_params"]
        async with http.post(d.base_urls[0] + "/v1/completions", json={
                "prompt": sim_prompt(1000), "max_tokens": 2, "stream": True, "kv_transfer_params": params}) as resp:
            async def deferred() -> bool:
                return (await state(http, d))["waiting_deferred"] == 1

            await eventually(deferred, what="deferred while pulling (1 s transfer)")
            text = (await resp.read()).decode()
        assert sse_data(text)[-1] == "[DONE]" and (await state(http, p))["pinned_requests"] == 0


async def test_both_role_without_params_behaves_as_a_plain_engine(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0)) as sim:
        status, text, _ = await post(http, sim.base_urls[0] + "/v1/completions", {
            "prompt": "x", "max_tokens": 3, "kv_transfer_params": {"do_remote_prefill": True}})
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == 3


async def test_no_kv_params_fault_answers_without_params_and_frees_blocks(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, role="prefill")) as p:
        await post(http, p.base_urls[0] + "/sim/faults", [{"kind": "no_kv_params", "on_request": 1}])
        body = await prefill(http, p.base_urls[0], 100)
        assert body["kv_transfer_params"] is None and body["choices"][0]["finish_reason"] == "stop"
        assert (await state(http, p))["kv_blocks_used"] == 0
        assert (await prefill(http, p.base_urls[0], 100))["kv_transfer_params"] is not None


async def test_recompute_stop_on_decoder_preemption_ends_the_stream(http: aiohttp.ClientSession) -> None:
    cfg = SimConfig(port=0, role="decode", recompute_stop=True, block_size=4, num_gpu_blocks_override=6,
                    max_model_len=64, decode_tokens_per_s=500)
    async with running_sim(cfg) as d:
        body = {"prompt": sim_prompt(8), "max_tokens": 12, "stream": True}
        results = await asyncio.gather(*(post(http, d.base_urls[0] + "/v1/completions", body) for _ in range(2)))
        finals = [json.loads(sse_data(text)[-2])["choices"][0] for _, text, _ in results]
        assert sorted((f["finish_reason"], f["stop_reason"]) for f in finals) == [("length", None),
                                                                                  ("stop", "recomputed")]
        recomputed = next(f for f in finals if f["stop_reason"] == "recomputed")
        assert recomputed["text"] == ""
        final_state = await state(http, d)
        assert final_state["preemptions"] == 1 and final_state["kv_blocks_used"] == 0


@pytest.mark.timeout(10)
@pytest.mark.parametrize("rejection", ["status_fault", "bad_dp_rank_header"])
async def test_decoder_error_before_the_pull_releases_the_prefillers_pin(http: aiohttp.ClientSession,
                                                                         rejection: str) -> None:
    """vLLM >= 0.26 notifies the prefiller on any ErrorResponse for a do_remote_prefill request
    (docs/pd-protocol.md §6)."""
    async with running_sim(SimConfig(port=0, role="prefill")) as p, \
            running_sim(SimConfig(port=0, role="decode")) as d:
        params = (await prefill(http, p.base_urls[0], 100))["kv_transfer_params"]
        assert (await state(http, p))["pinned_blocks"] == 7
        headers: dict[str, str] = {}
        if rejection == "status_fault":
            status, text, _ = await post(http, d.base_urls[0] + "/sim/faults", {"kind": "status", "status": 503})
            assert status == 200, text
            expected = 503
        else:
            headers["X-data-parallel-rank"] = "5"
            expected = 400
        status, text, _ = await post(http, d.base_urls[0] + "/v1/completions", {
            "prompt": sim_prompt(100), "max_tokens": 4, "kv_transfer_params": params}, **headers)
        assert status == expected and json.loads(text)["error"]["code"] == expected

        async def released() -> bool:
            s = await state(http, p)
            return s["pinned_blocks"] == 0 and s["pinned_requests"] == 0

        await eventually(released, timeout_s=3.0, what="pin released after the decoder's error answer")
        ds = await state(http, d)
        assert (ds["finished"], ds["aborted"], ds["kv_blocks_used"]) == (0, 0, 0)  # D's engine never saw it
        assert p.ranks[0].core.stats.kv_expired_reqs == 0  # freed by the notification, not the timeout


@pytest.mark.timeout(10)
async def test_sim_reset_clears_pins_and_their_expiry(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, role="prefill")) as p, \
            running_sim(SimConfig(port=0, role="decode")) as d:
        params = (await prefill(http, p.base_urls[0], 100))["kv_transfer_params"]
        await prefill(http, p.base_urls[0], 40, request_id="r2", unique_seed=3)
        s = await state(http, p)
        assert (s["pinned_requests"], s["pinned_blocks"]) == (2, 10)
        assert p.ranks[0].core.next_pin_expiry() is not None
        status, _, _ = await post(http, p.base_urls[0] + "/sim/reset", {})
        assert status == 200
        s = await state(http, p)
        assert (s["pinned_requests"], s["pinned_blocks"], s["kv_blocks_used"]) == (0, 0, 0)
        assert p.ranks[0].core.next_pin_expiry() is None
        assert p.ranks[0].core.stats.kv_expired_reqs == 0
        # the old params now point at nothing: the decoder's pull fails like expired KV
        status, _, _ = await post(http, d.base_urls[0] + "/v1/completions", {
            "prompt": sim_prompt(100), "max_tokens": 2, "kv_transfer_params": params})
        assert status == 500
