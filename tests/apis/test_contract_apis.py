"""The per-API P→D rules of ``pdproxy/apis/kv_transfer.py`` and the answer rules of ``pdproxy/apis/streams.py`` against
what real vLLM 0.32 accepted and answered (``tests/real_vllm/captures/apis/``, written by
``tests/real_vllm/capture_apis.py``): the prefill legs pdproxy builds are the ones the real prefiller served, the
handle and the cached tokens are read where the real answers put them, the real streams' ends and usage are
found, and a decode leg is the client's body plus the handle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from pdproxy.apis import kv_transfer
from pdproxy.apis import streams as api_streams
from pdproxy.apis.request import Api, parse_request
from pdproxy.timeline import RequestContext

CAPTURES = Path(__file__).resolve().parents[1] / "real_vllm" / "captures" / "apis"


def capture(name: str) -> dict[str, Any]:
    return dict(json.loads((CAPTURES / f"{name}.json").read_text()))


@pytest.mark.parametrize(("api", "name", "limit"), [(Api.RESPONSES, "pd_responses", "max_output_tokens"),
                                                    (Api.MESSAGES, "pd_messages", "max_tokens")])
def test_the_prefill_leg_is_the_one_the_real_prefiller_served(api: Api, name: str, limit: str) -> None:
    served = capture(f"{name}_prefill")["request"]["body"]
    client = {k: v for k, v in capture(f"{name}_decode")["request"]["body"].items() if k != "kv_transfer_params"}
    built = kv_transfer.prefill_body(client, api, request_id=None)
    assert built == served                                         # same fields, same one-token limit, stub
    assert built[limit] == 1 and built["stream"] is False
    named = kv_transfer.prefill_body(client, api, request_id="abc")
    assert ("request_id" in named) is (api is Api.RESPONSES) and named.get("request_id", "resp_abc") == "resp_abc"


@pytest.mark.parametrize(("api", "name"), [(Api.RESPONSES, "pd_responses"), (Api.MESSAGES, "pd_messages")])
def test_handle_and_cached_tokens_are_read_where_vllm_puts_them(api: Api, name: str) -> None:
    answer = kv_transfer.load_prefill_answer(orjson.dumps(capture(f"{name}_prefill")["response"]["json"]))
    handle = kv_transfer.extract_params(answer)
    assert handle is not None and handle.params()["do_remote_prefill"] is True
    assert handle.params() == capture(f"{name}_decode")["request"]["body"]["kv_transfer_params"]
    assert kv_transfer.prefill_cached_tokens(answer, api) == 0
    assert kv_transfer.prefill_cached_tokens({"usage": {"input_tokens_details": {"cached_tokens": 32}}},
                                             Api.RESPONSES) == 32
    assert kv_transfer.prefill_cached_tokens({"usage": {"cache_read_input_tokens": 48}}, Api.MESSAGES) == 48
    assert kv_transfer.prefill_cached_tokens({"usage": {"cache_read_input_tokens": 48}}, Api.CHAT) is None


@pytest.mark.parametrize("api", [Api.RESPONSES, Api.MESSAGES])
def test_the_decode_leg_is_the_client_body_plus_the_handle(api: Api) -> None:
    name = "pd_responses" if api is Api.RESPONSES else "pd_messages"
    sent = capture(f"{name}_decode")["request"]["body"]
    client = {k: v for k, v in sent.items() if k != "kv_transfer_params"}
    raw = orjson.dumps(client)
    req = parse_request(raw, api)
    handle = kv_transfer.KVHandle.of(sent["kv_transfer_params"])
    body = orjson.loads(kv_transfer.decode_leg_body(api, raw, req.body, handle, "rid"))
    expected = {**sent, **({"request_id": "resp_rid"} if api is Api.RESPONSES else {})}
    assert body == expected
    own = orjson.dumps({**client, "request_id": "resp_client"})
    if api is Api.RESPONSES:                                       # a client's own request_id stays, on both legs
        assert orjson.loads(kv_transfer.decode_leg_body(api, own, orjson.loads(own), None, "rid"))[
            "request_id"] == "resp_client"
        assert kv_transfer.prefill_body(orjson.loads(own), api, request_id="rid")["request_id"] == "resp_client"


@pytest.mark.parametrize(("name", "stream_class", "first_real"), [
    ("pd_responses_stream_decode", api_streams.ResponsesStream, b"response.output_item.added"),
    ("pd_messages_stream_decode", api_streams.MessagesStream, b"content_block_start")])
def test_real_streams_open_end_and_carry_usage_where_the_relay_looks(name: str, stream_class: Any,
                                                                     first_real: bytes) -> None:
    text = capture(name)["response"]["text"].encode()
    events = [e + b"\n\n" for e in text.split(b"\n\n") if e.strip()]
    ctx = RequestContext(request_id="r", client_request_id=None, api_label="x")
    stream = stream_class(ctx, 8)                                  # the prefiller's cached tokens
    opening = [e for e in events if api_streams.event_name(e) in stream.opening]
    assert opening and b"".join(events).startswith(b"".join(opening))       # the held-back events come first
    assert api_streams.event_name(events[len(opening)]) == first_real
    assert not any(stream.ended(e) for e in events[:-1]) and stream.ended(events[-1])
    assert stream.first_error(b"".join(events[:len(opening) + 1])) is None
    patched = b"".join(stream.feed(e) if e.find(stream.trigger) >= 0 else e for e in events)
    last = orjson.loads(patched.rsplit(b"data: ", 1)[1])
    usage = last["response"]["usage"] if "response" in last else None
    if stream_class is api_streams.MessagesStream:
        delta = orjson.loads(next(e for e in patched.split(b"\n\n") if e.startswith(b"event: message_delta"))
                             .split(b"data: ", 1)[1])
        usage = delta["usage"]                                    # 13 prompt tokens: 8 cached, 5 not
        assert (usage["cache_read_input_tokens"], usage["input_tokens"]) == (8, 5)
    else:
        assert usage is not None and usage["input_tokens_details"]["cached_tokens"] == 8
    assert ctx.completion_tokens == 8


def test_a_real_failed_pull_is_an_http_error_not_a_200_stream() -> None:
    text = capture("decode_bad_remote_messages_stream")["response"]["text"].encode()
    err = api_streams.MessagesStream.first_error(text)
    assert err is not None and err.status_code == 500
    assert orjson.loads(err.raw_body)["type"] == "error"           # the engine's Anthropic envelope, as is
    cut = capture("decode_bad_remote_responses_stream")["response"]["text"].encode()
    assert api_streams.only_opening(cut, api_streams.ResponsesStream.opening)   # held back: nothing reached the
                                                                                # client, the decoder is replaced
