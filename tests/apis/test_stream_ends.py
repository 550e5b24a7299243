"""A Responses / Messages stream ends at its end event's *line*, never at a model's text that spells the event's
name (pdproxy/apis/streams.py ``holds_event``): a false end would mark the client's response done, so a decoder
lost later would end it silently instead of with an error event or a continuation."""

from __future__ import annotations

import orjson
import pytest

from pdproxy.apis.streams import MessagesStream, ResponsesStream, holds_event
from pdproxy.timeline import RequestContext

pytestmark = pytest.mark.timeout(10)


class _Responder:
    done_sent = False


def named(name: str, obj: dict[str, object]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


SPELLED = "the stream ends with event: message_stop, event: response.completed or event: error"


@pytest.mark.parametrize("api", ["messages", "responses"])
def test_text_spelling_an_end_event_does_not_end_the_stream(api: str) -> None:
    ctx = RequestContext("r", None, api)
    stream = MessagesStream(ctx, None) if api == "messages" else ResponsesStream(ctx, None)
    stream.responder = out = _Responder()
    if api == "messages":
        text = named("content_block_delta", {"type": "content_block_delta", "index": 0,
                                             "delta": {"type": "text_delta", "text": SPELLED}})
        end = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    else:
        text = named("response.output_text.delta", {"type": "response.output_text.delta", "delta": SPELLED,
                                                    "sequence_number": 4})
        end = named("response.completed", {"type": "response.completed", "sequence_number": 5,
                                           "response": {"usage": {"output_tokens": 2}}})
    assert stream.feed(text, b"") == text
    assert not out.done_sent and ctx.outcome != "upstream_error"
    assert stream.feed(text + text, text) == text + text        # a block of several such events
    assert not out.done_sent
    stream.feed(text + end, text)                               # the real end, in the same block as text
    assert out.done_sent and ctx.outcome != "upstream_error"


def test_an_engine_error_event_still_ends_the_stream_as_an_error() -> None:
    ctx = RequestContext("r", None, "messages")
    stream = MessagesStream(ctx, None)
    stream.responder = out = _Responder()
    error = named("error", {"type": "error", "error": {"type": "api_error", "message": "KV load failed"}})
    stream.feed(named("ping", {"type": "ping"}) + error, b"")
    assert out.done_sent and ctx.outcome == "upstream_error"


@pytest.mark.parametrize(("block", "held"), [
    (b"event: message_stop\ndata: {}\n\n", True),
    (b'event: ping\ndata: {}\n\nevent: message_stop\ndata: {}\n\n', True),
    (b'data: {"text": "event: message_stop"}\n\n', False),
    (b'event: ping\ndata: {"text": "x event: message_stop"}\n\n', False),
])
def test_holds_event_reads_field_lines_only(block: bytes, held: bool) -> None:
    assert holds_event(block, b"event: message_stop") is held
