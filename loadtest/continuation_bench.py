"""Micro-benchmark: CPU per relayed event of the relay's splice (pdproxy/pd/relay.py) for a plain stream and for a
continuable one (docs/stream-continuation.md: blocks kept, ids rewritten to ``null``), in this process.

Run: ``python -m loadtest.continuation_bench [--events 200000] [--repeat 5]``.  Prints one JSON document: ns per
event (best of ``repeat`` runs) of ``_Splice.data`` on vLLM-shaped chat chunks, one event per block as vLLM writes
them, for

- ``plain``: the chunks as a stream without continuation gets them (``"token_ids":null``; the chat usage
  transform, whose trigger does not match a token chunk);
- ``plain_with_off_setting``: the same, with the relay built as ``stream_continuation`` off builds it (what
  ``make bench`` measures for the default);
- ``continuable``: the chunks with ``token_ids`` (what the decoder sends when asked for ``return_token_ids``)
  through :class:`~pdproxy.pd.continuation.RecordIds` + the usage transform (what the client gets has the ids
  rewritten to ``null``).

The client transport is a stub that drops the bytes (a real socket write costs the same in both cases), so the
figures are the splice's own cost; ``overhead_pct`` compares ``continuable`` with ``plain``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

from pdproxy.apis.request import Api, parse_request
from pdproxy.pd.continuation import Resume
from pdproxy.pd.relay import StreamRelay, _Splice
from pdproxy.timeline import RequestContext


class _Conn:
    flow: Any = None
    paused = False

    def body_writer(self) -> Callable[[bytes], None]:
        return _sink


def _sink(data: bytes) -> None:
    """The client transport's write, dropped."""


class _Out:
    def __init__(self) -> None:
        self.conn = _Conn()
        self.ended = False
        self.done_sent = False
        self.api_stream = None


class _Resp:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop


def chunk(i: int, ids: bool) -> bytes:
    """One vLLM chat chunk of one token (compact JSON, as vLLM writes it)."""
    choice = {"index": 0, "delta": {"content": " token"}, "logprobs": None, "finish_reason": None,
              "token_ids": [1000 + i % 5000] if ids else None}
    return b"data: " + orjson.dumps({"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk",
                                     "created": 1765000000, "model": "Qwen/Qwen3-0.6B", "choices": [choice]}) + b"\n\n"


def run(loop: asyncio.AbstractEventLoop, events: int, continuable: bool, resume_param: bool) -> float:
    """ns per event of ``_Splice.data`` over ``events`` one-event blocks."""
    req = parse_request(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                      "stream": True}), Api.CHAT)
    resume = Resume.of(req, True) if continuable else None
    ctx = RequestContext(request_id="bench", client_request_id=None, api_label="chat")
    relay = StreamRelay(_Resp(loop), _Out(), ctx, cached_tokens=None, first_event_timeout_s=1.0,  # type: ignore[arg-type]
                        resume=resume, lost_when=(20.0, 2.0) if resume_param else None)
    splice = _Splice(relay, relay.transforms(), b"", time.monotonic())
    blocks = [chunk(i, continuable) for i in range(1000)]
    data = splice.data
    gc.collect()
    start = time.process_time_ns()
    for k in range(events):
        data(blocks[k % 1000])
        if resume is not None and k % 1000 == 999:
            resume.blocks.clear()       # a stream holds its own blocks; keep memory flat across streams
    return (time.process_time_ns() - start) / events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.continuation_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    loop = asyncio.new_event_loop()
    try:
        best: dict[str, float] = {}
        for _ in range(args.repeat):
            for name, cont, param in (("plain", False, False), ("plain_with_off_setting", False, True),
                                      ("continuable", True, True)):
                ns = run(loop, args.events, cont, param)
                best[name] = min(best.get(name, ns), ns)
    finally:
        loop.close()
    result = {"ns_per_event": {k: round(v, 1) for k, v in best.items()},
              "overhead_pct": round(100 * (best["continuable"] / best["plain"] - 1), 1),
              "events": args.events, "repeat": args.repeat, "python": sys.version.split()[0]}
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
