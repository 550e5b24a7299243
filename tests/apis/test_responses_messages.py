"""``/v1/responses`` and ``/v1/messages`` through pdproxy's P→D path, with the real ``openai`` and ``anthropic``
clients against simulated engines (processes on loopback).

Asserts what the prefiller and the decoder received (each API's one-token prefill leg, the client's body plus the
prefiller's ``kv_transfer_params`` on the decoder), what the client got (its API's shapes, the prefiller's cached
tokens in its usage shape), failover when a decoder fails after the events it sends before the engine runs, an
error event in the API's shape when one fails later, and the Anthropic error envelope for pdproxy's own errors.
The ``proxy`` fixture (tests/conftest.py) asserts the load counters are back to zero after each test.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.apis.support import events, legs, wait_engines_idle
from tests.conftest import Fleet
from tests.support import ProxyThread, SimProcess, running

pytestmark = pytest.mark.timeout(60)

PROMPT = "Tell me about disaggregated prefill and decode " * 12      # > 6 blocks of 16 tokens
STUB = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}


def oai(proxy: ProxyThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=proxy.url + "/v1", api_key="sk-client", max_retries=0, timeout=20)


def claude(proxy: ProxyThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=proxy.url, api_key="sk-client", max_retries=0, timeout=20)


def one_pair(sims: Fleet, path: str, warmed: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The request's prefill leg and decode leg (after a warm-up request: the last of each)."""
    p, d = legs(sims.prefillers, path), legs(sims.decoders, path)
    assert (len(p), len(d)) == ((2, 2) if warmed else (1, 1))
    rid = p[-1]["headers"]["x-request-id"]                   # one prefiller: its last leg is the request's
    (decode,) = [x for x in d if x["headers"]["x-request-id"] == rid]
    return p[-1], decode


def warm(proxy: ProxyThread, path: str, body: dict[str, Any]) -> None:
    """Serve the prompt once, so that the next prefill of it has prefix-cache hits on the prefiller."""
    httpx.post(proxy.url + path, json=body, timeout=20).raise_for_status()


# ---------------------------------------------------------------------------------------------------- Responses
@pytest.mark.parametrize("stream", [False, True])
def test_responses_through_pd(proxy: ProxyThread, sims: Fleet, stream: bool) -> None:
    warm(proxy, "/v1/responses", {"model": "sim-model", "input": PROMPT, "instructions": "Be brief.",
                                  "max_output_tokens": 1})
    c = oai(proxy)
    kwargs = {"model": "sim-model", "input": PROMPT, "instructions": "Be brief.", "max_output_tokens": 7,
              "temperature": 0.5}
    if stream:
        got = list(c.responses.create(**kwargs, stream=True))
        kinds = [e.type for e in got]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert [e.sequence_number for e in got] == list(range(len(got)))
        assert kinds.count("response.output_text.delta") == 7
        resp = got[-1].response
    else:
        resp = c.responses.create(**kwargs)
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.output_text and resp.usage is not None and resp.usage.output_tokens == 7
    # the prefiller's prefix-cache hits (the warm-up left 96+ of the prompt's tokens cached), not the decoder's 0
    cached = resp.usage.input_tokens_details.cached_tokens
    assert cached >= 96 and cached % 16 == 0 and cached < resp.usage.input_tokens

    p, d = one_pair(sims, "/v1/responses", warmed=True)
    pb, db = p["body"], d["body"]
    assert pb["max_output_tokens"] == 1 and pb["stream"] is False and pb["kv_transfer_params"] == STUB
    assert "max_tokens" not in pb and pb["input"] == PROMPT and pb["instructions"] == "Be brief."
    assert db["max_output_tokens"] == 7 and db.get("stream", False) is stream and db["input"] == PROMPT
    assert db["kv_transfer_params"]["do_remote_prefill"] is True
    assert db["kv_transfer_params"]["remote_block_ids"]
    # one request id on both legs and in the answer (vLLM names a response after the body's request_id)
    assert pb["request_id"] == db["request_id"] == resp.id == "resp_" + p["headers"]["x-request-id"]
    assert p["headers"]["x-request-id"] == d["headers"]["x-request-id"]
    assert p["headers"]["authorization"] == d["headers"]["authorization"] == "Bearer sk-client"
    wait_engines_idle(sims)


def test_responses_client_request_id_is_kept(proxy: ProxyThread, sims: Fleet) -> None:
    r = httpx.post(proxy.url + "/v1/responses", json={"model": "sim-model", "input": "Hi", "max_output_tokens": 3,
                                                       "request_id": "resp_mine"}, timeout=20)
    assert r.status_code == 200 and r.json()["id"] == "resp_mine"
    p, d = one_pair(sims, "/v1/responses")
    assert p["body"]["request_id"] == d["body"]["request_id"] == "resp_mine"


def test_responses_stream_fails_over_after_the_opening_events(proxy: ProxyThread, sims: Fleet) -> None:
    """The decoder sends response.created and response.in_progress before its engine runs, then dies: the client
    saw nothing, so another decoder serves the request (a new prefill, since the KV may have been pulled)."""
    for d in sims.decoders:
        d.faults({"kind": "reset_after_events", "events": 2, "on_request": 1, "path": "/v1/responses"})
    got = list(oai(proxy).responses.create(model="sim-model", input="Hello there", max_output_tokens=5,
                                           stream=True))
    kinds = [e.type for e in got]
    assert kinds.count("response.created") == 1 and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in got] == list(range(len(got)))
    assert got[-1].response.usage is not None and got[-1].response.usage.output_tokens == 5
    # at least one failover, each with a new prefill (a decoder that failed may have pulled the KV; release legs,
    # JSON and non-streaming, free the old handle and may meet the other decoder's fault)
    streams = [x for x in legs(sims.decoders, "/v1/responses") if x["body"].get("stream")]
    assert len(streams) >= 2 and len(legs(sims.prefillers, "/v1/responses")) == len(streams)
    wait_engines_idle(sims)


def test_responses_stream_failure_after_output_ends_with_an_error_event(proxy: ProxyThread, sims: Fleet) -> None:
    for d in sims.decoders:
        d.faults({"kind": "reset_after_events", "events": 6, "path": "/v1/responses"})
    r = httpx.post(proxy.url + "/v1/responses", json={"model": "sim-model", "input": "Hello there",
                                                       "max_output_tokens": 12, "stream": True}, timeout=20)
    assert r.status_code == 200
    got = events(r.text)
    names = [n for n, _ in got]
    assert "response.output_text.delta" in names and "response.completed" not in names
    assert names[-1] == "error" and "[DONE]" not in r.text
    _, err = got[-1]
    assert err["type"] == "error" and "incomplete" in err["message"] and err["code"] == "502", err
    assert err["sequence_number"] == got[-2][1]["sequence_number"] + 1
    assert len(legs(sims.decoders, "/v1/responses")) == 1              # nothing replayed after the first byte
    wait_engines_idle(sims)


def test_responses_bad_requests_never_reach_an_engine(proxy: ProxyThread, sims: Fleet) -> None:
    for body, param in (({"model": "sim-model"}, "input"),
                        ({"model": "sim-model", "input": "x", "max_output_tokens": 0}, "max_tokens"),
                        ({"model": "sim-model", "input": "x", "background": True}, "background")):
        r = httpx.post(proxy.url + "/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    r = httpx.post(proxy.url + "/v1/responses", json={"model": "nope", "input": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The model `nope` does not exist. Valid aliases: sim-model."
    assert not [x for s in sims.all for x in s.received()]



def test_responses_client_request_id_is_bounded(proxy: ProxyThread, sims: Fleet) -> None:
    """A client's Responses ``request_id`` is both engines' request id (vLLM names the request and its KV transfer
    after it, and logs it), passed on as sent: it gets the bounds an ``X-Request-Id`` gets — at most 96 characters,
    visible ASCII — or a 400 naming it, before any engine is asked.  A newline in it reached both engines (and
    made the simulated one drop the connection); 100 KB of it was each engine's request id."""
    for rid in ("resp_a\nb", "resp_" + "x" * 100_000, "resp_ \u00e9", "resp_\u0000", ""):
        r = httpx.post(proxy.url + "/v1/responses", json={"model": "sim-model", "input": "x", "max_output_tokens": 2,
                                                           "request_id": rid})
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
        assert len(r.content) < 2_000
    assert not [x for s in sims.all for x in s.received()]
    ok = "resp_" + "A-z0_9.:" * 11                               # 93 characters: kept, named as sent
    r = httpx.post(proxy.url + "/v1/responses", json={"model": "sim-model", "input": "x", "max_output_tokens": 2,
                                                       "request_id": ok}, timeout=20)
    assert r.status_code == 200 and r.json()["id"] == ok
    wait_engines_idle(sims)


def test_responses_request_id_of_another_type_is_vllms_400(proxy: ProxyThread, sims: Fleet) -> None:
    """vLLM types a Responses ``request_id`` as a string (``ResponsesRequest``, pydantic strict on ``str``): a
    number, list, object or boolean is its 400 ``string_type``.  pdproxy put its own ``resp_<id>`` in its place on
    both legs and answered 200, the client's value silently dropped."""
    for value, shown in ((5, "5"), ([1], "<list of 1 items>"), ({"a": 1}, "<dict of 1 items>"), (True, "True")):
        r = httpx.post(proxy.url + "/v1/responses", json={"model": "sim-model", "input": "x", "max_output_tokens": 2,
                                                           "request_id": value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "body.request_id" and err["type"] == "Bad Request"
        assert "'type': 'string_type', 'loc': 'body.request_id', 'msg': 'Input should be a valid string'" in \
            err["message"] and f"'input': '{shown}'" in err["message"]
    assert not [x for s in sims.all for x in s.received()]


# ----------------------------------------------------------------------------------------------------- Messages
@pytest.mark.parametrize("stream", [False, True])
def test_messages_through_pd(proxy: ProxyThread, sims: Fleet, stream: bool) -> None:
    body = {"model": "sim-model", "system": "Be brief.", "messages": [{"role": "user", "content": PROMPT}]}
    warm(proxy, "/v1/messages", {**body, "max_tokens": 1})
    c = claude(proxy)
    if stream:
        with c.messages.stream(**body, max_tokens=6) as s:
            kinds = [e.type for e in s]
            message = s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
        assert kinds.count("content_block_delta") == 6
    else:
        message = c.messages.create(**body, max_tokens=6)
    assert message.stop_reason == "max_tokens" and message.content[0].type == "text"
    usage = message.usage
    assert usage.output_tokens == 6
    # the prefiller's cache hits, moved out of input_tokens so the prompt's total stays (decoder said 0)
    assert usage.cache_read_input_tokens is not None and usage.cache_read_input_tokens >= 96
    p, d = one_pair(sims, "/v1/messages", warmed=True)
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt_total(sims, body)
    pb, db = p["body"], d["body"]
    assert pb["max_tokens"] == 1 and pb["stream"] is False and pb["kv_transfer_params"] == STUB
    assert db["max_tokens"] == 6 and db.get("stream", False) is stream and db["system"] == "Be brief."
    assert db["kv_transfer_params"]["do_remote_prefill"] is True
    assert message.id == "chatcmpl-" + p["headers"]["x-request-id"] == "chatcmpl-" + d["headers"]["x-request-id"]
    wait_engines_idle(sims)


def prompt_total(sims: Fleet, body: dict[str, Any]) -> int:
    """The prompt's tokens as the engine counts them (``/v1/messages/count_tokens`` on the decoder)."""
    r = httpx.post(sims.decoders[0].url + "/v1/messages/count_tokens", json=body)
    return int(r.json()["input_tokens"])


def test_messages_stream_fails_over_when_message_start_is_followed_by_an_error(proxy: ProxyThread,
                                                                              sims: Fleet) -> None:
    """vLLM sends message_start and then an error event when the decoder's KV pull fails: message_start is held
    back, so the client sees one clean stream from another decoder."""
    for d in sims.decoders:
        d.faults({"kind": "reset_after_events", "events": 1, "on_request": 1, "path": "/v1/messages"})
    with claude(proxy).messages.stream(model="sim-model", max_tokens=4,
                                       messages=[{"role": "user", "content": "Hello"}]) as s:
        kinds = [e.type for e in s]
    assert kinds.count("message_start") == 1 and kinds[-1] == "message_stop"
    streams = [x for x in legs(sims.decoders, "/v1/messages") if x["body"].get("stream")]
    assert len(streams) >= 2 and len(legs(sims.prefillers, "/v1/messages")) == len(streams)
    wait_engines_idle(sims)


def test_messages_stream_failure_after_output_is_an_anthropic_error_event(proxy: ProxyThread,
                                                                         sims: Fleet) -> None:
    for d in sims.decoders:
        d.faults({"kind": "reset_after_events", "events": 4, "path": "/v1/messages"})
    with pytest.raises(anthropic.APIStatusError) as e, claude(proxy).messages.stream(  # raises at the error event
            model="sim-model", max_tokens=12, messages=[{"role": "user", "content": "Hello"}]) as s:
        for _ in s:
            pass
    assert isinstance(e.value.body, dict) and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "BadGatewayError" and "incomplete" in e.value.body["error"]["message"]
    assert len(legs(sims.decoders, "/v1/messages")) == 1
    wait_engines_idle(sims)


def test_messages_errors_pdproxy_raises_are_in_the_anthropic_shape(proxy: ProxyThread, sims: Fleet) -> None:
    c = claude(proxy)
    with pytest.raises(anthropic.NotFoundError) as nf:
        c.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "Hello"}])
    assert nf.value.body == {"type": "error", "error": {"type": "NotFoundError", "message":
                             "The model `nope` does not exist. Valid aliases: sim-model."}}
    for body, needle in (({"model": "sim-model", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
                         ({"model": "sim-model", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]},
                          "max_tokens"),
                         ({"model": "sim-model", "max_tokens": 3, "messages": [{"role": "wizard", "content": "x"}]},
                          "role"),
                         ({"max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}, "model"),
                         ({"model": "sim-model", "max_tokens": 3, "messages": [{"role": "user", "content": 5}]},
                          "messages.0.content must be a string or a list"),       # old code: the sim's 500
                         ({"model": "sim-model", "max_tokens": 3,
                           "messages": [{"role": "user", "content": ["text"]}]}, "messages.0.content")):
        r = httpx.post(proxy.url + "/v1/messages", json=body)
        assert r.status_code == 400, body
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "BadRequestError" and needle in err["error"][
            "message"]
    r = httpx.post(proxy.url + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert not [x for s in sims.all for x in s.received()]              # no engine was contacted


def test_a_thinking_budget_not_below_max_tokens_is_refused_before_any_kv_is_computed(proxy: ProxyThread,
                                                                                      sims: Fleet) -> None:
    """vLLM refuses ``thinking.budget_tokens >= max_tokens`` on every leg but one with ``do_remote_decode``
    (``anthropic/protocol.py::validate_thinking_budget``): a one-token prefill leg would pass and its KV be computed
    for a decoder that refuses the request.  pdproxy sends the client's own body to the prefiller instead, which
    refuses it in vLLM's words; no decoder is asked.  A budget below ``max_tokens`` goes through PD as usual."""
    msgs = [{"role": "user", "content": "Think, then answer."}]
    body = {"model": "sim-model", "max_tokens": 1500, "thinking": {"type": "enabled", "budget_tokens": "2048"},
            "messages": msgs}
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude(proxy).messages.create(**body)                       # type: ignore[call-overload]
    assert bad.value.status_code == 400
    assert "thinking.budget_tokens must be less than max_tokens" in bad.value.body["error"]["message"]
    (leg,) = legs(sims.prefillers, "/v1/messages")
    assert leg["body"]["max_tokens"] == 1500 and leg["body"]["thinking"] == body["thinking"]
    assert "kv_transfer_params" not in leg["body"]                  # the client's values, for vLLM to judge
    assert not legs(sims.decoders, "/v1/messages")
    small = {**body, "max_tokens": 100, "thinking": {"type": "enabled", "budget_tokens": 500}}
    r = httpx.post(proxy.url + "/v1/messages", json=small)     # under vLLM's Field(ge=1024): every leg's 400
    assert r.status_code == 400 and "greater than or equal to 1024" in r.json()["error"]["message"], r.text
    assert len(legs(sims.prefillers, "/v1/messages")) == 2 and not legs(sims.decoders, "/v1/messages")
    ok = claude(proxy).messages.create(model="sim-model", max_tokens=1500, messages=msgs,  # type: ignore[call-overload]
                                       thinking={"type": "enabled", "budget_tokens": 1024})
    assert ok.usage.output_tokens >= 1
    prefill, (decode,) = legs(sims.prefillers, "/v1/messages")[-1], legs(sims.decoders, "/v1/messages")
    assert prefill["body"]["max_tokens"] == 1 and prefill["body"]["kv_transfer_params"]["do_remote_decode"]
    assert decode["body"]["max_tokens"] == 1500 and decode["body"]["thinking"]["budget_tokens"] == 1024
    wait_engines_idle(sims)


@pytest.mark.parametrize("result", [5, True, 1.5, {"type": "text", "text": "x"}])
def test_a_tool_result_whose_content_is_not_text_or_blocks_is_the_engines_to_judge(
        proxy: ProxyThread, sims: Fleet, result: object) -> None:
    """A ``tool_result`` block's ``content`` that is neither a string nor a list (vLLM's ``AnthropicContentBlock``:
    ``str | list[dict] | None``) is counted as no text and the prefiller answers it: vLLM's 400 in the Anthropic
    shape (old code: pdproxy's own TypeError, a 500 with a traceback logged per request)."""
    body = {"model": "sim-model", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": result}]}]}
    r = httpx.post(proxy.url + "/v1/messages", json=body)
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "content" in r.json()["error"]["message"]
    assert [leg["body"]["messages"] for leg in legs(sims.prefillers, "/v1/messages")] == [body["messages"]]
    assert not legs(sims.decoders, "/v1/messages")


def test_an_engines_openai_shaped_error_on_messages_reaches_the_client_in_the_anthropic_shape(
        proxy: ProxyThread, sims: Fleet) -> None:
    """vLLM answers a request validation error in the OpenAI envelope on every route, /v1/messages included; an
    Anthropic client reads it as ``{"type": "error", "error": {"type", "message"}}`` with vLLM's status, type and
    words.  A body that is not a JSON object (a server's plain-text error page) is put in the route's envelope with
    the engine's status and its words — on the OpenAI routes too (old code: passed through as plain text)."""
    vllm_400 = {"error": {"message": "1 validation error: temperature: Input should be a valid number",
                          "type": "BadRequestError", "param": None, "code": 400}}
    for p in sims.prefillers:
        p.faults({"kind": "status", "status": 400, "body": vllm_400, "path": "/v1/messages", "times": 1})
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude(proxy).messages.create(model="sim-model", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert bad.value.body == {"type": "error", "error": {"type": "BadRequestError",
                                                         "message": vllm_400["error"]["message"]}}
    for p in sims.prefillers:
        p.faults({"kind": "status", "status": 400, "body": "not json", "path": "/v1/messages", "times": 1})
    r = httpx.post(proxy.url + "/v1/messages", json={"model": "sim-model", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json() == {"type": "error", "error": {"type": "BadRequestError",
                                                   "message": "engine answered HTTP 400: not json"}}
    for p in sims.prefillers:
        p.faults({"kind": "status", "status": 500, "body": "500 Internal Server Error\n\nServer got itself in trouble",
                  "path": "/v1/chat/completions", "times": 1})
    r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "sim-model", "max_tokens": 4,
                                                             "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": "engine answered HTTP 500: 500 Internal Server Error Server got itself "
                                             "in trouble", "type": "InternalServerError", "param": None, "code": 500}}
    for d in sims.decoders:                                   # the decode leg's error: the same envelope
        d.faults({"kind": "status", "status": 400, "body": "<html><body>Bad Request</body></html>",
                  "path": "/v1/chat/completions", "times": 1})
    r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "sim-model", "max_tokens": 4, "stream": True,
                                                             "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json() == {"error": {"message": "engine answered HTTP 400: <html><body>Bad Request</body></html>",
                                  "type": "BadRequestError", "param": None, "code": 400}}
    for body, message in ((b"", "engine answered HTTP 400"),                # no body, or JSON-looking text
                          (b"{oops not json", "engine answered HTTP 400: {oops not json")):
        for p in sims.prefillers:
            p.faults({"kind": "status", "status": 400, "body": body.decode(), "path": "/v1/chat/completions",
                      "times": 1})
        r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "sim-model", "max_tokens": 4,
                                                                 "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 400 and r.headers["content-type"] == "application/json", r.headers
        assert r.json()["error"]["message"] == message


def test_messages_count_tokens_passes_through(sims: Fleet) -> None:
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                        expose_routing_headers=True).start()
    try:
        body = {"model": "sim-model", "system": "Be brief.", "messages": [{"role": "user", "content": "Hi there"}]}
        raw = claude(proxy).messages.with_raw_response.count_tokens(**body)
        assert raw.parse().input_tokens == prompt_total(sims, body) > 0
        assert raw.headers["x-pdproxy-decoder"] in [s.url for s in sims.decoders]      # decoders first
        r = httpx.post(proxy.url + "/v1/messages/count_tokens", json={**body, "model": "nope"})
        assert r.status_code == 404 and r.json()["type"] == "error"                     # Anthropic envelope
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_messages_count_tokens_engine_errors_are_in_the_anthropic_envelope(proxy: ProxyThread, sims: Fleet) -> None:
    """vLLM answers a request its pydantic model refuses in the OpenAI envelope on every route; pdproxy answers every
    error on the Anthropic routes in Anthropic's, as on ``/v1/messages`` — count_tokens relayed the engine's
    ``{"error": {...}}`` as it came (the Anthropic client read no ``error.type``).  Other statuses, a body that does
    not end: tests/reliability/test_passthrough_error_body.py."""
    body = {"model": "sim-model", "messages": [{"role": "wizard", "content": "Hi"}]}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude(proxy).messages.count_tokens(**body)          # type: ignore[arg-type]
    assert e.value.status_code == 400 and e.value.body["type"] == "error", e.value.body
    assert e.value.body["error"]["type"] == "Bad Request"
    assert "body.messages.0.role" in e.value.body["error"]["message"]
    r = httpx.post(proxy.url + "/v1/messages/count_tokens", timeout=20, json={"model": "sim-model", "messages": "x"})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "Bad Request", r.json()
    assert "Input should be a valid list" in r.json()["error"]["message"]      # the engine's words (pydantic's)
    assert int(r.headers["content-length"]) == len(r.content)


def test_the_anthropic_client_key_reaches_engines_as_authorization() -> None:
    """vLLM's --api-key reads only ``Authorization``; the Anthropic client sends ``x-api-key``: with
    ``engine_api_key`` pdproxy presents the engine key itself on both legs."""
    args = ("--served-model-name", "sim-model", "--api-key", "engine-key", "--prefill-tokens-per-s", "0",
            "--decode-tokens-per-s", "0")
    with running(SimProcess("prefill", *args), SimProcess("decode", *args)) as (p, d):
        proxy = ProxyThread(prefill=[p.url], decode=[d.url], engine_api_key="engine-key").start()
        try:
            message = claude(proxy).messages.create(model="sim-model", max_tokens=3,
                                                    messages=[{"role": "user", "content": "Hello"}])
            assert message.usage.output_tokens == 3
            for sim in (p, d):
                (leg,) = [r for r in sim.received() if r["path"] == "/v1/messages"]
                assert leg["headers"]["authorization"] == "Bearer engine-key"
            proxy.wait_idle()
        finally:
            proxy.stop()


def test_the_anthropic_clients_x_api_key_is_a_client_key(sims: Fleet) -> None:
    """With ``api_keys`` pdproxy checks the client's key itself: the Anthropic client's ``x-api-key`` counts."""
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                        api_keys=["sk-client"]).start()
    try:
        assert claude(proxy).messages.create(model="sim-model", max_tokens=2, messages=[
            {"role": "user", "content": "Hello"}]).usage.output_tokens == 2
        wrong = anthropic.Anthropic(base_url=proxy.url, api_key="sk-wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            wrong.messages.create(model="sim-model", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert e.value.body == {"type": "error", "error": {"type": "AuthenticationError",
                                                           "message": "invalid or missing API key"}}
        (leg,) = [r for r in sims.prefillers[0].received() if r["path"] == "/v1/messages"]
        assert "authorization" not in leg["headers"] and "x-api-key" not in leg["headers"]   # never forwarded
        proxy.wait_idle()
    finally:
        proxy.stop()


# --------------------------------------------------------------------- a prefill that already ended the request
@pytest.mark.parametrize("api", ["responses", "messages"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_that_stopped_answers_or_a_decoder_prefills(proxy: ProxyThread, sims: Fleet, api: str,
                                                              stream: bool) -> None:
    """The prefiller ends the request on its first token and hands over no KV (vLLM-Ascend's Mooncake, older
    NIXL): a JSON client gets the prefiller's complete answer (Responses ``status "completed"``, Messages
    ``stop_reason "end_turn"``) and no decoder is asked; a streaming client gets the API's whole stream from a
    decoder that prefills the request itself (no handle in its body). Never a 502."""
    sims.prefillers[0].faults({"kind": "no_kv_params"})
    path = "/v1/responses" if api == "responses" else "/v1/messages"
    if api == "responses":
        kwargs: dict[str, Any] = {"model": "sim-model", "input": PROMPT, "max_output_tokens": 5}
        if stream:
            got = list(oai(proxy).responses.create(**kwargs, stream=True))
            assert got[0].type == "response.created" and got[-1].type == "response.completed"
            resp = got[-1].response
            assert resp.status == "incomplete" and resp.usage is not None and resp.usage.output_tokens == 5
        else:
            resp = oai(proxy).responses.create(**kwargs)
            assert resp.status == "completed" and resp.incomplete_details is None
            assert resp.usage is not None and resp.usage.output_tokens == 1
    else:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5}
        if stream:
            with claude(proxy).messages.stream(**body) as s:
                kinds = [e.type for e in s]
                message = s.get_final_message()
            assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
            assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
        else:
            message = claude(proxy).messages.create(**body)
            assert message.stop_reason == "end_turn" and message.usage.output_tokens == 1
    p, d = legs(sims.prefillers, path), legs(sims.decoders, path)
    assert len(p) == 1 and p[0]["body"]["kv_transfer_params"] == STUB
    if stream:
        (decode,) = d
        assert "kv_transfer_params" not in decode["body"] and decode["headers"]["x-request-id"] == p[0][
            "headers"]["x-request-id"]
    else:
        assert d == []
    wait_engines_idle(sims)
