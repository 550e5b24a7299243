"""The two completion routes of the simulator (``/v1/completions``, ``/v1/chat/completions``).

Flow per request: validate (vLLM's 400s; a rejected decoder request releases its prefiller pin,
reference §1.5). Then build an :class:`EngineRequest`, submit it to the rank, and answer:

* streaming: 200 ``text/event-stream`` headers at once, as vLLM's ``StreamingResponse`` does (seed 000:
  "200 OK but nothing happens"). Then one SSE event per engine wake-up, carrying every new token. A failed
  KV pull becomes an error event + ``[DONE]``;
* non-streaming: one JSON body when the request finishes. A failed KV pull becomes HTTP 500.

Client disconnect cancels the handler (aiohttp ``handler_cancellation``), which aborts the engine request and
frees its blocks. Output sizes: ``max_tokens`` given → exactly that many tokens, ``finish_reason "length"``.
Without it, completions generate ``min(--output-tokens, room)`` tokens ("length", vLLM's default cap of 16).
Chat generates ``--output-tokens`` and finishes ``"stop"``, like a model's EOS. Tool calls finish
``"tool_calls"``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from pdproxy.sim import connector
from pdproxy.sim.faults import Fault, slice_event
from pdproxy.sim.protocol import Api, ParsedRequest, SimHTTPError, kv_load_failed_body, parse_request
from pdproxy.sim.responses import DONE, ResponseWriter
from pdproxy.sim.scheduler import EngineRequest

if TYPE_CHECKING:
    from pdproxy.sim.runner import RankEngine
    from pdproxy.sim.server import Listener, SimServer


class _Wake:
    """Listener callback: sets an event the handler awaits."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __call__(self, _req: EngineRequest) -> None:
        self.event.set()

    async def wait(self) -> None:
        """Wait until the listener fires, then re-arm."""
        await self.event.wait()
        self.event.clear()


def abort_transport(request: web.Request) -> None:
    """Reset the TCP connection (SO_LINGER 0 + abort → RST)."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    transport.abort()


async def _forever() -> None:
    await asyncio.Event().wait()


async def pre_response_fault(fault: Fault, request: web.Request) -> web.StreamResponse | None:
    """Apply a fault that acts before the engine sees the request; None when the fault acts later."""
    kind = fault.kind
    if kind == "refuse":
        if request.transport is not None:
            request.transport.close()
        await _forever()
    if kind == "hang":
        await _forever()
    if kind == "status":
        status = int(fault.params.get("status", 503))
        body = fault.params.get("body")
        headers = {"Retry-After": str(fault.params["retry_after"])} if "retry_after" in fault.params else {}
        if body is None or isinstance(body, (dict, list)):
            payload = body if body is not None else {"error": {"message": "Service Unavailable (sim fault)",
                                                               "type": "ServiceUnavailableError",
                                                               "param": None, "code": status}}
            return web.json_response(payload, status=status, headers=headers)
        return web.Response(status=status, text=str(body), headers=headers)
    if kind == "headers_then_stall":
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await _forever()
    return None


class _SSE:
    """Writes SSE events, applying stream faults (slice, reset/close after k events, slow)."""

    def __init__(self, resp: web.StreamResponse, request: web.Request, fault: Fault | None) -> None:
        self.resp = resp
        self.request = request
        self.events = 0
        self.mode = fault.params.get("mode", "byte") if fault and fault.kind == "slice" else None
        self.limit = int(fault.params.get("events", 1)) if fault and fault.kind in (
            "reset_after_events", "close_without_done") else None
        self.reset = bool(fault and fault.kind == "reset_after_events")
        self.stopped = False

    async def send(self, event: bytes) -> None:
        """Write one SSE ``event`` (bytes), sliced if the fault says so; dropped once stopped.  Raises
        ``ConnectionResetError`` after the connection is reset by a ``reset_after_events`` fault."""
        if self.stopped or not event:
            return
        if self.mode is None:
            await self.resp.write(event)
        else:
            for piece in slice_event(event, self.mode):
                await self.resp.write(piece)
                await asyncio.sleep(0)
        self.events += 1
        if self.limit is not None and self.events >= self.limit:
            self.stopped = True
            if self.reset:
                abort_transport(self.request)
                raise ConnectionResetError("sim fault: reset_after_events")

    async def done(self) -> None:
        """Write ``data: [DONE]`` unless a ``close_without_done`` fault stopped the stream."""
        if self.limit is not None and self.stopped and not self.reset:
            return
        await self.send(DONE)


def _sizes(parsed: ParsedRequest, writer: ResponseWriter, output_tokens: int, max_model_len: int,
           fault: Fault | None) -> tuple[int, int | None]:
    room = max(max_model_len - len(parsed.prompt_token_ids), 1)
    eos: int | None = None
    if parsed.max_tokens is not None:
        max_tokens = parsed.max_tokens
    elif parsed.api == "completions":
        max_tokens = min(output_tokens, room)
    else:
        max_tokens, eos = room, min(output_tokens, room)
    if writer.natural_length is not None:
        eos = writer.natural_length
    if fault is not None and fault.kind == "no_kv_params":
        eos = 1
    if eos is not None:
        eos = max(eos, parsed.min_tokens)
    return max_tokens, eos


def notify_rejected(server: SimServer, rank: RankEngine, body: Any) -> None:
    """Tell the prefiller to free its pinned blocks when this decoder answers a ``do_remote_prefill`` request
    with an error before pulling (validation 400/404, an injected ``status`` fault).

    ``body`` is the parsed request body (anything else is ignored). The release runs as a side task of
    ``rank``; no-op on a prefill-only engine or without usable ``kv_transfer_params``. Protocol source:
    vLLM >= 0.26 ``generate/base/serving.py::_with_kv_transfer_rejection_cleanup`` calls
    ``notify_kv_transfer_request_rejected`` for every ErrorResponse (PR #41269; reference §1.5).
    """
    if server.config.role == "prefill" or not isinstance(body, dict):
        return
    source = connector.remote_prefill_source(body.get("kv_transfer_params"))
    if source is not None:
        rank.spawn(connector.release(server.session(), source))


async def handle_completion(server: SimServer, listener: Listener, request: web.Request, api: Api,
                            raw: bytes, body: Any, rank: RankEngine, fault: Fault | None) -> web.StreamResponse:
    """Validate, run on ``rank`` and answer one completion request (see the module docstring)."""
    cfg = server.config
    try:
        parsed = parse_request(body, api, request.headers, cfg, server.tokenizer)
    except SimHTTPError as exc:
        notify_rejected(server, rank, body)
        return web.Response(status=exc.status_code, body=exc.body(), content_type="application/json")
    params = parsed.kv_transfer_params
    remote = connector.remote_prefill_source(params) if cfg.role in ("decode", "both") else None
    pin = connector.wants_remote_decode(params) and cfg.role in ("prefill", "both")
    writer = ResponseWriter(parsed, cfg.served_model_name, int(time.time()), server.next_word_offset(),
                            server.fingerprint)
    max_tokens, eos = _sizes(parsed, writer, cfg.output_tokens, cfg.max_model_len, fault)
    wake = _Wake()
    ereq = EngineRequest(connector.internal_request_id(parsed.response_id, api), parsed.prompt_token_ids,
                         max_tokens, asyncio.get_running_loop().time(), eos_after=eos, remote_prefill=remote,
                         pin_on_finish=pin, listener=wake)
    headers = {"X-Request-Id": parsed.base_id}
    recompute_after = int(fault.params.get("tokens", fault.params.get("events", 1))) if (
        fault is not None and fault.kind == "recomputed") else None
    slow = (float(fault.params.get("factor", 10.0)), float(fault.params.get("min_gap_s", 0.005))) if (
        fault is not None and fault.kind == "slow") else None
    rank.submit(ereq)
    try:
        if parsed.stream:
            return await _stream(server, request, rank, parsed, writer, ereq, wake, headers, fault,
                                 recompute_after, slow)
        return await _unary(server, listener, rank, parsed, writer, ereq, wake, headers, recompute_after, slow)
    finally:
        if not ereq.finished:
            rank.abort(ereq)


async def _stretch(slow: tuple[float, float] | None, waited_s: float) -> None:
    if slow is not None:
        factor, min_gap = slow
        await asyncio.sleep(max(waited_s, min_gap) * max(factor - 1.0, 0.0))


async def _stream(server: SimServer, request: web.Request, rank: RankEngine, parsed: ParsedRequest,
                  writer: ResponseWriter, ereq: EngineRequest, wake: _Wake, headers: dict[str, str],
                  fault: Fault | None, recompute_after: int | None,
                  slow: tuple[float, float] | None) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={**headers, "Content-Type": "text/event-stream; charset=utf-8",
                                                   "Cache-Control": "no-cache"})
    await resp.prepare(request)
    sse = _SSE(resp, request, fault)
    rank.active_streams += 1
    loop = asyncio.get_running_loop()
    try:
        role_sent = False
        sent = 0
        stop_reason: Any = None
        while not sse.stopped:
            started = loop.time()
            await wake.wait()
            waited_s = loop.time() - started
            if ereq.kv_failed:
                await sse.send(writer.error_event("Internal server error", "InternalServerError", 500))
                break
            n = ereq.num_output_tokens
            finish = ereq.finish_reason if ereq.finished else None
            stop_reason = ereq.stop_reason
            if recompute_after is not None and n >= recompute_after:
                n, finish, stop_reason = recompute_after, "stop", "recomputed"
                rank.abort(ereq)
            if (n > sent or finish is not None) and not role_sent:
                await sse.send(writer.role_event())  # vLLM sends it with the first output
                role_sent = True
            if n > sent or finish is not None:
                usage = writer.usage(len(parsed.prompt_token_ids), n, ereq.num_cached_tokens, stream=True) if (
                    parsed.continuous_usage) else None
                if slow is not None:  # one token per event, each gap stretched
                    per_token_s = waited_s / max(n - sent, 1)
                    while n - sent > 1:
                        await _stretch(slow, per_token_s)
                        await sse.send(writer.token_event(sent, sent + 1, None, None, usage))
                        sent += 1
                    await _stretch(slow, per_token_s)
                if finish is not None and stop_reason == "recomputed" and n > sent:
                    await sse.send(writer.token_event(sent, n, None, None, usage))
                    sent = n
                last = finish is not None and not parsed.include_usage
                await sse.send(writer.token_event(sent, n, finish, stop_reason, usage, last))
                sent = n
            if finish is not None:
                if parsed.include_usage:
                    await sse.send(writer.usage_event(writer.usage(len(parsed.prompt_token_ids), sent,
                                                                   ereq.num_cached_tokens, stream=True)))
                break
        await sse.done()
        if not sse.reset:
            await resp.write_eof()
    except ConnectionResetError:
        pass  # the client went away (or a reset fault fired); the caller aborts the engine request
    finally:
        rank.active_streams -= 1
    return resp


async def _unary(server: SimServer, listener: Listener, rank: RankEngine, parsed: ParsedRequest,
                 writer: ResponseWriter, ereq: EngineRequest, wake: _Wake, headers: dict[str, str],
                 recompute_after: int | None, slow: tuple[float, float] | None) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    started = loop.time()
    stop_reason: Any = None
    n = 0
    while not ereq.finished:
        await wake.wait()
        if recompute_after is not None and ereq.num_output_tokens >= recompute_after:
            rank.abort(ereq)
            n, stop_reason = recompute_after, "recomputed"
            break
    await _stretch(slow, loop.time() - started)
    if ereq.kv_failed:
        return web.Response(status=500, body=kv_load_failed_body(), content_type="application/json",
                            headers=headers)
    finish = "stop" if stop_reason == "recomputed" else ereq.finish_reason
    if stop_reason is None:
        n, stop_reason = ereq.num_output_tokens, ereq.stop_reason
    kv_params = None
    if ereq.pinned:
        kv_params = connector.prefill_params(server.config, engine_id=rank.engine_id, request_id=ereq.request_id,
                                             host=server.advertised_host, port=rank.port or listener.port,
                                             block_ids=server.pinned_block_ids(rank, ereq),
                                             num_tokens=len(parsed.prompt_token_ids),
                                             last_token_id=server.last_token_id(ereq),
                                             cached_tokens=max(ereq.num_cached_tokens, 0))
    usage = writer.usage(len(parsed.prompt_token_ids), n, ereq.num_cached_tokens)
    body = writer.json_body(n, finish, stop_reason, usage, kv_params)
    return web.Response(status=200, body=body, content_type="application/json", headers=headers)
