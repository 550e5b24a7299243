"""Fan-out: ``n > 1`` and completion prompt lists served as one prefill/decode pair per sequence, merged the way
vLLM answers them.

Why: one P/D pair cannot carry several sequences.  A prefill leg with ``n: 2`` returned the ``kv_transfer_params``
of one child only, one with two prompts those of the first prompt only, and the other sequences' KV stayed pinned
on the prefiller until the connector's lease expired (``docs/apis-through-pd.md``, "n > 1 and prompt lists").

**Plan** (:func:`plan`): sequence ``i = prompt_index × n + k`` (vLLM's choice index,
``openai/completion/serving.py``: ``output.index + prompt_idx * num_choices``) is the client's body with one prompt
and ``n: 1``; with a ``seed``, child ``k`` of a prompt gets ``seed + k`` as vLLM's parallel sampling gives it
(``vllm/v1/engine/parallel_sampling.py::ParentRequest``), wrapped into vLLM's int64 bounds of ``seed`` (the same
64 bits: torch seeds a generator with a negative seed's two's complement); a seed outside them is vLLM's 400.
A streamed sequence always asks for its usage chunk (``stream_options.include_usage``): the merged usage needs it,
and it is dropped from the client's stream.  More than ``fan_out_max_sequences`` sequences is pdproxy's 400, and
so are sequences whose bodies together pass the bounds one client body has (``max_body_bytes``, ``max_json_items``):
each sequence is a body of its own for pdproxy to read and for both engines to parse, so ``n: 16`` on a 60 MB body
would be 1 GB of work; the plan stops building them as soon as the sum passes (work bounded by the bounds plus one
body, as for any one body).  ``n``
below 1, or above 1 with ``temperature`` 0 ("n must be 1 when using greedy sampling"), is vLLM's, from the
prefiller judging the client's own body (below: not fanned out), so it comes in vLLM's order of checks.

**Order**: each prompt is admitted once (its count serves its ``n`` children).  The first child of each prompt is
sent at once; its siblings after its prefill answered, bound to that prefiller while it can take them
(``PickRequest.affinity``, :class:`~pdproxy.scheduling.filters.Affinity`), so their prefills are prefix-cache hits.

**Merge** (:class:`Merger`), as vLLM 0.32 merges (``chat_completion/serving.py``, ``completion/serving.py``):

- choices carry their sequence's index; every chunk and answer carries the first sequence's ``id``, ``created``
  and ``model``;
- usage: ``prompt_tokens`` counts each prompt once (n children share it) and sums the prompts of a list;
  ``completion_tokens`` (and ``completion_tokens_details.reasoning_tokens``) sum every sequence;
  ``prompt_tokens_details.cached_tokens`` is the first prompt's in a stream and the last prompt's in a JSON answer
  (vLLM reads ``num_cached_tokens`` of its first / last result), each a prefiller's figure;
- a stream interleaves the sequences' chunks as they come, one chunk per choice (each chat choice with its own
  role chunk and finishing chunk), then one usage chunk (if the client asked) and one ``data: [DONE]``.

Not fanned out: a request pdproxy finds invalid (its prefill leg carries the client's own body, so the prefiller
answers vLLM's 400 for it, ``n`` included) and one a decoder serves alone anyway (beam search, prompt logprobs:
``ProxyRequest.decoder_prefills``), whose ``n`` and prompt list the decoder runs as vLLM does.

**Failures**: the response fails honestly — never a short list.  A sequence that fails before its first event is
failed over by its own P→D path (another decoder, re-prefilling as needed); if it still fails, or fails after its
first event, the other sequences are cancelled (their legs closed, their KV released) and the client gets the error:
as the HTTP status and body when nothing was sent yet, else as an SSE error event then ``data: [DONE]``.  A client
that leaves cancels every sequence the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from bisect import bisect_left
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from pdproxy.apis.request import INT64_MIN, Api, ProxyRequest, json_items, parse_request, prompt_list
from pdproxy.endpoints import Endpoint
from pdproxy.errors import BadRequest, InternalError, ProxyError, UpstreamHTTPError, UpstreamUnavailable, dumps_or_none
from pdproxy.http import sse
from pdproxy.http.client import ProtocolError
from pdproxy.http.errors import transport_error
from pdproxy.pd.responder import SSE_HEADERS, Responder
from pdproxy.timeline import RequestContext

log = logging.getLogger("pdproxy.fanout")

Admit = Callable[[ProxyRequest, RequestContext], Awaitable[None]]
Run = Callable[[ProxyRequest, RequestContext, Responder, Endpoint | None], Awaitable[None]]
"""Runs one admitted sequence; the last argument: the prefiller to prefer (a sibling's, or None)."""


@dataclass(slots=True)
class Sequence:
    """One sequence of a fanned-out request: choice ``index`` (= ``prompt_index × n + k``), its one-prompt,
    ``n: 1`` request ``req``, its context ``ctx`` (id ``<request id>-<index>``)."""

    index: int
    prompt_index: int
    k: int
    req: ProxyRequest
    ctx: RequestContext
    prefilled: asyncio.Event = field(default_factory=asyncio.Event)
    prefiller: Endpoint | None = None


def check(req: ProxyRequest, max_sequences: int) -> None:
    """Raise :class:`BadRequest` when ``req`` asks for more than ``max_sequences`` sequences (pdproxy's own
    bound).  vLLM's own rules on ``n`` (at least 1; 1 with greedy sampling) are faults of
    :func:`~pdproxy.apis.request.parse_request`: such a request does not fan out, its prefiller judges it."""
    if req.sequences > max_sequences:
        what = f"n={req.n} × {req.prompts} prompts" if req.prompts > 1 and req.n > 1 else (
            f"{req.prompts} prompts" if req.prompts > 1 else f"n={req.n}")
        raise BadRequest(f"{what} asks for {req.sequences} sequences; pdproxy serves at most {max_sequences} per "
                         "request (one prefill/decode pair each; setting fan_out_max_sequences)",
                         param="n" if req.prompts == 1 else "prompt")


def plan(req: ProxyRequest, parent: RequestContext, max_bytes: int | None = None,
         max_items: int | None = None) -> list[Sequence]:
    """The sequences of ``req`` (module docstring), in index order; each is read by
    :func:`~pdproxy.apis.request.parse_request` like a request of its own (``min_tokens``, usage options…).
    ``max_bytes`` / ``max_items`` (the settings ``max_body_bytes``, ``max_json_items``; None: unbounded): the most
    bytes, and ``{``/``[``/``,`` bytes, the sequences' bodies may hold together; raises :class:`BadRequest` (``param``
    ``n``, or ``prompt`` for a prompt list) as soon as their sum passes one, before the next is parsed."""
    body = req.body
    total_bytes = total_items = 0
    param = "n" if req.prompts == 1 else "prompt"
    prompts = prompt_list(body.get("prompt")) if req.api is Api.COMPLETIONS else None
    prompts = prompts or [None]
    seed = req.seed
    out: list[Sequence] = []
    for pi, prompt in enumerate(prompts):
        for k in range(req.n):
            leg = dict(body)
            leg.pop("n", None)
            if prompt is not None:
                leg["prompt"] = prompt
            if req.n > 1 and seed is not None:
                leg["seed"] = (seed + k - INT64_MIN) % (1 << 64) + INT64_MIN   # within vLLM's int64 bounds
            if req.stream:
                options = body.get("stream_options")
                leg["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
            index = pi * req.n + k
            raw = orjson.dumps(leg)
            total_bytes += len(raw)
            if max_bytes is not None and total_bytes > max_bytes:
                raise _too_much(req, f"{total_bytes:,} bytes or more", f"max_body_bytes ({max_bytes:,})", param)
            if max_items is not None:
                total_items += json_items(raw, max_items - total_items)          # bounded: stops past the rest
                if total_items > max_items:
                    raise _too_much(req, f"more than {max_items:,} JSON items", f"max_json_items ({max_items:,})",
                                    param)
            seq_req = parse_request(raw, req.api, max_items=None)   # as any one-sequence request
            ctx = RequestContext(request_id=f"{parent.request_id}-{index}",
                                 client_request_id=parent.client_request_id, api_label=parent.api_label,
                                 authorization=parent.authorization, model=parent.model)
            out.append(Sequence(index, pi, k, seq_req, ctx))
    return out


def _too_much(req: ProxyRequest, amount: str, bound: str, param: str) -> BadRequest:
    """The 400 (``param``: ``n`` or ``prompt``) for sequences whose bodies together hold ``amount`` (words, e.g.
    "1,234 bytes or more") past ``bound`` (the setting and its value, in words)."""
    return BadRequest(f"{req.sequences} sequences of this body would hold {amount} for pdproxy and the engines to "
                      f"parse (each sequence is a body of its own: one prefill/decode pair each); they may hold at "
                      f"most {bound} together, as one body: lower n or the body", param=param)


_FIGURE_MAX = 1 << 40
"""The largest usage figure counted (no answer comes near 10**12 tokens): sums of them, over any number of
sequences, stay within the 64 bits orjson writes."""


def _figure(value: Any) -> int:
    """A usage figure as a count: an integer (a finite float cut to one) from 0 to :data:`_FIGURE_MAX`, anything
    else — absent, null, a string, a list, a boolean, a negative or larger number — 0.  vLLM writes counts; a sum
    over an engine's other values must neither raise nor make the merged usage one orjson cannot write."""
    if isinstance(value, bool):
        return 0
    if isinstance(value, float):
        value = int(value) if math.isfinite(value) else 0
    return value if isinstance(value, int) and 0 <= value <= _FIGURE_MAX else 0


def _too_deep(decoder: str | None) -> UpstreamUnavailable:
    """A decoder's answer or event nested past the 254 levels orjson writes (it reads 1,023): it cannot be merged."""
    return UpstreamUnavailable("a decoder answered JSON nested too deep to merge", endpoint=decoder or "")


def merge_usage(usages: list[tuple[Sequence, dict[str, Any]]], stream: bool) -> dict[str, Any] | None:
    """The merged usage object (module docstring) from each sequence's usage, or None when none had one."""
    if not usages:
        return None
    usages = sorted(usages, key=lambda su: su[0].index)
    base = dict(usages[0][1])
    per_prompt: dict[int, dict[str, Any]] = {}
    for seq, usage in usages:
        per_prompt.setdefault(seq.prompt_index, usage)
    prompt_tokens = sum(_figure(u.get("prompt_tokens")) for u in per_prompt.values())
    completion = sum(_figure(u.get("completion_tokens")) for _, u in usages)
    base["prompt_tokens"] = prompt_tokens
    base["completion_tokens"] = completion
    base["total_tokens"] = prompt_tokens + completion
    details = [u.get("completion_tokens_details") for _, u in usages]
    if any(isinstance(d, dict) for d in details):
        reasoning = sum(_figure(d.get("reasoning_tokens")) for d in details if isinstance(d, dict))
        base["completion_tokens_details"] = {**(details[0] if isinstance(details[0], dict) else {}),
                                             "reasoning_tokens": reasoning}
    source = per_prompt[min(per_prompt)] if stream else per_prompt[max(per_prompt)]
    if "prompt_tokens_details" in source or "prompt_tokens_details" in base:
        base["prompt_tokens_details"] = source.get("prompt_tokens_details")
    return base


class _SequenceSink:
    """One sequence's client connection (:class:`pdproxy.pd.responder.ClientConnection`, under its own
    :class:`Responder`): what its relay would send a client goes to the :class:`Merger` instead — SSE blocks as they
    come (synchronously, from the splice), a JSON answer whole.  Flow control is the real client's: ``paused`` and
    ``drain`` are its connection's, and the merger hands its pause / resume / loss to every sequence's ``flow``."""

    def __init__(self, merger: Merger, seq: Sequence) -> None:
        self.merger = merger
        self.seq = seq
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.ended = False
        self.flow: Any = None

    @property
    def paused(self) -> bool:
        return bool(self.merger.out.conn.paused)

    @property
    def send_timeout_s(self) -> float:
        return self.merger.out.conn.send_timeout_s

    def unsent(self) -> int:
        return self.merger.out.conn.unsent()

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.status = status
        self.headers = list(headers)

    def write(self, data: bytes) -> None:
        if not data:
            return
        if self.merger.stream and self.status == 200:
            self.merger.sequence_events(self, data)
        else:
            self.body.append(data)

    def finish(self, data: bytes = b"") -> None:
        self.write(data)
        self.ended = True

    def body_writer(self) -> Callable[[bytes], None]:
        return self.write

    async def drain(self) -> None:
        await self.merger.out.conn.drain()

    def abort(self) -> None:
        """The sequence's relay gave up on the client (it kept its transport full too long): drop the client."""
        self.merger.out.conn.abort()


class Merger:
    """Merges the sequences' answers into the client's one (module docstring).  ``out``: the client's responder;
    ``stream``: the client asked for a stream; ``include_usage``: it asked for the usage chunk."""

    def __init__(self, req: ProxyRequest, ctx: RequestContext, out: Responder) -> None:
        self.req = req
        self.ctx = ctx
        self.out = out
        self.stream = req.stream
        self.include_usage = req.include_usage
        self.sinks: list[_SequenceSink] = []
        self.head: dict[str, Any] | None = None            # id / created / model of the first chunk or answer
        self.usages: list[tuple[Sequence, dict[str, Any]]] = []
        self.usage_chunk: dict[str, Any] | None = None
        self.failure: ProxyError | None = None
        self.failed = asyncio.Event()
        self.last_write = 0.0
        self.gaps = ctx.gaps

    # --- the client's flow control, handed to every sequence's relay (ClientConnection.flow) ---------------------
    def attach(self, sinks: list[_SequenceSink]) -> None:
        """Listen to the client connection's flow control for ``sinks`` (until :meth:`detach`)."""
        self.sinks = sinks
        self.out.conn.flow = self

    def detach(self) -> None:
        if self.out.conn.flow is self:
            self.out.conn.flow = None

    def client_paused(self) -> None:
        for sink in self.sinks:
            if sink.flow is not None:
                sink.flow.client_paused()

    def client_resumed(self) -> None:
        for sink in self.sinks:
            if sink.flow is not None:
                sink.flow.client_resumed()

    def client_gone(self) -> None:
        for sink in self.sinks:
            if sink.flow is not None:
                sink.flow.client_gone()

    def fail(self, err: ProxyError) -> None:
        """Record the first failure; the orchestrator cancels the other sequences and reports it."""
        if self.failure is None:
            self.failure = err
        self.failed.set()

    def _head(self, seq: Sequence, obj: dict[str, Any]) -> dict[str, Any]:
        """The ``id`` / ``created`` / ``model`` every chunk and answer carries: the first sequence's, its id naming
        the request (vLLM's ids embed the request id, ``chatcmpl-<X-Request-Id>``; a sequence's is ``<id>-<i>``)."""
        if self.head is None:
            head: dict[str, Any] = {k: obj[k] for k in ("id", "created", "model") if k in obj}
            if isinstance(head.get("id"), str):
                head["id"] = head["id"].replace(seq.ctx.request_id, self.ctx.request_id)
            self.head = head
            return head
        return self.head

    def _rewrite(self, seq: Sequence, obj: dict[str, Any]) -> dict[str, Any]:
        obj.update(self._head(seq, obj))
        choices = obj.get("choices")
        if isinstance(choices, list):
            for j, choice in enumerate(choices):
                if isinstance(choice, dict):
                    choice["index"] = seq.index + j
        return obj

    def _write(self, data: bytes, headers: list[tuple[bytes, bytes]]) -> None:
        """``data`` to the client (its status line first: with the first sequence's first events); one ITL gap
        counted per write after the first (:class:`pdproxy.timeline.GapCounts`)."""
        out = self.out
        now = time.monotonic()
        if not out.started:
            self.ctx.timeline.first_token_at = now
            keep = [h for h in headers if h[0] not in (b"x-request-id", b"content-type", b"cache-control",
                                                       b"x-accel-buffering")]
            out.start_nowait(200, [*SSE_HEADERS, *keep])
        elif self.gaps is not None:
            gap = now - self.last_write
            self.gaps.counts[bisect_left(self.gaps.bounds, gap)] += 1
            self.gaps.total += gap
        self.last_write = now
        self.ctx.events += 1
        out.conn.write(data)

    def sequence_events(self, sink: _SequenceSink, block: bytes) -> None:
        """A block of complete SSE events from one sequence's stream: chunks re-indexed and written, its usage
        chunk kept, ``[DONE]`` dropped, an error event fails the response, and so does an event whose data is not a
        JSON object (the decoder's malformed answer: never dropped unsaid)."""
        seq = sink.seq
        out: list[bytes] = []
        broken: ProxyError | None = None     # failed after the chunks before it, written as a relay would have
        malformed: bytes | None = None
        for event in sse.split_events(block):
            data = sse.event_data(event)
            if data is None or data == b"[DONE]":
                continue
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict):    # no chunk to merge: the decoder's malformed answer
                malformed = data
                break
            if "error" in obj:
                err = UpstreamHTTPError(500, data, endpoint=seq.ctx.decoder or "")   # as sent: JSON orjson may not
                # write again (nested past 254 levels)
                said = obj["error"].get("message") if isinstance(obj["error"], dict) else None
                if isinstance(said, str):    # the log's error: what the sequence's event says, not a made-up 500
                    err.message = f"sequence {seq.index}: {said}"
                self.fail(err)
                break
            if obj.get("choices") == [] and isinstance(obj.get("usage"), dict):
                self.usages.append((seq, obj["usage"]))
                if self.usage_chunk is None:
                    self.usage_chunk = obj
                continue
            written = dumps_or_none(self._rewrite(seq, obj))
            if written is None:              # nested past what orjson writes
                broken = _too_deep(seq.ctx.decoder)
                break
            out.append(sse.data_event(written))
        if out and self.failure is None and not self.out.ended:
            self._write(b"".join(out), sink.headers)
        if malformed is not None:
            broken = self._malformed(seq, malformed)      # worded after those chunks started the response
        if broken is not None:
            self.fail(broken)

    def _malformed(self, seq: Sequence, data: bytes) -> ProxyError:
        """The failure of sequence ``seq`` whose stream sent ``data``, an event that is not a JSON object: worded as
        a single stream's relay words a decoder's malformed answer (:func:`pdproxy.http.errors.transport_error` of
        a :class:`~pdproxy.http.client.ProtocolError`), since a merged stream cannot pass on what it cannot
        read (a single stream relays it as sent)."""
        decoder = seq.ctx.decoder or ""
        why = ProtocolError(f"sequence {seq.index} sent an event that is not a JSON object "
                            f"({len(data)} bytes starting {data[:24]!r})")
        why.public = "an event that is not a JSON object"
        started = self.out.started
        err = transport_error(why, f"decoder {decoder}", decoder, " mid-stream" if started else "")
        if started:
            err.note("; the response is incomplete")
        return err

    async def finish(self, sinks: list[_SequenceSink]) -> None:
        """Every sequence succeeded: end the stream (usage chunk, ``[DONE]``) or send the merged JSON answer."""
        out = self.out
        if self.stream:
            tail = b""
            usage = merge_usage(self.usages, stream=True)
            if self.include_usage and usage is not None:
                chunk = dict(self.usage_chunk or {"object": "chat.completion.chunk" if self.req.api is Api.CHAT
                                                   else "text_completion", "choices": []})
                chunk.update(self.head or {})
                chunk["usage"] = usage
                written = dumps_or_none(chunk)
                if written is None:  # a usage chunk nested past what orjson writes: no merge of it
                    raise _too_deep(self.ctx.decoder)
                tail = sse.data_event(written)
            self._account(usage)
            if not out.started:
                out.start_nowait(200, list(SSE_HEADERS))
            out.done_sent = True
            self.ctx.timeline.last_token_at = time.monotonic()
            out.end_nowait(tail + sse.DONE_EVENT)
            return
        answers: list[tuple[Sequence, dict[str, Any]]] = []
        headers: list[tuple[bytes, bytes]] = []
        for sink in sinks:
            try:   # relayed alone, an answer is checked by shape only (decode.json_answer_fault); merged, it is read
                obj = orjson.loads(b"".join(sink.body))
            except orjson.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict):
                raise UpstreamUnavailable(f"decoder {sink.seq.ctx.decoder} answered with a body that is not a JSON "
                                          "object", endpoint=sink.seq.ctx.decoder or "")
            answers.append((sink.seq, obj))
            headers = headers or [h for h in sink.headers if h[0].startswith(b"x-pdproxy-")]
        answers.sort(key=lambda so: so[0].index)
        merged = dict(answers[0][1])
        merged.update(self._head(answers[0][0], merged))
        choices: list[Any] = []
        for seq, obj in answers:
            for j, choice in enumerate(obj.get("choices") or []):
                if isinstance(choice, dict):
                    choices.append({**choice, "index": seq.index + j})
        merged["choices"] = choices
        usage = merge_usage([(s, o["usage"]) for s, o in answers if isinstance(o.get("usage"), dict)], stream=False)
        if usage is not None:
            merged["usage"] = usage
        self._account(usage)
        self.ctx.timeline.first_token_at = self.ctx.timeline.last_token_at = time.monotonic()
        body = dumps_or_none(merged)
        if body is None:  # an answer nested past what orjson writes: no merge of it
            raise _too_deep(self.ctx.decoder)
        await out.json(200, body, headers)

    def _account(self, usage: dict[str, Any] | None) -> None:
        if usage is None:
            return
        if isinstance(usage.get("completion_tokens"), int):
            self.ctx.completion_tokens = usage["completion_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.ctx.cached_tokens = details["cached_tokens"]


class FanOut:
    """Serves a request of several sequences (module docstring): ``admit`` counts and admits one prompt
    (:meth:`pdproxy.admission.admission.Admission.admit`), ``run`` serves one sequence on its P→D path
    (:meth:`pdproxy.pd.director.Director.run_sequence`); ``max_sequences``: the ``fan_out_max_sequences`` setting;
    ``max_bytes`` / ``max_items``: the sequences' bodies' bounds together (:func:`plan`)."""

    def __init__(self, *, admit: Admit, run: Run, max_sequences: int, max_bytes: int | None = None,
                 max_items: int | None = None) -> None:
        self.admit = admit
        self.run = run
        self.max_sequences = max_sequences
        self.max_bytes = max_bytes
        self.max_items = max_items

    async def serve(self, req: ProxyRequest, ctx: RequestContext, out: Responder) -> None:
        """Serve ``req`` (``req.sequences > 1``) to ``out``.  Raises :class:`BadRequest` (the plan's bounds), an
        admission refusal, or the first sequence failure while nothing reached the client."""
        check(req, self.max_sequences)
        seqs = plan(req, ctx, self.max_bytes, self.max_items)
        await self._admit(seqs, ctx)
        merger = Merger(req, ctx, out)
        sinks = [_SequenceSink(merger, s) for s in seqs]
        merger.attach(sinks)
        tasks = [asyncio.get_running_loop().create_task(self._sequence(merger, s, sinks[i], seqs))
                 for i, s in enumerate(seqs)]
        done = asyncio.gather(*tasks)
        failed = asyncio.ensure_future(merger.failed.wait())
        try:
            await asyncio.wait((done, failed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
            for task in tasks:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await done
            merger.detach()
            self._summarise(ctx, seqs)
        if merger.failure is not None:
            ctx.outcome = merger.failure.outcome
            raise merger.failure
        await merger.finish(sinks)

    async def _admit(self, seqs: list[Sequence], ctx: RequestContext) -> None:
        """Admit each prompt once (its first child); the siblings share its count and path."""
        firsts: dict[int, Sequence] = {}
        for seq in seqs:
            first = firsts.get(seq.prompt_index)
            if first is None:
                firsts[seq.prompt_index] = seq
                await self.admit(seq.req, seq.ctx)
                continue
            seq.req.size_from(first.req, 0)                         # the same prompt: its count and bounds
            seq.ctx.prompt_tokens = first.ctx.prompt_tokens
            seq.ctx.disaggregated = first.ctx.disaggregated
            seq.ctx.timeline.admitted_at = first.ctx.timeline.admitted_at
        ctx.prompt_tokens = sum(s.ctx.prompt_tokens or 0 for s in firsts.values())
        ctx.timeline.admitted_at = time.monotonic()

    async def _sequence(self, merger: Merger, seq: Sequence, sink: _SequenceSink, seqs: list[Sequence]) -> None:
        """Run one sequence: after its prompt's first child prefilled (siblings), on its own P→D path; a failure is
        reported to the merger (never raised)."""
        first = next(s for s in seqs if s.prompt_index == seq.prompt_index)

        def prefilled(endpoint: Endpoint) -> None:
            seq.prefiller = endpoint
            seq.prefilled.set()

        seq.ctx.on_prefilled = prefilled
        try:
            affinity: Endpoint | None = None
            if first is not seq and first.ctx.disaggregated:
                await first.prefilled.wait()
                affinity = first.prefiller
            out = Responder(sink, seq.ctx, [], seq.req.api)
            await self.run(seq.req, seq.ctx, out, affinity)
            if merger.stream and out.started and not out.done_sent:
                merger.fail(UpstreamUnavailable(f"sequence {seq.index} ended without data: [DONE]",
                                                endpoint=seq.ctx.decoder or ""))
            elif not merger.stream and sink.status != 200:
                merger.fail(UpstreamHTTPError(sink.status or 502, b"".join(sink.body),
                                              endpoint=seq.ctx.decoder or ""))
        except ProxyError as err:
            merger.fail(err)
        except Exception as exc:             # a bug, not an engine condition: still fail the response honestly
            log.exception("sequence %s of request %s failed", seq.index, seq.ctx.request_id)
            merger.fail(InternalError(exc))
        finally:
            seq.prefilled.set()              # siblings never wait on a sequence that is over

    @staticmethod
    def _summarise(ctx: RequestContext, seqs: list[Sequence]) -> None:
        """The parent context from its sequences: the first one's endpoints, summed events, the phase marks, the
        engine's prompt count (each prompt's once), the continued sequences' later ids and lost decoders."""
        first = seqs[0].ctx
        ctx.prefiller, ctx.decoder, ctx.decoder_dp_rank = first.prefiller, first.decoder, first.decoder_dp_rank
        tl = ctx.timeline
        marks = [s.ctx.timeline for s in seqs]
        starts = [m.prefill_start_at for m in marks if m.prefill_start_at is not None]
        ends = [m.prefill_end_at for m in marks if m.prefill_end_at is not None]
        decodes = [m.decode_start_at for m in marks if m.decode_start_at is not None]
        tl.prefill_start_at = min(starts) if starts else None
        tl.prefill_end_at = min(ends) if ends else None
        tl.decode_start_at = min(decodes) if decodes else None
        lasts = [m.last_token_at for m in marks if m.last_token_at is not None]
        if lasts:
            tl.last_token_at = max(lasts)
        for s in seqs:
            if s.ctx.outcome != "ok" and ctx.outcome == "ok":
                ctx.outcome = s.ctx.outcome
        prompts: dict[int, int] = {}     # the engine's count of each prompt, from its first sequence that has one
        for s in seqs:
            if s.ctx.engine_prompt_tokens is not None:
                prompts.setdefault(s.prompt_index, s.ctx.engine_prompt_tokens)
        ctx.engine_prompt_tokens = sum(prompts.values()) if prompts else None
        for s in seqs:                   # a continued sequence: its later legs' ids and lost decoders, in order
            ctx.continued_as += s.ctx.continued_as
            ctx.lost_decoders += s.ctx.lost_decoders
