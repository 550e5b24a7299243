"""The relay's transform seam (pdproxy/apis/transform.py): every transform the relay can choose is a
``Transform``, and a chain runs each part's ``ending`` in order (the relay calls ``ending`` on the last block)."""

from __future__ import annotations

from pdproxy.apis import recompute
from pdproxy.apis.chat import Chain, ChatUsage, ContinueTranscript, RecordTranscript
from pdproxy.apis.streams import MessagesStream, ResponsesStream
from pdproxy.apis.transform import Transform
from pdproxy.timeline import RequestContext


class _Tag:
    trigger = b""
    recomputed = False

    def __init__(self, tag: bytes) -> None:
        self.tag = tag

    def feed(self, block: bytes, prev: bytes) -> bytes:
        return block + self.tag

    def ending(self, block: bytes, prev: bytes) -> bytes:
        return block + self.tag.upper()


def test_chain_runs_each_parts_feed_and_ending_in_order() -> None:
    chain = Chain([_Tag(b"a"), _Tag(b"b")])
    assert chain.feed(b"x", b"") == b"xab"
    assert chain.ending(b"x", b"") == b"xAB"


def test_every_relay_transform_is_a_transform() -> None:
    ctx = RequestContext("r", None, "chat")
    transcript = recompute.Transcript(True)
    transforms: list[Transform] = [ChatUsage(ctx, 3, False), RecordTranscript(transcript),
                                   ContinueTranscript(ctx, transcript, keep_usage=True),
                                   ResponsesStream(ctx, None), MessagesStream(ctx, None),
                                   Chain([ChatUsage(ctx, None, False), RecordTranscript(transcript)])]
    block = b'data: {"choices": []}\n\n'
    for t in transforms:
        assert t.ending(block, b"") == block, t
        assert t.recomputed is False
