"""The request log: one structured JSON line per completion request, written when it ends.

Fields (snake_case, stable; absent values are ``null``)::

    {"event": "request", "ts": 1755000000.123, "request_id": "<the id the client saw>",
     "client_request_id": "<X-Request-Id>", "api": "chat", "model": "m", "stream": true, "status": 200,
     "outcome": "ok", "rejection": null, "prefiller": "http://p0:9100", "decoder": "http://d0:9101", "dp_rank": 1,
     "prompt_tokens": 5120, "engine_prompt_tokens": 5120, "completion_tokens": 256, "cached_tokens": 4096,
     "predicted_cached_tokens": 4096, "prefix_mode": "precise", "events": 258,
     "admission_wait_s": 0.0001, "prefill_s": 0.41, "pd_gap_s": 0.0002, "decode_first_token_s": 0.05,
     "decode_s": 5.1, "ttft_s": 0.46, "e2e_s": 5.56, "error": null, "pid": 4242}

``request_id`` is the id the client saw (the response's ``id`` embeds it, ``chatcmpl-<request_id>``; it is the
``X-Request-Id`` answer header when the client sent none, else ``<client's id>-<16 hex digits>``); a stream
whose decoder was lost with ``stream_continuation`` on (docs/stream-continuation.md) adds ``continued_as`` (the
engine-side ids of its later legs, in order: those the engines' own logs name; empty when the loss was not
continued) and ``lost_decoders`` (lost, or preempted with vLLM-Ascend's ``stop_reason "recomputed"``), and its
``decoder`` is the last one.  ``prompt_tokens`` is the proxy's count (admission; exact when prefix routing had the
token ids, else possibly an estimate: docs/limits.md), ``engine_prompt_tokens`` the prefiller's (its
``usage.prompt_tokens``; null without a prefill leg);
``cached_tokens`` the prefiller's prefix-cache hits; ``predicted_cached_tokens`` what prefix routing expected
there and ``prefix_mode`` from where (``precise``: the engine's KV events, ``approximate``: pdproxy's record of
token keys, ``text``: of text keys; both null when prefix routing is off or the request skipped the prefiller).  The
prompt text is never logged unless ``log_prompts`` is set (then ``prompt`` or ``messages`` is added as sent).
``model`` and ``error`` carry client input (an unknown model's name, a field vLLM refused): cut to
:data:`~pdproxy.timeline.MODEL_SHOWN_MAX` and :data:`~pdproxy.timeline.TEXT_SHOWN_MAX` characters
(:func:`~pdproxy.timeline.clip`), so a line stays kilobytes whatever the client sends.
Times are seconds (``ts`` wall clock, the rest durations from :meth:`Timeline.phases`).

Where lines go (``request_log_path``): unset → the ``pdproxy.requests`` logger at INFO (the message is the
JSON object; when the process's own stderr handler is all that would see the record — no handler or filter added
by an embedding program — the line goes straight to that handler, formatted as it formats records:
:func:`pdproxy.ops.logs.sole_sink`); ``-`` → stdout, one bare JSON line each; a path → appended to that file,
one line each.  ``request_log: false`` turns the log off.  A file or stdout is written through a
:class:`pdproxy.ops.linesink.LineSink`, as the logger's handler is (:mod:`pdproxy.ops.logs`): a file at once,
stdout by a writer thread, so a reader that falls behind makes lines wait in ``log_buffer_bytes``, then drops
them with a ``{"event": "log_lines_dropped", "dropped": n, "ts": ...}`` line once it has room — never the event
loop; a log that cannot be written (a full disk, a closed pipe) is said once on the ``pdproxy`` logger.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import orjson

from pdproxy.apis.request import ProxyRequest
from pdproxy.ops.linesink import LineSink
from pdproxy.ops.logs import sole_sink
from pdproxy.settings import Settings
from pdproxy.timeline import MODEL_SHOWN_MAX, TEXT_SHOWN_MAX, RequestContext, clip

LOGGER_NAME = "pdproxy.requests"


def request_record(ctx: RequestContext, req: ProxyRequest | None, *, rejection: tuple[str, str] | None = None,
                   log_prompts: bool = False) -> dict[str, Any]:
    """The log record of one finished request as a dict (see module docstring)."""
    record: dict[str, Any] = {
        "event": "request", "ts": round(time.time(), 3), "request_id": ctx.client_visible_id,
        "client_request_id": ctx.client_request_id, "api": ctx.api_label, "model": clip(ctx.model, MODEL_SHOWN_MAX),
        "stream": req.stream if req is not None else None, "status": ctx.status, "outcome": ctx.outcome,
        "rejection": ":".join(x for x in rejection if x) if rejection else None,
        "prefiller": ctx.prefiller, "decoder": ctx.decoder, "dp_rank": ctx.decoder_dp_rank,
        "prompt_tokens": ctx.prompt_tokens, "engine_prompt_tokens": ctx.engine_prompt_tokens,
        "completion_tokens": ctx.completion_tokens,
        "cached_tokens": ctx.cached_tokens, "predicted_cached_tokens": ctx.predicted_cached_tokens,
        "prefix_mode": ctx.prefix_mode, "events": ctx.events,
    }
    if ctx.lost_decoders:      # a stream that lost (or was preempted by) a decoder: its later legs' ids, the decoders
        record["continued_as"] = list(ctx.continued_as)
        record["lost_decoders"] = list(ctx.lost_decoders)
    for key, value in ctx.timeline.phases().items():
        record[key] = None if value is None else round(value, 6)
    record["error"] = clip(ctx.error, TEXT_SHOWN_MAX)
    record["pid"] = os.getpid()
    if log_prompts and req is not None:
        key = req.prompt_param
        record[key] = req.body.get(key)
    return record


class RequestLog:
    """Writes request records where ``settings`` says (see module docstring).

    Use as a context manager (the app lifespan does): a log file is opened on enter and closed on exit.
    ``emit`` never raises for I/O problems of the log itself (they go to the ``pdproxy`` logger once).
    """

    def __init__(self, settings: Settings) -> None:
        self.enabled = settings.request_log
        self.path = settings.request_log_path
        self.log_prompts = settings.log_prompts
        self.max_buffer_bytes = settings.log_buffer_bytes
        self._logger = logging.getLogger(LOGGER_NAME)
        self._fd: int | None = None
        self._sink: LineSink | None = None
        self._closed = False

    def __enter__(self) -> RequestLog:
        if self.enabled and self.path:
            if self.path == "-":
                try:
                    sys.stdout.flush()
                    fd = sys.stdout.fileno()
                except (AttributeError, OSError, ValueError):  # a stdout with no descriptor (a test harness's)
                    return self                                 # lines go to the pdproxy.requests logger
            else:
                fd = self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self._sink = LineSink(fd, max_buffer_bytes=self.max_buffer_bytes, dropped_line=_dropped_line,
                                  on_error=self._unusable)
        return self

    def __exit__(self, *exc: object) -> None:
        drained = True
        if self._sink is not None:
            drained = self._sink.close()
            self._sink = None
        if self._fd is not None and drained:   # a writer thread still blocked on it keeps it (process exit frees it)
            os.close(self._fd)
        self._fd = None
        self._closed = True

    def _append_late(self, path: str, data: bytes) -> None:
        """A request that ended after the log was closed (a forced shutdown: the streams a second Ctrl-C cut end
        once the lifespan is over): its line still goes to the file, not to stderr."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError as exc:
            self._unusable(exc)

    def _unusable(self, exc: OSError) -> None:
        """The sink's first write error (its writer thread, or a file write): said once."""
        logging.getLogger("pdproxy").error("request log %s unusable: %s", self.path, exc)

    def emit(self, ctx: RequestContext, req: ProxyRequest | None, rejection: tuple[str, str] | None = None) -> None:
        """Write the line for one finished request (never waits on the reader: module docstring)."""
        sink = self._sink
        if not self.enabled or (sink is None and not self._logger.isEnabledFor(logging.INFO)):
            return
        line = orjson.dumps(request_record(ctx, req, rejection=rejection, log_prompts=self.log_prompts))
        if sink is not None:
            sink.write(line + b"\n")
            return
        if self._closed and self.path and self.path != "-":
            self._append_late(self.path, line + b"\n")
            return
        handler = sole_sink(self._logger)   # the line as the root handler writes it, without a LogRecord
        if handler is None or not handler.write_json_line(LOGGER_NAME, logging.INFO, line):
            self._logger.info(line.decode(), extra={"raw_json": True})  # JSON log format: as is


def _dropped_line(n: int) -> bytes:
    return orjson.dumps({"event": "log_lines_dropped", "ts": round(time.time(), 3), "dropped": n}) + b"\n"
