"""What a client gets when pdproxy answers an error itself, on the real director and relay with fake engines:

- a fixed sentence per failure kind in the API's own error shape, never a Python exception's text or an engine's
  address (those go to the log and the request's log line, ``ctx.error``);
- a decoder stream ending with ``data:[DONE]`` (no space) is ended, and the client's ends with ``data: [DONE]``;
- 503 with ``Retry-After`` when the prefillers, or the decoders, tried all failed and none is left (as when none
  is available);
- a Responses error event whose ``code`` is a string (the HTTP status, as the other routes' ``error.code``);
- 401 for a missing or wrong admin or metrics key (as for a client key), 403 only where no key opens the route."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from pdproxy.apis.request import Api
from pdproxy.app.application import build_control_app
from pdproxy.http.client import Disconnected, ProtocolError, ReadTimeout
from tests.middle.fake_upstream import (
    MODEL,
    Answer,
    Gate,
    Outcome,
    Refuse,
    Reset,
    Status,
    Stream,
    TimeOut,
    chat_chunks,
    completion,
)
from tests.middle.rig import DECODERS, PREFILLERS, Rig, until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]

TOKENS = [orjson.loads(c[6:]) for c in chat_chunks(3)]
SECRET = "10.9.8.7:9100 ConnectionResetError(104, 'Connection reset by peer')"


def streamed(client_events: list[bytes]) -> list[object]:
    return [b"[DONE]" if e == b"[DONE]" else orjson.loads(e) for e in client_events]


def assert_no_internals(message: str) -> None:
    for internal in ("10.9.8.7", "9100", "ConnectionResetError", "Connection reset by peer", "Disconnected",
                     "ProtocolError", "ReadTimeout", "d0", "http://"):
        assert internal not in message, (internal, message)


MID_STREAM = {
    "reset": (Disconnected(f"engine closed the connection: {SECRET}"),
              "the connection to the decoder broke mid-stream; the response is incomplete", 502),
    "malformed": (ProtocolError(f"malformed HTTP response: {SECRET}"),
                  "the decoder sent a malformed answer mid-stream; the response is incomplete", 502),
    "silent": (ReadTimeout(f"no data for 30 s from {SECRET}"),
               "the decoder timed out mid-stream; the response is incomplete", 504),
}


@pytest.mark.parametrize("failure", list(MID_STREAM))
async def test_a_stream_broken_mid_way_tells_the_client_a_fixed_sentence_and_the_log_the_detail(failure: str) -> None:
    end, sentence, code = MID_STREAM[failure]
    logged: list[str | None] = []
    async with Rig() as rig:
        rig.app.request_log.emit = lambda ctx, *_: logged.append(ctx.error)  # type: ignore[method-assign]
        rig.fake.script("r", decode=[Stream(events=2, end=end)])
        sent = rig.send("r")
        client = await sent.done()
        (decode,) = rig.fake.of("decode", "r")
        # the decoder failed the request: told to its breaker (old code: a success, without stream_continuation)
        assert rig.state.health.breaker(decode.endpoint).consecutive_failures == 1
    events = streamed(client.events())
    assert client.status == 200 and client.finished and events[-1] == b"[DONE]" and events[:2] == TOKENS[:2]
    error = events[2]
    assert isinstance(error, dict) and set(error) == {"error"}, error
    assert error["error"] == {"message": sentence, "type": "BadGatewayError" if code == 502 else "GatewayTimeoutError",
                              "param": None, "code": code}
    assert_no_internals(error["error"]["message"])
    (detail,) = logged                                              # the request's log line keeps the detail
    assert detail is not None and SECRET in detail and "http://d" in detail, detail


async def test_decoders_broken_before_their_first_event_are_a_503_with_a_fixed_sentence() -> None:
    async with Rig() as rig:
        rig.fake.script("r", decode=[Stream(events=0, end=Disconnected(f"engine closed: {SECRET}"))] * 3)
        client = await rig.run("r")
    assert client.status == 503 and client.header_of(b"retry-after") is not None
    assert client.json() == {"error": {"message": "no decoder could serve the request; retry later: the connection "
                                                  "to the decoder broke before its first event",
                                       "type": "ServiceUnavailableError", "param": None, "code": 503}}


async def test_a_reset_prefill_leg_reads_as_a_sentence_without_the_exception() -> None:
    async with Rig() as rig:
        rig.fake.script("r", prefill=[Reset()] * 3)
        client = await rig.run("r")
    message = client.json()["error"]["message"]
    assert_no_internals(message)
    assert "Disconnected" not in message and "engine closed the connection" not in message, message


# ---------------------------------------------------------------------------------------- data:[DONE] (no space)
NO_SPACE_ENDS = {
    "own read": [*chat_chunks(3), b"data:[DONE]\n\n"],
    "same read": [b"".join(chat_chunks(3)) + b"data:[DONE]\n\n"],
    "crlf": [*chat_chunks(3), b"data:[DONE]\r\n\r\n"],
    "no blank line": [*chat_chunks(3), b"data:[DONE]"],
}


@pytest.mark.parametrize("ending", list(NO_SPACE_ENDS))
async def test_a_stream_ending_with_data_done_without_a_space_is_ended_and_the_client_gets_data_space_done(
        ending: str) -> None:
    """``data:[DONE]`` is the same event as ``data: [DONE]`` for an SSE parser (one leading space is optional): the
    stream has ended — not "ended without data: [DONE]" — and the client's stream ends as vLLM's does."""
    async with Rig() as rig:
        rig.fake.script("r", decode=[Stream(events=NO_SPACE_ENDS[ending], end="eof")])
        client = await rig.run("r")
    assert client.status == 200 and client.finished
    assert streamed(client.events()) == [*TOKENS, b"[DONE]"]
    assert client.text.endswith(b"}\n\ndata: [DONE]\n\n") and client.text.count(b"[DONE]") == 1, client.text
    (decode,) = rig.fake.of("decode", "r")
    assert decode.response is not None and decode.response.ended == "released"


async def test_a_stream_of_data_done_without_a_space_and_nothing_before_it_is_a_failed_decoder() -> None:
    """As with ``data: [DONE]``: a decoder that ends before its first token never ran the request (every decoder
    doing so: 503 + ``Retry-After``, as any decoder failure once none is left)."""
    async with Rig() as rig:
        rig.fake.script("r", decode=[Stream(events=[b"data:[DONE]\n\n"], end="eof")] * 3)
        client = await rig.run("r")
    assert client.status == 503 and "ended the stream before its first event" in client.json()["error"]["message"]


# ------------------------------------------------------------------------------------------- no prefiller left
PREFILL_FAILURES: dict[str, Callable[[], Outcome]] = {"refused": Refuse, "reset": Reset, "timeout": TimeOut}


@pytest.mark.parametrize("failure", list(PREFILL_FAILURES))
@pytest.mark.parametrize("prefillers", [1, 3])
async def test_when_no_prefiller_is_left_the_client_gets_503_with_retry_after(failure: str, prefillers: int) -> None:
    """The first request after a lone prefiller failed it on every attempt (or after every prefiller failed it)
    gets what the next one gets — 503 + ``Retry-After``, the answer for "no prefiller available" — not a 502 a
    client does not retry; counted as the engines' failure (``upstream_error``), not as a rejection.  A lone
    prefiller is tried again (``prefill_attempts``) unless its breaker opened (a refusal opens it at once)."""
    outcomes: list[str | None] = []
    # breaker_failures 4: the three attempts leave a lone prefiller's breaker closed (but for a refusal)
    async with Rig(prefill=PREFILLERS[:prefillers], breaker_failures=4) as rig:
        rig.app.request_log.emit = lambda ctx, *_: outcomes.append(ctx.outcome)  # type: ignore[method-assign]
        rig.fake.script("first", prefill=[PREFILL_FAILURES[failure]() for _ in range(3)])
        first = await rig.run("first")
    tried = 1 if failure == "refused" and prefillers == 1 else 3
    legs = rig.fake.of("prefill", "first")
    assert len(legs) == tried and len({leg.endpoint for leg in legs}) == min(prefillers, tried)
    assert not rig.fake.of("decode")
    assert first.status == 503, first.text
    retry_after = first.header_of(b"retry-after")
    assert retry_after is not None and int(retry_after) >= 1
    error = first.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503 and error["param"] is None
    sentence = {"refused": "the prefiller refused the connection", "reset": "the connection to the prefiller broke",
                "timeout": "did not answer within"}[failure]
    assert error["message"].startswith("no prefiller could serve the request; retry later: "), error
    assert sentence in error["message"], error
    assert_no_internals(error["message"])
    assert outcomes == ["upstream_error"]


async def test_when_the_last_prefiller_answers_its_own_503_the_client_gets_that_answer() -> None:
    async with Rig(prefill=PREFILLERS[:1]) as rig:
        rig.fake.script("r", prefill=[Status(503, b'{"error": "busy"}', retry_after="7")])
        client = await rig.run("r")
    assert client.status == 503 and client.text == b'{"error": "busy"}' and client.header_of(b"retry-after") == b"7"


# -------------------------------------------------------------------------------------------- no decoder left
DECODE_FAILURES: dict[str, tuple[Callable[[], Outcome], str]] = {
    "refused": (Refuse, "the decoder refused the connection"),
    "reset": (Reset, "the connection to the decoder broke"),
    "reset before its first event": (lambda: Stream(events=0, end=Disconnected(f"engine closed: {SECRET}")),
                                     "the connection to the decoder broke before its first event"),
    "timeout": (TimeOut, "decoder sent no response headers within"),
}


@pytest.mark.parametrize("failure", list(DECODE_FAILURES))
@pytest.mark.parametrize("decoders", [1, 3])
async def test_when_no_decoder_is_left_the_client_gets_503_with_retry_after(failure: str, decoders: int) -> None:
    """The decode side's twin of the prefill test above: a lone decoder that resets (or refuses, or times out)
    before its first event on every attempt, or every decoder failing the request, gets the client 503 +
    ``Retry-After`` ("no decoder could serve the request; retry later: <the last failure's sentence>"), as
    "no decoder available" answers the next request — not a 502 without ``Retry-After``; counted as the engines'
    failure (``upstream_error``), one strike on each decoder's breaker however often the request failed there
    (``HealthMonitor.record_error``'s ``again``)."""
    make, sentence = DECODE_FAILURES[failure]
    outcomes: list[str | None] = []
    # breaker_failures 4: the three attempts leave a lone decoder's breaker closed (but for a refusal, which opens it
    # at once), so the last re-prefill's KV release finds it (a release leg waits for a decoder it may use)
    async with Rig(decode=DECODERS[:decoders], breaker_failures=4) as rig:
        rig.app.request_log.emit = lambda ctx, *_: outcomes.append(ctx.outcome)  # type: ignore[method-assign]
        rig.fake.script("first", decode=[make() for _ in range(3)])
        first = await rig.run("first")
        failures = sum(rig.state.health.breaker(rig.endpoint(url)).consecutive_failures for url in DECODERS[:decoders])
    tried = 1 if failure == "refused" and decoders == 1 else 3   # a refusal opens the lone decoder's breaker at once
    assert len(rig.fake.of("decode", "first")) == tried
    if failure != "refused":      # (a refused decoder's count is cleared by the probe that finds it listening)
        assert failures == decoders
    assert first.status == 503, first.text
    retry_after = first.header_of(b"retry-after")
    assert retry_after is not None and int(retry_after) >= 1
    error = first.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503 and error["param"] is None
    assert error["message"].startswith("no decoder could serve the request; retry later: "), error
    assert sentence in error["message"], error
    assert_no_internals(error["message"])
    assert outcomes == ["upstream_error"]


async def test_when_the_last_decoder_answers_its_own_502_the_client_gets_that_answer() -> None:
    async with Rig(decode=DECODERS[:1]) as rig:
        rig.fake.script("r", decode=[Status(502, b'{"error": "bad gateway"}')] * 3)
        client = await rig.run("r")
    assert len(rig.fake.of("decode", "r")) == 3
    assert client.status == 502 and client.text == b'{"error": "bad gateway"}'


# ---------------------------------------------------------------------------------- Responses: the error event
def responses_event(name: str, seq: int, **fields: object) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, "sequence_number": seq,
                                                                      **fields}) + b"\n\n"


RESPONSES_OPENING = [responses_event("response.created", 0, response={"id": "resp_1", "status": "in_progress"}),
                     responses_event("response.in_progress", 1, response={"id": "resp_1", "status": "in_progress"}),
                     responses_event("response.output_text.delta", 2, item_id="msg_1", output_index=0,
                                     content_index=0, delta=" t0")]


@pytest.mark.parametrize(("end", "code"), [(Disconnected(f"engine closed: {SECRET}"), "502"),
                                           (ReadTimeout("no data for 30 s"), "504")])
async def test_a_responses_stream_failure_is_the_responses_error_event_with_a_string_code(
        end: Exception, code: str) -> None:
    """The Responses API's ``error`` event (OpenAI's ``ResponseErrorEvent``: ``code`` a string or null) carries the
    HTTP status as the other routes' ``error.code`` does — ``"502"``, not the class name ``"BadGatewayError"``
    (vLLM has no working Responses error event: docs/apis-through-pd.md)."""
    body = orjson.dumps({"model": MODEL, "input": "tell me about r", "stream": True, "max_output_tokens": 8})
    async with Rig() as rig:
        rig.fake.script("r", decode=[Stream(events=RESPONSES_OPENING, end=end)])  # type: ignore[arg-type]
        client = await rig.send("r", body=body, api=Api.RESPONSES).done()
    assert client.status == 200 and client.finished
    last = client.text.rstrip(b"\n").rsplit(b"\n\n", 1)[-1]
    name, data = last.split(b"\n", 1)
    assert name == b"event: error", client.text
    event = orjson.loads(data.removeprefix(b"data: "))
    assert event["type"] == "error" and event["code"] == code and event["param"] is None, event
    assert isinstance(event["sequence_number"], int) and event["sequence_number"] > 2, event
    assert event["message"].endswith("mid-stream; the response is incomplete"), event
    assert_no_internals(event["message"])


# ------------------------------------------------------------------------------------- operator keys: 401 vs 403
async def control_status(rig: Rig, path: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    app = build_control_app(rig.app)              # no lifespan: the rig's state is the proxy's
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://pdproxy") as client:
        r = await client.get(path, headers=headers)
    return r.status_code, r.json() if r.headers.get("content-type") == "application/json" else {}


@pytest.mark.parametrize("path", ["/admin/endpoints", "/debug/load", "/metrics"])
async def test_a_missing_or_wrong_operator_key_is_a_401_as_a_missing_or_wrong_client_key(path: str) -> None:
    """vLLM's ``--api-key`` and pdproxy's own ``api_keys`` answer 401 for a missing or invalid credential; the admin
    key (admin API, debug routes) and the metrics key do too — a valid client key is no operator credential."""
    key = "scrape-me" if path == "/metrics" else "admin-secret"
    async with Rig(host="0.0.0.0", api_keys=["sk-client"], admin_key="admin-secret", metrics_key="scrape-me") as rig:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Bearer sk-client"}):
            status, body = await control_status(rig, path, headers)
            assert status == 401, (headers, status, body)
            assert body["error"]["type"] == "AuthenticationError" and body["error"]["code"] == 401, body
        status, _ = await control_status(rig, path, {"authorization": f"Bearer {key}"})
        assert status == 200


async def test_an_operator_surface_that_is_off_stays_a_403() -> None:
    """No admin key configured: no credential opens the admin API or the debug routes (off) — 403, not 401."""
    async with Rig(host="0.0.0.0") as rig:
        for path in ("/admin/endpoints", "/debug/load"):
            status, body = await control_status(rig, path, {"authorization": "Bearer anything"})
            assert status == 403 and body["error"]["type"] == "PermissionDeniedError", (path, body)


async def test_a_fanned_out_json_answer_that_is_not_json_is_the_decoders_502_not_pdproxys_500() -> None:
    """A non-streamed answer is relayed alone after a check of its shape (``{`` … ``}`` holding ``"choices"``), but
    a fanned-out request's answers are parsed to be merged: one that passed the shape check yet is no JSON (a
    decoder's broken body) is the decoder's fault, a 502 saying so — it was an unhandled ``JSONDecodeError``, the
    client's 500 "internal error in pdproxy" with a traceback in the log (found by a decoder sending
    ``{"choices": [1,}``)."""
    async with Rig() as rig:
        rig.fake.script("r", decode=[Answer(raw=b'{"id": "x", "choices": [1,}')] * 2)
        client = await rig.send("r", body=orjson.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
            "temperature": 1.0})).done()
    error = client.json()["error"]
    assert client.status == 502 and error["code"] == 502, error
    assert "decoder" in error["message"] and "internal" not in error["message"], error


DEEP = b"[" * 300 + b"]" * 300       # orjson reads 1,023 levels, writes 254


@pytest.mark.parametrize("n", [1, 2])
async def test_a_json_answer_nested_past_what_orjson_writes_is_never_pdproxys_500(n: int) -> None:
    """A non-streamed answer whose usage pdproxy patches (the prefiller's cached tokens) is parsed and written
    again: one nested 300 levels deep (orjson reads it, cannot write it) raised ``TypeError`` — the client's 500
    "internal error in pdproxy" and a traceback (found with a decoder answering a ``"deep"`` member of 300
    brackets).  Alone it is relayed as the decoder sent it (its usage unpatched); merged with a fan-out sibling it
    is the decoder's 502."""
    async with Rig() as rig:
        prefill = {**completion(), "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13,
                                             "prompt_tokens_details": {"cached_tokens": 4}}}
        answer = orjson.dumps(completion("deep"))[:-1] + b', "deep": ' + DEEP + b"}"
        rig.fake.script("r", prefill=[Answer(body=prefill)] * n, decode=[Answer(raw=answer)] * n)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": False}
        if n > 1:
            body.update(n=n, temperature=1.0)
        client = await rig.send("r", body=orjson.dumps(body)).done()
    if n == 1:
        assert client.status == 200 and client.text == answer
    else:
        error = client.json()["error"]
        assert client.status == 502 and "internal" not in error["message"], error


@pytest.mark.parametrize("api", [Api.MESSAGES, Api.RESPONSES])
def test_a_messages_or_responses_answer_nested_past_what_orjson_writes_is_relayed_as_it_came(api: Api) -> None:
    """The same for the Messages and Responses usage patch (``streams.patch_json``): it raised ``TypeError``, the
    client's 500, on an answer nested 300 levels deep."""
    from pdproxy.apis.streams import patch_json

    usage = b'{"input_tokens": 3, "output_tokens": 1}'
    answer = b'{"id": "x", "usage": ' + usage + b', "deep": ' + DEEP + b"}"
    assert patch_json(api, answer, 2) == answer


@pytest.mark.parametrize("figure", ["abc", 10 ** 19, 1e300, -5])
@pytest.mark.parametrize("stream", [False, True])
async def test_fanned_out_usage_figures_that_are_not_numbers_are_no_500(stream: bool, figure: object) -> None:
    """A fan-out sums its sequences' usage figures; ``int()`` of a decoder's ``"completion_tokens": "abc"`` (or a
    list) raised out of the merge — the client's 500 "internal error in pdproxy" with a traceback (found with a
    decoder answering such a usage to an n=2 chat).  Such a figure now counts 0, as does a number that is no count
    (10**19 twice sums past the 64 bits orjson writes; 1e300 is cut to a 300-digit integer; a negative one): writing
    the merged usage raised ``TypeError``, the streamed client's 500, the non-streamed one's 502 "nested too deep"."""
    async with Rig() as rig:
        usage = {"prompt_tokens": 3, "completion_tokens": figure, "total_tokens": [1],
                 "completion_tokens_details": {"reasoning_tokens": "x"}}
        if stream:
            events = [*chat_chunks(2), b"data: " + orjson.dumps({"id": "c", "object": "chat.completion.chunk",
                                                                 "choices": [], "usage": usage}) + b"\n\n"]
            rig.fake.script("r", decode=[Stream(events=events)] * 2)
        else:
            rig.fake.script("r", decode=[Answer(body={**completion("a"), "usage": usage})] * 2)
        body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                "n": 2, "temperature": 1.0, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        client = await rig.send("r", body=orjson.dumps(body)).done()
    assert client.status == 200, client.text[:300]
    if stream:
        events = client.events()
        assert events[-1] == b"[DONE]", events[-2:]
        merged = [orjson.loads(e) for e in events if e != b"[DONE]"][-1]["usage"]
    else:
        merged = client.json()["usage"]
    assert merged["completion_tokens"] == 0 and merged["prompt_tokens"] == 3 and merged["total_tokens"] == 3


@pytest.mark.parametrize("bad", [b"data: {not json\n\n", b"data: [1, 2]\n\n", b'data: "text"\n\n'])
@pytest.mark.parametrize("first", [True, False])
async def test_a_fanned_out_stream_event_that_is_not_a_json_object_fails_the_stream_never_dropped(
        bad: bytes, first: bool) -> None:
    """A fan-out stream's events are parsed to be merged: one whose data is not a JSON object was dropped from the
    merged stream without a word (a single stream relays it as sent).  It is the decoder's malformed answer, as a
    relay words it: the client's stream ends with that error event and ``[DONE]`` — or, nothing sent yet, the
    decoder's 502."""
    async with Rig() as rig:
        events = [bad, *chat_chunks(2)] if first else [*chat_chunks(1), bad, *chat_chunks(1)]
        rig.fake.script("r", decode=[Stream(events=events)] * 2)
        client = await rig.send("r", body=orjson.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
            "temperature": 1.0, "stream": True})).done()
    if first:
        error = client.json()["error"]
        assert client.status == 502 and error["message"] == (
            "the decoder sent a malformed answer: an event that is not a JSON object"), error
        return
    assert client.status == 200
    events_out = client.events()
    assert events_out[-1] == b"[DONE]"
    error = orjson.loads(events_out[-2])["error"]
    assert error["message"] == ("the decoder sent a malformed answer mid-stream: an event that is not a JSON object; "
                                "the response is incomplete"), error
    assert_no_internals(error["message"])


@pytest.mark.parametrize("continuous", [False, True])
async def test_a_streamed_usage_chunk_nested_past_what_orjson_writes_is_relayed_as_it_came(continuous: bool) -> None:
    """A streamed usage chunk is parsed and written again to carry the prefiller's cached tokens: one with a member
    nested 300 levels deep (valid JSON: orjson reads 1,023 levels, writes 254) raised ``TypeError`` in the relay —
    the stream ended with "the decoder sent a malformed answer mid-stream" and the decoder's breaker took a strike.
    It is relayed as it came (its usage unpatched), as a non-streamed answer is, and no strike is counted."""
    async with Rig(decode=DECODERS[:1]) as rig:
        prefill = {**completion(), "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13,
                                             "prompt_tokens_details": {"cached_tokens": 4}}}
        usage = (b'{"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14, '
                 b'"prompt_tokens_details": {"cached_tokens": 11, "deep": ' + DEEP + b"}}")
        deep = b'data: {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "choices": [], "usage": ' + usage
        deep += b"}\n\n"
        chunks = chat_chunks(2)
        if continuous:      # continuous usage: a token chunk carries it too
            chunks[1] = chunks[1][:-3] + b', "usage": ' + usage + b"}\n\n"
        rig.fake.script("r", prefill=[Answer(body=prefill)], decode=[Stream(events=[*chunks, deep])])
        client = await rig.send("r", body=orjson.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}})).done()
        breaker = rig.state.health.breaker(rig.endpoint(DECODERS[0]))
        assert breaker.consecutive_failures == 0
    assert client.status == 200 and client.finished
    assert client.text.endswith(deep + b"data: [DONE]\n\n"), client.text[-200:]
    assert b'"error"' not in client.text
    if continuous:
        assert chunks[1] in client.text


@pytest.mark.parametrize("where", ["usage", "chunk"])
async def test_a_fanned_out_stream_nested_past_what_orjson_writes_is_the_decoders_502_not_pdproxys_500(
        where: str) -> None:
    """Merged with a fan-out sibling, a streamed usage chunk (or a token chunk) nested 300 levels deep cannot be
    written again: the decoder's 502 error event ends the stream, as the JSON merge answers — not the TypeError's
    "internal error in pdproxy"."""
    async with Rig() as rig:
        deep = b'{"id": "chatcmpl-fake", "object": "chat.completion.chunk", "choices": [], "usage": {' \
               b'"prompt_tokens": 12, "completion_tokens": 2, "total_tokens": 14, "deep": ' + DEEP + b"}}"
        if where == "chunk":
            deep = chat_chunks(1)[0][6:-3] + b', "deep": ' + DEEP + b"}"
        rig.fake.script("r", decode=[Stream(events=[*chat_chunks(1), b"data: " + deep + b"\n\n"])] * 2)
        client = await rig.send("r", body=orjson.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
            "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}})).done()
    assert client.status == 200 and client.events()[-1] == b"[DONE]"
    error = orjson.loads(client.events()[-2])["error"]
    assert error["code"] == 502 and "too deep to merge" in error["message"], error


@pytest.mark.parametrize("api", [Api.MESSAGES, Api.RESPONSES])
def test_a_messages_or_responses_usage_event_nested_past_what_orjson_writes_is_relayed_as_it_came(api: Api) -> None:
    """The same for the Messages and Responses streams' usage patch (``streams._patch_events``)."""
    from pdproxy.apis.streams import stream_for
    from pdproxy.timeline import RequestContext

    usage = b'{"input_tokens": 3, "output_tokens": 1, "deep": ' + DEEP + b"}"
    if api is Api.MESSAGES:
        block = b'event: message_delta\ndata: {"type": "message_delta", "usage": ' + usage + b"}\n\n"
    else:
        block = (b'event: response.completed\ndata: {"type": "response.completed", "response": {"usage": '
                 + usage + b"}}\n\n")
    stream = stream_for(api, RequestContext(request_id="r", client_request_id=None, api_label=api.label), 2)
    assert stream is not None
    assert stream.feed(block) == block


async def test_a_json_answer_read_for_a_recomputed_end_that_is_not_json_is_relayed_not_pdproxys_500() -> None:
    """A non-streamed answer holding ``"recomputed"`` (vLLM-Ascend's ``stop_reason``; ``recompute_continuation``
    is on by default) is parsed to tell whether it ended so: one that passed the shape check yet is no JSON raised
    ``JSONDecodeError`` out of ``relay_json`` — the client's 500 "internal error in pdproxy".  It is no recomputed
    end, so it is relayed as any answer checked by shape only is (as it came)."""
    raw = b'{"id": "x", "choices": [1,}, "stop_reason": "recomputed"}'
    async with Rig() as rig:
        rig.fake.script("r", decode=[Answer(raw=raw)] * 2)
        client = await rig.send("r", body=orjson.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})).done()
    assert client.status == 200 and client.text == raw, client.text[:300]


async def test_a_fanned_out_stream_event_nested_past_what_orjson_writes_is_no_500() -> None:
    """A fan-out re-indexes each sequence's stream events (parsed, written again): an event nested past the 254
    levels orjson writes (it reads 1,023) raised ``TypeError`` out of the merge of the streams."""
    deep = (b'data: {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "' + MODEL.encode()
            + b'", "choices": [{"index": 0, "delta": {"content": " d"}, "finish_reason": null}], "deep": ' + DEEP
            + b"}\n\n")
    async with Rig() as rig:
        rig.fake.script("r", decode=[Stream(events=[*chat_chunks(2), deep])] * 2)
        client = await rig.send("r", body=orjson.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
            "temperature": 1.0, "stream": True})).done()
    assert b"internal error" not in client.text and b"nested too deep to merge" in client.text, client.text[-400:]


async def test_a_fanned_out_usage_chunk_nested_past_what_orjson_writes_is_no_500() -> None:
    """The merged stream's usage chunk is the first sequence's, its usage replaced: one nested past what orjson
    writes raised ``TypeError`` out of the stream's end."""
    usage = (b'data: {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "' + MODEL.encode()
             + b'", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}, '
             b'"deep": ' + DEEP + b"}\n\n")
    async with Rig() as rig:
        rig.fake.script("r", decode=[Stream(events=[*chat_chunks(2), usage])] * 2)
        client = await rig.send("r", body=orjson.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
            "temperature": 1.0, "stream": True, "stream_options": {"include_usage": True}})).done()
    assert b"internal error" not in client.text and b"nested too deep to merge" in client.text, client.text[-400:]


def test_a_chat_usage_chunk_nested_past_what_orjson_writes_is_relayed_as_it_came() -> None:
    """The same for a chat / completions stream's usage patch (``ChatUsage``, the prefiller's cached tokens)."""
    from pdproxy.apis.chat import ChatUsage
    from pdproxy.timeline import RequestContext

    event = (b'data: {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": {"prompt_tokens": 3, '
             b'"completion_tokens": 1, "total_tokens": 4}, "deep": ' + DEEP + b"}\n\n")
    usage = ChatUsage(RequestContext(request_id="t", client_request_id=None, api_label="chat"), 2, False, None)
    assert usage.feed(event, b"") == event


@pytest.mark.parametrize("mid_stream", [False, True])
async def test_a_fanned_out_stream_error_event_nested_past_what_orjson_writes_is_no_500(mid_stream: bool) -> None:
    """A fan-out sequence's error event is kept as the failure's body: it was written again, and one nested past
    the 254 levels orjson writes (it reads 1,023) raised ``TypeError`` out of the merge — pdproxy's "internal
    error".  Before anything was sent the client gets the decoder's error as sent; mid-stream, its error event."""
    deep = b'data: {"error": {"message": "boom", "code": 500, "deep": ' + DEEP + b"}}\n\n"
    gate = Gate("the error event")
    async with Rig() as rig:
        rig.fake.script("r", decode=[Stream(events=[*chat_chunks(1), deep], gates={1: gate} if mid_stream else {})]
                        * 2)
        sent = rig.send("r", body=orjson.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2,
            "temperature": 1.0, "stream": True}))
        if mid_stream:
            await gate.reached.wait()
            await until(lambda: len(sent.client.events()) >= 1, "a chunk at the client")
            gate.open()
        client = await sent.done()
    assert b"internal error" not in client.text, client.text[-400:]
    if not mid_stream:
        assert client.status == 500 and client.text == deep[6:-2], client.text[-400:]  # the decoder's error as sent
        return
    events = client.events()
    assert client.status == 200 and events[-1] == b"[DONE]", client.text[-400:]
    error = orjson.loads(events[-2])["error"]
    assert error["code"] == 500 and "boom" in error["message"], error
