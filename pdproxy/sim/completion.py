"""The simulator's generation loop, shared by every generation route (``/v1/completions``,
``/v1/chat/completions``, ``/v1/responses``, ``/v1/messages``, ``/inference/v1/generate``).

Flow per request: the route's parser validates (vLLM's 400s/404s; a rejected decoder request releases its
prefiller pin, docs/pd-protocol.md §6) and returns a :class:`~pdproxy.sim.protocol.ParsedRequest`;
:func:`run_generation` builds one engine request per output sequence (``n`` per prompt, every prompt of a list; see
:mod:`pdproxy.sim.generation`), submits them to the rank, and answers through the route's
:class:`~pdproxy.sim.generation.Writer`:

* streaming: 200 ``text/event-stream`` headers at once, as vLLM's ``StreamingResponse`` does (a request the
  engine never schedules still logs "200 OK": ``docs/field-reports.md``), then the writer's head events
  (Responses: ``response.created``), then one event per engine wake-up and sequence, carrying every new token,
  then the tail and the terminator. A failed KV pull becomes the writer's failure events (OpenAI routes: an error
  event + ``[DONE]``);
* non-streaming: one JSON body when every sequence finished. A failed KV pull becomes HTTP 500.

Outputs: each request says something else (a word offset per request), except that a request with ``seed``
always says the same thing, and a greedy one (``temperature: 0``) always says the same thing for the same prompt,
as a real model does.

Client disconnect cancels the handler (aiohttp ``handler_cancellation``), which aborts the engine requests and
frees their blocks. Output sizes: a chat/completions ``max_tokens`` → exactly that many tokens, ``finish_reason
"length"``. Without it, completions generate ``min(--output-tokens, room)`` tokens ("length", vLLM's default cap of
16); chat generates ``--output-tokens`` and finishes ``"stop"``, like a model's EOS; Responses and Messages do the
same under their (required or usual) limit, and stop at the limit when it is lower. Stop strings, stop
token ids, ``min_tokens``, ``ignore_eos`` and fixed contents (JSON, tool calls) end sequences as
:mod:`pdproxy.sim.outputs` describes.

Streamed events: one per engine step's new tokens; with ``--stream-interval N`` (vLLM's flag: its output processor
sends a request's first token alone, then at least N tokens at a time, ``vllm/v1/engine/output_processor.py``) the
first token alone, then one event per group of N tokens, cut at 1 + k·N (vLLM sends what accumulated, so its cuts
drift under load; fixed cuts make a test's cut reproducible), the last one shorter; a ``slow`` fault still sends
one token per event.

PD: a prefill leg (``kv_transfer_params.do_remote_decode``) pins every sequence's blocks and returns the params
of one sequence only (the last child of the first prompt), as vLLM 0.32 does for ``n > 1`` and prompt lists
(``tests/real_vllm/captures/apis/pd_n2_prefill.json``): the others stay pinned until they expire. A decode leg
(``do_remote_prefill``) pulls for its first sequence; other sequences compute their prompt locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import time
from typing import TYPE_CHECKING, Any

from aiohttp import web

from pdproxy.sim import connector
from pdproxy.sim.continuation import MID_STREAM_KINDS, error_events, greedy_offset, mid_stream_fault
from pdproxy.sim.faults import Fault, slice_event
from pdproxy.sim.generation import Seq, Usage, Writer
from pdproxy.sim.outputs import json_example, json_text, plan_output, tool_arguments
from pdproxy.sim.protocol import Api, ParsedRequest, SimHTTPError, parse_request
from pdproxy.sim.responses import DONE, ResponseWriter
from pdproxy.sim.scheduler import EngineRequest
from pdproxy.sim.validation import SAMPLING_EPS

if TYPE_CHECKING:
    from pdproxy.sim.runner import RankEngine
    from pdproxy.sim.server import Listener, SimServer

__all__ = ["DONE", "abort_transport", "handle_completion", "notify_rejected", "pre_response_fault",
           "run_generation"]


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

    def __init__(self, resp: web.StreamResponse, request: web.Request, fault: Fault | None,
                 writer: Writer | None = None) -> None:
        self.resp = resp
        self.request = request
        self.events = 0
        self.mode = fault.params.get("mode", "byte") if fault and fault.kind == "slice" else None
        self.limit = int(fault.params.get("events", 1)) if fault and fault.kind in (
            "reset_after_events", "close_without_done", *MID_STREAM_KINDS) else None
        self.reset = bool(fault and fault.kind == "reset_after_events")
        self.stopped = False
        self.mid_stream = fault.kind if fault and fault.kind in MID_STREAM_KINDS else None
        self.writer = writer

    async def send(self, event: bytes) -> None:
        """Write one SSE ``event`` (bytes), sliced if the fault says so; dropped once stopped.  Raises
        ``ConnectionResetError`` after the connection is reset by a ``reset_after_events`` fault."""
        if self.stopped or not event:
            return
        if self.limit is not None and self.limit <= 0:
            await self._fire()   # ``events: 0``: before the first event (the engine has the request and its KV)
            return
        if self.mode is None:
            if (self.mid_stream == "error_after_events" and self.writer is not None and self.limit is not None
                    and self.events + 1 >= self.limit):
                # the k-th event and the error event in one write, as an engine that fails right after an event
                # (even after ``[DONE]``) sends them: the proxy reads them together
                self.events += 1
                self.stopped = True
                await self.resp.write(event + error_events(self.writer))
                return
            await self.resp.write(event)
        else:
            for piece in slice_event(event, self.mode):
                await self.resp.write(piece)
                await asyncio.sleep(0)
        self.events += 1
        if self.limit is not None and self.events >= self.limit:
            await self._fire()

    async def _fire(self) -> None:
        """The stream fault, once its event count is reached."""
        self.stopped = True
        if self.reset:
            abort_transport(self.request)
            raise ConnectionResetError("sim fault: reset_after_events")
        if self.mid_stream is not None:
            await mid_stream_fault(self.resp, self.mid_stream, self.writer)

    async def send_all(self, events: list[bytes]) -> None:
        """Write each of ``events``."""
        for event in events:
            await self.send(event)

    async def done(self, marker: bytes) -> None:
        """Write the terminator (``data: [DONE]``; nothing for APIs without one) unless a ``close_without_done``
        fault stopped the stream."""
        if self.limit is not None and self.stopped and not self.reset:
            return
        await self.send(marker)


def notify_rejected(server: SimServer, rank: RankEngine, body: Any) -> None:
    """Tell the prefiller to free its pinned blocks when this decoder answers a ``do_remote_prefill`` request
    with an error before pulling (validation 400/404, an injected ``status`` fault).

    ``body`` is the parsed request body (anything else is ignored). The release runs as a side task of
    ``rank``; no-op on a prefill-only engine or without usable ``kv_transfer_params``. Protocol source:
    vLLM >= 0.26 ``generate/base/serving.py::_with_kv_transfer_rejection_cleanup`` calls
    ``notify_kv_transfer_request_rejected`` for every ErrorResponse (docs/pd-protocol.md §6).
    """
    if server.config.role == "prefill" or not isinstance(body, dict):
        return
    source = connector.remote_prefill_source(body.get("kv_transfer_params"))
    if source is not None:
        rank.spawn(connector.release(server.session(), source))


async def handle_completion(server: SimServer, listener: Listener, request: web.Request, api: Api,
                            raw: bytes, body: Any, rank: RankEngine, fault: Fault | None) -> web.StreamResponse:
    """Validate, run on ``rank`` and answer one chat or completions request (see the module docstring)."""
    cfg = server.config
    try:
        parsed = parse_request(body, api, request.headers, cfg, server.tokenizer, server.models)
    except SimHTTPError as exc:
        notify_rejected(server, rank, body)
        return web.Response(status=exc.status_code, body=exc.body(), content_type="application/json")
    writer = ResponseWriter(parsed, parsed.model or cfg.served_model_name, int(time.time()), server.fingerprint)
    return await run_generation(server, listener, request, parsed, writer, rank, fault)


def fixed_content(parsed: ParsedRequest) -> str | None:
    """The fixed output of a request whose answer is constrained: a tool call's arguments, or JSON for
    ``response_format``/``structured_outputs``; None for free text."""
    if parsed.tool_mode is not None:
        return tool_arguments(parsed.tool_schema)
    structured = parsed.structured
    if structured is None:
        return None
    if structured.kind == "json":
        return json_text(json_example(structured.schema))
    if structured.kind == "json_object":
        return json_text({"answer": "sim", "engine": "pdproxy sim"})
    if structured.kind == "choice":
        return structured.choices[0]
    return None


def _limits(parsed: ParsedRequest, prompt: list[int], limit: int | None, output_tokens: int, max_model_len: int,
            fault: Fault | None) -> tuple[int, int | None]:
    """``(max_tokens, plain-text EOS)`` of one sequence (tokens). Chat, Responses and Messages end by themselves
    after ``--output-tokens`` ("stop"); completions and generate run to their limit. A chat or completions request
    that sets ``max_tokens`` gets exactly that many tokens ("length"), as the simulator has always answered; the
    Responses and Messages limits are caps (``max_tokens`` is required in Messages), reached only when they are
    below ``--output-tokens``."""
    room = max(max_model_len - len(prompt), 1)
    eos: int | None = None
    if limit is not None:
        max_tokens = limit
        if parsed.api in ("responses", "messages") and output_tokens < limit:
            eos = output_tokens
    elif parsed.api in ("completions", "generate"):
        max_tokens = min(output_tokens, room)
    else:
        max_tokens, eos = room, min(output_tokens, room)
    if fault is not None and fault.kind == "no_kv_params":
        eos = 1
    return max_tokens, eos


def build_sequences(server: SimServer, rank: RankEngine, parsed: ParsedRequest, wake: _Wake,
                    fault: Fault | None) -> list[Seq]:
    """One :class:`Seq` per output sequence, each with its engine request (not yet submitted)."""
    cfg = server.config
    params = parsed.kv_transfer_params
    remote = connector.remote_prefill_source(params) if cfg.role in ("decode", "both") else None
    pin = connector.wants_remote_decode(params) and cfg.role in ("prefill", "both")
    content = fixed_content(parsed)
    n = parsed.sampling.n
    now = asyncio.get_running_loop().time()
    seqs: list[Seq] = []
    spec = parsed.sampling
    for p, prompt in enumerate(parsed.prompts):
        max_tokens, eos = _limits(parsed, prompt, parsed.prompt_max_tokens[p], cfg.output_tokens, cfg.max_model_len,
                                  fault)
        parent = connector.internal_request_id(parsed.response_id, parsed.api, p)
        if spec.seed is not None:  # the same seed says the same thing
            base = spec.seed * 7
        elif spec.temperature < SAMPLING_EPS:  # greedy: a prompt always gets the same answer
            base = greedy_offset(prompt, server.token_table)  # continues its own greedy output exactly
        else:
            base = server.next_word_offset()
        for k in range(n):
            index = p * n + k
            plan = plan_output(base + 3 * k, server.token_table, spec.rules, max_tokens, eos, content,
                               sampled=spec.temperature >= SAMPLING_EPS)
            if fault is not None and fault.kind == "no_kv_params":
                plan.end = 1
            rid = connector.child_request_id(parent, k, n)
            ereq = EngineRequest(rid, prompt, max_tokens, now, eos_after=plan.end,
                                 remote_prefill=remote if index == 0 else None, pin_on_finish=pin, listener=wake)
            seqs.append(Seq(index, p, ereq, plan))
    return seqs


def usage_of(seqs: list[Seq], parsed: ParsedRequest, block_size: int, counted: dict[int, int] | None = None) -> Usage:
    """Usage of a request: every prompt once, every sequence's output (``counted``: tokens per sequence index,
    default what the engine produced), the prefix-cache hits and the prompt tokens this engine cached."""
    prompt = cached = created = 0
    seen: set[int] = set()
    completion = 0
    for seq in seqs:
        completion += counted[seq.index] if counted is not None else seq.ereq.num_output_tokens
        if seq.prompt_index in seen:
            continue
        seen.add(seq.prompt_index)
        e = seq.ereq
        n_prompt = len(e.prompt_token_ids)
        prompt += n_prompt
        hits = max(e.num_cached_tokens, 0)
        cached += hits
        if e.remote_prefill is None and e.num_cached_tokens >= 0:
            created += max((n_prompt // block_size) * block_size - hits, 0)
    return Usage(prompt, completion, cached, created)


def _kv_params(server: SimServer, listener: Listener, rank: RankEngine, seqs: list[Seq]) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` a prefill leg returns: those of the first prompt's last pinned sequence."""
    first = [s for s in seqs if s.prompt_index == 0 and s.ereq.pinned]
    if not first:
        return None
    ereq = first[-1].ereq
    return connector.prefill_params(server.config, engine_id=rank.engine_id, request_id=ereq.request_id,
                                    host=server.advertised_host, port=rank.port or listener.port,
                                    block_ids=server.pinned_block_ids(rank, ereq),
                                    num_tokens=len(ereq.prompt_token_ids), last_token_id=server.last_token_id(ereq),
                                    cached_tokens=max(ereq.num_cached_tokens, 0))


async def run_generation(server: SimServer, listener: Listener, request: web.Request, parsed: ParsedRequest,
                         writer: Writer, rank: RankEngine, fault: Fault | None,
                         headers: dict[str, str] | None = None) -> web.StreamResponse:
    """Run a validated request on ``rank`` and answer it through ``writer`` (see the module docstring)."""
    wake = _Wake()
    seqs = build_sequences(server, rank, parsed, wake, fault)
    if headers is None:    # vLLM's XRequestIdMiddleware: the request's own header, else 32 random hex digits
        headers = {"X-Request-Id": request.headers.get("X-Request-Id") or secrets.token_hex(16)}  # (not the body's)
    recompute_after = int(fault.params.get("tokens", fault.params.get("events", 1))) if (
        fault is not None and fault.kind == "recomputed") else None
    slow = (float(fault.params.get("factor", 10.0)), float(fault.params.get("min_gap_s", 0.005))) if (
        fault is not None and fault.kind == "slow") else None
    for seq in seqs:
        rank.submit(seq.ereq)
    try:
        if parsed.stream:
            return await _stream(server, listener, request, rank, parsed, writer, seqs, wake, headers, fault,
                                 recompute_after, slow)
        hold_s = float(fault.params.get("delay_s", 0.5)) if fault is not None and fault.kind == "hold_answer" else 0.0
        return await _unary(server, listener, rank, parsed, writer, seqs, wake, headers, recompute_after, slow,
                            hold_s, request, fault)
    finally:
        for seq in seqs:
            if not seq.ereq.finished:
                rank.abort(seq.ereq)


async def _stretch(slow: tuple[float, float] | None, waited_s: float) -> None:
    if slow is not None:
        factor, min_gap = slow
        await asyncio.sleep(max(waited_s, min_gap) * max(factor - 1.0, 0.0))


def _progress(seq: Seq, rank: RankEngine, recompute_after: int | None) -> tuple[int, str | None, Any]:
    """``(tokens produced, finish reason or None, stop_reason)`` of ``seq`` now; a ``recomputed`` fault ends it
    after its token count with vLLM-Ascend's ``stop_reason``."""
    ereq = seq.ereq
    n = ereq.num_output_tokens
    if recompute_after is not None and n >= recompute_after:
        rank.abort(ereq)
        seq.finish, seq.reason = "stop", "recomputed"
        return recompute_after, "stop", "recomputed"
    if ereq.finished:
        seq.settle()
        return n, seq.finish, seq.reason
    return n, None, None


async def _stream(server: SimServer, listener: Listener, request: web.Request, rank: RankEngine,
                  parsed: ParsedRequest, writer: Writer, seqs: list[Seq], wake: _Wake, headers: dict[str, str],
                  fault: Fault | None, recompute_after: int | None,
                  slow: tuple[float, float] | None) -> web.StreamResponse:
    resp = web.StreamResponse(status=200, headers={**headers, "Content-Type": "text/event-stream; charset=utf-8",
                                                   "Cache-Control": "no-cache"})
    await resp.prepare(request)
    sse = _SSE(resp, request, fault, writer)
    rank.active_streams += 1
    loop = asyncio.get_running_loop()
    block_size = server.config.block_size
    interval = server.config.stream_interval
    counted: dict[int, int] = {s.index: 0 for s in seqs}
    try:
        await sse.send_all(writer.head())
        open_seqs = list(seqs)
        failed = False
        while open_seqs and not sse.stopped:
            started = loop.time()
            await wake.wait()
            waited_s = loop.time() - started
            if seqs[0].ereq.kv_failed:
                await sse.send_all(writer.failure())
                failed = True
                if getattr(writer, "abort_on_failure", False):  # Responses: the connection is cut
                    abort_transport(request)
                    return resp
                break
            for seq in open_seqs if len(open_seqs) == 1 else list(open_seqs):
                ereq = seq.ereq
                if recompute_after is None and not ereq.finished:  # the common case, inline
                    n, finish, stop_reason = ereq.num_output_tokens, None, None
                else:
                    n, finish, stop_reason = _progress(seq, rank, recompute_after)
                sent = seq.sent
                if interval > 1 and finish is None:      # --stream-interval: the first token alone, then groups
                    n = min(n, 1) if sent == 0 else n - (n - sent) % interval
                if n <= sent and finish is None:
                    continue
                if not seq.started:  # chat's role chunk goes out with the first output, before any stretch
                    for event in writer.opening(seq):
                        await sse.send(event)
                usage = usage_of(seqs, parsed, block_size, {**counted, seq.index: n}) if (
                    writer.continuous_usage) else None
                if slow is not None:  # one token per event, each gap stretched
                    per_token_s = waited_s / max(n - sent, 1)
                    while n - sent > 1:
                        await _stretch(slow, per_token_s)
                        await sse.send_all(writer.output(seq, sent, sent + 1, None, None, usage, False))
                        sent += 1
                    await _stretch(slow, per_token_s)
                while interval > 1 and n - sent > (step := 1 if sent == 0 else interval):   # one event per group
                    await sse.send_all(writer.output(seq, sent, sent + step, None, None, usage, False))
                    sent += step
                if finish is not None and stop_reason == "recomputed" and n > sent:
                    await sse.send_all(writer.output(seq, sent, n, None, None, usage, False))
                    sent = n
                last = finish is not None and not writer.include_usage and len(open_seqs) == 1
                for event in writer.output(seq, sent, n, finish, stop_reason, usage, last):
                    await sse.send(event)
                seq.sent = counted[seq.index] = n
                if finish is not None:
                    open_seqs.remove(seq)
        if not failed and not open_seqs:
            kv = _kv_params(server, listener, rank, seqs)
            await sse.send_all(writer.tail(seqs, usage_of(seqs, parsed, block_size, counted), kv))
        if not failed or writer.done:
            await sse.done(writer.done)
        if not sse.reset:
            await resp.write_eof()
    except ConnectionResetError:
        pass  # the client went away (or a reset fault fired); the caller aborts the engine requests
    finally:
        rank.active_streams -= 1
    return resp


async def _unary(server: SimServer, listener: Listener, rank: RankEngine, parsed: ParsedRequest, writer: Writer,
                 seqs: list[Seq], wake: _Wake, headers: dict[str, str], recompute_after: int | None,
                 slow: tuple[float, float] | None, hold_s: float = 0.0, request: web.Request | None = None,
                 fault: Fault | None = None) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    started = loop.time()
    pending = list(seqs)
    while pending:
        await wake.wait()
        if seqs[0].ereq.kv_failed:
            break
        for seq in list(pending):
            n, finish, _reason = _progress(seq, rank, recompute_after)
            if finish is not None:
                seq.sent = n
                pending.remove(seq)
    await _stretch(slow, loop.time() - started)
    if hold_s:
        await asyncio.sleep(hold_s)             # finished (a prefiller's KV pinned), the answer not sent yet
    if seqs[0].ereq.kv_failed:
        status, body = writer.failure_body()
        return web.Response(status=status, body=body, content_type="application/json", headers=headers)
    counted = {s.index: s.sent for s in seqs}
    usage = usage_of(seqs, parsed, server.config.block_size, counted)
    body = writer.body(seqs, usage, _kv_params(server, listener, rank, seqs))
    if fault is not None and request is not None and fault.kind in UNARY_CUT_KINDS:
        if fault.kind == "error_after_events":
            status, failure = writer.failure_body()
            return web.Response(status=status, body=failure, content_type="application/json", headers=headers)
        return await _cut_unary(request, fault.kind, body, headers)
    return web.Response(status=200, body=body, content_type="application/json", headers=headers)


UNARY_CUT_KINDS = ("reset_after_events", "close_without_done", "error_after_events", "stall_after_events")
"""Stream faults that also cut a non-streaming answer, once the engine finished the request (a decoder pulled its
KV and generated): ``reset_after_events`` sends the status line, headers and half the body, then resets the
connection; ``close_without_done`` the same, then closes it cleanly (the body shorter than its
``Content-Length``); ``error_after_events`` answers vLLM's failure (a failed KV load: HTTP 500); and
``stall_after_events`` sends half the body, then nothing (``events`` is not used)."""


async def _cut_unary(request: web.Request, kind: str, body: bytes, headers: dict[str, str]) -> web.StreamResponse:
    """Send part of a non-streaming answer, then cut it as ``kind`` says (:data:`UNARY_CUT_KINDS`)."""
    resp = web.StreamResponse(status=200, headers={**headers, "Content-Type": "application/json"})
    resp.content_length = len(body)
    await resp.prepare(request)
    with contextlib.suppress(ConnectionResetError):
        await resp.write(body[:len(body) // 2])
        if kind == "stall_after_events":
            await _forever()
        if kind == "reset_after_events":
            abort_transport(request)
        elif request.transport is not None:
            request.transport.close()
    return resp
