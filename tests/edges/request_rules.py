"""Requests generated from vLLM 0.32's request models, and the rule pdproxy must keep with each of them.

The strategies draw every field pdproxy reads or rewrites, and a sample of those it passes through, with values
vLLM accepts and values it refuses: each field's type, its nullability (``min_tokens: null`` is a 400 in vLLM,
``max_tokens: null`` is not), pydantic's lax coercions (``"5"``, ``5.0``, ``True``, ``"no"``) and the cross-field
rules of the model validators (``chat_completion/protocol.py::ChatCompletionRequest``,
``completion/protocol.py::CompletionRequest``, ``sampling_params.py::SamplingParams._verify_args``).

:func:`check` states the rule for one request, given ``judge(api, raw) -> (status, json)``: vLLM's verdict on a
body (``tests/real_vllm/vllm_oracle.py`` live, or the verdicts it recorded in ``request_rules_cases.json``):

- vLLM accepts it → pdproxy accepts it with vLLM's meaning (stream, output-token request, ``min_tokens``, usage
  options, whether the prompt's logits are needed), and every leg it builds is accepted by vLLM with the
  meaning the leg must have (prefill: one token, not streamed; decode: the client's); ``n`` > 1 and a list of
  several prompts fan out (``pdproxy/pd/fanout.py``): every sequence's legs are accepted with that meaning, one
  prompt and no ``n`` each;
- vLLM refuses it → the first engine leg that refuses it gets vLLM's own 400 for it (an engine judges it), or,
  for a body that is not one JSON object or asks for ``n`` > 1 with greedy sampling, pdproxy answers that same
  400 itself: the client sees exactly vLLM's answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson
from hypothesis import strategies as st

from pdproxy.apis import kv_transfer
from pdproxy.apis.request import Api, ProxyRequest, parse_request
from pdproxy.errors import BadRequest
from pdproxy.pd import fanout
from pdproxy.timeline import RequestContext

Judge = Callable[[str, bytes], tuple[int, dict[str, Any]]]
MAX_MODEL_LEN = 2048
"""The oracle's (and the real test engines') ``max_model_len``."""
HANDLE = kv_transfer.KVHandle.of({"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1]],
                                   "remote_engine_id": "e", "remote_request_id": "r", "remote_host": "h",
                                   "remote_port": 1})
ABSENT = object()
FAN_OUT_MAX = 16
"""pdproxy's default ``fan_out_max_sequences``."""

INTS = st.sampled_from([None, 0, 1, 2, 7, 16, 2047, 2048, 5000, -1, "5", "x", 5.0, 5.5, True, False, [3]])
COMMON: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["tiny", None, 5]),
    "max_tokens": INTS,
    "min_tokens": st.sampled_from([0, 1, 3, 8, 3000, -1, None, "2", 2.0, "x"]),
    "stream": st.sampled_from([True, False, None, "true", "false", "no", "maybe", 1, 0, 2]),
    "stream_options": st.sampled_from([None, {}, {"include_usage": True}, {"include_usage": "no"},
                                       {"include_usage": "maybe"}, {"continuous_usage_stats": True}, "x", [1]]),
    "n": st.sampled_from([None, 1, 2, "2", 0, 1.0, "x"]),
    "use_beam_search": st.sampled_from([False, True, "no", 3]),
    "prompt_logprobs": st.sampled_from([None, 0, 1, -1, -2, "x"]),
    "temperature": st.sampled_from([None, 0, 0.7, -1, 3, "hot"]),
    "top_p": st.sampled_from([None, 0.5, 0, 1.5]),
    "stop": st.sampled_from([None, "x", ["a", "b"], [""], 5]),
    "seed": st.sampled_from([None, 1, "x"]),
    "ignore_eos": st.sampled_from([True, False, "x"]),
    "priority": st.sampled_from([0, 1, "x"]),
    "cache_salt": st.sampled_from(["salt", "", "a/b", 7]),
    "kv_transfer_params": st.sampled_from([None, {}, {"do_remote_prefill": True, "remote_host": "client"}, "x",
                                           [1]]),
    "ec_transfer_params": st.sampled_from([None, {"x": 1}, 3]),
    "structured_outputs": st.sampled_from([None, {"regex": "a+"}, {"regex": "a", "choice": ["x"]},
                                           {"choice": ["a", "b"]}, "x"]),
    "response_format": st.sampled_from([None, {"type": "json_object"}, {"type": "json_schema"}, {"type": "text"},
                                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
                                        {"type": "bogus"}]),
    "guided_json": st.just({"type": "object"}),           # removed from vLLM: an ignored extra field
    "logits_processors": st.just(["my.module:Proc"]),    # not a vLLM 0.32 field: ignored
    "stream_interval": st.sampled_from([None, 1, 0, "x"]),
    "truncate_prompt_tokens": st.sampled_from([None, -1, 4, -2, 5000]),
}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CHAT: dict[str, st.SearchStrategy[Any]] = {
    "max_completion_tokens": INTS,
    "echo": st.sampled_from([True, False, None, "yes", 3]),
    "logprobs": st.sampled_from([True, False, None, "x"]),
    "top_logprobs": st.sampled_from([0, 1, None, -1, -2, "x"]),
    "tools": st.sampled_from([None, [], [TOOL], "x", ["x"]]),
    "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {
        "name": "get_weather"}}, {"type": "function", "function": {"name": "other"}}, "bogus"]),
    "add_generation_prompt": st.sampled_from([True, False]),
    "continue_final_message": st.sampled_from([True, False]),
}
COMPLETIONS: dict[str, st.SearchStrategy[Any]] = {
    "echo": st.sampled_from([True, False, None, "yes", 3]),
    "logprobs": st.sampled_from([None, 0, 1, 5, -1, -2, "x"]),
    "suffix": st.sampled_from([None, "end", 3]),
}
MESSAGES = st.sampled_from([[{"role": "user", "content": "Hello there"}],
                            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                            [], "hi", [1], None])
PROMPTS = st.sampled_from(["The prefiller reads the whole prompt.", "", None, [1, 2, 3], [[1, 2]], ["a"],
                           ["a", "b"], [[1], [2]], 5, [-1], [], ABSENT])


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    """``(api, body)``: a chat or completions request with a random subset of the fields above."""
    api = draw(st.sampled_from(["chat", "completions"]))
    fields = {**COMMON, **(CHAT if api == "chat" else COMPLETIONS)}
    chosen = draw(st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True))
    body: dict[str, Any] = {}
    if api == "chat":
        messages = draw(MESSAGES)
        if messages is not None:
            body["messages"] = messages
    else:
        prompt = draw(PROMPTS)
        if prompt is not ABSENT:
            body["prompt"] = prompt
    for name in chosen:
        body[name] = draw(fields[name])
    return api, body


def first_leg(req: ProxyRequest) -> tuple[str, bytes]:
    """Which engine gets ``req`` first, and the body pdproxy sends it (as ``pdproxy/pd/director.py`` builds it)."""
    if req.decoder_prefills:
        return "decode", kv_transfer.decode_body_bytes(req.raw, None, req.body)
    judges = req.engine_judges or kv_transfer.engine_must_judge(req.max_output_tokens, MAX_MODEL_LEN)
    return "prefill", orjson.dumps(kv_transfer.prefill_body(req.body, engine_judges=judges))


def meaning(verdict: dict[str, Any]) -> dict[str, Any]:
    """What vLLM understood of an accepted request, in :class:`ProxyRequest`'s terms (a beam search's negative
    ``max_tokens`` runs no step: 0 tokens).  An echo without generation
    (completions, ``echo`` with ``max_tokens`` 0) is run with one output token, and pdproxy hands it to a decoder
    alone: nothing is decoded, so a P→D handoff would only add a leg."""
    echo_only = bool(verdict.get("echo_only"))
    asked = verdict["requested_max_tokens"]
    if verdict["beam_search"] and asked is not None and asked < 0:   # accepted, no beam step runs: 0 tokens
        asked = 0
    return {"stream": verdict["stream"], "max_output_tokens": 1 if echo_only else asked,
            "min_tokens": verdict["min_tokens"], "include_usage": verdict["stream"] and verdict["include_usage"],
            "decoder_prefills": verdict["prompt_logits"] or verdict["beam_search"] or echo_only}


def understood(req: ProxyRequest, verdict: dict[str, Any]) -> dict[str, Any]:
    """pdproxy's reading of ``req`` in :func:`meaning`'s terms (``min_tokens`` as vLLM has it: none in beam
    search)."""
    return {"stream": req.stream, "max_output_tokens": req.max_output_tokens,
            "min_tokens": req.min_tokens if verdict["min_tokens"] is not None else None,
            "include_usage": req.include_usage, "decoder_prefills": req.decoder_prefills}


def raw_of(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def check(api: str, body: dict[str, Any], judge: Judge) -> None:
    """Assert the rule of the module docstring for one request (``judge``: vLLM's verdict on raw bytes)."""
    raw = raw_of(body)
    status, verdict = judge(api, raw)
    try:
        req = parse_request(raw, Api.CHAT if api == "chat" else Api.COMPLETIONS)
        if req.sequences > 1 and not (req.engine_judges or req.decoder_prefills):
            fanout.check(req, FAN_OUT_MAX)
    except BadRequest as exc:
        mine = exc.body()
        assert mine == verdict and status == 400, f"{body}: pdproxy answered {mine}, vLLM {status} {verdict}"
        return
    if req.sequences > 1 and not (req.engine_judges or req.decoder_prefills):
        check_fan_out(api, body, req, status, verdict, judge)
        return
    who, leg = first_leg(req)
    leg_status, leg_verdict = judge(api, leg)
    if status != 200:
        if leg_status == 200 and req.fault is not None:  # an engine accepting it after all: pdproxy says it
            leg_status, leg_verdict = 400, req.fault.body()
        elif leg_status == 200 and who == "prefill":     # the decoder is the one that refuses it, as vLLM would
            leg_status, leg_verdict = judge(api, kv_transfer.decode_body_bytes(req.raw, HANDLE, req.body))
        assert (leg_status, leg_verdict) == (status, verdict), (
            f"{body}: vLLM says {status} {verdict}; the {who} leg {leg!r} got {leg_status} {leg_verdict}")
        return
    assert not req.engine_judges, f"{body}: vLLM accepts it but pdproxy left it to the engine"
    assert understood(req, verdict) == meaning(verdict), (
        f"{body}: vLLM {meaning(verdict)}, pdproxy {understood(req, verdict)}")
    assert leg_status == 200, f"{body}: the {who} leg {leg!r} was refused: {leg_verdict}"
    if who == "prefill":
        assert (leg_verdict["stream"], leg_verdict["requested_max_tokens"], leg_verdict["min_tokens"]) == (
            False, 1, 1), f"{body}: prefill leg understood as {leg_verdict}"
        dec_status, dec_verdict = judge(api, kv_transfer.decode_body_bytes(req.raw, HANDLE, req.body))
        assert dec_status == 200 and meaning(dec_verdict) == meaning(verdict), (
            f"{body}: decode leg {dec_status} {dec_verdict}")
    else:
        assert meaning(leg_verdict) == meaning(verdict)


def check_fan_out(api: str, body: dict[str, Any], req: ProxyRequest, status: int, verdict: dict[str, Any],
                  judge: Judge) -> None:
    """The rule for a request of several sequences (one P/D pair each, ``pdproxy/pd/fanout.py``): vLLM refuses it →
    the first sequence's first leg that refuses it gets that same 400 (its decode leg when the refusal needs the
    client's output constraints, e.g. ``min_tokens`` over the room ``max_model_len`` leaves, which the prefill leg's
    one token does not ask); vLLM accepts it → pdproxy read it as vLLM did, and every
    sequence's legs are accepted (prefill: one token, not streamed; decode: the client's meaning, usage asked for
    when streaming, which the merge needs)."""
    seqs = fanout.plan(req, RequestContext(request_id="r", client_request_id=None, api_label=api))
    assert len(seqs) == req.sequences
    if status != 200:
        who, leg = first_leg(seqs[0].req)
        got = judge(api, leg)
        if got[0] == 200 and who == "prefill":     # the decoder is the one that refuses it, as for one sequence
            got = judge(api, kv_transfer.decode_body_bytes(seqs[0].req.raw, HANDLE, seqs[0].req.body))
        assert got == (status, verdict), f"{body}: vLLM says {status} {verdict}; the first sequence's legs {got}"
        return
    assert understood(req, verdict) == meaning(verdict), (
        f"{body}: vLLM {meaning(verdict)}, pdproxy {understood(req, verdict)}")
    want = {**meaning(verdict), "include_usage": verdict["stream"]}
    for seq in seqs:
        assert "n" not in seq.req.body and seq.req.sequences == 1
        _, leg = first_leg(seq.req)
        leg_status, leg_verdict = judge(api, leg)
        assert leg_status == 200 and (leg_verdict["stream"], leg_verdict["requested_max_tokens"],
                                      leg_verdict["min_tokens"]) == (False, 1, 1), f"{body}: {leg!r} {leg_verdict}"
        dec_status, dec_verdict = judge(api, kv_transfer.decode_body_bytes(seq.req.raw, HANDLE, seq.req.body))
        assert dec_status == 200 and meaning(dec_verdict) == want, f"{body}: decode leg {dec_status} {dec_verdict}"
