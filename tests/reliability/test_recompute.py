"""vLLM-Ascend ``stop_reason: "recomputed"`` continuation: the request that continues, and the rewritten stream."""

from __future__ import annotations

import orjson
import pytest

from pdproxy.apis.recompute import Transcript, continuation_body, force_usage_bytes
from pdproxy.http import sse

pytestmark = pytest.mark.timeout(5)

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def ev(obj: dict) -> bytes:
    return sse.data_event(orjson.dumps(obj))


def test_chat_continuation_appends_assistant_text_and_keeps_everything_else() -> None:
    original = {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]}],
                "tools": TOOLS, "max_completion_tokens": 50, "max_tokens": 60, "min_tokens": 10, "stream": True,
                "request_id": "abc"}
    body = continuation_body(original, True, " Hello there", 12)
    assert body is not None
    assert body["messages"][:2] == original["messages"]  # multi-part content intact
    assert body["messages"][2] == {"role": "assistant", "content": " Hello there"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["tools"] == TOOLS
    assert (body["max_completion_tokens"], body["max_tokens"], body["min_tokens"]) == (38, 48, 0)
    assert "request_id" not in body
    assert original["messages"][-1]["role"] == "user"  # never mutated


def test_chat_continuing_a_final_assistant_message_extends_it() -> None:
    original = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}],
                "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 10}
    body = continuation_body(original, True, " upon", 1)
    assert body is not None and body["messages"][-1] == {"role": "assistant", "content": "Once upon"}
    assert len(body["messages"]) == 2


def test_completions_continuation_and_limits() -> None:
    assert continuation_body({"prompt": "a b", "max_tokens": 5}, False, " c", 1) == {"prompt": "a b c",
                                                                                     "max_tokens": 4}
    assert continuation_body({"prompt": ["x"], "max_tokens": 5}, False, "y", 1)["prompt"] == "xy"  # type: ignore
    assert continuation_body({"prompt": "a", "max_tokens": 5}, False, "b", 5) is None  # budget spent
    with pytest.raises(ValueError, match="token-id"):
        continuation_body({"prompt": [1, 2, 3], "max_tokens": 5}, False, "b", 1)
    unbounded = continuation_body({"messages": [{"role": "user", "content": "q"}]}, True, "t", 3)
    assert unbounded is not None and "max_tokens" not in unbounded


def test_transcript_counts_usage_and_rewrites_the_continuation() -> None:
    head = {"id": "chatcmpl-A", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    first = (ev({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
             + ev({**head, "choices": [{"index": 0, "delta": {"content": " one"}}]})
             + ev({**head, "choices": [{"index": 0, "delta": {"content": " two"}}]}))
    t = Transcript(chat=True)
    t.add(first)
    t.observe({**head, "choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}})
    t.cached_tokens = 4
    assert t.end_attempt() == 2 and t.text == " one two" and t.attempts == 2

    other = {"id": "chatcmpl-B", "object": "chat.completion.chunk", "created": 2, "model": "m"}
    block = (ev({**other, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
             + ev({**other, "choices": [{"index": 0, "delta": {"content": " three"}, "finish_reason": "length"}]})
             + ev({**other, "choices": [], "usage": {"prompt_tokens": 13, "completion_tokens": 1,
                                                       "total_tokens": 14}})
             + sse.DONE_EVENT)
    out, again = t.rewrite(block, keep_usage=True)
    assert not again
    events = [orjson.loads(e[6:]) for e in sse.split_events(out) if e != sse.DONE_EVENT]
    assert all(e["id"] == "chatcmpl-A" and e["created"] == 1 for e in events)
    assert not any("role" in c.get("delta", {}) for e in events for c in e["choices"])  # one role chunk in all
    assert events[-1]["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12,
                                   "prompt_tokens_details": {"cached_tokens": 4}}
    assert out.endswith(sse.DONE_EVENT)
    stripped, _ = t.rewrite(block, keep_usage=False)
    assert b'"usage"' not in stripped


def test_a_second_recompute_is_detected_and_withheld() -> None:
    t = Transcript(chat=False)
    t.end_attempt()
    block = (ev({"id": "x", "choices": [{"index": 0, "text": " a"}]})
             + ev({"id": "x", "choices": [{"index": 0, "text": "", "finish_reason": "stop",
                                           "stop_reason": "recomputed"}]})
             + sse.DONE_EVENT)
    out, again = t.rewrite(block, keep_usage=True)
    assert again and b"recomputed" not in out and b"[DONE]" not in out and b'" a"' in out


def test_force_usage_keeps_other_stream_options() -> None:
    raw = b'{"stream": true, "stream_options": {"continuous_usage_stats": true}}'
    forced = force_usage_bytes(raw, orjson.loads(raw))
    assert orjson.loads(forced)["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}


@pytest.mark.parametrize("chat", [True, False])
def test_compaction_of_a_long_stream_keeps_the_exact_text(chat: bool) -> None:
    """Past COMPACT_BYTES the stored blocks are read with a regular expression; the text must equal a JSON parse
    (escapes, quotes, multi-byte characters, a ``reasoning_content`` field that must not count)."""
    pieces = [' a"b', " \\ c", " 世界", "", " naïve\n", " end"]
    blocks = []
    for i in range(3000):
        piece = pieces[i % len(pieces)]
        choice = ({"index": 0, "delta": {"content": piece, "reasoning_content": "hmm"}} if chat
                  else {"index": 0, "text": piece})
        blocks.append(ev({"id": "x", "choices": [choice]}))
    t = Transcript(chat=chat)
    for i in range(0, len(blocks), 3):
        t.add(b"".join(blocks[i:i + 3]))
    expected = "".join(pieces[i % len(pieces)] for i in range(3000))
    assert t.text == expected
    assert t.content_events == sum(1 for i in range(3000) if pieces[i % len(pieces)])
