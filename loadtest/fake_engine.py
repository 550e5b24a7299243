"""A minimal vLLM-shaped engine on a raw asyncio protocol (uvloop + httptools), for overhead benchmarks.

Why not ``pdproxy sim``: the benchmark must measure the proxy, so the engines have to cost far less CPU per
event than any proxy.  This engine does no scheduling, tokenizing or validation: it
answers the shapes a PD proxy relays, with scripted timing, and costs a few µs per event (``bench.py`` reports
its CPU next to the proxy's).

Wire behaviour (shapes follow vLLM's OpenAI server: the handle of ``docs/pd-protocol.md`` §1, the SSE stream of
``vllm/entrypoints/openai/completion/serving.py`` and ``chat_completion/serving.py``):

- ``POST /v1/completions`` and ``/v1/chat/completions``:
  - ``stream`` false: one JSON body after ``prefill_s`` seconds; when the body carries
    ``kv_transfer_params.do_remote_decode`` the answer carries NIXL-shaped ``kv_transfer_params``
    (``remote_block_ids``, one id per 16 prompt tokens as NixlConnector lists them, … ``remote_request_id``) and
    ``usage.prompt_tokens_details.cached_tokens``;
  - ``stream`` true: chunked SSE, first event after ``ttft_s``, then one event every ``itl_s`` seconds
    (``itl_s`` 0 = full speed: bursts of ``burst`` events per loop turn), ``max_completion_tokens`` or
    ``max_tokens`` events (default 16), a usage chunk when ``stream_options.include_usage``, then
    ``data: [DONE]``; with ``return_token_ids`` every chunk carries ``token_ids`` and the first one the prompt's
    8 ids (chat: a role chunk first, with top-level ``prompt_token_ids``), as vLLM sends them;
- ``GET /health``, ``/v1/models`` (``max_model_len``), ``/metrics`` (``vllm:cache_config_info``);
- ``POST /bench/config`` ``{"itl_s", "ttft_s", "prefill_s", "burst", "step_s"}`` changes timing for later
  requests (``step_s``: paced events fall on a grid of that step, like an engine's scheduler steps);
  ``GET /bench/stats`` returns counters (``requests``, ``stream_events``, ``active_streams``,
  ``kv_prefills`` (prefill legs answered with kv_transfer_params), ``kv_decodes`` (decode legs that carried them),
  ``aborted``).

Run: ``python -m loadtest.fake_engine --port 9100 [--itl-s 0.02]``.  A closed client connection stops its
stream (like vLLM's abort on disconnect).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import math
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import httptools
import orjson

MODEL = "bench-model"
_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
             b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")
_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Timing:
    """Scripted engine timing (seconds) and full-speed burst size (events per loop turn)."""

    itl_s: float = 0.02
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    burst: int = 8
    step_s: float = 0.0
    """Engine step grid (seconds): paced events fall on multiples of it, so streams due in the same step are
    written in the same loop turn, as a real engine emits one token per running sequence per step (0: no grid)."""


@dataclass(slots=True)
class Stats:
    """Counters served on ``GET /bench/stats``."""

    requests: int = 0
    stream_events: int = 0
    active_streams: int = 0
    kv_prefills: int = 0
    kv_decodes: int = 0
    aborted: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _json_response(status: int, payload: Any) -> bytes:
    body = orjson.dumps(payload)
    return b"HTTP/1.1 %d OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
        status, len(body), body)


class Engine:
    """Shared state of one engine process: timing, counters, the loop."""

    def __init__(self, timing: Timing) -> None:
        self.timing = timing
        self.stats = Stats()
        self.loop = asyncio.get_running_loop()
        self.created = int(time.time())

    def completion_reply(self, path: bytes, body: dict[str, Any]) -> bytes:
        """The non-streaming answer (a prefill leg, or a plain non-stream request)."""
        n = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        prompt_tokens = max(1, len(orjson.dumps(body.get("messages") or body.get("prompt") or "")) // 4)
        rid = uuid.uuid4().hex
        chat = path.endswith(b"/chat/completions")
        choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": " tok" * n},
                                   "logprobs": None, "finish_reason": "length", "stop_reason": None}
                                  if chat else {"index": 0, "text": " tok" * n, "logprobs": None,
                                                "finish_reason": "length", "stop_reason": None})
        out: dict[str, Any] = {
            "id": ("chatcmpl-" if chat else "cmpl-") + rid, "object": "chat.completion" if chat else "text_completion",
            "created": self.created, "model": MODEL, "choices": [choice],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n,
                      "prompt_tokens_details": {"cached_tokens": 0}}}
        kv = body.get("kv_transfer_params")
        if isinstance(kv, dict) and kv.get("do_remote_decode"):
            self.stats.kv_prefills += 1
            out["kv_transfer_params"] = {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": block_ids(prompt_tokens),
                "remote_engine_id": "bench-engine_dp0", "remote_request_id": out["id"] + "-0-1a2b3c4d",
                "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1, "remote_num_tokens": prompt_tokens}
        return _json_response(200, out)


BLOCK_SIZE = 16
"""Tokens per KV block, as ``/metrics`` declares (``vllm:cache_config_info``)."""


@functools.lru_cache(maxsize=256)
def block_ids(prompt_tokens: int) -> orjson.Fragment:
    """``remote_block_ids`` as NixlConnector lists them (``nixl/pull_scheduler.py::request_finished``): one list
    per KV cache group holding one id per ``BLOCK_SIZE`` prompt tokens — ~4,000 six-digit ids for a 64K-token
    prompt, which a proxy reads and forwards on every request (encoded once per size: the engine stays cheap)."""
    n = max(1, -(-prompt_tokens // BLOCK_SIZE))
    return orjson.Fragment(orjson.dumps([list(range(100_000, 100_000 + n))]))


class Stream:
    """One SSE response being written: prebuilt event bytes, paced by loop timers."""

    __slots__ = ("done", "engine", "event", "first", "handle", "include_usage", "last", "left", "proto", "usage")

    def __init__(self, engine: Engine, proto: EngineProtocol, path: bytes, body: dict[str, Any]) -> None:
        self.engine = engine
        self.proto = proto
        self.left = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        chat = path.endswith(b"/chat/completions")
        rid = (b"chatcmpl-" if chat else b"cmpl-") + uuid.uuid4().hex.encode()
        head = b'{"id":"%s","object":"%s","created":%d,"model":"%s","choices":[{"index":0,' % (
            rid, b"chat.completion.chunk" if chat else b"text_completion", engine.created, MODEL.encode())
        ids = body.get("return_token_ids") is True
        self.first = b""        # with ids: chat's role chunk (before the first event), or completions' first event
        if chat:
            tid = b',"token_ids":[1000]}]}\n\n' if ids else b"}]}\n\n"
            self.event = _chunk(b"data: " + head + b'"delta":{"content":" tok"},"logprobs":null,'
                                                   b'"finish_reason":null' + tid)
            self.last = _chunk(b"data: " + head + b'"delta":{"content":" tok"},"logprobs":null,'
                                                  b'"finish_reason":"length","stop_reason":null' + tid)
            if ids:
                self.first = _chunk(b"data: " + head + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
                                    b'"finish_reason":null}],"prompt_token_ids":[1,2,3,4,5,6,7,8],'
                                    b'"prompt_text":null}\n\n')
        else:
            tail = b'"stop_reason":null,"prompt_token_ids":null,"token_ids":%s}]}\n\n' % (b"[1000]" if ids else b"null")
            self.event = _chunk(b"data: " + head + b'"text":" tok","logprobs":null,"finish_reason":null,' + tail)
            self.last = _chunk(b"data: " + head + b'"text":" tok","logprobs":null,"finish_reason":"length",' + tail)
            if ids:
                self.first = _chunk(b"data: " + head + b'"text":" tok","logprobs":null,"finish_reason":null,'
                                    + tail.replace(b'"prompt_token_ids":null', b'"prompt_token_ids":[1,2,3,4,5,6,7,8]'))
        opts = body.get("stream_options")
        self.include_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        n = self.left
        self.usage = _chunk(b'data: {"id":"%s","object":"%s","created":%d,"model":"%s","choices":[],'
                            b'"usage":{"prompt_tokens":8,"total_tokens":%d,"completion_tokens":%d}}\n\n' % (
                                rid, b"chat.completion.chunk" if chat else b"text_completion", engine.created,
                                MODEL.encode(), 8 + n, n))
        self.handle: asyncio.TimerHandle | asyncio.Handle | None = None
        self.done = False

    def start(self) -> None:
        """Write the SSE response head, then the first event now or after ``ttft_s``."""
        t = self.engine.timing
        self.proto.transport.write(_SSE_HEAD)
        self.engine.stats.active_streams += 1
        if t.ttft_s > 0:
            self.handle = self.engine.loop.call_later(t.ttft_s, self.tick)
        else:
            self.tick()

    def tick(self) -> None:
        """Write the next event (or a burst at full speed); the last one also writes usage, ``[DONE]`` and the end."""
        if self.done:
            return
        t = self.engine.timing
        n = min(self.left, t.burst) if t.itl_s <= 0 else 1
        self.left -= n
        self.engine.stats.stream_events += n
        data = self.event * (n - 1) + (self.last if self.left == 0 else self.event)
        if self.first:      # the stream's first write, with ids: chat's role chunk / completions' first chunk
            if self.first.find(b'"role"') >= 0:
                data = self.first + data
            elif data.startswith(self.event):
                data = self.first + data[len(self.event):]
            self.first = b""
        if self.left == 0:
            data += (self.usage if self.include_usage else b"") + _chunk(_DONE) + b"0\r\n\r\n"
            self.proto.transport.write(data)
            self.finish()
            self.proto.stream_done()
            return
        self.proto.transport.write(data)
        if t.itl_s > 0:
            loop = self.engine.loop
            due = loop.time() + t.itl_s
            if t.step_s > 0:
                due = math.ceil(due / t.step_s) * t.step_s
            self.handle = loop.call_at(due, self.tick)
        else:
            self.handle = self.engine.loop.call_soon(self.tick)

    def finish(self, aborted: bool = False) -> None:
        """Stop the stream (idempotent); ``aborted``: the client went away first."""
        if self.done:
            return
        self.done = True
        self.engine.stats.active_streams -= 1
        if aborted:
            self.engine.stats.aborted += 1
        if self.handle is not None:
            self.handle.cancel()


class EngineProtocol(asyncio.Protocol):
    """One client connection: HTTP/1.1 keep-alive, one request at a time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.stream: Stream | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.stream is not None:
            self.stream.finish(aborted=True)
            self.stream = None

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        path, raw = self.url.split(b"?", 1)[0], b"".join(self.body)
        self.url, self.body = b"", []
        method = self.parser.get_method()
        try:
            self.dispatch(method, path, raw)
        except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError) as exc:
            self.transport.write(_json_response(400, {"error": {"message": str(exc), "type": "BadRequestError",
                                                                "param": None, "code": 400}}))

    def stream_done(self) -> None:
        self.stream = None

    def dispatch(self, method: bytes, path: bytes, raw: bytes) -> None:
        """Answer one complete request (see the module docstring for the routes)."""
        eng = self.engine
        if method == b"POST" and path.endswith(b"/completions"):
            eng.stats.requests += 1
            body = orjson.loads(raw)
            kv = body.get("kv_transfer_params")
            if body.get("stream"):
                if isinstance(kv, dict) and kv.get("do_remote_prefill"):
                    eng.stats.kv_decodes += 1
                self.stream = Stream(eng, self, path, body)
                self.stream.start()
                return
            reply = eng.completion_reply(path, body)
            if eng.timing.prefill_s > 0:
                eng.loop.call_later(eng.timing.prefill_s, self._write_if_open, reply)
            else:
                self.transport.write(reply)
        elif path == b"/health":
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        elif path == b"/v1/models":
            self.transport.write(_json_response(200, {"object": "list", "data": [
                {"id": MODEL, "object": "model", "owned_by": "vllm", "root": MODEL, "max_model_len": 1_000_000}]}))
        elif path == b"/metrics":
            text = b'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000000"} 1.0\n'
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                                 % (len(text), text))
        elif path == b"/bench/config" and method == b"POST":
            for k, v in orjson.loads(raw).items():
                setattr(eng.timing, k, type(getattr(eng.timing, k))(v))
            self.transport.write(_json_response(200, asdict(eng.timing)))
        elif path == b"/bench/stats":
            self.transport.write(_json_response(200, asdict(eng.stats)))
        else:
            self.transport.write(_json_response(404, {"error": {"message": "Not Found", "type": "NotFoundError",
                                                                "param": None, "code": 404}}))

    def _write_if_open(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)


async def serve(host: str, port: int, timing: Timing) -> None:
    """Serve until cancelled."""
    engine = Engine(timing)
    server = await asyncio.get_running_loop().create_server(lambda: EngineProtocol(engine), host, port,
                                                            backlog=4096, reuse_address=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    """Command line: ``python -m loadtest.fake_engine --port N [--itl-s S] [--ttft-s S] [--prefill-s S]``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--itl-s", type=float, default=0.02)
    p.add_argument("--ttft-s", type=float, default=0.0)
    p.add_argument("--prefill-s", type=float, default=0.0)
    args = p.parse_args()
    import uvloop

    uvloop.run(serve(args.host, args.port, Timing(itl_s=args.itl_s, ttft_s=args.ttft_s, prefill_s=args.prefill_s)))


if __name__ == "__main__":
    main()
