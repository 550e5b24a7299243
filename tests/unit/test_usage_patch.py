"""Usage rewriting in a block of events (pdproxy/apis/chat.py ``ChatUsage``): the prefiller's ``cached_tokens``
lands in every usage the decoder sent — the last chunk's (``include_usage``) or every chunk's
(``continuous_usage_stats``) — whatever the block's size, and nothing else in the block changes; and the relay's
end-of-stream check finds an error event among a stream's last events (pdproxy/pd/relay.py)."""

from __future__ import annotations

import orjson
import pytest

from pdproxy.apis.chat import ChatUsage
from pdproxy.pd.relay import carries_error_event
from pdproxy.timeline import RequestContext

USAGE = {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43, "prompt_tokens_details": {"cached_tokens": 0}}


def event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(i: int, usage: bool) -> dict[str, object]:
    out: dict[str, object] = {"id": "chatcmpl-1", "object": "chat.completion.chunk",
                              "choices": [{"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}]}
    if usage:
        out["usage"] = USAGE
    return out


def cached_in(block: bytes) -> list[int | None]:
    """Per event of ``block`` (``[DONE]`` left out): its usage's cached tokens, None for an event without usage."""
    out: list[int | None] = []
    for ev in block.split(b"\n\n"):
        if ev and ev != b"data: [DONE]":
            obj = orjson.loads(ev.removeprefix(b"data: "))
            out.append(obj["usage"]["prompt_tokens_details"]["cached_tokens"] if "usage" in obj else None)
    return out


@pytest.mark.parametrize("events", [1, 3, 200])
def test_the_last_chunks_usage_is_patched_and_the_rest_left_byte_for_byte(events: int) -> None:
    head = b"".join(event(chunk(i, False)) for i in range(events))
    block = head + event({"id": "chatcmpl-1", "choices": [], "usage": USAGE}) + b"data: [DONE]\n\n"
    ctx = RequestContext("r", None, "chat")
    out = ChatUsage(ctx, 7, False).feed(block, b"")
    assert out.startswith(head)
    assert cached_in(out) == [None] * events + [7]
    assert ctx.completion_tokens == 3


@pytest.mark.parametrize("events", [1, 5, 200])
def test_continuous_usage_is_patched_in_every_chunk(events: int) -> None:
    block = b"".join(event(chunk(i, True)) for i in range(events)) + b"data: [DONE]\n\n"
    out = ChatUsage(RequestContext("r", None, "chat"), 9, False).feed(block, b"")
    assert cached_in(out) == [9] * events


def test_the_usage_only_chunk_the_client_did_not_ask_for_is_dropped() -> None:
    block = event(chunk(0, False)) + event({"id": "chatcmpl-1", "choices": [], "usage": USAGE}) + b"data: [DONE]\n\n"
    out = ChatUsage(RequestContext("r", None, "chat"), None, True).feed(block, b"")
    assert out == event(chunk(0, False)) + b"data: [DONE]\n\n"


ERROR = event({"error": {"message": "boom", "code": 500}})
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize(("blocks", "error"), [
    (b"".join(event(chunk(i, False)) for i in range(300)) + ERROR + DONE, True),          # a whole answer's block
    (ERROR + event({"choices": [], "usage": USAGE}) + DONE, True),                        # usage between
    (ERROR + DONE, True),
    (ERROR, True),
    (b"".join(event(chunk(i, False)) for i in range(300)) + DONE, False),
    (b'event: response.output_text.delta\ndata: {}\n\nevent: error\ndata: {"type": "error"}\n\n', True),
    (b': keep-alive\nevent: error\ndata: {}\n\n' + DONE, True),                            # at a line start inside
])
def test_an_error_event_among_the_streams_last_events_is_found(blocks: bytes, error: bool) -> None:
    assert carries_error_event(blocks) is error
