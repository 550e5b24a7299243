"""The decode leg: send the client's body with the prefiller's ``kv_transfer_params`` to a decoder and relay its
answer — an SSE stream (:class:`~pdproxy.pd.relay.StreamRelay`) or one JSON body.

The prefiller's lease (the KV pinned on it, counted by the prefill queue) is released as soon as the decoder starts
answering: at its first event for a stream, at its status line for a JSON answer.  A decoder that answers has the
request and has pulled (or will free) the prompt's KV, so holding the lease longer only over-counts the prefiller's
pinned KV.  (vLLM itself sends a non-streamed answer's status line together with its body, after the generation:
``vllm/entrypoints/openai/chat_completion/api_router.py`` returns a ``JSONResponse``; an engine or gateway that
sends the status line first lets the lease go that much earlier.)

A decoder fault before anything reached the client is :class:`~pdproxy.errors.DecodeFailed` (the director may try another
decoder); the client's status line goes out only once the decoder's first event (stream) or whole body (JSON) is
in, so a decoder error reaches the client with the engine's status and body.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import orjson

from pdproxy.apis import kv_transfer, recompute
from pdproxy.apis import streams as api_streams
from pdproxy.apis.request import Api, ProxyRequest, completion_tokens_in, patch_usage_bytes
from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.health import HealthMonitor
from pdproxy.engines.limits import Limits
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import (
    DecodeFailed,
    EnginesFailed,
    ProxyError,
    UpstreamHTTPError,
    UpstreamTimeout,
    UpstreamUnavailable,
    classify,
    dumps_or_none,
)
from pdproxy.http.client import H1Response, TransportError
from pdproxy.http.engine_headers import EngineHeaders
from pdproxy.http.errors import transport_error
from pdproxy.http.upstream import Upstream, read_answer
from pdproxy.ops.tracing import NO_TRACING, Tracing
from pdproxy.pd.continuation import LiveStreams, Refusal, Resume, StreamLost, ask_token_ids, ineligible_reason
from pdproxy.pd.prefill import PrefillResult
from pdproxy.pd.relay import StreamRelay
from pdproxy.pd.responder import Responder
from pdproxy.scheduling import PickRequest, Scheduler
from pdproxy.settings import Settings
from pdproxy.timeline import RequestContext


def decode_lease_tokens(req: ProxyRequest, reserved_output: int) -> int:
    """The decoder KV (tokens) a decode leg's pool lease counts while it runs: the prompt (admission's count) and
    ``min(max_tokens, reserved_output)`` of output (``reserved_output`` alone when the request sets no limit;
    setting ``decode_reserved_output_tokens``).  vLLM allocates a request's output blocks as it generates
    (``vllm/v1/core/sched/scheduler.py``, ``schedule``: ``allocate_slots`` per step) and preempts when they run
    out; a lease of the whole ``max_tokens`` let ten requests asking 8,000 tokens each hold back every prefill on
    decoders whose pool stood 95 % free.  A request whose prompt and output outgrow a whole pool is bounded by
    :meth:`DecodeLeg.output_room` instead."""
    asked = req.max_output_tokens
    return (req.prompt_tokens or 0) + (reserved_output if asked is None else max(0, min(asked, reserved_output)))


def routing_headers(ctx: RequestContext) -> list[tuple[bytes, bytes]]:
    """Response headers naming the prefiller and decoder used (setting ``expose_routing_headers``)."""
    out = []
    if ctx.prefiller:
        out.append((b"x-pdproxy-prefiller", ctx.prefiller.encode()))
    if ctx.decoder:
        out.append((b"x-pdproxy-decoder", ctx.decoder.encode()))
    return out


class DecodeLeg:
    """Runs the decode leg of a request (see the module docstring).  ``scheduler`` picks the decoder, ``pool``
    holds its lease, ``health`` hears the verdict, ``upstream`` opens it with ``headers``; ``tracing`` spans each
    attempt; ``live``: the registry of continuable streams per decoder (:mod:`pdproxy.pd.continuation`)."""

    def __init__(self, settings: Settings, *, scheduler: Scheduler, pool: EndpointPool, health: HealthMonitor,
                 upstream: Upstream, headers: EngineHeaders, tracing: Tracing = NO_TRACING,
                 live: LiveStreams | None = None, limits: Limits | None = None) -> None:
        self.settings = settings
        self.limits = limits
        """The engines' limits (:meth:`output_room` reads the decoders' KV pools); None: not capped."""
        self.live = live or LiveStreams()
        """The continuable streams each decoder relays now (a drain with ``migrate`` moves them)."""
        self.scheduler = scheduler
        self.pool = pool
        self.health = health
        self.upstream = upstream
        self.headers = headers
        self.tracing = tracing
        self.recompute_decoders: set[str] = {u.rstrip("/") for u in settings.recompute_decoders}
        """Decoder URLs known to end streams with ``recomputed`` (``recompute_decoders``, plus detected ones)."""

    def sends_recomputed(self, endpoint: Endpoint) -> bool:
        """Whether ``endpoint`` is a decoder known to end streams with ``stop_reason "recomputed"``
        (``recompute_decoders``: its URL or ``*``; or detected in an earlier stream)."""
        known = self.recompute_decoders
        return "*" in known or endpoint.url in known

    def output_room(self, req: ProxyRequest, ctx: RequestContext, endpoint: Endpoint, first_leg: bool) -> int | None:
        """The output-token limit (tokens, ≥ 1) the decode leg of ``req`` must carry for the answer to fit
        ``endpoint``'s KV pool, or None when the limit the engine would apply fits: the client's, else vLLM's
        default (16 for a completion, the room ``max_model_len`` leaves for the others).

        vLLM lowers an absent ``max_tokens`` to the room ``max_model_len`` leaves, never to its KV pool.  vLLM 0.32
        refuses to start with a pool below ``max_model_len`` (``vllm/v1/core/kv_cache_utils.py``,
        ``_check_enough_kv_cache_memory``), so there this never binds; engines that do start so (vLLM-Ascend
        0.23: 4,584 tokens under 133,120, ``docs/field-reports.md``) run a request whose prompt and
        output together outgrow the whole pool until it preempts itself, and it then waits forever
        (``vllm/v1/core/sched/scheduler.py``, ``schedule``: "Cannot schedule this request") — a
        200 whose stream stops.  So the leg asks for at most the pool (less vLLM's null block) less the prompt (the
        prefiller's exact count on a first leg, else admission's upper bound of the leg's prompt), shared by the
        request's sequences (``n`` choices of each prompt of a completion prompt list, which a decoder that prefills
        runs whole); the answer then ends with ``finish_reason`` ``length`` there, as it does at ``max_model_len``
        (``README.md``, "admit").  With ``max_tokens_overflow = reject`` a client's larger limit was refused at
        admission instead."""
        limits = self.limits.of(endpoint) if self.limits is not None else None
        if limits is None or limits.usable_pool is None:
            return None
        prompt = ctx.engine_prompt_tokens if first_leg and ctx.engine_prompt_tokens else None
        if prompt is None:        # no engine count (the decoder prefills; a continuation leg): admission's upper
            prompt = req.prompt_tokens        # bound, not its estimate, which may fall short of the real prompt
            if prompt is not None and req.prompt_tokens_upper is not None:
                prompt = max(prompt, req.prompt_tokens_upper)
        if not prompt:
            return None
        choices = req.sequences      # n as vLLM reads it ("4", 4.0), times the prompts of a list the decoder runs
        asked = req.max_output_tokens
        if asked is None and req.api is Api.COMPLETIONS:
            asked = 16                        # vLLM's default on a completion; a chat's: max_model_len's room
        return limits.output_room(prompt, asked, choices)

    def gave_up(self, last: ProxyError) -> ProxyError:
        """What the client gets when ``decode_attempts`` ran out (or no decoder is left to try) after ``last``, the
        last decoder failure before its first event: a decoder's own error answer (a 502/503/504, a 500) as it sent
        it; a transport failure (refused, reset, timed out, a stream ended before its first event) becomes
        :class:`~pdproxy.errors.EnginesFailed`, 503 with ``Retry-After`` until a decoder's breaker re-admits it —
        what the next request gets when none is available, and what the prefill side answers
        (:meth:`pdproxy.pd.prefill.PrefillLeg.gave_up`)."""
        return EnginesFailed.after(Role.DECODE, last, self.health.retry_after_s(self.pool.endpoints(Role.DECODE)))

    async def run(self, req: ProxyRequest, ctx: RequestContext, pick: PickRequest, prefill: PrefillResult,
                  out: Responder, exclude: Sequence[Endpoint], transcript: recompute.Transcript | None,
                  resume: Resume | None = None, struck: Sequence[Endpoint] = ()) -> bool:
        """Pick a decoder (not in ``exclude``), open the decode leg and relay its answer to ``out``.  ``struck``:
        the decoders this request's failures were strikes against before (another failure there is no further
        strike: :meth:`~pdproxy.engines.health.HealthMonitor.record_error`'s ``again``).

        ``resume``: the stream is continuable (:mod:`pdproxy.pd.continuation`): its first leg asks the decoder for
        ``return_token_ids``; a loss after the first event raises :class:`StreamLost` (the decoder's breaker is
        told).  A decoder known to send vLLM-Ascend's ``recomputed`` keeps that continuation instead.

        Raises :class:`DecodeFailed` for an engine fault before the client got anything,
        :class:`~pdproxy.errors.UpstreamHTTPError` for its 4xx, the scheduler's refusal when no decoder is
        usable.  Returns True when the decoder ended with ``stop_reason "recomputed"``.
        """
        s = self.settings
        tokens = decode_lease_tokens(req, s.decode_reserved_output_tokens)
        endpoint = self.scheduler.pick(Role.DECODE, pick, exclude)
        with self.health.judging(endpoint) as verdict:   # from the pick on: no verdict (cancelled, a fault) is
            # neutral on exit, so a half-open trial the pick took is given back (engines/health.py Verdict)
            prefill.decoders.append(endpoint)
            ctx.decoder = endpoint.name
            ctx.decoder_dp_rank = endpoint.dp_rank
            body = kv_transfer.decode_leg_body(req.api, req.raw, req.body, prefill.params, ctx.request_id)
            room = self.output_room(req, ctx, endpoint, first_leg=resume is None or resume.legs == 1)
            if room is not None:
                body = kv_transfer.with_output_limit(body, req.api, req.body, room, req.min_tokens)
            if resume is not None and resume.legs > 1:
                transcript = None  # a continuation leg: re-framed by pdproxy.pd.continuation
            elif resume is not None and transcript is not None and self.sends_recomputed(endpoint):
                resume = None      # vLLM-Ascend's recomputed continuation (pdproxy.apis.recompute) instead
            if (req.stream and transcript is not None and transcript.attempts == 1
                    and not self.sends_recomputed(endpoint)):
                transcript = None  # plain splice; a "recomputed" from this decoder is detected (on_recomputed)
            if resume is not None and resume.legs == 1:
                resume.cached_tokens = prefill.cached_tokens
                if not resume.keep_ids and resume.openai:   # vLLM's Responses / Messages streams carry no ids
                    body = ask_token_ids(body)
            strip_usage = bool(req.stream and transcript is not None and not req.include_usage)
            if strip_usage:
                body = recompute.force_usage_bytes(body, req.body)
            ctx.timeline.decode_start_at = time.monotonic()
            first_byte_s = s.decode_first_byte_timeout_s if req.stream else s.decode_nonstream_timeout_s
            leg_deadline = asyncio.get_running_loop().time() + first_byte_s   # a non-streamed leg's, head and body
            routing = routing_headers(ctx) if s.expose_routing_headers else []
            broken: ProxyError | None = None     # a failure after the first event, told to the error event's client
            head = False                         # a non-streamed answer's status line came (vLLM sends it when done)
            with self.pool.lease(endpoint, tokens), self.tracing.decode(ctx, endpoint):  # the leg's traceparent
                if prefill.slot is not None:
                    prefill.slot.decode_started()
                try:
                    async with self.upstream.open_stream(
                            endpoint, req.api.value, body,
                            self.headers.leg(endpoint, ctx.request_id, ctx.authorization, ctx.client_headers),
                            first_byte_timeout_s=first_byte_s) as resp:
                        if req.stream:
                            relay = StreamRelay(
                                resp, out, ctx, cached_tokens=prefill.cached_tokens,
                                first_event_timeout_s=first_byte_s,
                                on_first_event=prefill.consume, headers=routing, transcript=transcript,
                                strip_usage=strip_usage, idle_timeout_s=s.decode_idle_timeout_s,
                                on_recomputed=(lambda: self.recompute_decoders.add(endpoint.url))
                                if s.recompute_continuation else None,
                                api_stream=api_streams.stream_for(req.api, ctx, prefill.cached_tokens),
                                resume=resume, lost_when=(s.stream_continuation_stall_factor,
                                                          s.stream_continuation_stall_min_s),
                                not_continued=req if resume is None and s.stream_continuation else None)
                            if resume is None:
                                recomputed = await relay.run()
                                broken = relay.failure
                                if s.stream_continuation and ctx.outcome == "upstream_error" and (
                                        ineligible_reason(req) is not None):     # cut, and of a shape not continued
                                    self.live.observer.refused(Refusal.INELIGIBLE, ctx.api_label)
                            else:
                                with self.live.track(endpoint.name, relay):
                                    recomputed = await relay.run()
                        else:
                            head = True
                            prefill.consume()          # the decoder answered: it has the request and its KV
                            # vLLM sends the body with the status line, once the answer is done: a body silent for
                            # decode_idle_timeout_s is a lost decoder, and the whole leg ends by its deadline (the
                            # body's wait no longer starts decode_nonstream_timeout_s again)
                            idle_s = min(s.decode_idle_timeout_s, first_byte_s)   # (a head just before the
                            # deadline still gets its body: idle_s after it, never less)
                            resp.deadline_at = max(leg_deadline, asyncio.get_running_loop().time() + idle_s)
                            resp.set_idle_timeout(idle_s)
                            recomputed = await relay_json(resp, ctx, prefill.cached_tokens, out, transcript,
                                                          first_byte_s, routing, req.api, s.engine_answer_max_bytes)
                except ProxyError as exc:
                    if isinstance(exc, UpstreamHTTPError):      # it answered an error: vLLM freed the KV it was sent
                        prefill.handed = True
                    if not req.stream and not head and isinstance(exc, UpstreamTimeout):
                        # no answer within decode_nonstream_timeout_s: vLLM answers a non-streamed request when
                        # done, so a long generation cannot be told from a hung decoder — replaced (decode_attempts),
                        # but no verdict on this one: a client's long requests must not open the decoders' breakers
                        verdict.neutral()
                        raise DecodeFailed(exc, endpoint, kv_intact=classify(exc).unsent, struck=False) from None
                    elif not verdict.error(exc, again=endpoint in struck):
                        raise
                    raise DecodeFailed(exc, endpoint, kv_intact=classify(exc).unsent) from None
                except StreamLost as lost:             # lost after its first event: the director continues elsewhere
                    if lost.planned:
                        verdict.neutral()
                    else:
                        verdict.error(lost.error, again=endpoint in struck)
                    if resume is not None:
                        resume.lost.append(endpoint)
                    raise
            if broken is not None:                     # cut mid-stream (the client got the error event): its fault
                verdict.error(broken, again=endpoint in struck)
            else:
                verdict.success()
        return recomputed


_JSON_WS = b" \t\r\n"


_ANSWER_KEY = {Api.CHAT: b'"choices"', Api.COMPLETIONS: b'"choices"', Api.RESPONSES: b'"output"',
               Api.MESSAGES: b'"content"'}
"""The key every answer of each API holds (vLLM's ``ChatCompletionResponse`` and ``CompletionResponse``:
``choices``; ``ResponsesResponse``: ``output``; the Anthropic ``MessagesResponse``: ``content``)."""


def json_answer_fault(status: int, data: bytes, api: Api = Api.CHAT) -> str | None:
    """Why a decoder's non-streamed answer (``status``, whole ``data``) to an ``api`` request is not one to relay,
    or None: vLLM answers a completion with 200 and a JSON object holding its API's answer key (:data:`_ANSWER_KEY`;
    ``vllm/entrypoints/openai/chat_completion/api_router.py``), its errors with 4xx/5xx (raised before this).
    Checked by shape, not parsed: the first and last bytes past whitespace are ``{`` and ``}`` (O(1)), and the
    key's quoted name occurs (one ``memmem`` over the answer, a few µs for 100 KB) — so ``{}`` or an object
    without the answer is refused too.  A short body is a :class:`~pdproxy.http.client.TransportError` already."""
    if status != 200:
        return f"{status} to a completion (not 200 with its answer)"
    body = data.strip(_JSON_WS)          # the same object when there is no whitespace to strip (vLLM's)
    if not body:
        return "200 with an empty body"
    if body[0] != 123 or body[-1] != 125:             # "{" ... "}"
        return f"200 with a body that is not a JSON object ({len(data)} bytes starting {data[:24]!r})"
    key = _ANSWER_KEY[api]
    if body.find(key) < 0:
        return f"200 with a JSON object without {key.decode()} ({len(data)} bytes starting {data[:24]!r})"
    return None


async def relay_json(resp: H1Response, ctx: RequestContext, cached_tokens: int | None, out: Responder,
                     transcript: recompute.Transcript | None, timeout_s: float,
                     routing: list[tuple[bytes, bytes]], api: Api = Api.CHAT, max_bytes: int | None = None) -> bool:
    """Read a non-streaming decode answer (within ``timeout_s`` seconds) and send it with ``routing`` headers:
    usage patched with the prefiller's ``cached_tokens`` (in ``api``'s usage shape); a ``recomputed`` answer is
    kept back and True returned; a continuation's answer is merged with the earlier text.  Raises
    :class:`UpstreamUnavailable` / :class:`UpstreamTimeout` when the body does not arrive, and
    :class:`UpstreamUnavailable` (502) when it is not an answer: a status other than 200, or a body that is not a
    JSON object (empty, an SSE stream, text) — never relayed as a 200 (:func:`json_answer_fault`), or larger than
    ``max_bytes`` (setting ``engine_answer_max_bytes``; None: any size; read no further)."""
    endpoint = ctx.decoder or ""
    try:
        async with asyncio.timeout(timeout_s):
            data = await read_answer(resp, max_bytes, f"decoder {endpoint}", endpoint)
    except TransportError as exc:
        raise transport_error(exc, f"decoder {endpoint}", endpoint) from None
    except TimeoutError:
        raise UpstreamTimeout(f"decoder {endpoint} did not finish within {timeout_s:.1f} s",
                              endpoint=endpoint) from None
    fault = json_answer_fault(resp.status, data, api)
    if fault is not None:
        raise UpstreamUnavailable(f"decoder {endpoint} answered {fault}", endpoint=endpoint)
    ctx.timeline.first_token_at = ctx.timeline.last_token_at = time.monotonic()
    if api is Api.RESPONSES or api is Api.MESSAGES:
        if data.find(b'"output_tokens"') >= 0:
            ctx.completion_tokens = api_streams.output_tokens_in(data)
        await out.json(resp.status, api_streams.patch_json(api, data, cached_tokens), routing)
        return False
    if transcript is not None and (data.find(recompute.MARKER) >= 0 or transcript.attempts > 1):
        try:   # checked by shape only (json_answer_fault): relayed alone as it came, unless it must be merged
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and recompute.is_recomputed(obj):
            transcript.observe(obj)
            return True
        if transcript.attempts > 1:
            if not isinstance(obj, dict):
                raise UpstreamUnavailable(f"decoder {endpoint} answered with a body that is not a JSON object",
                                          endpoint=endpoint)
            try:
                merged = dumps_or_none(transcript.merge_json(obj))   # None: nested past what orjson writes
            except TypeError:   # merge_json's own: a message content or text that is no string
                merged = None
            if merged is None:
                raise UpstreamUnavailable(f"decoder {endpoint} answered JSON nested too deep to merge",
                                          endpoint=endpoint)
            data = merged
    if data.find(b'"completion_tokens"') >= 0:
        ctx.completion_tokens = completion_tokens_in(data)
    await out.json(resp.status, patch_usage_bytes(data, cached_tokens if transcript is None
                                                  or transcript.attempts == 1 else None), routing)
    return False
