"""Per-request context: ids, the chosen endpoints, and a timeline of monotonic marks.

Definitions (used by metrics, logs and load tests alike):

- **TTFT** = ``first_token_at − arrived_at`` as the client sees it: admission wait + prefill round trip + KV
  handoff + the decoder's first event;
- **ITL** = gaps between consecutive relayed event writes (one write may carry several events);
- **TPOT** = ``(last_token_at − first_token_at) / (completion_tokens − 1)``;
- **E2E** = ``finished_at − arrived_at``;
- phases: ``admission_wait_s`` (arrived → admitted), ``prefill_s`` (prefill start → prefill end),
  ``pd_gap_s`` (prefill end → decode leg sent), ``decode_first_token_s`` (decode sent → first event),
  ``decode_s`` (first event → finished).

All ``*_at`` values are ``time.monotonic()`` seconds; all ``*_s`` values are durations in seconds.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from pdproxy.endpoints import Endpoint


class GapCounts:
    """One stream's inter-token gaps as histogram bucket counts, filled by the relay at the cost of one
    ``bisect`` and one list increment per write (``counts[bisect_left(bounds, gap)] += 1; total += gap``) and added
    to ``pdproxy_inter_token_latency_seconds`` once when the request ends (:meth:`ProxyMetrics.observe`).

    ``bounds``: the histogram's upper bounds in seconds (``+Inf`` last); ``counts[i]``: gaps ``≤ bounds[i]`` and
    ``> bounds[i-1]``; ``total``: their sum (seconds)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0


@dataclass(slots=True)
class Timeline:
    """Monotonic marks of one request (seconds; None = not reached)."""

    arrived_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    prefill_start_at: float | None = None
    prefill_end_at: float | None = None
    decode_start_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None

    @staticmethod
    def _span(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else max(0.0, b - a)

    def phases(self) -> dict[str, float | None]:
        """The phase split in seconds (see module docstring)."""
        return {
            "admission_wait_s": self._span(self.arrived_at, self.admitted_at),
            "prefill_s": self._span(self.prefill_start_at, self.prefill_end_at),
            "pd_gap_s": self._span(self.prefill_end_at, self.decode_start_at),
            "decode_first_token_s": self._span(self.decode_start_at, self.first_token_at),
            "decode_s": self._span(self.first_token_at, self.finished_at),
            "ttft_s": self._span(self.arrived_at, self.first_token_at),
            "e2e_s": self._span(self.arrived_at, self.finished_at),
        }


CLIENT_REQUEST_ID_MAX: Final = 96
"""The longest client ``X-Request-Id`` kept, in characters: longer ones are cut to this length wherever they are
read (pdproxy/http/server.py cuts the header field as it arrives) and in the engine-side id."""


MODEL_SHOWN_MAX: Final = 256
"""The longest client ``model`` name written into a log line or a span as it is, in characters (:func:`clip`):
the body may hold one of megabytes, which the 404 answering it quotes whole, as vLLM's does."""
TEXT_SHOWN_MAX: Final = 2048
"""The longest other text carrying client input (an error message quoting a field) written into a log line or a
span attribute, in characters (:func:`clip`; spans: the SDK's ``SpanLimits``, pdproxy/ops/tracing_otel.py)."""


def clip(text: str | None, limit: int) -> str | None:
    """``text`` as it is when it has at most ``limit`` characters, else its first ``limit`` and how many were cut
    (``"…[+N chars]"``); None stays None.  For client input written to logs and spans: their size is bounded
    whatever the client sends."""
    if text is None or len(text) <= limit:
        return text
    return f"{text[:limit]}…[+{len(text) - limit} chars]"


_SAFE_ID: Final = re.compile(r"[A-Za-z0-9_.:-]+")
"""A client id kept as it is (the common case, one C-level match); any other is filtered character by character."""


def new_request_id(client_id: str | None) -> str:
    """A unique engine-side request id that keeps the client's ``X-Request-Id`` recognisable as its prefix.

    Engines key the KV transfer on this id and two clients may send the same one, so random bits are always in
    it (colliding ids corrupt the engine: vLLM itself adds 8 random characters to every id for this,
    ``vllm/v1/engine/input_processor.py::assign_request_id``; vLLM-Ascend replaced counters with uuid4): the id
    is 128 random bits (32 hex digits, as many as a uuid4 holds), or the client's id (its characters outside
    ``[A-Za-z0-9-_.:]`` dropped) then ``-`` and 64 random bits (16 hex digits: two ids that share a client's id
    collide with odds of 2^-64, and only ids in flight together matter to an engine).
    """
    suffix = os.urandom(16).hex()  # 128 random bits, as a uuid4 (without building one: ~2 µs less)
    if client_id:
        client_id = client_id[:CLIENT_REQUEST_ID_MAX]
        safe = client_id if _SAFE_ID.fullmatch(client_id) else "".join(
            c for c in client_id if c in "-_.:" or (c.isascii() and c.isalnum()))   # ASCII: a header value
        if safe:
            return f"{safe}-{suffix[:16]}"
    return suffix


@dataclass(slots=True)
class RequestContext:
    """What one request carries through the path: ids, auth, chosen endpoints, outcome, timeline.

    Every field has one owner that writes it (others only read, for metrics, the request log and spans); the
    passthrough routes (``pdproxy/app/passthrough.py``) and fan-out (``pdproxy/pd/fanout.py``, each sequence's
    own context summed into the client's) stand in for the P→D owners on their own paths:

    - ``request_id``, ``client_request_id``, ``api_label``, ``client_headers`` (the client's request headers as
      (lower-case name, value) byte pairs, read only when needed: the trace context, pdproxy/ops/tracing.py),
      ``authorization``, ``model``, ``gaps``, ``engine_request``: the route handler (``pdproxy/app/application.py``) when the
      request arrives; ``request_id`` is renewed by the director for a continuation (``pdproxy/pd/director.py``,
      :meth:`renew_request_id`, which keeps the first id, the later ones and the lost decoders in
      ``first_request_id``, ``continued_as`` and ``lost_decoders``; fan-out sums its sequences' into the client's);
    - ``prompt_tokens``, ``disaggregated``, ``timeline.admitted_at``: admission
      (``pdproxy/admission/admission.py``); the prefix lookup replaces ``prompt_tokens`` by the engine's count
      (``pdproxy/prefix/routing.py``), which also owns ``predicted_cached_tokens`` and ``prefix_mode``;
    - ``prefiller``, ``engine_prompt_tokens``, ``cached_tokens``, ``timeline.prefill_start_at`` /
      ``prefill_end_at``: the prefill leg (``pdproxy/pd/prefill.py``; the director clears ``cached_tokens`` when a
      decoder prefills after all); ``on_prefilled`` is set by fan-out and called by the prefill leg;
    - ``decoder``, ``decoder_dp_rank``, ``timeline.decode_start_at``: the decode leg (``pdproxy/pd/decode.py``);
    - ``events``, ``timeline.first_token_at`` / ``last_token_at`` and the counts in ``gaps``: the relay
      (``pdproxy/pd/relay.py``; for a JSON answer the decode leg, for an answer from the prefiller
      ``pdproxy/pd/prefill_answer.py``); ``completion_tokens``: the stream transforms that read usage
      (``pdproxy/apis/chat.py``, ``pdproxy/apis/streams.py``) or the JSON answer's reader;
    - ``status``: the responder when the status line goes out (``pdproxy/pd/responder.py``);
    - ``outcome``, ``error``, ``rejection``, ``timeline.finished_at``: the route handler from the error that
      ended the request; a failure after the response started is the relay's (``outcome``, ``error``).
    """

    request_id: str
    client_request_id: str | None
    api_label: str
    authorization: str | None = None
    model: str | None = None
    prefiller: str | None = None
    decoder: str | None = None
    decoder_dp_rank: int | None = None
    prompt_tokens: int | None = None
    engine_prompt_tokens: int | None = None  # the prefiller's usage.prompt_tokens (admission may have estimated)
    cached_tokens: int | None = None
    predicted_cached_tokens: int | None = None  # prefix routing's prediction for the prefiller (pdproxy/prefix/routing.py)
    prefix_mode: str | None = None  # where that prediction came from: precise | approximate | text
    completion_tokens: int | None = None
    events: int = 0
    status: int = 0
    outcome: str = "ok"
    error: str | None = None
    rejection: tuple[str, str] | None = None  # (reason, detail) when pdproxy refused the request (pdproxy/ops/metrics.py)
    gaps: GapCounts | None = None  # ITL: the relay counts each gap between client writes (:class:`GapCounts`)
    on_prefilled: Callable[[Endpoint], None] | None = None  # called with the prefiller once its answer is in (fan-out)
    disaggregated: bool = True
    engine_request: bool = True  # False: a call about the model (tokenize, render...), not timed as a request
    timeline: Timeline = field(default_factory=Timeline)
    client_headers: Sequence[tuple[bytes, bytes]] = ()
    retries: tuple[tuple[str, str, bool], ...] = ()  # (leg, reason, failover) per retried leg attempt (metrics.py)
    first_request_id: str | None = None  # a continued stream's first engine-side id (the one the client saw)
    continued_as: tuple[str, ...] = ()  # a continued stream's later engine-side ids, in order (fan-out: all)
    lost_decoders: tuple[str, ...] = ()  # the decoders a continued stream lost or was preempted by, in order (names)

    @property
    def client_visible_id(self) -> str:
        """The id the client saw (the response's ``id`` embeds it, and the ``X-Request-Id`` answer header is it
        when the client sent none): ``request_id``, or for a continued stream the first leg's (a continuation
        renews ``request_id`` for the engines)."""
        return self.first_request_id or self.request_id

    def renew_request_id(self, lost_decoder: str) -> None:
        """A continuation leg starts: the engines get a new ``request_id`` (kept in ``continued_as``; the first in
        ``first_request_id``); ``lost_decoder``: the endpoint name of the decoder lost (or that preempted the
        request: vLLM-Ascend's ``stop_reason "recomputed"``)."""
        if self.first_request_id is None:
            self.first_request_id = self.request_id
        self.request_id = new_request_id(self.client_request_id)
        self.continued_as += (self.request_id,)
        self.lost_decoders += (lost_decoder,)

    def retried(self, leg: str, reason: str, *, failover: bool = False) -> None:
        """A failed ``leg`` attempt (``"prefill"`` | ``"decode"``) is being tried again on another endpoint;
        ``reason``: the failure's ``ProxyError.outcome``; ``failover``: the request moves to a new P/D pair (the
        KV handle was lost, so it is prefilled again).  Counted into ``/metrics`` when the request ends."""
        self.retries += ((leg, reason, failover),)
