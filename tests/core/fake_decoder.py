"""A decoder that sends its status line at once and its JSON body only when the test says so.

vLLM and ``pdproxy sim`` send a non-streamed answer's status line together with its body; this engine (aiohttp, on
127.0.0.1, in a thread with its own loop) separates the two so a test can see what pdproxy does in between.
It answers ``/health``, ``/v1/models`` and an empty ``/metrics`` like an engine serving ``sim-model``, records the
completion bodies it receives, and holds each answer's body until :attr:`release` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import orjson
from aiohttp import web

from tests.support import free_port, wait_until

ANSWER = {"id": "cmpl-x", "object": "chat.completion", "created": 1, "model": "sim-model",
          "choices": [{"index": 0, "message": {"role": "assistant", "content": "done"}, "finish_reason": "stop"}],
          "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}}


class HeadersFirstDecoder:
    """See the module docstring.  ``headers_sent``: answers whose status line went out."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.received: list[dict[str, Any]] = []
        self.headers_sent = 0
        self.release = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.received.append(await request.json())
        body = orjson.dumps(ANSWER)
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.content_length = len(body)
        await resp.prepare(request)                   # the status line and headers go out now
        self.headers_sent += 1
        while not self.release.is_set():
            await asyncio.sleep(0.01)
        await resp.write(body)
        await resp.write_eof()
        return resp

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/health", lambda _r: web.Response(status=200))
        app.router.add_get("/metrics", lambda _r: web.Response(text=""))
        app.router.add_get("/v1/models", lambda _r: web.json_response(
            {"object": "list", "data": [{"id": "sim-model", "object": "model", "max_model_len": 4096}]}))
        app.router.add_post("/v1/chat/completions", self._complete)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        self._stop = asyncio.Event()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    @contextlib.contextmanager
    def running(self) -> Iterator[HeadersFirstDecoder]:
        """Serve for the ``with`` block (the thread is joined on exit)."""
        self._thread.start()
        wait_until(lambda: self._stop is not None, 10, 0.01, "fake decoder listening")
        try:
            yield self
        finally:
            self.release.set()
            assert self._loop is not None and self._stop is not None
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=10)
