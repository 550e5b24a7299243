"""The failure policy of pdproxy/pd/director.py and pdproxy/pd/prefill.py, on the real director and relay with fake
engines in process (tests/middle/fake_upstream.py): what each engine got, what the client got, and — in every
case, asserted by ``Rig.close`` — the pool idle, the prefill queue empty and every KV handle pulled, rejected by a
decoder or released by a release leg, exactly once."""

from __future__ import annotations

from collections.abc import Callable

import orjson
import pytest

from pdproxy.apis import kv_transfer
from pdproxy.http.client import Disconnected, ReadTimeout
from tests.middle.fake_upstream import (
    Answer,
    FakeClient,
    Outcome,
    Refuse,
    Reset,
    Status,
    Stream,
    TimeOut,
    chat_chunks,
    completion,
    error_event,
    handle_id,
)
from tests.middle.rig import DECODERS, PREFILLERS, Rig

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]

TOKENS = [orjson.loads(c[6:]) for c in chat_chunks(3)]


def streamed(client_events: list[bytes]) -> list[object]:
    return [b"[DONE]" if e == b"[DONE]" else orjson.loads(e) for e in client_events]


def assert_full_stream(client: FakeClient) -> None:
    assert client.status == 200 and client.finished
    assert streamed(client.events()) == [*TOKENS, b"[DONE]"]


# ----------------------------------------------------------------------------------------------------- prefill
RETRYABLE: dict[str, tuple[Callable[[], Outcome], str]] = {
    "refused": (Refuse, "refused"),
    "reset": (Reset, "reset"),
    "timeout": (TimeOut, "timeout"),
    "502": (lambda: Status(502), "status"),
    "503": (lambda: Status(503), "status"),
    "504": (lambda: Status(504), "status"),
}


@pytest.mark.parametrize("failure", list(RETRYABLE))
async def test_a_prefiller_that_refuses_resets_times_out_or_answers_502_503_504_is_replaced(failure: str) -> None:
    make, result = RETRYABLE[failure]
    async with Rig() as rig:
        rig.fake.script("r", prefill=[make()])
        client = await rig.run("r")
    first, second = rig.fake.of("prefill", "r")
    assert (first.result, second.result) == (result, "answered")
    assert first.endpoint != second.endpoint                          # another prefiller
    (decode,) = rig.fake.of("decode", "r")
    assert decode.handle_in == handle_id(second.handle)               # the second prefiller's KV
    assert first.request_id == second.request_id == decode.request_id  # one id across the legs
    for leg in (first, second):                                       # the prefill leg's body (pd-protocol §1)
        assert leg.body["stream"] is False and leg.body["max_tokens"] == 1 and leg.body["min_tokens"] == 1
        assert leg.body["kv_transfer_params"] == kv_transfer.PREFILL_STUB
    assert decode.body["stream"] is True and decode.body["max_tokens"] == 8
    assert_full_stream(client)
    assert not rig.fake.of("release")
    b = rig.state.health.breaker(first.endpoint)
    if failure == "refused":     # opened at once; the fake's /health answers, so a good probe closed it again
        assert b.opened_total == 1
    else:
        assert b.consecutive_failures == 1                            # the failure counted on it


@pytest.mark.parametrize("failure", ["reset", "timeout", "502", "503"])
async def test_a_lone_prefiller_that_fails_once_is_tried_again(failure: str) -> None:
    """With one prefiller (1P1D, or the others' breakers open) a transient failure is retried on it after the
    backoff, as the decode side retries a lone decoder and vLLM-Ascend's example proxy retries its server
    (``--max-retries``); the request gets its whole stream from the second attempt's KV."""
    make, result = RETRYABLE[failure]
    async with Rig(prefill=PREFILLERS[:1]) as rig:
        rig.fake.script("r", prefill=[make()])
        client = await rig.run("r")
    first, second = rig.fake.of("prefill", "r")
    assert (first.result, second.result) == (result, "answered")
    assert first.endpoint == second.endpoint
    (decode,) = rig.fake.of("decode", "r")
    assert decode.handle_in == handle_id(second.handle)
    assert_full_stream(client)
    assert rig.state.health.breaker(first.endpoint).consecutive_failures == 0   # the success closed the count


@pytest.mark.parametrize("failure", ["reset", "timeout", "502"])
async def test_one_requests_attempts_on_a_lone_engine_count_once_against_its_breaker(failure: str) -> None:
    """A request that fails every attempt on the lone prefiller (a body that makes it answer a malformed head, a
    502) is one strike, not ``prefill_attempts`` of them: old code opened the breaker (threshold 3) with one
    request, and every other client got 503 until it closed.  Other requests' failures still add up (below), and
    so do a lone decoder's."""
    make, result = RETRYABLE[failure]
    async with Rig(prefill=PREFILLERS[:1], decode=DECODERS[:1]) as rig:
        rig.fake.script("r", prefill=[make(), make(), make()])
        client = await rig.run("r")
        legs = rig.fake.of("prefill", "r")
        assert [c.result for c in legs] == [result] * 3 and len({c.endpoint for c in legs}) == 1
        assert client.status in (502, 503, 504) and not rig.fake.of("decode")
        b = rig.state.health.breaker(legs[0].endpoint)
        assert b.consecutive_failures == 1 and b.opened_total == 0
        rig.fake.script("s", prefill=[make(), make(), make()])
        await rig.run("s")
        assert b.consecutive_failures == 2 and b.opened_total == 0      # another request: another strike
        rig.fake.script("t", decode=[make(), make(), make()])
        client = await rig.run("t")
        decodes = rig.fake.of("decode", "t")
        assert len(decodes) == 3 and client.status in (502, 503, 504)
        d = rig.state.health.breaker(decodes[0].endpoint)
        assert d.consecutive_failures == 1 and d.opened_total == 0
        if failure == "502":     # a non-streamed answer's timeout is no verdict: the 502s after it are the strike
            rig.fake.script("u", decode=[TimeOut(), make(), make()])
            await rig.run("u", stream=False)
            assert d.consecutive_failures == 2 and d.opened_total == 0


async def test_a_lone_prefiller_whose_engine_core_died_is_not_tried_again() -> None:
    dead = orjson.dumps({"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the "
                                              "root cause.", "type": "InternalServerError", "code": 500}})
    async with Rig(prefill=PREFILLERS[:1]) as rig:
        rig.fake.script("r", prefill=[Status(500, dead)])
        client = await rig.run("r")
    assert [c.result for c in rig.fake.of("prefill", "r")] == ["status"]
    assert client.status == 500 and client.json()["error"]["code"] == 500 and not rig.fake.of("decode")


async def test_when_every_prefill_attempt_fails_the_client_gets_the_last_failure() -> None:
    async with Rig() as rig:
        rig.fake.script("r", prefill=[Refuse(), Reset(), Status(503, b'{"error": "busy"}', retry_after="7")])
        client = await rig.run("r")
    legs = rig.fake.of("prefill", "r")
    assert [c.result for c in legs] == ["refused", "reset", "status"]
    assert len({c.endpoint for c in legs}) == 3                       # prefill_attempts = 3, each elsewhere
    assert not rig.fake.of("decode")
    assert client.status == 503 and client.text == b'{"error": "busy"}'   # the engine's answer, verbatim
    assert client.header_of(b"retry-after") == b"7"


async def test_when_every_prefiller_refuses_the_client_gets_a_503_with_retry_after_without_engine_addresses() -> None:
    async with Rig() as rig:
        rig.fake.script("r", prefill=[Refuse(), Refuse(), Refuse()])
        client = await rig.run("r")
    assert len(rig.fake.of("prefill", "r")) == 3 and not rig.fake.of("decode")
    error = client.json()["error"]
    assert client.status == 503 and error["code"] == 503
    assert int(client.header_of(b"retry-after") or 0) >= 1           # until a prefiller's breaker re-admits one
    assert "p2" not in error["message"] and "9000" not in error["message"], error


async def test_a_prefiller_500_is_tried_elsewhere_only_when_its_engine_died() -> None:
    """vLLM's EngineDeadError 500 gets one more prefiller; any other 500 is the request's own failure (a
    constraint the model cannot meet in one token, say) and would fail the same way everywhere: never retried."""
    dead = orjson.dumps({"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the "
                                              "root cause.", "type": "InternalServerError", "code": 500}})
    async with Rig() as rig:
        rig.fake.script("dead", prefill=[Status(500, dead)])
        rig.fake.script("twice", prefill=[Status(500, dead), Status(500, dead)])
        rig.fake.script("request", prefill=[Status(500, b'{"error": "engine bug"}')])
        once = await rig.run("dead")
        twice = await rig.run("twice")
        request = await rig.run("request")
    first, second = rig.fake.of("prefill", "dead")
    assert first.result == "status" and second.result == "answered" and first.endpoint != second.endpoint
    assert_full_stream(once)
    legs = rig.fake.of("prefill", "twice")
    assert [c.result for c in legs] == ["status", "status"]           # not a third time
    assert legs[0].endpoint != legs[1].endpoint
    assert twice.status == 500 and twice.json()["error"]["code"] == 500
    assert [c.result for c in rig.fake.of("prefill", "request")] == ["status"]     # deterministic: not retried
    assert request.status == 500 and request.json() == {"error": "engine bug"}
    assert not rig.fake.of("decode", "twice") and not rig.fake.of("decode", "request")


@pytest.mark.parametrize("status", [400, 404, 422, 429])
async def test_a_prefiller_4xx_reaches_the_client_verbatim_and_is_not_retried(status: int) -> None:
    body = orjson.dumps({"error": {"message": "bad request", "type": "BadRequestError", "code": status}})
    async with Rig() as rig:
        rig.fake.script("r", prefill=[Status(status, body)])
        client = await rig.run("r")
    (leg,) = rig.fake.of("prefill", "r")
    assert not rig.fake.of("decode")
    assert client.status == status and client.text == body
    assert rig.state.health.breaker(leg.endpoint).consecutive_failures == 0   # the request's fault, not the engine's


async def test_a_retry_after_holds_that_prefillers_breaker_open_for_later_requests() -> None:
    async with Rig() as rig:
        rig.fake.script("r", prefill=[Status(503, retry_after="30")])
        await rig.run("r")
        busy = rig.fake.of("prefill", "r")[0].endpoint
        assert not rig.state.health.can_take(busy)
        for key in ("s", "t", "u"):
            assert_full_stream(await rig.run(key))
    assert all(c.endpoint != busy for key in "stu" for c in rig.fake.of("prefill", key))


async def test_dead_prefillers_are_tried_once_then_routed_around() -> None:
    async with Rig() as rig:
        for url in PREFILLERS[:2]:                                     # nothing listens there
            rig.fake.script_endpoint(url, "prefill", *[Refuse() for _ in range(10)])
            rig.fake.engines.down.add(url)
        for key in "abcdef":
            assert_full_stream(await rig.run(key))
        refused = [c for c in rig.fake.of("prefill") if c.result == "refused"]
        assert len({c.endpoint for c in refused}) == len(refused) <= 2  # the probe after a refusal takes it out
        assert all(not rig.state.pool.load(c.endpoint).healthy for c in refused)
    answered = [c for c in rig.fake.of("prefill") if c.result == "answered"]
    assert len(answered) == 6 and {c.endpoint.url for c in answered} == {PREFILLERS[2]}


async def test_a_prefill_answer_without_a_handle_is_a_502_not_a_decode() -> None:
    async with Rig() as rig:
        rig.fake.script("r", prefill=[Answer(handle=False)])           # finish "length", no KV connector
        client = await rig.run("r")
    assert len(rig.fake.of("prefill", "r")) == 1 and not rig.fake.of("decode")
    assert client.status == 502 and "kv_transfer_params" in client.json()["error"]["message"]


VLLM_ERROR_IN_200 = {
    "flat 400": ({"object": "error", "message": "boom", "type": "BadRequestError", "param": None, "code": 400}, 400),
    "envelope 422": ({"error": {"message": "boom", "type": "BadRequestError", "param": "x", "code": 422}}, 422),
    "flat 500": ({"object": "error", "message": "boom", "type": "InternalServerError", "param": None,
                  "code": 500}, 500),
    "flat, no code": ({"object": "error", "message": "boom", "type": "BadRequestError"}, 500),
}


@pytest.mark.parametrize("case", list(VLLM_ERROR_IN_200))
@pytest.mark.parametrize("stream", [True, False])
async def test_a_prefiller_error_object_in_a_200_is_the_engines_error_not_a_missing_kv_connector(
        case: str, stream: bool) -> None:
    """vLLM's error object answered with HTTP 200 (its flat ``ErrorResponse``, or the envelope) is the engine's
    error with its own words and the status its ``code`` says (500 when none), as an error status would be —
    not pdproxy's 502 blaming a missing ``--kv-transfer-config``; the request log's error names the engine's
    words; a 4xx is no strike against the prefiller."""
    answer, status = VLLM_ERROR_IN_200[case]
    async with Rig(prefill=PREFILLERS[:1]) as rig:
        logged: list[str | None] = []
        emit = rig.app.request_log.emit
        rig.app.request_log.emit = lambda ctx, *a: (logged.append(ctx.error), emit(ctx, *a))[1]  # type: ignore
        rig.fake.script("r", prefill=[Answer(body=answer, handle=False)])
        client = await rig.run("r", stream=stream)
        breaker = rig.state.health.breaker(rig.endpoint(PREFILLERS[0]))
        assert breaker.consecutive_failures == (0 if status < 500 else 1)
    assert not rig.fake.of("decode") and not rig.fake.of("release")
    assert client.status == status, client.text
    err = client.json()["error"]
    assert err["message"] == "boom" and err["code"] == status and b"kv-transfer-config" not in client.text
    assert logged and logged[-1] is not None and "boom" in logged[-1] and "error object" in logged[-1]


async def test_a_prefiller_that_finished_the_request_answers_it_without_a_decoder() -> None:
    answer = completion("done already", finish="stop", completion_tokens=1)
    async with Rig() as rig:
        rig.fake.script("r", prefill=[Answer(body=answer, handle=False)])
        client = await rig.run("r", stream=False)
    assert not rig.fake.of("decode") and not rig.fake.of("release")
    assert client.status == 200 and client.json()["choices"][0]["message"]["content"] == "done already"


# ------------------------------------------------------------------------------------------------------ decode
async def test_a_refused_decoder_is_replaced_and_the_intact_kv_handle_reused() -> None:
    async with Rig() as rig:
        rig.fake.script("r", decode=[Refuse()])
        client = await rig.run("r")
    (prefill,) = rig.fake.of("prefill", "r")                           # no second prefill
    first, second = rig.fake.of("decode", "r")
    assert first.result == "refused" and not first.received and second.result == "answered"
    assert first.endpoint != second.endpoint
    assert first.handle_in == second.handle_in == handle_id(prefill.handle)
    assert_full_stream(client)
    assert not rig.fake.of("release")


BEFORE_FIRST_EVENT: dict[str, tuple[Callable[[], Outcome], str]] = {
    # the decoder had the request and failed before its first event: the KV may be gone (re-prefill); the
    # handle is released unless the decoder answered an error for it (vLLM then frees it itself)
    "reset": (Reset, "released"),
    "timeout": (TimeOut, "released"),
    "503": (lambda: Status(503), "rejected"),
    "500": (lambda: Status(500), "rejected"),
    "broken before an event": (lambda: Stream(events=0, end=Disconnected("engine reset")), "released"),
    "ended before an event": (lambda: Stream(events=0, end="eof"), "released"),
    "first event timed out": (lambda: Stream(events=0, end=ReadTimeout("no event")), "released"),
    "error event first": (lambda: Stream(events=[error_event(500)]), "rejected"),
}


@pytest.mark.parametrize("failure", list(BEFORE_FIRST_EVENT))
async def test_a_decoder_failing_before_its_first_event_is_replaced_after_a_new_prefill(failure: str) -> None:
    make, fate = BEFORE_FIRST_EVENT[failure]
    async with Rig() as rig:
        rig.fake.script("r", decode=[make()])
        client = await rig.run("r")
    p1, p2 = rig.fake.of("prefill", "r")                               # the prefill ran again
    h1, h2 = handle_id(p1.handle), handle_id(p2.handle)
    d1, d2 = rig.fake.of("decode", "r")
    assert d1.received and (d1.handle_in, d2.handle_in) == (h1, h2)
    assert d1.endpoint != d2.endpoint                                  # another decoder
    assert_full_stream(client)                                         # nothing of the failed one reached it
    assert h1 is not None and h2 is not None
    assert rig.fake.fates[h1] == [fate] and rig.fake.fates[h2] == ["pulled"]
    releases = rig.fake.of("release", "r")
    if fate == "released":
        (release,) = releases
        assert release.handle_in == h1 and release.endpoint != d1.endpoint   # not to the decoder that failed
        assert release.body["max_tokens"] == 1 and release.body["stream"] is False
        assert release.request_id == d1.request_id
    else:
        assert not releases


@pytest.mark.parametrize("decoders", [1, 2])
async def test_when_every_decoder_failed_the_request_the_retry_goes_to_one_that_did(decoders: int) -> None:
    """Decoders that failed a request before its first event are a preference, not a ban: once none other could
    take it, the next attempt (after a new prefill) goes to one of them — their breakers still decide — instead of
    the client getting a 503 while ``decode_attempts`` remain (as Envoy's ``previous_hosts`` retry predicate)."""
    async with Rig(decode=DECODERS[:decoders]) as rig:
        rig.fake.script("r", decode=[Reset()] * decoders)
        client = await rig.run("r")
    decodes = rig.fake.of("decode", "r")
    assert len(decodes) == decoders + 1 and len(rig.fake.of("prefill", "r")) == decoders + 1
    assert len({d.endpoint for d in decodes[:decoders]}) == decoders          # each decoder first
    assert decodes[-1].endpoint in {d.endpoint for d in decodes[:decoders]}   # then one that failed it
    assert_full_stream(client)


@pytest.mark.parametrize("first", ["status", "error event"])
async def test_a_decoder_4xx_reaches_the_client_and_is_not_retried(first: str) -> None:
    body = orjson.dumps({"error": {"message": "bad params", "type": "BadRequestError", "param": None, "code": 400}})
    outcome = Status(400, body) if first == "status" else Stream(events=[b"data: " + body + b"\n\n"])
    async with Rig() as rig:
        rig.fake.script("r", decode=[outcome])
        client = await rig.run("r")
    assert len(rig.fake.of("prefill", "r")) == 1 and len(rig.fake.of("decode", "r")) == 1
    assert client.status == 400 and client.text == body
    assert not rig.fake.of("release")                                   # the decoder freed the KV it rejected


async def test_when_every_decode_attempt_fails_each_handle_is_released_and_the_client_gets_a_503() -> None:
    async with Rig() as rig:
        rig.fake.script("r", decode=[Reset(), Reset(), Reset()])
        client = await rig.run("r")
    handles = rig.fake.handles_of("r")
    assert len(handles) == 3                                           # decode_attempts = 3, a prefill each
    assert [d.handle_in for d in rig.fake.of("decode", "r")] == handles
    assert len({d.endpoint for d in rig.fake.of("decode", "r")}) == 3
    assert sorted(r.handle_in or 0 for r in rig.fake.of("release", "r")) == handles
    assert client.status == 503 and client.json()["error"]["code"] == 503      # no decoder left: retry later
    assert client.header_of(b"retry-after") is not None


async def test_when_every_decoder_refuses_the_one_handle_is_released_once() -> None:
    async with Rig() as rig:
        rig.fake.script("r", decode=[Refuse(), Refuse(), Refuse()])
        client = await rig.run("r")
    (handle,) = rig.fake.handles_of("r")                               # never re-prefilled: the KV stayed intact
    decodes = rig.fake.of("decode", "r")
    assert [d.handle_in for d in decodes] == [handle] * 3 and len({d.endpoint for d in decodes}) == 3
    (release,) = rig.fake.of("release", "r")
    assert release.handle_in == handle                                  # once a probe let a decoder back in
    assert client.status == 503 and "refused" in client.json()["error"]["message"]


async def test_every_engine_leg_carries_the_one_request_id_and_the_engine_key_not_the_clients() -> None:
    async with Rig(engine_api_key="engine-secret") as rig:
        rig.fake.script("r", decode=[Reset()])                         # prefill, decode, release, prefill, decode
        client = await rig.send("r", headers=[(b"authorization", b"Bearer client-key")]).done()
    assert client.status == 200
    legs = rig.fake.of(key="r")
    assert sorted(c.kind for c in legs) == ["decode", "decode", "prefill", "prefill", "release"]
    assert len({c.request_id for c in legs}) == 1 and legs[0].request_id.startswith("r-")
    for c in legs:
        assert c.headers["Authorization"] == "Bearer engine-secret" and c.headers["Content-Type"] == "application/json"


async def test_a_stream_broken_after_its_first_event_ends_with_an_error_event_and_done_never_replayed() -> None:
    async with Rig() as rig:
        rig.fake.script("reset", decode=[Stream(events=2, end=Disconnected("engine reset"))])
        rig.fake.script("idle", decode=[Stream(events=2, end=ReadTimeout("no data"))])
        rig.fake.script("eof", decode=[Stream(events=2, end="eof")])
        clients = {key: await rig.run(key) for key in ("reset", "idle", "eof")}
    codes = {"reset": 502, "idle": 504, "eof": 502}
    for key, client in clients.items():
        assert len(rig.fake.of("prefill", key)) == 1 and len(rig.fake.of("decode", key)) == 1   # no replay
        events = streamed(client.events())
        assert client.status == 200 and client.finished
        assert events[:2] == TOKENS[:2] and events[3] == b"[DONE]" and len(events) == 4, events
        error = events[2]
        assert isinstance(error, dict) and error["error"]["code"] == codes[key], (key, error)
        assert "incomplete" in error["error"]["message"]
        (decode,) = rig.fake.of("decode", key)
        assert decode.response is not None                              # a body that ended is pooled
        assert decode.response.ended == ("released" if key == "eof" else "closed")
    assert not rig.fake.of("release")                                   # the decoder had the KV


BROKEN_ANSWERS = {"empty": Answer(raw=b""), "text": Answer(raw=b"hello"), "sse": Answer(raw=chat_chunks(1)[0]),
                  "204": Answer(raw=b"", status=204), "array": Answer(raw=b"[]"), "empty_object": Answer(raw=b"{}"),
                  "no_choices": Answer(raw=b'{"id": "cmpl-1", "object": "chat.completion", "usage": {}}')}


@pytest.mark.parametrize("broken", list(BROKEN_ANSWERS))
async def test_a_decoder_answer_that_is_not_a_json_object_is_never_a_200(broken: str) -> None:
    """A non-streamed answer must be 200 with a JSON object holding ``choices`` (vLLM's): an empty body, text, an
    SSE stream, a 204, ``[]``, ``{}`` or an object without ``choices`` is the decoder's fault — the decoder's breaker
    told, never relayed as a 200 ("200 OK" with the engine doing nothing, docs/field-reports.md); with another
    decoder the request is retried there (the KV re-prefilled); when every attempt failed so, 503 +
    ``Retry-After`` in the API's error shape, naming the fault (pdproxy.pd.decode.DecodeLeg.gave_up)."""
    async with Rig() as rig:
        rig.fake.script("alone", decode=[BROKEN_ANSWERS[broken]] * 3)
        rig.fake.script("retried", decode=[BROKEN_ANSWERS[broken], Answer(body=completion("the answer"))])
        alone = await rig.run("alone", stream=False)
        retried = await rig.run("retried", stream=False)
    error = alone.json()["error"]
    assert alone.status == 503 and error["code"] == 503 and "answered" in error["message"], error
    assert retried.status == 200 and retried.json()["choices"][0]["message"]["content"] == "the answer"
    first = rig.fake.of("decode", "retried")[0]
    assert rig.state.health.breaker(first.endpoint).consecutive_failures >= 1


@pytest.mark.parametrize("before", [[], [b": ping\n\n"], [b"data: \n\n"], [b": ping\n\n", b"data:\n\n"]])
async def test_a_stream_that_ends_before_any_content_is_a_failure_not_an_empty_200(before: list[bytes]) -> None:
    """vLLM sends a chunk before [DONE]: a decoder whose stream ends with nothing before it but keep-alive comments
    or empty data events never ran the request — a failed attempt (the prefiller's KV released; every attempt so:
    503 + ``Retry-After``), not a 200 with no content."""
    async with Rig() as rig:
        rig.fake.script("r", decode=[Stream(events=before)] * 3)
        client = await rig.run("r")
    assert client.status == 503 and "ended the stream before its first event" in client.json()["error"]["message"]
    assert len(rig.fake.of("release", "r")) == 3                       # each attempt's KV freed on its prefiller


async def test_a_non_streamed_answer_is_relayed_after_a_decoder_failover() -> None:
    async with Rig() as rig:
        rig.fake.script("r", decode=[Reset(), Answer(body=completion("the answer"))])
        client = await rig.run("r", stream=False)
    d1, d2 = rig.fake.of("decode", "r")
    assert d1.body["stream"] is False and d2.body["stream"] is False
    assert client.status == 200 and client.json()["choices"][0]["message"]["content"] == "the answer"
    (release,) = rig.fake.of("release", "r")
    assert release.handle_in == d1.handle_in
    assert d2.response is not None and d2.response.ended == "released"  # read to its end: pooled
