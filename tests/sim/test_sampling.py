"""``pdproxy sim`` honours what clients send, as vLLM 0.32 does: stop strings and token ids, ``min_tokens``,
``ignore_eos``, logprobs, JSON output, ``n`` and prompt lists, forced tool calls; and refuses what vLLM refuses
with vLLM's error bodies. Real openai client against a simulator process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdproxy.sim.outputs import WORDS
from tests.sim.helpers import sse_json
from tests.support import SimProcess, running

pytestmark = pytest.mark.timeout(60)
MESSAGES = [{"role": "user", "content": "Hello there"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"]}}}]


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with running(SimProcess("both", "--output-tokens", "8")) as (s,):
        yield s


@pytest.fixture
def oai(sim: SimProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=sim.url + "/v1", api_key="none", max_retries=0) as client:
        yield client


def post(sim: SimProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(sim.url + path, json=body, timeout=10)


def test_stop_string_ends_the_answer_before_it(oai: openai.OpenAI) -> None:
    free = oai.completions.create(model="sim-model", prompt="x", max_tokens=20, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 4]
    cut = oai.completions.create(model="sim-model", prompt="x", max_tokens=20, stop=[stop], temperature=0)
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop  # type: ignore[attr-defined]
    assert stop not in choice.text and text.startswith(choice.text)
    kept = oai.completions.create(model="sim-model", prompt="x", max_tokens=20, stop=[stop], temperature=0,
                                  extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop) and text.startswith(kept.choices[0].text)
    chunks = list(oai.completions.create(model="sim-model", prompt="x", max_tokens=20, stop=stop, stream=True,
                                         temperature=0))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_token_ids_and_min_tokens(sim: SimProcess) -> None:
    ids = [httpx.post(sim.url + "/tokenize", json={"prompt": w}).json()["tokens"][0] for w in WORDS]
    base = post(sim, "/v1/completions", {"prompt": "x", "max_tokens": 20, "return_token_ids": True,
                                         "seed": 5}).json()
    out_ids = base["choices"][0]["token_ids"]
    assert set(out_ids) <= set(ids)
    target = out_ids[3]
    first = out_ids.index(target)
    stopped = post(sim, "/v1/completions", {"prompt": "x", "max_tokens": 20, "stop_token_ids": [target],
                                            "seed": 5}).json()
    choice = stopped["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", target)
    assert stopped["usage"]["completion_tokens"] == first + 1  # counted, but its text left out
    later = post(sim, "/v1/completions", {"prompt": "x", "max_tokens": 40, "stop_token_ids": [target],
                                          "min_tokens": first + 1, "seed": 5}).json()
    assert later["usage"]["completion_tokens"] > first + 1  # not before min_tokens
    chat = post(sim, "/v1/chat/completions", {"messages": MESSAGES, "min_tokens": 12}).json()
    assert chat["usage"]["completion_tokens"] == 12 and chat["choices"][0]["finish_reason"] == "stop"
    natural = post(sim, "/v1/responses", {"input": "hi", "max_output_tokens": 30}).json()
    assert natural["usage"]["output_tokens"] == 8 and natural["status"] == "completed"
    eos = post(sim, "/v1/responses", {"input": "hi", "max_output_tokens": 30, "ignore_eos": True}).json()
    assert eos["usage"]["output_tokens"] == 30 and eos["status"] == "incomplete"


def test_logprobs_chat_and_completions(oai: openai.OpenAI) -> None:
    chat = oai.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=4,  # type: ignore[arg-type]
                                       logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    for t in content:
        assert t.logprob < 0 and len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
        assert bytes(t.bytes or []) == t.token.encode()
    cmpl = oai.completions.create(model="sim-model", prompt="x", max_tokens=3, logprobs=2)
    lp = cmpl.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 3 and all(len(d) == 2 for d in lp.top_logprobs or [])
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]  # type: ignore[index]


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_completion_logprobs_offsets_run_on_across_events(oai: openai.OpenAI, n: int) -> None:
    """Each event's ``text_offset`` continues the text streamed before it, per choice (the sim kept each event's
    offset from the text before it, found again from the stream's start: quadratic, 33 s of CPU for 8,000
    tokens)."""
    text: dict[int, str] = {}
    events = 0
    for chunk in oai.completions.create(model="sim-model", prompt="x", max_tokens=40, logprobs=1, n=n,
                                        stream=True, temperature=1.0, seed=3):
        for c in chunk.choices:
            if c.logprobs is None or not c.logprobs.text_offset:
                continue
            before = text.get(c.index, "")
            assert c.logprobs.text_offset[0] == len(before)
            assert "".join(c.logprobs.tokens or []) == c.text
            text[c.index] = before + c.text
            events += 1
    assert sorted(text) == list(range(n)) and events >= 2 * n
    stream = list(oai.chat.completions.create(model="sim-model", messages=MESSAGES,  # type: ignore[arg-type]
                                              max_tokens=3, logprobs=True, top_logprobs=1, stream=True))
    assert sum(len(c.choices[0].logprobs.content or []) for c in stream if c.choices and c.choices[0].logprobs) == 3


def test_json_output_parses_and_fits_the_schema(oai: openai.OpenAI) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "kind"],
              "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 18},
                             "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
                             "kind": {"enum": ["a", "b"]}}}
    resp = oai.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=200,  # type: ignore[arg-type]
                                       response_format={"type": "json_schema",  # type: ignore[typeddict-item]
                                                        "json_schema": {"name": "p", "schema": schema}})
    value = json.loads(resp.choices[0].message.content or "")
    assert set(value) == {"name", "age", "tags", "kind"} and isinstance(value["age"], int) and value["age"] >= 18
    assert len(value["tags"]) >= 2 and value["kind"] == "a" and resp.choices[0].finish_reason == "stop"
    obj = oai.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=200,  # type: ignore[arg-type]
                                      response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    cut = oai.chat.completions.create(model="sim-model", messages=MESSAGES, max_tokens=2,  # type: ignore[arg-type]
                                      response_format={"type": "json_object"})
    assert cut.choices[0].finish_reason == "length"  # a limit cuts JSON as it cuts text


def test_n_and_prompt_lists(oai: openai.OpenAI, sim: SimProcess) -> None:
    resp = oai.completions.create(model="sim-model", prompt="x", max_tokens=3, n=3)
    assert [c.index for c in resp.choices] == [0, 1, 2] and len({c.text for c in resp.choices}) == 3
    assert resp.usage and resp.usage.completion_tokens == 9 and resp.usage.prompt_tokens == 1
    lists = oai.completions.create(model="sim-model", prompt=["one two", "three"], max_tokens=2, n=2)
    assert [c.index for c in lists.choices] == [0, 1, 2, 3]
    assert lists.usage and lists.usage.prompt_tokens == 3 and lists.usage.completion_tokens == 8
    ids = oai.completions.create(model="sim-model", prompt=[[1, 2, 3], [4, 5]], max_tokens=2)
    assert len(ids.choices) == 2 and ids.usage and ids.usage.prompt_tokens == 5
    events = sse_json(post(sim, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 2, "n": 2, "stream": True,
        "stream_options": {"include_usage": True}}).text)
    roles = [e["choices"][0]["index"] for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
    finishes = [e["choices"][0]["index"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert sorted(roles) == [0, 1] and sorted(finishes) == [0, 1]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 4
    assert [("system_fingerprint" in e) for e in events] == [False] * (len(events) - 1) + [True]


def test_forced_tool_calls(oai: openai.OpenAI, sim: SimProcess) -> None:
    named = oai.chat.completions.create(model="sim-model", messages=MESSAGES, tools=TOOLS,  # type: ignore[arg-type]
                                        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = named.choices[0]
    (call,) = choice.message.tool_calls or []
    assert choice.finish_reason == "stop" and choice.message.content == ""
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"zone": "UTC"}
    required = oai.chat.completions.create(model="sim-model", messages=MESSAGES, tools=TOOLS,  # type: ignore[arg-type]
                                           tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    assert (required.choices[0].message.tool_calls or [])[0].function.name == "get_weather"  # type: ignore[union-attr]
    events = sse_json(post(sim, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "stream": True,
                                                         "tool_choice": "required"}).text)
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[1] == {"content": None, "tool_calls": [{"id": deltas[1]["tool_calls"][0]["id"], "type": "function",
                                                          "index": 0, "function": {"name": "get_weather"}}]}
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[2:] if d.get("tool_calls"))
    assert json.loads(args) == {"city": "sim"} and deltas[-1] == {}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(("path", "body", "message", "param"), [
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1},
     "temperature must be non-negative, got -1.0. (parameter=temperature, value=-1.0)", "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 2.5},
     "temperature must be in [0, 2], got 2.5. (parameter=temperature, value=2.5)", "temperature"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_p": 0},
     "top_p must be in (0, 1], got 0.0. (parameter=top_p, value=0.0)", "top_p"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2, "temperature": 0},
     "n must be 1 when using greedy sampling, got 2.", None),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
     "Requested sample logprobs of 21, which is greater than max allowed: 20 (parameter=logprobs, value=21)",
     "logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2},
     "when using `top_logprobs`, `logprobs` must be set to true. (parameter=top_logprobs)", "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stop": [""]}, "stop cannot contain an empty string.", None),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"},
     "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)", "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}},
     "When response_format type is 'json_schema', the 'json_schema' field must be provided. "
     "(parameter=response_format)", "response_format"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty must be in [-2, 2], got 3.0.",
     None),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n must be at least 1, got 0.", None),
])
def test_vllms_400s(sim: SimProcess, path: str, body: dict[str, Any], message: str, param: str | None) -> None:
    resp = post(sim, path, body)
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


def test_type_errors_are_pydantics(sim: SimProcess) -> None:
    resp = post(sim, "/v1/chat/completions", {"messages": MESSAGES, "stop_token_ids": ["x"]})
    assert resp.status_code == 400 and resp.json()["error"] == {
        "message": "1 validation error:\n  {'type': 'int_parsing', 'loc': 'body.stop_token_ids.0', 'msg': 'Input "
                   "should be a valid integer, unable to parse string as an integer', 'input': 'x'}",
        "type": "Bad Request", "param": "body.stop_token_ids.0", "code": 400}
    resp = post(sim, "/v1/chat/completions", {"model": "sim-model"})
    assert "'input': '<dict of 1 items>'" in resp.json()["error"]["message"]


def test_a_custom_role_is_served_as_vllm_serves_it(sim: SimProcess) -> None:
    """Real vLLM 0.32 answered a chat with role "wizard" 200 (its chat messages accept custom roles;
    ``tests/real_vllm/captures/apis/error_chat_bad_role.json``); only ``/v1/messages`` refuses it."""
    resp = post(sim, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 2})
    assert resp.status_code == 200


def test_echo_without_generation_answers_the_prompt(oai: openai.OpenAI, sim: SimProcess) -> None:
    """A completion with ``echo`` and ``max_tokens: 0`` is valid in vLLM 0.32: it runs with ``max_tokens`` 1
    (``CompletionRequest.to_sampling_params``) and answers the prompt alone as the text, with the finish reason
    and usage of that one token (``completion/serving.py``), as JSON and streamed; each prompt of a list echoes
    itself. ``max_tokens: 0`` without ``echo`` stays vLLM's 400 (was a 400 with ``echo`` too)."""
    prompt = "Hello there world"
    one = oai.completions.create(model="sim-model", prompt=prompt, max_tokens=0, echo=True)
    (choice,) = one.choices
    assert (choice.text, choice.finish_reason) == (prompt, "length")
    assert one.usage is not None and (one.usage.prompt_tokens, one.usage.completion_tokens) == (3, 1)
    listed = oai.completions.create(model="sim-model", prompt=[prompt, "Bye now"], max_tokens=0, echo=True)
    assert [c.text for c in listed.choices] == [prompt, "Bye now"]
    chunks = list(oai.completions.create(model="sim-model", prompt=prompt, max_tokens=0, echo=True, stream=True,
                                         stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts == [prompt] and chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 1
    refused = post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"] == {
        "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        "type": "BadRequestError", "param": "max_tokens", "code": 400}
    refused = post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": False})
    assert refused.status_code == 400


def test_echo_with_generation_prepends_the_prompt(oai: openai.OpenAI, sim: SimProcess) -> None:
    """``echo`` with ``max_tokens`` > 0: vLLM 0.32 answers the prompt followed by the generated text
    (``completion/serving.py``: ``output_text = prompt_text + output.text``; streamed, the first chunk of each
    choice is ``prompt_text + output.text``), usage counting the generated tokens only; a token-id prompt is
    decoded, each prompt of a list and each of ``n`` choices echoes its prompt; ``return_token_ids`` makes the
    prompt text ``""``. The simulator answered the generated text alone."""
    prompt = "Hello there world"
    plain = oai.completions.create(model="sim-model", prompt=prompt, max_tokens=4, seed=7)
    generated = plain.choices[0].text
    assert generated
    one = oai.completions.create(model="sim-model", prompt=prompt, max_tokens=4, seed=7, echo=True)
    assert one.choices[0].text == prompt + generated
    assert one.usage is not None and (one.usage.prompt_tokens, one.usage.completion_tokens) == (3, 4)
    ids = post(sim, "/tokenize", {"prompt": prompt}).json()["tokens"]
    by_ids = oai.completions.create(model="sim-model", prompt=ids, max_tokens=4, echo=True)
    assert by_ids.choices[0].text.startswith(prompt) and len(by_ids.choices[0].text) > len(prompt)
    listed = oai.completions.create(model="sim-model", prompt=[prompt, "Bye now"], max_tokens=3, n=2, echo=True)
    assert [c.text.startswith(p) and len(c.text) > len(p) for c, p in
            zip(sorted(listed.choices, key=lambda c: c.index), [prompt, prompt, "Bye now", "Bye now"],
                strict=True)] == [True] * 4
    assert listed.usage is not None and listed.usage.completion_tokens == 12
    raw = post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "seed": 7, "echo": True,
                                        "return_token_ids": True}).json()
    assert raw["choices"][0]["text"] == generated
    lp = oai.completions.create(model="sim-model", prompt=prompt, max_tokens=4, seed=7, echo=True, logprobs=1)
    assert lp.choices[0].text == prompt + generated and lp.choices[0].logprobs is not None
    assert lp.choices[0].logprobs.text_offset is not None and lp.choices[0].logprobs.text_offset[0] == len(prompt)
    chunks = list(oai.completions.create(model="sim-model", prompt=prompt, max_tokens=4, seed=7, echo=True,
                                         stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0].startswith(prompt) and len(texts[0]) > len(prompt) and "".join(texts) == prompt + generated
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    streamed = list(oai.completions.create(model="sim-model", prompt=[prompt, "Bye now"], max_tokens=3, n=2,
                                           echo=True, stream=True))
    by_choice: dict[int, str] = {}
    for c in streamed:
        for ch in c.choices:
            if ch.index not in by_choice:
                assert ch.text.startswith(prompt if ch.index < 2 else "Bye now")
            by_choice[ch.index] = by_choice.get(ch.index, "") + ch.text
    assert sorted(by_choice) == [0, 1, 2, 3]
