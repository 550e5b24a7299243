"""Output constraints on the one-token prefill leg (simulated engines on loopback): a forced tool call becomes
``tool_choice: auto`` and structured outputs are dropped on the prefill leg only — ``tools`` stay (they shape the
prompt, hence the KV) and the decode leg carries the client's body untouched; ``prefill_relax_constraints: false``
keeps them on both legs (pdproxy/apis/kv_transfer.py)."""

from __future__ import annotations

from typing import Any

import httpx
import orjson
import pytest

from pdproxy.apis import kv_transfer
from pdproxy.apis.request import Api
from pdproxy.errors import Action, UpstreamHTTPError, classify
from tests.apis.support import legs
from tests.conftest import Fleet
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(60)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 3,
        "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_schema", "json_schema": SCHEMA},
        "structured_outputs": {"regex": "[0-9]+"}, "guided_choice": ["a", "b"]}


def pair(sims: Fleet, path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    prefill, decode = (legs(group, path) for group in (sims.prefillers, sims.decoders))
    assert len(prefill) == 1 and len(decode) == 1
    return prefill[0]["body"], decode[0]["body"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_prefill_leg_is_relaxed_and_the_decode_leg_keeps_every_constraint(proxy: ProxyThread, sims: Fleet,
                                                                              stream: bool) -> None:
    r = httpx.post(proxy.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, timeout=20)
    assert r.status_code == 200, r.text
    prefill, decode = pair(sims, "/v1/chat/completions")
    assert prefill["tools"] == TOOLS and prefill["tool_choice"] == "auto" and prefill["max_tokens"] == 1
    assert not {"response_format", "structured_outputs", "guided_choice"} & prefill.keys()
    assert {k: v for k, v in decode.items() if k != "kv_transfer_params"} == {**CHAT, "stream": stream}


def test_a_named_tool_on_messages_becomes_auto_on_the_prefill_leg_only(proxy: ProxyThread, sims: Fleet) -> None:
    tools = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {}}}]
    body = {"model": "sim-model", "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}], "tools": tools,
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}}
    r = httpx.post(proxy.url + "/v1/messages", json=body, timeout=20)
    assert r.status_code == 200, r.text
    prefill, decode = pair(sims, "/v1/messages")
    assert prefill["tools"] == tools
    assert prefill["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}
    assert decode["tool_choice"] == body["tool_choice"]


def test_the_setting_keeps_the_constraints(sims: Fleet) -> None:
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                        prefill_relax_constraints=False).start()
    try:
        assert httpx.post(proxy.url + "/v1/chat/completions", json=CHAT, timeout=20).status_code == 200
        prefill, _decode = pair(sims, "/v1/chat/completions")
        assert prefill["tool_choice"] == "required" and prefill["response_format"] == CHAT["response_format"]
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_relaxing_rules_per_api() -> None:
    def leg(api: Api, **body: Any) -> dict[str, Any]:
        return kv_transfer.prefill_body(body, api, relax=True)

    assert leg(Api.CHAT, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})[
        "tool_choice"] == "auto"
    assert leg(Api.CHAT, tools=TOOLS, tool_choice="none")["tool_choice"] == "none"   # may drop tools: as sent
    assert leg(Api.CHAT, tool_choice="required")["tool_choice"] == "required"         # no tools: vLLM judges
    assert leg(Api.CHAT, response_format={"type": "text"})["response_format"] == {"type": "text"}
    assert "response_format" not in leg(Api.COMPLETIONS, response_format={"type": "json_object"})
    assert "guided_json" not in leg(Api.COMPLETIONS, guided_json={"type": "object"})
    responses = leg(Api.RESPONSES, tools=[{"type": "function", "name": "f"}], tool_choice={"type": "function",
                                                                                          "name": "f"},
                    text={"format": {"type": "json_schema", "schema": {}}, "verbosity": "low"})
    assert responses["tool_choice"] == "auto" and responses["text"] == {"verbosity": "low"}
    messages = leg(Api.MESSAGES, tools=[{"name": "f"}], tool_choice={"type": "any"},
                   output_config={"format": {"type": "json_schema", "schema": {}}, "effort": "low"})
    assert messages["tool_choice"] == {"type": "auto"} and messages["output_config"] == {"effort": "low"}
    original = {"tools": TOOLS, "tool_choice": "required"}
    kv_transfer.prefill_body(original, Api.CHAT, relax=True)
    assert original == {"tools": TOOLS, "tool_choice": "required"}                     # never mutated
    assert kv_transfer.prefill_body(original, Api.CHAT)["tool_choice"] == "required"  # release legs: as sent


def test_only_a_dead_engines_500_is_worth_another_prefiller() -> None:
    dead = orjson.dumps({"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the "
                                              "root cause.", "type": "InternalServerError", "code": 500}})
    assert classify(UpstreamHTTPError(500, dead)).action is Action.RETRY_ONCE
    other = classify(UpstreamHTTPError(500, b'{"error": {"message": "xgrammar failed", "code": 500}}'))
    assert other.action is Action.ENGINE_UNWELL and not other.retry()
