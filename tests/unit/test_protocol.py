"""Client body validation: bad bodies get a 400 in vLLM's envelope before any engine is touched."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

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
    ({"prompt": [1.0] * 20}, 1, 1),                 # lax token ids: one prompt (old code: 20, refused at 16)
    ({"prompt": ["5", 6, 7]}, 1, 1),
    ({"prompt": [True, False]}, 1, 1),
    ({"prompt": [[1.0], [2]]}, 1, 2),
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


@pytest.mark.parametrize(("api", "body", "limit"), [
    (Api.RESPONSES, {"input": "x", "stream": "true", "max_output_tokens": "3"}, 3),
    (Api.RESPONSES, {"input": "x", "stream": 1, "max_output_tokens": 3.0}, 3),
    (Api.MESSAGES, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "true",
                    "max_tokens": "5"}, 5),
    (Api.MESSAGES, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes",
                    "max_tokens": 5.0}, 5)])
def test_responses_and_messages_read_stream_and_limits_with_vllms_coercions(api: Api, body: dict,
                                                                           limit: int) -> None:
    """``ResponsesRequest`` / ``AnthropicMessagesRequest`` type ``stream: bool | None`` and the limit ``int`` in
    pydantic's lax mode: vLLM streams ``"stream": "true"`` and reads ``"3"`` / ``3.0`` as 3 (the simulator
    too); pdproxy answered 400 "'stream' must be a boolean" / "must be an integer"."""
    req = parse(body, api)
    assert req.stream is True and req.max_output_tokens == limit  # type: ignore[attr-defined]
    with pytest.raises(BadRequest):
        parse({**body, "stream": "maybe"}, api)
    with pytest.raises(BadRequest):
        parse({**body, "max_output_tokens" if api is Api.RESPONSES else "max_tokens": "3.5"}, api)


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


# --- the shapes pdproxy reads, checked in C before (and mostly instead of) its pydantic models -----------------
_SCALARS = st.sampled_from([0, 1, 7, -1, 2**40, True, False, None, 1.0, 1.5, "", "a", "5"])
_SHAPE_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                             | st.dictionaries(st.sampled_from(["role", "content", "type", "x"]), inner, max_size=3),
                             max_leaves=12)


@settings(max_examples=400, deadline=None)
@given(prompt=_SHAPE_VALUES, messages=_SHAPE_VALUES, tools=_SHAPE_VALUES, handle=_SHAPE_VALUES,
       chat=st.booleans())
def test_the_fast_shape_check_agrees_with_the_models(prompt: object, messages: object, tools: object,
                                                     handle: object, chat: bool) -> None:
    """Whatever the fields' shapes, a body the C-speed checks pass is one the pydantic model accepts: they never
    let through what vLLM's types refuse (a body they do not pass goes to the model, which has the last word)."""
    from pdproxy.apis.request import _ChatShape, _CompletionShape, _shape_fault, _shape_problem

    body = {"messages": messages, "tools": tools, "kv_transfer_params": handle} if chat else {
        "prompt": prompt, "kv_transfer_params": handle}
    model = _ChatShape if chat else _CompletionShape
    try:
        model.model_validate(body, from_attributes=True)
        accepted = True
    except ValidationError:
        accepted = False
    if _shape_problem(body, chat) is None:
        assert accepted, body
    assert (_shape_fault(body, chat) is None) == accepted, body


def test_long_lists_are_read_without_the_models(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pydantic's models cost 1–6 µs a list member (a 150,000-tool chat was 0.85 s of the event loop, a
    480,000-prompt list 1.4 s): long lists of the plain shapes never reach them; a long list that is not one of
    them gets pdproxy's words (the prefiller still judges it in vLLM's); a prompt list longer than any fan-out
    is refused before any member is read."""
    from pdproxy.apis import request as request_mod
    from pdproxy.settings import FAN_OUT_CEILING

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("a long list reached pydantic")

    monkeypatch.setattr(request_mod._ChatShape, "model_validate", no_model)
    monkeypatch.setattr(request_mod._CompletionShape, "model_validate", no_model)
    tool = {"type": "function", "function": {"name": "f"}}
    ok = parse_request(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                     "tools": [tool] * 150_000}), Api.CHAT)
    assert ok.fault is None and not ok.engine_judges
    ids = parse_request(orjson.dumps({"model": "m", "prompt": list(range(300_000))}), Api.COMPLETIONS)
    assert ids.fault is None and ids.prompts == 1
    bad = parse_request(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * 20_000 + [5]}),
                        Api.CHAT)
    assert bad.engine_judges and bad.fault is not None and bad.fault.param == "messages"
    assert "'messages' must be a list of message objects" in bad.fault.message
    handle = parse_request(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}] * 20_000,
                                         "kv_transfer_params": 5}), Api.CHAT)
    assert handle.engine_judges and handle.fault is not None and handle.fault.param == "kv_transfer_params"
    bad_ids = parse_request(orjson.dumps({"model": "m", "prompt": [1] * 20_000 + [-1]}), Api.COMPLETIONS)
    assert bad_ids.engine_judges and bad_ids.fault is not None and bad_ids.fault.param == "prompt"
    with pytest.raises(BadRequest) as many:
        parse_request(orjson.dumps({"model": "m", "prompt": [[1]] * (FAN_OUT_CEILING + 1)}), Api.COMPLETIONS)
    assert many.value.param == "prompt" and f"at most {FAN_OUT_CEILING} per request" in many.value.message
    fan = parse_request(orjson.dumps({"model": "m", "prompt": ["a"] * FAN_OUT_CEILING}), Api.COMPLETIONS)
    assert fan.prompts == FAN_OUT_CEILING and fan.fault is None


_MESSAGE_VALUES = st.one_of(
    _SHAPE_VALUES,
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", 5, ["user"]])},
                          optional={"content": st.one_of(_SHAPE_VALUES, st.text(max_size=3),
                                                         st.lists(st.one_of(
                                                             st.dictionaries(st.sampled_from(["type", "text"]),
                                                                             _SCALARS, max_size=2), _SCALARS),
                                                             max_size=3))}))


@settings(max_examples=400, deadline=None)
@given(messages=st.lists(_MESSAGE_VALUES, min_size=1, max_size=5))
def test_the_messages_fast_check_agrees_with_the_per_message_loop(messages: list[object]) -> None:
    """Anthropic messages pass the C-speed check exactly when the per-message loop finds nothing to refuse."""
    from pdproxy.apis.fields import _message_fault, _plain_messages

    try:
        _message_fault(messages)
        refused = False
    except BadRequest:
        refused = True
    assert _plain_messages(messages) is not refused, messages


@settings(max_examples=300, deadline=None)
@given(value=st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1)
                          | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
                          lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                                     max_size=4), max_leaves=20))
def test_a_fields_bytes_from_its_json_bound_its_strings_and_numbers(value: object) -> None:
    """The size admission gives a message's other fields and ``chat_template_kwargs`` (their compact JSON, in C)
    is never below what the Python walk it replaced counted: every string and number as ``str()`` writes it."""
    from pdproxy.admission.bounds import _strings_bytes, _walked_bytes

    assert _strings_bytes(value) >= _walked_bytes(value)


def test_echo_without_generation_is_valid_and_goes_to_a_decoder_alone() -> None:
    """vLLM runs a completion with ``echo`` and ``max_tokens: 0`` (the prompt echoed, nothing generated) with
    ``max_tokens`` 1 (``CompletionRequest.to_sampling_params``): valid, not left to the engine to refuse (found by
    the real-vLLM oracle test), and served by a decoder alone as the other echo requests are."""
    req = parse({"prompt": "x", "echo": True, "max_tokens": 0}, Api.COMPLETIONS)
    assert not req.engine_judges and req.decoder_prefills  # type: ignore[attr-defined]
    assert parse({"prompt": "x", "max_tokens": 0}, Api.COMPLETIONS).engine_judges  # type: ignore[attr-defined]


@pytest.mark.parametrize("api", [Api.CHAT, Api.COMPLETIONS])
def test_beam_search_is_read_without_sampling_params_checks(api: Api) -> None:
    """vLLM builds ``BeamSearchParams`` for beam search, which check none of ``SamplingParams._verify_args`` (no
    ``max_tokens`` ≥ 1, no ``n`` ≥ 1: its own ``beam_width`` check): such a request is not pdproxy's to refuse, its
    decoder (serving it alone) judges it (real-vLLM oracle: ``max_tokens: 0`` with beam search is accepted)."""
    head = {"messages": [{"role": "user", "content": "x"}]} if api is Api.CHAT else {"prompt": "x"}
    for extra in ({"max_tokens": 0}, {"n": 0}, {"n": 2, "temperature": 0}, {"min_tokens": -1}):
        req = parse({**head, "use_beam_search": True, **extra}, api)
        assert not req.engine_judges and req.decoder_prefills, extra  # type: ignore[attr-defined]
        assert parse({**head, **extra}, api).engine_judges, extra  # type: ignore[attr-defined]


@pytest.mark.parametrize("max_tokens", [-1, -1_000_000_000, 0])
def test_beam_search_with_a_limit_below_one_asks_for_no_output_never_a_negative_count(max_tokens: int) -> None:
    """vLLM accepts beam search with ``max_tokens`` ≤ 0 and runs no step (``beam_search/online.py``): pdproxy reads
    it as 0 output tokens, so no decode lease, admission bound or metric gets a negative count (a lease of
    prompt − 10⁹ once made a decoder look empty to the prefill queue and the balancer)."""
    from pdproxy.pd.decode import decode_lease_tokens

    req = parse({"messages": [{"role": "user", "content": "x"}], "use_beam_search": True, "max_tokens": max_tokens})
    assert req.max_output_tokens == 0 and not req.engine_judges  # type: ignore[attr-defined]
    req.prompt_tokens = 10  # type: ignore[attr-defined]
    assert decode_lease_tokens(req, 1024) == 10  # type: ignore[arg-type]
