"""A vLLM stand-in engine for tests of what pdproxy does with an engine's answers (pdproxy/app/passthrough.py):
an HTTP/1.1 server on loopback in its own threads, serving both roles for pdproxy's probes — ``GET /health`` (200),
``GET /v1/models`` (one model, ``max_model_len`` 4096), 404 ``{"detail": "Not Found"}`` elsewhere — and handing every
``POST`` to the subclass's :meth:`StandInEngine.post`."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Self

import orjson

from tests.support import free_port

MODEL = "sim-model"
PREFILL_ANSWER = orjson.dumps({
    "id": "chatcmpl-p", "object": "chat.completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [[1]],
                           "remote_host": "127.0.0.1", "remote_port": 1}})
"""A prefiller's answer to a chat prefill leg, with NixlConnector's handle (one block) for the decode leg."""


class StandInHandler(BaseHTTPRequestHandler):
    """One connection's requests; :attr:`engine` is the :class:`StandInEngine` serving them."""

    protocol_version = "HTTP/1.1"
    engine: StandInEngine

    def log_message(self, *args: Any) -> None:
        pass

    def answer(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        """A JSON answer (``content-length`` framed) with ``headers`` besides; a client that left is ignored."""
        self.send_response(status)
        self.send_header("content-type", "application/json")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):   # the client left
            self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.answer(200, b"")
        elif self.path == "/v1/models":
            self.answer(200, orjson.dumps({"object": "list", "data": [
                {"id": self.engine.model, "object": "model", "owned_by": "vllm", "max_model_len": 4096}]}))
        else:
            self.answer(404, b'{"detail": "Not Found"}')

    def do_POST(self) -> None:
        self.engine.post(self, self.rfile.read(int(self.headers.get("content-length") or 0)))


class StandInEngine:
    """The engine: ``url`` (a port below the ephemeral range, :func:`tests.support.free_port`), :meth:`running`
    around its use; :meth:`post` answers each ``POST`` (``handler.path``, the raw ``body``) — by default
    ``{"ok": true}``.  :attr:`release` is set when it stops (a ``post`` waiting on it returns)."""

    def __init__(self, model: str = MODEL) -> None:
        self.model = model
        self.release = threading.Event()
        handler = type("Handler", (StandInHandler,), {"engine": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def post(self, handler: StandInHandler, body: bytes) -> None:
        handler.answer(200, b'{"ok": true}')

    @contextlib.contextmanager
    def running(self) -> Iterator[Self]:
        self.thread.start()
        try:
            yield self
        finally:
            self.release.set()
            self.server.shutdown()
            self.server.server_close()
