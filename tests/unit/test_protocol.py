"""Client body validation: bad bodies get a 400 in vLLM's envelope before any engine is touched."""

from __future__ import annotations

import orjson
import pytest

from pdproxy.errors import BadRequest
from pdproxy.protocol import Api, parse_request, patch_usage_bytes


def parse(body: object, api: Api = Api.CHAT) -> object:
    return parse_request(orjson.dumps(body), api)


@pytest.mark.parametrize(("raw", "param"), [
    (b"{not json", "body"),
    (b"[1, 2]", "body"),
])
def test_not_a_json_object(raw: bytes, param: str) -> None:
    with pytest.raises(BadRequest) as e:
        parse_request(raw, Api.CHAT)
    assert e.value.param == param
    assert e.value.body()["error"]["type"] == "BadRequestError" and e.value.body()["error"]["code"] == 400


@pytest.mark.parametrize(("body", "api", "param"), [
    ({"model": "m"}, Api.CHAT, "messages"),
    ({"messages": []}, Api.CHAT, "messages"),
    ({"model": "m"}, Api.COMPLETIONS, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, Api.COMPLETIONS, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, Api.COMPLETIONS, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, Api.CHAT, "max_completion_tokens"),
    ({"prompt": ["a", "b"]}, Api.COMPLETIONS, "prompt"),
    ({"prompt": [[1, 2], [3, 4]]}, Api.COMPLETIONS, "prompt"),
    ({"prompt": "x", "n": 2}, Api.COMPLETIONS, "n"),
    ({"prompt": "x", "echo": True}, Api.COMPLETIONS, "echo"),
    ({"prompt": "x", "prompt_logprobs": 1}, Api.COMPLETIONS, "prompt_logprobs"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, Api.COMPLETIONS, "stream_options"),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, Api.COMPLETIONS, "min_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": "nope"}, Api.CHAT, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": ["nope"]}, Api.CHAT, "tools"),
    ({"prompt": "x", "stream": True, "stream_options": "yes"}, Api.COMPLETIONS, "stream_options"),
])
def test_bad_bodies(body: dict, api: Api, param: str) -> None:
    with pytest.raises(BadRequest) as e:
        parse(body, api)
    assert e.value.param == param
    assert e.value.status_code == 400


@pytest.mark.parametrize("prompt", ["hello", [1, 2, 3], ["hello"], [[1, 2, 3]]])
def test_single_prompts_are_accepted(prompt: object) -> None:
    req = parse({"prompt": prompt, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}},
                Api.COMPLETIONS)
    assert req.stream and req.include_usage and req.max_output_tokens == 5  # type: ignore[attr-defined]


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = parse({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "max_completion_tokens": 3})
    assert req.max_output_tokens == 3  # type: ignore[attr-defined]


def test_patch_usage_bytes() -> None:
    data = orjson.dumps({"id": "x", "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 9}}})
    assert orjson.loads(patch_usage_bytes(data, 2))["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    assert patch_usage_bytes(data, None) is data
    no_usage = b'{"id": "x"}'
    assert patch_usage_bytes(no_usage, 3) is no_usage
