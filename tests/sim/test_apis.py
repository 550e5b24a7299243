"""The Responses and Anthropic Messages APIs of ``pdproxy sim``, driven by the real ``openai`` and ``anthropic``
clients against simulator processes on loopback, plainly and as the two legs of a PD request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.sim.helpers import PREFILL_STUB
from tests.support import SimProcess, running, wait_until

pytestmark = pytest.mark.timeout(60)
PROMPT = "Tell me about disaggregated prefill and decode"


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, SimProcess]]:
    """A plain engine, a prefiller and a decoder."""
    fleet = {"both": SimProcess("both"), "prefill": SimProcess("prefill"), "decode": SimProcess("decode")}
    with running(*fleet.values()):
        yield fleet


@pytest.fixture
def oai(sims: dict[str, SimProcess]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=sims["both"].url + "/v1", api_key="none", max_retries=0) as client:
        yield client


@pytest.fixture
def claude(sims: dict[str, SimProcess]) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=sims["both"].url, api_key="none", max_retries=0) as client:
        yield client


def last_body(sim: SimProcess, path: str) -> dict[str, Any]:
    bodies = [r["body"] for r in sim.received() if r["path"] == path]
    assert bodies, f"{path} never reached the sim"
    return dict(bodies[-1])


# ---------------------------------------------------------------------------------------------------- Responses
def test_responses_json_with_the_openai_client(oai: openai.OpenAI, sims: dict[str, SimProcess]) -> None:
    resp = oai.responses.create(model="sim-model", input=PROMPT, instructions="Be brief.", max_output_tokens=5)
    assert resp.status == "incomplete" and resp.incomplete_details and resp.incomplete_details.reason == (
        "max_output_tokens")
    assert resp.output_text and resp.usage and resp.usage.output_tokens == 5
    assert resp.usage.total_tokens == resp.usage.input_tokens + 5 and resp.usage.input_tokens_details.cached_tokens == 0
    assert resp.id.startswith("resp_") and resp.model == "sim-model"
    assert last_body(sims["both"], "/v1/responses")["instructions"] == "Be brief."


def test_responses_stream_with_the_openai_client(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model="sim-model", input=PROMPT, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert done.status == "completed" and done.output_text == text and done.usage and done.usage.output_tokens == 16


def test_responses_json_schema_and_tool_call(oai: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    resp = oai.responses.create(model="sim-model", input=PROMPT, max_output_tokens=100,
                                text={"format": {"type": "json_schema", "name": "plan", "schema": schema}})
    assert set(json.loads(resp.output_text)) == {"city", "days"} and resp.status == "completed"
    tools = [{"type": "function", "name": "get_weather", "parameters": schema}]
    resp = oai.responses.create(model="sim-model", input=PROMPT, tools=tools,  # type: ignore[arg-type]
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "sim", "days": 1}


def test_responses_errors_are_vllms(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        oai.responses.create(model="sim-model", input=PROMPT, temperature=-1)
    assert bad.value.body["message"] == ("temperature must be non-negative, got -1.0. (parameter=temperature, "  # type: ignore[index]
                                         "value=-1.0)")
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model="nope", input=PROMPT)
    with pytest.raises(openai.NotFoundError) as missing:
        oai.responses.create(model="sim-model", input=PROMPT, previous_response_id="resp_x")
    assert missing.value.body["type"] == "invalid_request_error"  # type: ignore[index]



@pytest.mark.parametrize(("item", "param"), [({"role": 5, "content": "x"}, "body.input.0.role"),   # old: a 500
                                             ({"role": "user", "content": 5}, "body.input.0.content")])
def test_responses_message_items_of_the_wrong_shape_are_a_400(sims: dict[str, SimProcess], item: dict[str, Any],
                                                              param: str) -> None:
    """A message item's role and content as openai's input-item types refuse them: pydantic's 400, never the
    sim's own 500 (which a proxy counts against the engine's health)."""
    resp = httpx.post(sims["both"].url + "/v1/responses", json={"model": "sim-model", "input": [item]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param


# ---------------------------------------------------------------------------------------------------- Messages
def test_messages_json_with_the_anthropic_client(claude: anthropic.Anthropic) -> None:
    msg = claude.messages.create(model="sim-model", max_tokens=6, system="Be brief.",
                                 messages=[{"role": "user", "content": PROMPT}])
    assert msg.type == "message" and msg.role == "assistant" and msg.stop_reason == "max_tokens"
    assert msg.content[0].type == "text" and msg.content[0].text and msg.usage.output_tokens == 6
    msg = claude.messages.create(model="sim-model", max_tokens=100, messages=[{"role": "user", "content": PROMPT}],
                                 stop_sequences=["cache"])
    assert msg.stop_reason in ("stop_sequence", "end_turn")
    if msg.stop_reason == "stop_sequence":
        assert msg.stop_sequence == "cache" and "cache" not in msg.content[0].text  # type: ignore[union-attr]


def test_messages_stream_with_the_anthropic_client(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model="sim-model", max_tokens=64,
                                messages=[{"role": "user", "content": PROMPT}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason == "end_turn"  # type: ignore[union-attr]
    assert final.usage.output_tokens == 16
    events = [e.type for e in claude.messages.create(model="sim-model", max_tokens=3, stream=True,
                                                    messages=[{"role": "user", "content": PROMPT}])]
    assert events[:2] == ["message_start", "content_block_start"] and events[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]


def test_messages_tool_use_and_count_tokens(claude: anthropic.Anthropic, sims: dict[str, SimProcess]) -> None:
    tools = [{"name": "get_weather", "description": "weather",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    msg = claude.messages.create(model="sim-model", max_tokens=50, tools=tools,  # type: ignore[arg-type]
                                 tool_choice={"type": "tool", "name": "get_weather"},
                                 messages=[{"role": "user", "content": "weather in Oslo?"}])
    (block,) = msg.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "sim"}
    assert msg.stop_reason == "tool_use"
    count = claude.messages.count_tokens(model="sim-model", messages=[{"role": "user", "content": PROMPT}])
    tokenized = httpx.post(sims["both"].url + "/tokenize", json={"messages": [{"role": "user", "content": PROMPT}]})
    assert count.input_tokens == tokenized.json()["count"]


def test_messages_errors_have_the_shapes_vllm_gives(claude: anthropic.Anthropic, sims: dict[str, SimProcess]) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert missing.value.body == {"type": "error", "error": {
        "type": "NotFoundError", "message": "The model `nope` does not exist. Valid aliases: sim-model."}}
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model="sim-model", max_tokens=5, extra_body={"temperature": -1},
                               messages=[{"role": "user", "content": "x"}])
    assert bad.value.body["error"]["type"] == "BadRequestError"  # type: ignore[index]
    resp = httpx.post(sims["both"].url + "/v1/messages", json={"model": "sim-model", "messages": [
        {"role": "wizard", "content": "x"}], "max_tokens": 5})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "body.messages.0.role"  # pydantic's shape
    for content, param in ((5, "body.messages.0.content.str"),                          # old: a 500
                           ([{"type": "tool_result", "tool_use_id": "t", "content": 5}],
                            "body.messages.0.content.list[AnthropicContentBlock].0.content.str"),
                           ([{"type": "weird"}], "body.messages.0.content.list[AnthropicContentBlock].0.type"),
                           ([{"text": "x"}], "body.messages.0.content.list[AnthropicContentBlock].0.type")):
        resp = httpx.post(sims["both"].url + "/v1/messages", json={"model": "sim-model", "max_tokens": 5,
                                                                   "messages": [{"role": "user", "content": content}]})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param
    resp = httpx.post(sims["both"].url + "/v1/messages", json={      # a bad block after a good message: the same
        "model": "sim-model", "max_tokens": 5, "system": [{"type": "text", "text": "s"}],
        "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "weird"}]}]})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "body.messages.1.content.list[AnthropicContentBlock].0.type"
    resp = httpx.post(sims["both"].url + "/v1/messages", json={"model": "sim-model", "max_tokens": 5, "system": [
        {"type": "weird"}], "messages": [{"role": "user", "content": "x"}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "body.system.list[AnthropicContentBlock].0.type"
    for schema in ([], "x", None):                                 # AnthropicTool.input_schema: an object
        resp = httpx.post(sims["both"].url + "/v1/messages", json={
            "model": "sim-model", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "f", "input_schema": schema}]})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "body.tools.0.input_schema", schema
    resp = httpx.post(sims["both"].url + "/v1/messages", json={"model": "sim-model", "messages": []})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "body.max_tokens"


# ---------------------------------------------------------------------------------------------------- PD legs
@pytest.mark.parametrize(("path", "body", "limit"), [
    ("/v1/responses", {"model": "sim-model", "input": PROMPT, "max_output_tokens": 6}, {"max_output_tokens": 1}),
    ("/v1/messages", {"model": "sim-model", "max_tokens": 6, "messages": [{"role": "user", "content": PROMPT}]},
     {"max_tokens": 1}),
    ("/inference/v1/generate", {"token_ids": list(range(40, 90)), "sampling_params": {"max_tokens": 6}},
     {"sampling_params": {"max_tokens": 1}}),
])
@pytest.mark.parametrize("stream", [False, True])
def test_pd_legs_pull_the_prefillers_kv(sims: dict[str, SimProcess], path: str, body: dict[str, Any],
                                        limit: dict[str, Any], stream: bool) -> None:
    p, d = sims["prefill"], sims["decode"]
    first = httpx.post(p.url + path, json={**body, **limit, "stream": False, "kv_transfer_params": PREFILL_STUB},
                       headers={"X-Request-Id": "pd-1"}, timeout=10)
    params = first.json()["kv_transfer_params"]
    assert first.status_code == 200 and params["do_remote_prefill"] is True
    assert wait_until(lambda: p.state()["pinned_requests"] >= 1, 5)
    second = httpx.post(d.url + path, json={**body, "stream": stream, "kv_transfer_params": params},
                        headers={"X-Request-Id": "pd-1"}, timeout=10)
    assert second.status_code == 200
    if stream and path == "/v1/responses":
        assert second.text.rstrip().splitlines()[-2] == "event: response.completed" and "[DONE]" not in second.text
    elif stream and path == "/v1/messages":
        assert second.text.rstrip().splitlines()[-2] == "event: message_stop" and "[DONE]" not in second.text
    elif stream:
        assert second.text.endswith("data: [DONE]\n\n")
    assert wait_until(lambda: p.state()["pinned_requests"] == 0, 5), "the decoder's pull released the pin"
    received = [r for r in d.received() if r["path"] == path][-1]["body"]
    assert received["kv_transfer_params"] == params


def test_a_streamed_responses_prefill_leg_returns_params_in_response_completed(sims: dict[str, SimProcess]) -> None:
    p = sims["prefill"]
    resp = httpx.post(p.url + "/v1/responses", json={"model": "sim-model", "input": PROMPT, "max_output_tokens": 1,
                                                     "stream": True, "kv_transfer_params": PREFILL_STUB}, timeout=10)
    completed = [json.loads(line[6:]) for line in resp.text.splitlines() if '"response.completed"' in line]
    params = completed[0]["response"]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    httpx.post(sims["decode"].url + "/v1/responses", json={"model": "sim-model", "input": PROMPT,
                                                           "max_output_tokens": 2, "kv_transfer_params": params})
    assert wait_until(lambda: p.state()["pinned_requests"] == 0, 5)


def test_a_streamed_messages_prefill_leg_never_returns_params(sims: dict[str, SimProcess]) -> None:
    resp = httpx.post(sims["prefill"].url + "/v1/messages", json={
        "model": "sim-model", "max_tokens": 1, "stream": True, "messages": [{"role": "user", "content": PROMPT}],
        "kv_transfer_params": PREFILL_STUB}, timeout=10)
    assert resp.status_code == 200 and "kv_transfer_params" not in resp.text
    sims["prefill"].reset()  # the pin it left (vLLM's would wait for its lease to expire)


def test_kv_pull_failures_end_each_stream_as_vllm_does(sims: dict[str, SimProcess]) -> None:
    bogus = {"do_remote_prefill": True, "remote_request_id": "gone", "remote_host": "127.0.0.1",
             "remote_port": sims["prefill"].port, "remote_engine_id": "x", "remote_block_ids": [[1]]}
    d = sims["decode"]
    with pytest.raises(httpx.HTTPError):  # Responses: the connection is cut after response.created
        httpx.post(d.url + "/v1/responses", json={"model": "sim-model", "input": PROMPT, "stream": True,
                                                  "kv_transfer_params": bogus}, timeout=10)
    resp = httpx.post(d.url + "/v1/messages", json={"model": "sim-model", "max_tokens": 4, "stream": True,
                                                    "messages": [{"role": "user", "content": PROMPT}],
                                                    "kv_transfer_params": bogus}, timeout=10)
    assert resp.text.startswith("event: message_start") and "event: error" in resp.text
    assert "message_stop" not in resp.text
    resp = httpx.post(d.url + "/v1/messages", json={"model": "sim-model", "max_tokens": 4,
                                                    "messages": [{"role": "user", "content": PROMPT}],
                                                    "kv_transfer_params": bogus}, timeout=10)
    assert resp.status_code == 500 and resp.json()["type"] == "error"


@pytest.mark.parametrize("prompt", [[], [[]], [""]])
def test_an_empty_completions_prompt_gets_vllms_400(sims: dict[str, SimProcess], prompt: list[Any]) -> None:
    resp = httpx.post(sims["both"].url + "/v1/completions", json={"model": "sim-model", "prompt": prompt,
                                                                  "max_tokens": 2}, timeout=10)
    assert resp.status_code == 400  # vllm/v1/engine/input_processor.py: an empty decoder prompt
    assert resp.json()["error"]["message"] == "The decoder prompt cannot be empty"
