"""The prefill leg's field decisions on real vLLM 0.32 (NixlConnector; engines with ``--enable-auto-tool-choice
--tool-call-parser pythonic``), the facts ``docs/pd-protocol.md`` records:

- a constraint that cannot be met in one token (tool_choice "required" / a named function, response_format
  json_object / json_schema, structured outputs, min_tokens, a first token forced to EOS, a stop string matching
  the first token) neither fails nor
  distorts the one-token prefill: through pdproxy each request answers exactly what the decoder alone answers
  (greedy), after a real KV pull;
- KV pulled from a prefill that ran *without* the constraint decodes under it from the first token: the decoder
  samples every output token itself, so the prefill's own sample never matters;
- prompt logprobs and beam search are computed by the decoder from the prompt: pdproxy sends no prefill leg;
- an invalid request gets vLLM's own 400, word for word, and no decoder sees it;
- a client's ``kv_transfer_params`` never reaches an engine (here one naming a remote engine that does not exist,
  which a decoder would fail to pull from).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from pdproxy.apis import kv_transfer
from tests.real_vllm.support import Engines, Prompts, completion_requests, metric, scrape
from tests.support import ProxyThread, wait_until

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(180)]

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
EOS_FIRST = {"logit_bias": {"1": 100, "3": 100}}        # the tiny model's two EOS ids (generation_config.json)
CONSTRAINED: list[tuple[str, str, dict[str, Any]]] = [
    ("tool_required", "chat", {"tools": TOOLS, "tool_choice": "required"}),
    ("tool_named", "chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    ("json_object", "chat", {"response_format": {"type": "json_object"}}),
    ("json_schema", "chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                         "schema": SCHEMA}}}),
    ("regex", "completions", {"structured_outputs": {"regex": "[0-9]{3}"}}),
    ("choice", "completions", {"structured_outputs": {"choice": ["yes", "no"]}}),
    ("min_tokens", "completions", {"min_tokens": 6, **EOS_FIRST}),
    ("eos_first_chat", "chat", EOS_FIRST),
    ("eos_first_completion", "completions", EOS_FIRST),
]


def base(api: str, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "temperature": 0}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def path(api: str) -> str:
    return "/v1/chat/completions" if api == "chat" else "/v1/completions"


def answer(j: dict[str, Any]) -> tuple[Any, ...]:
    """What a client reads in a JSON answer: text, tool calls (names, arguments), finish reason, tokens."""
    choice = j["choices"][0]
    message = choice.get("message") or {}
    calls = tuple((c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or [])
    return (choice.get("text", message.get("content")), calls, choice["finish_reason"],
            j["usage"]["completion_tokens"])


def pulled(url: str) -> float:
    return metric(scrape(url), "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


def test_constraints_survive_the_one_token_prefill(engines: Engines, prompts: Prompts,
                                                   make_proxy: Callable[..., ProxyThread]) -> None:
    proxy = make_proxy(engines, tokenizer=str(engines.model_dir))
    for i, (name, api, extra) in enumerate(CONSTRAINED):
        body = {**base(api, prompts.unique(24, seed=700 + i)), **extra}
        before = pulled(engines.decode_url)
        via = httpx.post(proxy.url + path(api), json=body, timeout=60)
        assert via.status_code == 200, (name, via.text)
        wait_until(lambda before=before: pulled(engines.decode_url) > before, 10, 0.1, f"{name}: the KV pull")
        alone = httpx.post(engines.decode_url + path(api), json=body, timeout=60)
        assert answer(via.json()) == answer(alone.json()), name
        if name.startswith("eos_first"):      # the client's answer is vLLM's: stopped at once, nothing said
            assert answer(via.json())[2:] == ("stop", 1) and not answer(via.json())[0]
    # a stop string that matches the first token: vLLM checks stop strings only past min_tokens, so the one-token
    # prefill leg (min_tokens 1) still hands over its KV, and the decoder stops at once as vLLM alone does
    body = base("chat", "Tell me the weather in Paris please, in a few words.")
    first = httpx.post(engines.decode_url + path("chat"), json={**body, "max_tokens": 1}, timeout=60).json()
    word = (first["choices"][0]["message"]["content"] or "").strip()
    assert word, first
    body["stop"] = [word]
    before = pulled(engines.decode_url)
    via = httpx.post(proxy.url + path("chat"), json=body, timeout=60)
    wait_until(lambda: pulled(engines.decode_url) > before, 10, 0.1, "stop string: the KV pull")
    alone = httpx.post(engines.decode_url + path("chat"), json=body, timeout=60)
    assert answer(via.json()) == answer(alone.json()) and answer(via.json())[2] == "stop"


CONSTRAINTS = ("tool_choice", "response_format", "structured_outputs", "min_tokens", "logit_bias")
"""Output constraints: they do not change the prompt (``tools`` do, and stay: a prefill that rendered fewer prompt
tokens than the decoder crashes vLLM 0.32's decoder, see docs/pd-protocol.md)."""


def test_kv_from_an_unconstrained_prefill_decodes_under_the_constraint(engines: Engines, prompts: Prompts) -> None:
    """Direct legs, no proxy: the prefill runs without the output constraint, the decode with it."""
    for i, (name, api, extra) in enumerate(CONSTRAINED):
        body = {**base(api, prompts.unique(24, seed=800 + i)), **extra}
        plain = {k: v for k, v in body.items() if k not in CONSTRAINTS}
        prefill = httpx.post(engines.prefill_url + path(api), json=kv_transfer.prefill_body(plain), timeout=60)
        params = kv_transfer.extract_params(kv_transfer.load_prefill_answer(prefill.content))
        assert params is not None, (name, prefill.text)
        decode = httpx.post(engines.decode_url + path(api), content=orjson.dumps(kv_transfer.decode_body(body, params)),
                            headers={"Content-Type": "application/json"}, timeout=60)
        alone = httpx.post(engines.decode_url + path(api), json=body, timeout=60)
        assert answer(decode.json()) == answer(alone.json()), name


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 1}, {"echo": True, "logprobs": 1},
                                   {"use_beam_search": True}], ids=["prompt_logprobs", "echo_logprobs", "beam"])
def test_prompt_logits_and_beam_search_are_the_decoders_own(engines: Engines, prompts: Prompts,
                                                            make_proxy: Callable[..., ProxyThread],
                                                            extra: dict[str, Any]) -> None:
    proxy = make_proxy(engines, tokenizer=str(engines.model_dir))
    body = {**base("completions", prompts.unique(12, seed=900)), "max_tokens": 4, **extra}
    asked = completion_requests(engines.prefill_url)
    via = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
    alone = httpx.post(engines.decode_url + "/v1/completions", json=body, timeout=60)
    assert via.status_code == alone.status_code == 200, via.text
    for key in ("text", "prompt_logprobs"):
        assert via.json()["choices"][0].get(key) == alone.json()["choices"][0].get(key), key
    assert completion_requests(engines.prefill_url) == asked      # no prefill leg was sent


INVALID: list[tuple[str, dict[str, Any]]] = [
    ("completions", {"max_tokens": 0}),
    ("completions", {"min_tokens": None}),
    ("completions", {"max_tokens": 3, "min_tokens": 5}),
    ("completions", {"stream": False, "stream_options": {"include_usage": True}}),
    ("completions", {"max_tokens": 5000}),
    ("completions", {"kv_transfer_params": "handle"}),
    ("chat", {"messages": [1]}),
    ("chat", {"tool_choice": "required"}),
    ("chat", {"max_completion_tokens": "many", "temperature": -1}),
]


def test_invalid_requests_get_vllms_own_400(engines: Engines, make_proxy: Callable[..., ProxyThread]) -> None:
    proxy = make_proxy(engines)
    for api, extra in INVALID:
        body = {**base(api, "The prefiller reads the prompt."), **extra}
        raw = orjson.dumps(body)
        asked = completion_requests(engines.decode_url)
        via = httpx.post(proxy.url + path(api), content=raw, timeout=30, headers={"Content-Type": "application/json"})
        alone = httpx.post(engines.decode_url + path(api), content=raw, timeout=30,
                           headers={"Content-Type": "application/json"})
        assert (via.status_code, via.json()) == (alone.status_code, alone.json()) and via.status_code == 400, extra
        assert completion_requests(engines.decode_url) == asked + 1, extra   # only our direct request


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_gets_vllms_own_400(engines: Engines, make_proxy: Callable[..., ProxyThread],
                                                   content_type: str | None) -> None:
    """vLLM's ``validate_json_request``: what ``curl -d`` sends (a form's media type), or none, is its 400 — the
    same bytes through pdproxy, which answers it itself, before any engine."""
    proxy = make_proxy(engines)
    raw = orjson.dumps(base("chat", "The prefiller reads the prompt."))
    headers = {} if content_type is None else {"Content-Type": content_type}
    asked = completion_requests(engines.decode_url)
    via = httpx.post(proxy.url + "/v1/chat/completions", content=raw, timeout=30, headers=headers)
    alone = httpx.post(engines.decode_url + "/v1/chat/completions", content=raw, timeout=30, headers=headers)
    assert (via.status_code, via.json()) == (alone.status_code, alone.json()) and via.status_code == 400
    assert completion_requests(engines.decode_url) == asked + 1          # only our direct request


def test_a_client_handle_never_reaches_an_engine(engines: Engines, prompts: Prompts,
                                                 make_proxy: Callable[..., ProxyThread]) -> None:
    proxy = make_proxy(engines)
    body = {**base("completions", prompts.unique(20, seed=950)), "kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]],
        "remote_engine_id": "no-such-engine", "remote_request_id": "x", "remote_host": "127.0.0.1",
        "remote_port": 9, "remote_num_tokens": 20}}
    via = httpx.post(proxy.url + "/v1/completions", json=body, timeout=60)
    plain = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    alone = httpx.post(engines.decode_url + "/v1/completions", json=plain, timeout=60)
    assert via.status_code == 200 and answer(via.json()) == answer(alone.json())
