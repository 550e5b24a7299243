"""Streams survive a decoder (docs/stream-continuation.md): a chat or text completions stream cut after its first
event (reset, end of body without ``[DONE]``, vLLM's in-band error event, a silence far above its inter-token
time) continues on another P→D pair, and the client's stream is the
uninterrupted one — same text, one role chunk, one id, usage of the original prompt and every delivered token."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.ops.promtext import scrape
from tests.reliability.harness import Fleet4, Result, run
from tests.support import wait_until

pytestmark = pytest.mark.timeout(60)

MAX = 24
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "Tell me about continuation."}],
        "max_tokens": MAX, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
COMPLETIONS = {"model": "sim-model", "prompt": "Once upon a time in a data center", "max_tokens": MAX,
               "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
ON = {"stream_continuation": True, "stream_continuation_max": 3, "stream_continuation_stall_min_s": 0.3}


def one(url: str, body: dict[str, Any], path: str) -> Result:
    return run(url, body, n=1, concurrency=1, path=path)[0]


def logged(path: Path, n: int) -> list[dict[str, Any]]:
    """The request log's lines once it has ``n`` (a line is written just after the request leaves the in-flight
    count ``wait_idle`` watches)."""
    def read() -> list[dict[str, Any]] | None:
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return rows if len(rows) >= n else None

    return list(wait_until(read, 5, 0.02, f"{n} request-log lines"))


def roles(r: Result) -> int:
    return sum(1 for e in r.events for c in e.get("choices") or [] if "role" in (c.get("delta") or {}))


def usage(r: Result) -> dict[str, Any]:
    found = [e["usage"] for e in r.events if e.get("usage")]
    assert len(found) == 1, found
    return dict(found[0])


@pytest.mark.parametrize(("path", "body", "kind"), [
    ("/v1/chat/completions", CHAT, "reset_after_events"), ("/v1/chat/completions", CHAT, "close_without_done"),
    ("/v1/chat/completions", CHAT, "error_after_events"), ("/v1/chat/completions", CHAT, "stall_after_events"),
    ("/v1/completions", COMPLETIONS, "reset_after_events"), ("/v1/completions", COMPLETIONS, "stall_after_events"),
], ids=["chat-reset", "chat-eof", "chat-error-event", "chat-stall", "completions-reset", "completions-stall"])
def test_cut_stream_continues_token_exact(fleet5: Fleet4, kind: str, path: str, body: dict[str, Any],
                                          tmp_path: Path) -> None:
    """Every decoder cuts its first stream after 5 events; the client's stream still equals the uninterrupted
    run (text, finish, usage), with one id and one role chunk, and the continuation legs carry the token ids.
    The request log's line is the client's id (``X-Request-Id``, the stream's ``id``) and names the continuation's
    engine-side id and the decoder lost."""
    log_path = tmp_path / "requests.jsonl"
    proxy = fleet5.proxy(**ON, request_log_path=str(log_path))
    try:
        base = one(proxy.url, body, path)
        assert base.status == 200 and not base.errors and base.done == 1
        for sim in fleet5.decoders:
            sim.faults({"kind": kind, "events": 5, "times": 1})
        cut = one(proxy.url, body, path)
        assert cut.status == 200 and not cut.errors, cut.body[-400:]
        assert cut.done == 1
        assert cut.text == base.text and len(cut.text.split()) == MAX
        assert roles(cut) == roles(base) == (1 if "chat" in path else 0)
        assert len({e["id"] for e in cut.events}) == 1
        assert usage(cut)["completion_tokens"] == MAX
        assert usage(cut)["prompt_tokens"] == usage(base)["prompt_tokens"]
        assert [c["finish_reason"] for e in cut.events for c in e["choices"] if c.get("finish_reason")] == ["length"]
        assert all(c.get("token_ids") is None and c.get("prompt_token_ids") is None and e.get("prompt_token_ids")
                   is None for e in cut.events for c in e["choices"])  # the ids were for the proxy only
        legs = [r["body"] for s in fleet5.decoders for r in s.received()
                if r["path"] == "/v1/completions" and isinstance(r["body"].get("prompt"), list)]
        assert legs, "no continuation leg reached a decoder"
        assert all(b["return_token_ids"] is True and b["max_tokens"] < MAX for b in legs)
        fleet5.assert_clean(proxy)
        client_id = cut.headers["x-request-id"]
        assert client_id in cut.events[0]["id"]
        line = logged(log_path, 2)[-1]
        assert line["request_id"] == client_id and line["outcome"] == "ok", line
        assert len(line["continued_as"]) >= 1 and client_id not in line["continued_as"], line
        assert line["lost_decoders"][0] in {s.url for s in fleet5.decoders} and line["decoder"], line
        phases = ("admission_wait_s", "prefill_s", "pd_gap_s", "decode_first_token_s")   # the first leg's
        assert line["decode_first_token_s"] > 0 and sum(line[p] for p in phases) <= line["ttft_s"] + 1e-5, line
        received_ids = {r["headers"].get("x-request-id") for s in fleet5.decoders for r in s.received()}
        assert set(line["continued_as"]) <= received_ids, "the engines know the continuation by those ids"
    finally:
        proxy.stop()


def test_past_the_continuation_cap_every_lost_decoder_is_in_the_log(fleet5: Fleet4, tmp_path: Path) -> None:
    """Every leg is cut after 5 events: the stream is continued ``stream_continuation_max`` (3) times, then its
    fourth loss is refused with the reason; the log line lists all four lost decoders and the three legs' ids,
    and the loss counters say 3 continued, 1 refused."""
    log_path = tmp_path / "requests.jsonl"
    proxy = fleet5.proxy(**ON, request_log_path=str(log_path))
    try:
        for sim in fleet5.decoders:
            sim.faults({"kind": "reset_after_events", "events": 5, "times": 10})
        cut = one(proxy.url, {**CHAT, "max_tokens": 60}, "/v1/chat/completions")
        assert cut.status == 200 and cut.done == 1 and len(cut.errors) == 1, cut.body[-400:]
        message = cut.errors[0]["error"]["message"]
        assert "(not continued: it was already continued 3 times)" in message, message
        proxy.wait_idle()
        line = logged(log_path, 1)[-1]
        assert line["request_id"] in cut.events[0]["id"]
        assert len(line["lost_decoders"]) == 4 and len(line["continued_as"]) == 3, line
        assert line["lost_decoders"][-1] == line["decoder"], line
        m = scrape(proxy.url)
        assert m.total("pdproxy_continuations_total") == 3 and m.total("pdproxy_continuations_refused_total") == 1
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


def test_a_fanned_out_sequence_not_continued_logs_its_own_error(fleet5: Fleet4, tmp_path: Path) -> None:
    """``n: 2`` with logprobs (never continued): a cut sequence fails the response; the client's error event and
    the log line's ``error`` both say what happened to it, not an engine's made-up HTTP 500."""
    log_path = tmp_path / "requests.jsonl"
    proxy = fleet5.proxy(**ON, request_log_path=str(log_path))
    try:
        for sim in fleet5.decoders:
            sim.faults({"kind": "reset_after_events", "events": 5, "times": 1})
        cut = one(proxy.url, {**CHAT, "n": 2, "temperature": 0.7, "logprobs": True}, "/v1/chat/completions")
        assert cut.status == 200 and cut.done == 1 and len(cut.errors) == 1, cut.body[-400:]
        assert "(not continued: logprobs)" in cut.errors[0]["error"]["message"]
        proxy.wait_idle()
        line = logged(log_path, 1)[-1]
        assert "(not continued: logprobs)" in line["error"] and "answered HTTP 500" not in line["error"], line
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


def test_off_or_ineligible_gets_the_error_event(fleet5: Fleet4) -> None:
    """With continuation off, and for an ineligible stream (stop strings, logprobs, tools the model may call) with
    it on, a cut stream ends with the typed error event + [DONE] as before, and no continuation leg is sent; with
    it on, the event's message says why the stream was not continued (docs/stream-continuation.md)."""
    params = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(8)},
              "required": [f"field_{i}" for i in range(8)]}        # a call long enough to be cut mid-way
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    for settings, body, why in (({}, CHAT, None), (ON, {**CHAT, "stop": ["never-said"]}, "stop"),
                                (ON, {**CHAT, "logprobs": True}, "logprobs"),
                                (ON, {**CHAT, "tools": tools, "tool_choice": "auto"}, "tools")):
        proxy = fleet5.proxy(**settings)
        try:
            fleet5.reset()
            for sim in fleet5.decoders:
                sim.faults({"kind": "reset_after_events", "events": 5, "times": 1})
            cut = one(proxy.url, body, "/v1/chat/completions")
            assert cut.status == 200 and len(cut.errors) == 1 and cut.done == 1
            message = cut.errors[0]["error"]["message"]
            assert message.endswith(f"(not continued: {why})") if why else "not continued" not in message, message
            assert not any(isinstance(r["body"].get("prompt"), list) for s in fleet5.decoders for r in s.received())
            fleet5.assert_clean(proxy)
        finally:
            proxy.stop()


RESPONSES = {"model": "sim-model", "input": "Tell me about continuation.", "max_output_tokens": MAX,
             "temperature": 0, "stream": True}
MESSAGES = {"model": "sim-model", "messages": [{"role": "user", "content": "Tell me about continuation."}],
            "max_tokens": MAX, "temperature": 0, "stream": True}


def named_events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for raw in body.split(b"\n\n"):
        lines = raw.strip().split(b"\n")
        if len(lines) == 2 and lines[0].startswith(b"event: ") and lines[1].startswith(b"data: "):
            out.append((lines[0][7:].decode(), orjson.loads(lines[1][6:])))
    return out


def responses_view(body: bytes) -> tuple[str, list[int], dict[str, Any], list[str]]:
    """(delta text, sequence numbers, the completed response, event names)."""
    events = named_events(body)
    text = "".join(e["delta"] for n, e in events if n == "response.output_text.delta")
    done = [e["response"] for n, e in events if n == "response.completed"]
    return text, [e["sequence_number"] for _, e in events], done[0] if done else {}, [n for n, _ in events]


def messages_view(body: bytes) -> tuple[str, list[str], dict[str, Any]]:
    """(delta text, event names, the message_delta event)."""
    events = named_events(body)
    text = "".join(e["delta"]["text"] for n, e in events if n == "content_block_delta")
    final = [e for n, e in events if n == "message_delta"]
    return text, [n for n, _ in events], final[0] if final else {}


@pytest.mark.parametrize("kind", ["reset_after_events", "error_after_events"])
def test_responses_and_messages_streams_continue(fleet5: Fleet4, kind: str) -> None:
    """A Responses and a Messages stream cut mid-text continue (text continuation on the chat the request
    renders, ids from then on): same text and end as the uninterrupted run, one ``response.created`` /
    ``message_start``, ``sequence_number`` 0, 1, 2, … without a gap, output tokens = the tokens delivered."""
    proxy = fleet5.proxy(**ON)
    try:
        base_r = one(proxy.url, RESPONSES, "/v1/responses")
        base_m = one(proxy.url, MESSAGES, "/v1/messages")
        cut, legs = {}, []
        for path, body in (("/v1/responses", RESPONSES), ("/v1/messages", MESSAGES)):
            for sim in fleet5.decoders:
                sim.reset()
                sim.faults({"kind": kind, "events": 6, "times": 1})
            cut[path] = one(proxy.url, body, path)
            legs += [r["body"] for s in fleet5.decoders for r in s.received()
                     if r["body"].get("continue_final_message")]
        cut_r, cut_m = cut["/v1/responses"], cut["/v1/messages"]

        text, seqs, done, names = responses_view(cut_r.body)
        b_text, _, b_done, _ = responses_view(base_r.body)
        assert cut_r.status == 200 and "error" not in names, cut_r.body[-600:]
        assert text == b_text and len(b_text.split()) == MAX
        assert seqs == list(range(len(seqs))) and names.count("response.created") == 1
        assert names[-1] == "response.completed" and done["status"] == b_done["status"]
        assert done["output"][0]["content"][0]["text"] == b_text
        assert done["usage"]["output_tokens"] == MAX
        # Responses streams carry no prompt count: the continuation's prompt less the delivered tokens, off by what
        # re-tokenizing the delivered text changes (the sim's words are 1-2 tokens of its tokenizer)
        assert 0 <= done["usage"]["input_tokens"] - b_done["usage"]["input_tokens"] <= 6

        text, names, final = messages_view(cut_m.body)
        b_text, _, b_final = messages_view(base_m.body)
        assert cut_m.status == 200 and "error" not in names, cut_m.body[-600:]
        assert text == b_text and names.count("message_start") == 1 and names[-1] == "message_stop"
        assert final["delta"] == b_final["delta"] and final["usage"]["output_tokens"] == MAX
        assert final["usage"]["input_tokens"] == b_final["usage"]["input_tokens"]
        assert len(legs) >= 2 and all(b["messages"][-1]["role"] == "assistant" for b in legs)
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


def test_a_messages_stream_with_structured_output_is_not_continued_unconstrained(fleet5: Fleet4) -> None:
    """vLLM 0.32 reads a Messages request's structured output from ``output_config.format`` (its chat's
    ``response_format``). A text continuation is a chat without it: a stream cut mid-JSON went on unconstrained and
    the client got a 200 ``message_stop`` whose text broke its schema. It is refused as ``response_format`` is on
    chat: the typed error event naming the field, and no continuation leg."""
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(8)},
              "required": [f"field_{i}" for i in range(8)]}
    body = {**MESSAGES, "max_tokens": 200, "output_config": {"format": {"type": "json_schema", "schema": schema}}}
    proxy = fleet5.proxy(**ON)
    try:
        whole, _, _ = messages_view(one(proxy.url, body, "/v1/messages").body)
        assert set(json.loads(whole)) == set(schema["properties"])      # the uninterrupted answer: the schema's
        for sim in fleet5.decoders:
            sim.reset()
            sim.faults({"kind": "reset_after_events", "events": 6, "times": 1})
        cut = one(proxy.url, body, "/v1/messages")
        text, names, _ = messages_view(cut.body)
        assert names[-1] == "error" and "message_stop" not in names, cut.body[-600:]
        errors = [e for n, e in named_events(cut.body) if n == "error"]
        assert errors[0]["error"]["message"].endswith("(not continued: output_config.format)"), errors
        assert whole.startswith(text) and text != whole
        assert not any(r["body"].get("continue_final_message") for s in fleet5.decoders for r in s.received())
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


def test_client_that_asked_for_token_ids_keeps_them(fleet5: Fleet4) -> None:
    """A client that asked for ``return_token_ids`` gets the prompt ids once and every delta's ids, across the
    cut: the same ids as the uninterrupted run."""
    body = {**CHAT, "return_token_ids": True}
    proxy = fleet5.proxy(**ON)
    try:
        base = one(proxy.url, body, "/v1/chat/completions")
        for sim in fleet5.decoders:
            sim.faults({"kind": "reset_after_events", "events": 5, "times": 1})
        cut = one(proxy.url, body, "/v1/chat/completions")
        assert cut.status == 200 and not cut.errors and cut.text == base.text

        def ids(r: Result) -> tuple[list[list[int]], list[int]]:
            prompts = [e["prompt_token_ids"] for e in r.events if e.get("prompt_token_ids")]
            return prompts, [i for e in r.events for c in e["choices"] for i in c.get("token_ids") or []]

        assert ids(cut) == ids(base) and len(ids(base)[1]) == MAX and len(ids(base)[0]) == 1
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


def test_each_sequence_of_an_n_2_stream_continues_on_its_own(fleet5: Fleet4, tmp_path: Path) -> None:
    """``n: 2`` is fanned out into two one-sequence requests (pdproxy/pd/fanout.py); each decoder cuts its first
    stream: each sequence continues on its own (as docs/stream-continuation.md says) and the client gets both
    whole — every token, both finishing chunks, one ``[DONE]``.  (Sampled, as ``n > 1`` must be: a continued
    sequence's later tokens are drawn anew, so the texts are not compared with the uninterrupted run's.)"""
    body = {**CHAT, "n": 2, "temperature": 0.8, "seed": 7}

    def texts(r: Result) -> dict[int, str]:
        out: dict[int, str] = {}
        for e in r.events:
            for c in e.get("choices") or []:
                out[c["index"]] = out.get(c["index"], "") + ((c.get("delta") or {}).get("content") or "")
        return out

    def finishes(r: Result) -> list[tuple[int, str]]:
        return sorted((c["index"], c["finish_reason"]) for e in r.events for c in e.get("choices") or []
                      if c.get("finish_reason"))

    log_path = tmp_path / "requests.jsonl"
    proxy = fleet5.proxy(**ON, request_log_path=str(log_path))
    try:
        base = one(proxy.url, body, "/v1/chat/completions")
        assert base.status == 200 and not base.errors and base.done == 1
        for sim in fleet5.decoders:
            sim.faults({"kind": "reset_after_events", "events": 5, "times": 1})
        cut = one(proxy.url, body, "/v1/chat/completions")
        assert cut.status == 200 and not cut.errors and cut.done == 1, cut.body[-400:]
        proxy.wait_idle()
        first, line = logged(log_path, 2)[-2:]
        assert "continued_as" not in first and first["engine_prompt_tokens"] == usage(base)["prompt_tokens"]
        assert line["request_id"] == cut.headers["x-request-id"] and line["request_id"] in cut.events[0]["id"]
        assert len(line["continued_as"]) == len(line["lost_decoders"]) >= 2, line   # each sequence's continuation
        assert line["engine_prompt_tokens"] == usage(cut)["prompt_tokens"], line    # one prompt, counted once
        assert len(texts(cut)) == len(texts(base)) == 2 and all(texts(cut).values())
        assert finishes(cut) == finishes(base) == [(0, "length"), (1, "length")]
        assert usage(cut)["completion_tokens"] == 2 * MAX
        legs = [r["body"] for s in fleet5.decoders for r in s.received()
                if r["path"] == "/v1/completions" and isinstance(r["body"].get("prompt"), list)]
        assert legs and all(b["max_tokens"] < MAX for b in legs)   # continuation legs (token ids), not restarts
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


def test_a_chat_without_an_output_limit_is_not_cut_to_16_tokens_after_a_loss(fleet5: Fleet4) -> None:
    """A chat stream that set no ``max_tokens``, cut after 5 events: its continuation (a completion on the token
    ids) asks for the room ``max_model_len`` leaves (here the proxy's ``max_model_len`` 80), not null — vLLM reads
    a completion's null ``max_tokens`` as 16, and the simulator does too, so the answer would have ended 16 tokens
    after the loss (old code: 21 tokens, "length").  The client gets prompt + answer = 80 tokens, one stream."""
    proxy = fleet5.proxy(**ON, max_model_len=80)
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    try:
        for sim in fleet5.decoders:
            sim.faults({"kind": "reset_after_events", "events": 5, "times": 1})
        cut = one(proxy.url, body, "/v1/chat/completions")
        assert cut.status == 200 and not cut.errors and cut.done == 1, cut.body[-400:]
        legs = [r["body"] for s in fleet5.decoders for r in s.received()
                if r["path"] == "/v1/completions" and isinstance(r["body"].get("prompt"), list)]
        assert legs and all(b["max_tokens"] == 80 - len(b["prompt"]) for b in legs), legs  # each decoder cuts once
        used = usage(cut)
        assert used["completion_tokens"] > 5 + 16 and used["prompt_tokens"] + used["completion_tokens"] == 80
        assert [c["finish_reason"] for e in cut.events for c in e["choices"] if c.get("finish_reason")] == ["length"]
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()


def test_a_cut_stream_whose_context_is_full_ends_with_length(fleet5: Fleet4, tmp_path: Path) -> None:
    """Cut when the prompt and the delivered tokens fill ``max_model_len`` (the proxy's, here): nothing is left to
    generate, and the client's stream ends as vLLM's would — ``finish_reason: "length"``, usage, ``[DONE]`` —
    not with ``[DONE]`` after chunks that never said why (old code: a silently cut answer, logged "ok")."""
    body = {k: v for k, v in CHAT.items() if k != "max_tokens"}
    probe = fleet5.proxy(**ON)
    try:
        prompt = usage(one(probe.url, {**body, "max_tokens": 1}, "/v1/chat/completions"))["prompt_tokens"]
    finally:
        probe.stop()
    proxy = fleet5.proxy(**ON, max_model_len=prompt + 4)     # the cut after 5 events (role + 4 tokens) fills it
    try:
        for sim in fleet5.decoders:
            sim.faults({"kind": "reset_after_events", "events": 5, "times": 1})
        cut = one(proxy.url, body, "/v1/chat/completions")
        assert cut.status == 200 and not cut.errors and cut.done == 1, cut.body[-400:]
        assert [c["finish_reason"] for e in cut.events for c in e["choices"] if c.get("finish_reason")] == ["length"]
        assert usage(cut)["completion_tokens"] == 4              # prompt + 4 tokens: max_model_len
        legs = [r for s in fleet5.decoders for r in s.received() if r["path"] == "/v1/completions"]
        assert legs == []                                        # nothing left to generate: no continuation leg
        fleet5.assert_clean(proxy)
    finally:
        proxy.stop()
