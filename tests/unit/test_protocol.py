"""Client body validation: bad bodies get a 400 in vLLM's envelope before any engine is touched."""

from __future__ import annotations

import orjson
import pytest

from pdproxy.apis.request import Api, parse_request, patch_usage_bytes
from pdproxy.errors import BadRequest


def parse(body: object, api: Api = Api.CHAT) -> object:
    return parse_request(orjson.dumps(body), api)


@pytest.mark.parametrize(("raw", "param"), [
    (b"{not json", "body.1"),
    (b"[1, 2]", "body"),
    (b"", "body"),
])
def test_not_a_json_object(raw: bytes, param: str) -> None:
    """vLLM's FastAPI envelope for a body that is not one JSON object (json_invalid at Python's position...)."""
    with pytest.raises(BadRequest) as e:
        parse_request(raw, Api.CHAT)
    assert e.value.param == param
    assert e.value.body()["error"]["type"] == "Bad Request" and e.value.body()["error"]["code"] == 400


@pytest.mark.parametrize(("body", "n", "prompts"), [
    ({"prompt": ["a", "b"]}, 1, 2),
    ({"prompt": [[1, 2], [3, 4]], "n": 3}, 3, 2),
    ({"prompt": "x", "n": 2}, 2, 1),
    ({"prompt": "x", "n": "3"}, 3, 1),
    ({"prompt": [1, 2, 3]}, 1, 1),
])
def test_several_sequences_are_read_for_fan_out(body: dict, n: int, prompts: int) -> None:
    """One P/D pair per sequence (pdproxy/pd/fanout.py): n and the prompt count are read as vLLM reads them."""
    req = parse(body, Api.COMPLETIONS)
    assert (req.n, req.prompts, req.sequences) == (n, prompts, n * prompts)  # type: ignore[attr-defined]
    assert not req.engine_judges  # type: ignore[attr-defined]


@pytest.mark.parametrize(("body", "api"), [
    ({"model": "m"}, Api.CHAT),
    ({"messages": "hi"}, Api.CHAT),
    ({"messages": [1]}, Api.CHAT),
    ({"model": "m"}, Api.COMPLETIONS),
    ({"prompt": ""}, Api.COMPLETIONS),
    ({"prompt": 5}, Api.COMPLETIONS),
    ({"prompt": "x", "kv_transfer_params": "handle"}, Api.COMPLETIONS),
    ({"messages": [{"role": "user", "content": "x"}], "tools": "nope"}, Api.CHAT),
    ({"prompt": "x", "max_tokens": 0}, Api.COMPLETIONS),
    ({"prompt": "x", "max_tokens": "five"}, Api.COMPLETIONS),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, Api.CHAT),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, Api.COMPLETIONS),
    ({"prompt": "x", "max_tokens": 4, "min_tokens": 5}, Api.COMPLETIONS),
    ({"prompt": "x", "min_tokens": None}, Api.COMPLETIONS),
    ({"prompt": "x", "stream": True, "stream_options": "yes"}, Api.COMPLETIONS),
])
def test_invalid_requests_are_judged_by_the_engine(body: dict, api: Api) -> None:
    """pdproxy finds them invalid for vLLM: the prefiller gets the client's own values and answers vLLM's 400."""
    req = parse(body, api)
    assert req.engine_judges and not req.decoder_prefills  # type: ignore[attr-defined]


@pytest.mark.parametrize(("body", "api"), [
    ({"prompt": "x", "prompt_logprobs": 1}, Api.COMPLETIONS),
    ({"prompt": "x", "echo": True, "logprobs": 0}, Api.COMPLETIONS),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, Api.CHAT),
    ({"prompt": "x", "use_beam_search": "true"}, Api.COMPLETIONS),
])
def test_requests_needing_the_prompts_logits_skip_the_prefill_leg(body: dict, api: Api) -> None:
    assert parse(body, api).decoder_prefills  # type: ignore[attr-defined]


def test_vllm_coercions_and_defaults() -> None:
    req = parse({"prompt": "x", "stream": "true", "stream_options": {"include_usage": "no"}, "max_tokens": None},
                Api.COMPLETIONS)
    assert req.stream and not req.include_usage and req.max_output_tokens == 16  # type: ignore[attr-defined]
    req = parse({"prompt": "x", "stream": None, "max_tokens": True, "echo": True}, Api.COMPLETIONS)
    assert not req.stream and req.max_output_tokens == 1 and not req.decoder_prefills  # type: ignore[attr-defined]


@pytest.mark.parametrize("prompt", ["hello", [1, 2, 3], ["hello"], [[1, 2, 3]], []])
def test_single_prompts_are_accepted(prompt: object) -> None:
    req = parse({"prompt": prompt, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}},
                Api.COMPLETIONS)
    assert req.stream and req.include_usage and req.max_output_tokens == 5  # type: ignore[attr-defined]
    assert not req.engine_judges  # type: ignore[attr-defined]


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = parse({"messages": [{"role": "user", "content": "x"}], "max_tokens": 9, "max_completion_tokens": 3})
    assert req.max_output_tokens == 3  # type: ignore[attr-defined]


def test_patch_usage_bytes() -> None:
    data = orjson.dumps({"id": "x", "usage": {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 9}}})
    assert orjson.loads(patch_usage_bytes(data, 2))["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    assert patch_usage_bytes(data, None) is data
    no_usage = b'{"id": "x"}'
    assert patch_usage_bytes(no_usage, 3) is no_usage
