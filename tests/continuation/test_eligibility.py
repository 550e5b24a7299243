"""Which streams are continued (``pdproxy.pd.continuation.eligible``) and the words a refused one's error event
gives (``ineligible_reason``): the two agree on every request shape, and the words name the field."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdproxy.apis.request import Api, parse_request
from pdproxy.pd.continuation import eligible, ineligible_reason

pytestmark = pytest.mark.timeout(10)

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                        "max_tokens": 8}
RESPONSES: dict[str, Any] = {"model": "m", "input": "hi", "stream": True, "max_output_tokens": 8}
TOOL: dict[str, Any] = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
MESSAGES: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                            "max_tokens": 8}


@pytest.mark.parametrize(("api", "body", "why"), [
    (Api.CHAT, CHAT, None),
    (Api.CHAT, {**CHAT, "logprobs": True}, "logprobs"),
    (Api.CHAT, {**CHAT, "logprobs": False}, None),
    (Api.CHAT, {**CHAT, "stop": ["x"]}, "stop"),
    (Api.CHAT, {**CHAT, "stop": []}, None),
    (Api.CHAT, {**CHAT, "n": 2, "temperature": 1}, "2 sequences"),
    (Api.CHAT, {**CHAT, "stream": False}, "not streamed"),
    (Api.CHAT, {**CHAT, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "continuous_usage_stats"),
    (Api.COMPLETIONS, {"model": "m", "prompt": "hi", "stream": True, "echo": True}, "echo"),
    (Api.RESPONSES, RESPONSES, None),
    (Api.RESPONSES, {**RESPONSES, "previous_response_id": "resp_1"}, "previous_response_id"),
    (Api.RESPONSES, {**RESPONSES, "text": {"format": {"type": "json_object"}}}, "text.format"),
    (Api.RESPONSES, {**RESPONSES, "text": {"format": {"type": "text"}}}, None),
    (Api.MESSAGES, MESSAGES, None),
    (Api.MESSAGES, {**MESSAGES, "stop_sequences": ["x"]}, "stop_sequences"),
    # tools the model may call: continued as text, a tool call's markup would reach the client as text
    (Api.CHAT, {**CHAT, "tools": [TOOL]}, "tools"),
    (Api.CHAT, {**CHAT, "tools": [TOOL], "tool_choice": "required"}, "tools"),
    (Api.CHAT, {**CHAT, "tools": [TOOL], "tool_choice": "none"}, None),
    (Api.CHAT, {**CHAT, "tools": []}, None),
    (Api.RESPONSES, {**RESPONSES, "tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    (Api.MESSAGES, {**MESSAGES, "tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "any"}},
     "tools"),
    (Api.MESSAGES, {**MESSAGES, "tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "none"}},
     None),
    # vLLM 0.32's structured output on Messages is output_config.format (-> response_format): a continuation,
    # a chat without it, was unconstrained and the client's schema-bound JSON came back broken, as a 200
    (Api.MESSAGES, {**MESSAGES, "output_config": {"format": {"type": "json_schema", "schema": {}}}},
     "output_config.format"),
    (Api.MESSAGES, {**MESSAGES, "output_config": {"format": {"type": "json_schema", "schema": {}}, "effort": "low"}},
     "output_config.format"),
    (Api.MESSAGES, {**MESSAGES, "output_config": {"effort": "low"}}, None),
    (Api.MESSAGES, {**MESSAGES, "output_config": {"format": None}}, None),
])
def test_the_reason_names_what_makes_a_stream_ineligible(api: Api, body: dict[str, Any], why: str | None) -> None:
    req = parse_request(orjson.dumps(body), api)
    assert ineligible_reason(req) == why
    assert eligible(req, True) is (why is None)
    assert eligible(req, False) is False
