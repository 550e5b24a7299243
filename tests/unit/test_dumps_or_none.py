"""The one rule for JSON that orjson reads but cannot write again (:func:`pdproxy.errors.dumps_or_none`):
orjson reads up to 1,023 levels and writes at most 254, so a document parsed from an engine may not be written
again; its users relay such a document as it came, or refuse it as the engine's answer, never pdproxy's 500."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdproxy.apis.request import patch_usage_bytes
from pdproxy.errors import UpstreamHTTPError, dumps_or_none, sse_error_event
from pdproxy.pd.prefill_answer import chat_events, completion_events


def nested(levels: int) -> Any:
    """``levels`` arrays inside each other around 0 (``[[...[0]...]]``)."""
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


def test_what_orjson_writes_is_written_as_orjson_writes_it() -> None:
    for obj in ({"a": [1, 2.5, None, "é"]}, [], "x", nested(254), {"k": nested(253)}):
        assert dumps_or_none(obj) == orjson.dumps(obj)


@pytest.mark.parametrize("obj", [nested(255), {"k": nested(254)}, nested(1023)], ids=["255", "obj+254", "1023"])
def test_json_nested_past_what_orjson_writes_is_none_not_a_type_error(obj: Any) -> None:
    assert dumps_or_none(obj) is None


def test_what_orjson_read_past_its_write_limit_is_none() -> None:
    raw = b"[" * 300 + b"]" * 300
    assert dumps_or_none(orjson.loads(raw)) is None


@pytest.mark.parametrize("obj", [{1: "a"}, {"a": object()}, 1 << 64])
def test_anything_else_orjson_cannot_write_is_none_too(obj: Any) -> None:
    assert dumps_or_none(obj) is None


def test_a_usage_patch_of_a_deep_answer_relays_it_as_it_came() -> None:
    shallow = b'{"usage": {"prompt_tokens": 3}, "d": [[1]]}'
    patched = orjson.loads(patch_usage_bytes(shallow, 2))
    assert patched["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    deep = b'{"usage": {"prompt_tokens": 3}, "d": ' + b"[" * 300 + b"]" * 300 + b"}"
    assert patch_usage_bytes(deep, 2) is deep


def test_an_engines_error_too_deep_to_write_is_sent_in_pdproxys_words() -> None:
    said = orjson.dumps({"error": {"message": "boom", "code": 400}})
    assert sse_error_event(UpstreamHTTPError(400, said + b"\n")) == b"data: " + said + b"\n\n"   # compacted
    deep = b'{"error": {"message": "boom", "code": 400, "d": ' + b"[" * 300 + b"]" * 300 + b"}}"
    event = sse_error_event(UpstreamHTTPError(400, deep))
    assert event.startswith(b"data: {") and event.endswith(b"\n\n")
    assert orjson.loads(event[6:]) == UpstreamHTTPError(400, deep).body()


@pytest.mark.parametrize("build", [chat_events, completion_events])
def test_a_finished_prefill_answer_too_deep_to_write_has_no_events(build: Any) -> None:
    reply = {"id": "x", "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                                   "text": "hi", "finish_reason": "stop"}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    events = build(reply, True)
    assert events is not None and events[-1] == b"data: [DONE]\n\n" and len(events) >= 3
    reply["usage"]["deep"] = nested(300)
    assert build(reply, True) is None
    assert build(reply, False) is not None           # the deep usage is not sent without include_usage
