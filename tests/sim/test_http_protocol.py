"""vLLM's HTTP surface as the simulator serves it (real loopback sockets, in-process server)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import aiohttp
import pytest

from pdproxy.sim.config import SimConfig
from pdproxy.sim.server import SimServer, running_sim
from pdproxy.tokens import sim_prompt
from tests.sim.helpers import eventually, get_json, post, sse_json

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]


@pytest.fixture
async def sim() -> AsyncIterator[SimServer]:
    async with running_sim(SimConfig(port=0, max_model_len=2048)) as server:
        yield server


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_completion_json_shape_usage_and_request_id(sim: SimServer, http: aiohttp.ClientSession) -> None:
    status, text, headers = await post(http, sim.base_urls[0] + "/v1/completions",
                                       {"prompt": sim_prompt(20), "max_tokens": 5}, **{"X-Request-Id": "abc123"})
    body = json.loads(text)
    assert status == 200 and headers["X-Request-Id"] == "abc123"
    assert body["id"] == "cmpl-abc123" and body["object"] == "text_completion" and body["model"] == "sim-model"
    assert body["choices"][0]["finish_reason"] == "length" and body["kv_transfer_params"] is None
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,  # vLLM 0.32's shape
                             "prompt_tokens_details": {"cached_tokens": 0, "created_cache_tokens": None,
                                                       "multimodal_tokens": None},
                             "completion_tokens_details": None}
    assert len(sim.tokenizer.encode(body["choices"][0]["text"])) == 5


async def test_chat_stream_framing_role_chunk_finish_and_usage(sim: SimServer, http: aiohttp.ClientSession) -> None:
    status, text, headers = await post(http, sim.base_urls[0] + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": sim_prompt(10)}], "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}}, **{"X-Request-Id": "s1"})
    assert status == 200 and headers["Content-Type"] == "text/event-stream; charset=utf-8"
    events = sse_json(text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["id"] == "chatcmpl-s1" and e["object"] == "chat.completion.chunk" for e in events)
    content = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert content[-1]["choices"][0]["stop_reason"] is None
    assert all(e["choices"][0]["finish_reason"] is None for e in content[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert events[-1]["usage"]["prompt_tokens"] == 10 + 3 and "cached_tokens" in events[-1]["usage"][
        "prompt_tokens_details"]


async def test_completion_stream_without_include_usage_has_no_usage_chunk(sim: SimServer,
                                                                          http: aiohttp.ClientSession) -> None:
    _, text, _ = await post(http, sim.base_urls[0] + "/v1/completions", {"prompt": "hi", "max_tokens": 3,
                                                                          "stream": True})
    events = sse_json(text)
    assert all(e["choices"] for e in events) and "usage" not in events[-1]
    assert "".join(e["choices"][0]["text"] for e in events).count(" ") == 3


async def test_default_output_lengths(sim: SimServer, http: aiohttp.ClientSession) -> None:
    _, text, _ = await post(http, sim.base_urls[0] + "/v1/completions", {"prompt": "hi"})
    assert json.loads(text)["usage"]["completion_tokens"] == 16
    assert json.loads(text)["choices"][0]["finish_reason"] == "length"
    _, text, _ = await post(http, sim.base_urls[0] + "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]})
    assert json.loads(text)["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls(sim: SimServer, http: aiohttp.ClientSession, stream: bool) -> None:
    _, text, _ = await post(http, sim.base_urls[0] + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, "stream": stream})
    if not stream:
        choice = json.loads(text)["choices"][0]
        call = choice["message"]["tool_calls"][0]
        assert choice["finish_reason"] == "tool_calls" and call["type"] == "function"
        assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "sim"}
        return
    events = sse_json(text)
    deltas = [e["choices"][0]["delta"]["tool_calls"][0] for e in events[1:] if e["choices"][0]["delta"].get("tool_calls")]
    assert deltas[0]["id"].startswith("chatcmpl-tool-") and deltas[0]["function"]["name"] == "get_weather"
    assert all(d["index"] == 0 for d in deltas) and len(deltas) > 1
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "sim"}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_tool_choice_none_answers_with_text(sim: SimServer, http: aiohttp.ClientSession) -> None:
    _, text, _ = await post(http, sim.base_urls[0] + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "none", "max_tokens": 2})
    message = json.loads(text)["choices"][0]["message"]
    assert message["content"] and "tool_calls" not in message  # vLLM 0.32 omits an empty tool_calls


async def test_over_length_prompt_gets_vllm_032s_400(sim: SimServer, http: aiohttp.ClientSession) -> None:
    status, text, _ = await post(http, sim.base_urls[0] + "/v1/completions", {"prompt": sim_prompt(2049)})
    assert status == 400
    assert json.loads(text) == {"error": {
        "message": "This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 "
                   "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
                   "of the input prompt. (parameter=input_tokens, value=2049)",
        "type": "BadRequestError", "param": "input_tokens", "code": 400}}


async def test_max_tokens_is_clamped_to_the_room_left(sim: SimServer, http: aiohttp.ClientSession) -> None:
    """vLLM 0.32 (tests/real_vllm/captures/length_*.json): no 400 for prompt + max_tokens > max_model_len; the
    output is cut to max_model_len - prompt, and a prompt of exactly max_model_len leaves max_tokens 0."""
    url = sim.base_urls[0] + "/v1/completions"
    for prompt, max_tokens, generated in ((2000, 100, 48), (2047, 16, 1), (2000, None, 16)):
        body = {"prompt": sim_prompt(prompt)} | ({"max_tokens": max_tokens} if max_tokens else {})
        status, text, _ = await post(http, url, body)
        assert status == 200 and json.loads(text)["usage"]["completion_tokens"] == generated, (prompt, max_tokens)
    for body in ({"prompt": sim_prompt(2048), "max_tokens": 1}, {"prompt": sim_prompt(2048)}):
        status, text, _ = await post(http, url, body)
        assert status == 400 and json.loads(text) == {"error": {
            "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            "type": "BadRequestError", "param": "max_tokens", "code": 400}}


async def test_reject_mode_refuses_prompt_plus_max_tokens_over_the_limit(http: aiohttp.ClientSession) -> None:
    """``--max-tokens-overflow reject``: vLLM <= 0.26 / vLLM-Ascend refuse instead of clamping
    (``renderers/params.py::_token_len_check``)."""
    async with running_sim(SimConfig(port=0, max_model_len=2048, max_tokens_overflow="reject")) as sim:
        url = sim.base_urls[0] + "/v1/completions"
        ok, _, _ = await post(http, url, {"prompt": sim_prompt(2000), "max_tokens": 48})
        status, text, _ = await post(http, url, {"prompt": sim_prompt(2001), "max_tokens": 48})
        assert ok == 200 and status == 400
        err = json.loads(text)["error"]
        assert "you requested 48 output tokens" in err["message"] and err["param"] == "input_tokens"


@pytest.mark.parametrize(("path", "body", "needle", "error_type"), [
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     "Stream options can only be defined when `stream=True`. (parameter=stream_options)", "BadRequestError"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3},
     "min_tokens must be less than or equal to max_tokens=2, got 3.", "BadRequestError"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
     "max_tokens must be at least 1", "BadRequestError"),
    ("/v1/completions", {"model": "sim-model"}, "Either prompt or prompt_embeds must be provided and non-empty. "
     "(parameter=prompt)", "BadRequestError"),
    ("/v1/chat/completions", {"model": "sim-model"}, "messages", "Bad Request"),
    # vLLM types ``model`` ``str | None``: its 400 (old sim: a TypeError, a plain-text 500 that opened breakers)
    ("/v1/chat/completions", {"model": ["sim-model"], "messages": [{"role": "user", "content": "x"}]},
     "'type': 'string_type', 'loc': 'body.model', 'msg': 'Input should be a valid string', 'input': '<list of 1 "
     "items>'", "Bad Request"),
    ("/v1/completions", {"model": 5, "prompt": "x"}, "'loc': 'body.model', 'msg': 'Input should be a valid string', "
     "'input': '5'", "Bad Request"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
     "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)", "BadRequestError"),
])
async def test_validation_errors(sim: SimServer, http: aiohttp.ClientSession, path: str, body: dict, needle: str,
                                 error_type: str) -> None:
    status, text, _ = await post(http, sim.base_urls[0] + path, body)
    err = json.loads(text)["error"]
    assert status == 400 and err["code"] == 400 and needle in err["message"] and err["type"] == error_type


async def test_bad_json_and_unknown_model(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.post(sim.base_urls[0] + "/v1/completions", data=b"{not json") as resp:
        assert resp.status == 400 and (await resp.json())["error"]["code"] == 400
    status, text, _ = await post(http, sim.base_urls[0] + "/v1/completions", {"prompt": "x", "model": "other"})
    assert status == 404 and json.loads(text)["error"] == {
        "message": "The model `other` does not exist. Valid aliases: sim-model.", "type": "NotFoundError",
        "param": "model", "code": 404}


async def test_models_tokenize_health_version(sim: SimServer, http: aiohttp.ClientSession) -> None:
    base = sim.base_urls[0]
    models = await get_json(http, base + "/v1/models")
    assert models["data"][0]["id"] == "sim-model" and models["data"][0]["max_model_len"] == 2048
    status, text, _ = await post(http, base + "/tokenize", {"prompt": sim_prompt(7)})
    assert status == 200 and json.loads(text)["count"] == 7 and json.loads(text)["max_model_len"] == 2048
    status, text, _ = await post(http, base + "/tokenize", {"messages": [{"role": "user", "content": sim_prompt(7)}]})
    assert json.loads(text)["count"] == 7 + 3
    async with http.get(base + "/health") as resp:
        assert resp.status == 200 and await resp.read() == b""
    assert (await get_json(http, base + "/version"))["version"]


async def test_metrics_use_vllm_names_and_real_values(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, block_size=4, num_gpu_blocks_override=1146, max_model_len=133120)) as sim:
        await post(http, sim.base_urls[0] + "/v1/completions", {"prompt": sim_prompt(100), "max_tokens": 2})
        await post(http, sim.base_urls[0] + "/v1/completions", {"prompt": sim_prompt(100), "max_tokens": 2})
        async with http.get(sim.base_urls[0] + "/metrics") as resp:
            text = await resp.text()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    lab = 'engine="0",model_name="sim-model"'
    assert lines[f"vllm:num_requests_running{{{lab}}}"] == "0.0"
    assert lines[f'vllm:num_requests_waiting_by_reason{{{lab},reason="capacity"}}'] == "0.0"
    assert lines[f"vllm:prefix_cache_queries_total{{{lab}}}"] == "200.0"
    assert float(lines[f"vllm:prefix_cache_hits_total{{{lab}}}"]) == 96.0
    assert lines[f'vllm:request_success_total{{{lab},finished_reason="length"}}'] == "2.0"
    assert lines[f"vllm:time_to_first_token_seconds_count{{{lab}}}"] == "2.0"
    info = next(k for k in lines if k.startswith("vllm:cache_config_info"))
    assert 'block_size="4"' in info and 'num_gpu_blocks="1146"' in info and 'kv_cache_size_tokens="4584"' in info
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_preemptions_total", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:generation_tokens_total"):
        assert f"{name}{{{lab}}}" in lines


async def test_received_records_requests_in_order_and_reset_clears(sim: SimServer,
                                                                   http: aiohttp.ClientSession) -> None:
    base = sim.base_urls[0]
    await post(http, base + "/v1/completions", {"prompt": "one", "max_tokens": 1, "ignore_eos": True},
               **{"X-Request-Id": "a"})
    async with http.post(base + "/v1/chat/completions", data=b"{bad") as resp:
        await resp.read()
    got = (await get_json(http, base + "/sim/received"))["requests"]
    assert [r["path"] for r in got] == ["/v1/completions", "/v1/chat/completions"]
    assert got[0]["headers"]["x-request-id"] == "a" and got[0]["body"]["ignore_eos"] is True
    assert got[0]["dp_rank"] == 0 and got[0]["raw_len"] > 0 and got[1]["body"] is None
    await post(http, base + "/sim/reset", {})
    assert (await get_json(http, base + "/sim/received"))["requests"] == []


async def test_client_disconnect_mid_stream_aborts_and_frees_blocks(http: aiohttp.ClientSession) -> None:
    async with running_sim(SimConfig(port=0, decode_tokens_per_s=200)) as sim:
        base = sim.base_urls[0]
        async with http.post(base + "/v1/completions", json={"prompt": sim_prompt(200), "max_tokens": 2000,
                                                             "stream": True}) as resp:
            await resp.content.readline()
            assert (await get_json(http, base + "/sim/state"))["kv_blocks_used"] > 0
            resp.close()

        async def freed() -> dict:
            state = await get_json(http, base + "/sim/state")
            return state if state["aborted"] == 1 and state["kv_blocks_used"] == 0 and state["running"] == 0 else {}

        state = await eventually(freed, what="abort after disconnect")
        assert state["active_streams"] == 0 and state["finished"] == 1


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_body_request_id_never_becomes_a_header(sim: SimServer, http: aiohttp.ClientSession, api: str) -> None:
    """A body's ``request_id`` (a client's, passed on by pdproxy on both Responses legs) names the response but is
    no header: vLLM answers ``X-Request-Id`` only from the request's own header (its ``XRequestIdMiddleware``).
    A newline in it made aiohttp refuse the answer's headers (the connection dropped: pdproxy struck and then
    opened the prefiller's breaker for every client), and 100 KB of it an answer head no client reads."""
    for rid in ("resp_a\nb", "resp_" + "x" * 100_000):
        body: dict[str, object] = ({"input": "hi", "max_output_tokens": 2} if api == "responses" else
                                   {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        path = "/v1/responses" if api == "responses" else "/v1/chat/completions"
        status, text, headers = await post(http, sim.base_urls[0] + path, {**body, "request_id": rid})
        assert status == 200, text
        assert "\n" not in headers.get("X-Request-Id", "") and len(headers.get("X-Request-Id", "")) <= 64
        if api == "responses":
            assert json.loads(text)["id"] == rid
    status, _, headers = await post(http, sim.base_urls[0] + "/v1/responses",
                                    {"input": "hi", "max_output_tokens": 2}, **{"X-Request-Id": "hdr-7"})
    assert status == 200 and headers["X-Request-Id"] == "hdr-7"
