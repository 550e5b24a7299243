"""Prometheus metrics of one proxy app: ``GET /metrics``.

Names mirror vLLM's (``vllm/v1/metrics/loggers.py``) with a ``pdproxy_`` prefix; times are seconds,
sizes tokens.  Three kinds of series:

- **per request** (observed once, when a request ends — :meth:`ProxyMetrics.observe`), the request, latency and
  token series also labelled ``model_name`` as vLLM's are (not the rejections, retries and failovers): the
  request's model when an engine lists it (a base model or a LoRA adapter; or the operator pinned it), else ``""``
  (no model, an unknown one) — so several models behind one port keep their own series, and a client's made-up
  names add none (:meth:`ProxyMetrics.model_label`):
  ``pdproxy_requests_total{api,status,outcome}``; ``pdproxy_rejections_total{reason,detail}`` for requests pdproxy
  refused itself (``too_long``/``max_model_len``|``kv_pool``, ``queue_full``, ``deadline``,
  ``no_endpoint``/``prefill``|``decode``, ``bad_request``/param …); client-visible
  ``pdproxy_time_to_first_token_seconds``, ``pdproxy_inter_token_latency_seconds`` (one observation per gap
  between consecutive writes of a stream to the client, observed by the relay as it writes; a write may carry
  several events: the engine's stream interval above 1, or every event of one read from a decoder ahead of the
  proxy — the client gets them at one instant),
  ``pdproxy_request_time_per_output_token_seconds`` (streams of two events or more whose ``completion_tokens`` is
  known: a JSON answer arrives at one instant),
  ``pdproxy_e2e_request_latency_seconds{api,outcome}``; and the phase split of :meth:`Timeline.phases`:
  ``pdproxy_admission_wait_seconds``, ``pdproxy_prefill_time_seconds``, ``pdproxy_pd_gap_seconds``,
  ``pdproxy_decode_first_token_seconds``, ``pdproxy_decode_time_seconds`` — none of these latencies for a call
  about the model (``/tokenize``, ``/detokenize``, ``count_tokens``, the render routes:
  ``RequestContext.engine_request``), for which vLLM times no request either; ``pdproxy_requests_in_progress{api}``
  (no ``model_name``: counted before the body is read);
  tokens through the proxy, as vLLM's ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``:
  ``pdproxy_prompt_tokens_total{api}`` (the prefiller's ``usage.prompt_tokens``, else pdproxy's count, for requests
  sent to an engine) and ``pdproxy_generation_tokens_total{api}`` (``completion_tokens``); retried leg attempts, as
  vllm-router's retry counters: ``pdproxy_retries_total{leg,reason}`` (``leg`` = ``prefill`` | ``decode``,
  ``reason`` = the failed attempt's outcome: ``upstream_error``, ``timeout`` …; each retry goes to another
  endpoint) and ``pdproxy_failovers_total{leg,reason}`` (the decode failures among them that moved the request to a
  new P/D pair, prefilling it again, because the KV handle was lost);
- **stream continuation** (counted as it happens, :class:`ContinuationMetrics`; docs/stream-continuation.md):
  ``pdproxy_continuations_total{cause,api}`` (a started stream whose decoder was lost and that goes on: ``cause`` =
  ``reset`` | ``no_end`` | ``error_event`` | ``stall`` | ``drain``), ``pdproxy_continuations_refused_total{reason,api}``
  (lost and ended with the typed error event: ``ineligible`` | ``tool_or_reasoning`` | ``closing`` |
  ``no_token_ids`` | ``unreadable`` | ``max_continuations`` | ``timeout`` | ``failed``),
  ``pdproxy_continuation_prefill_tokens_total{api}``
  (the continuation legs' prompts, prefilled again — never in the client's usage nor in
  ``pdproxy_prompt_tokens_total``) and ``pdproxy_continuation_gap_seconds{api}`` (client-visible: the last write
  before the loss to the continuation's first event);
- **release legs** (copied from the director's releaser, :meth:`ProxyMetrics.follow_releases`):
  ``pdproxy_kv_release_legs_total{outcome}`` (``sent``: a decoder was told to free the prefiller's pinned KV;
  ``no_decoder``: none could be asked, the KV stays pinned until the connector's timeout);
- **admission** (copied from its counters, :meth:`ProxyMetrics.sync`): ``pdproxy_prefill_queue_depth``,
  ``pdproxy_prefill_queue_waited_total``, ``…_wait_seconds_total``, ``…_full_total``, ``…_timed_out_total``,
  ``pdproxy_decode_only_total{reason}``, ``pdproxy_prompt_counts_total{method}``,
  ``pdproxy_prompt_count_seconds_total``, ``pdproxy_prompt_count_errors_total``, ``pdproxy_tokenize_skipped_total``;
- **proxy state at scrape time** (a collector reading ``ProxyState``): per endpoint
  ``pdproxy_inflight_requests``, ``pdproxy_inflight_tokens``, ``pdproxy_endpoint_healthy``,
  ``pdproxy_endpoint_draining``, ``pdproxy_endpoint_breaker_state{state}`` (1 for the current state),
  ``pdproxy_endpoint_breaker_opened_total``, per prefiller ``pdproxy_prefill_budget_tokens``; with ``--workers N``
  also ``pdproxy_worker_inflight_requests{worker}``;
- **prefix cache** (when a ``PrefixCacheCollector`` is added with :meth:`ProxyMetrics.add_collector`, as the app
  does): ``pdproxy_kv_events_*`` and ``pdproxy_prefix_index_*`` (:mod:`pdproxy.prefix.metrics`); and per request,
  prefix routing's prediction for the prefiller against its report, by the prediction's ``source`` (``precise`` |
  ``approximate`` | ``text``): ``pdproxy_prefix_predicted_cached_tokens_total{source}``,
  ``pdproxy_prefix_actual_cached_tokens_total{source}``, ``pdproxy_prefix_predictions_total{source,outcome}``
  (``exact`` | ``over`` | ``under`` | ``unreported``);
- **the engines' own gauges**, as last read from each engine's ``/metrics`` by the health loop
  (``state.infos``), re-exported with ``role``/``endpoint``/``dp_rank`` labels:
  ``pdproxy_engine_up``, ``pdproxy_engine_max_model_len``, ``pdproxy_engine_kv_pool_tokens`` (``num_gpu_blocks ×
  block_size`` from ``vllm:cache_config_info``), ``pdproxy_engine_num_requests_running``,
  ``pdproxy_engine_num_requests_waiting``, ``pdproxy_engine_num_requests_waiting_by_reason{reason}``,
  ``pdproxy_engine_kv_cache_usage_perc``, ``pdproxy_engine_info_age_seconds``.  Internal-DP ranks behind one URL
  share that URL's figures.

Several workers (``pdproxy serve --workers N``): prometheus-client's multiprocess mode.  The supervisor sets
``PROMETHEUS_MULTIPROC_DIR`` before the workers start; counters and histograms then live in per-process files in
that directory and every scrape — whichever worker answers — sums all of them (``MultiProcessCollector``);
``pdproxy_requests_in_progress`` is a ``livesum`` gauge.  The state collector needs no files: in-flight counts come
from the shared load board (:mod:`pdproxy.workers.board`), which already holds every worker's leases, and engine
gauges are the answering worker's latest reading.  Each app owns its registry; nothing is registered globally.
"""

from __future__ import annotations

import os
from bisect import bisect_left
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from pdproxy.errors import BadRequest, NoEndpointAvailable, Overloaded, PayloadTooLarge, PromptTooLong, ProxyError
from pdproxy.ops.collector import MetricsState, StateCollector
from pdproxy.timeline import GapCounts, RequestContext

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# vLLM's TTFT buckets (loggers.py: 0.001 … 2560 s), and one set for the shorter phases and gaps.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Timeline.phases() key → (metric name, help, buckets)
PHASES: Final[Mapping[str, tuple[str, str, tuple[float, ...]]]] = MappingProxyType({
    "admission_wait_s": ("pdproxy_admission_wait_seconds", "Arrival to admission (proxy queue wait).", TTFT_BUCKETS),
    "prefill_s": ("pdproxy_prefill_time_seconds", "Prefill leg round trip (last attempt).", TTFT_BUCKETS),
    "pd_gap_s": ("pdproxy_pd_gap_seconds", "Prefill answer to decode leg sent (P→D handoff in the proxy).",
                 GAP_BUCKETS),
    "decode_first_token_s": ("pdproxy_decode_first_token_seconds",
                             "Decode leg sent to the decoder's first event (KV pull + first token).", TTFT_BUCKETS),
    "decode_s": ("pdproxy_decode_time_seconds", "First relayed event to the end of the response.", E2E_BUCKETS),
})


class ReleaseCounts(Protocol):
    """What :meth:`ProxyMetrics.follow_releases` reads: the release legs a releaser ran (plain running totals,
    ``pdproxy/pd/kv_release.py``'s ``KVReleaser``)."""

    released: int  # release legs sent to a decoder (whatever it answered)
    failed: int  # releases no decoder could take


PARAM_LABELS = frozenset({
    "body", "model", "messages", "prompt", "prompt_embeds", "input", "instructions", "system", "tools",
    "tool_choice", "max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens", "n", "stream",
    "stream_options", "echo", "logprobs", "prompt_logprobs", "use_beam_search", "background", "input_tokens",
    "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "sampling_params", "request_id", "force", "url",
    "thinking", "cache_salt"})
"""The ``detail`` label values of a ``bad_request`` rejection: the request fields pdproxy itself judges."""


def param_label(param: str | None) -> str:
    """A 400's ``param`` as a label value from a closed set (:data:`PARAM_LABELS`, ``""`` for none, ``"other"``):
    its first field, ``body.`` and positions dropped — ``body.1834`` (a JSON syntax error's offset) is ``body``,
    ``body.messages.3.content`` is ``messages`` — so no client can mint a new series per request."""
    if not param:
        return ""
    parts = param.split(".")
    field = parts[1] if parts[0] == "body" and len(parts) > 1 and not parts[1].isdigit() else parts[0]
    return field if field in PARAM_LABELS else "other"


def rejection_of(err: ProxyError) -> tuple[str, str] | None:
    """``(reason, detail)`` when pdproxy refused a request itself, else None (engine errors are not rejections).

    An error may declare ``rejection = (reason, detail)`` (:attr:`ProxyError.rejection`); otherwise: :class:`PromptTooLong` →
    ``("too_long", limit_kind)``, :class:`Overloaded` → ``("queue_full", "")``, :class:`NoEndpointAvailable` →
    ``("no_endpoint", role)``, an outcome of ``deadline`` → ``("deadline", "")``, :class:`PayloadTooLarge` →
    ``("too_large", "body")``, :class:`BadRequest` → ``("bad_request", param_label(param))``, other proxy-side outcomes →
    ``(outcome, "")``.
    """
    if err.rejection is not None:
        return err.rejection
    if isinstance(err, PromptTooLong):
        return "too_long", err.limit_kind
    if isinstance(err, Overloaded):
        return "queue_full", ""
    if isinstance(err, NoEndpointAvailable):
        return "no_endpoint", err.role
    if err.outcome in ("deadline", "deadline_exceeded"):
        return "deadline", ""
    if isinstance(err, PayloadTooLarge):
        return "too_large", "body"
    if isinstance(err, BadRequest):
        return "bad_request", param_label(err.param)
    if err.outcome in ("unauthorized", "shutting_down"):
        return err.outcome, ""
    return None


def _observe(hist_child: Any, value: float) -> None:
    """``hist_child.observe(value)`` (one labelled prometheus ``Histogram`` child, no exemplar): the same stored
    values, the bucket found by bisection instead of ``observe``'s Python loop over every bound (a request
    observes several histograms; works in multiprocess mode too, as :func:`_add_gaps`)."""
    bounds = hist_child._upper_bounds
    i = bisect_left(bounds, value)
    hist_child._sum.inc(value)
    if i < len(bounds) and value <= bounds[i]:  # always, but for NaN (which observe puts in no bucket)
        hist_child._buckets[i].inc(1)


def _add_gaps(hist_child: Any, gaps: GapCounts) -> None:
    """Add ``gaps`` to one labelled prometheus ``Histogram`` child: the same stored values ``observe`` would
    write, one increment per non-empty bucket (works in multiprocess mode too: the values are its mmap files)."""
    buckets = hist_child._buckets
    for i, n in enumerate(gaps.counts):
        if n:
            buckets[i].inc(n)
    if gaps.total:
        hist_child._sum.inc(gaps.total)


class ContinuationMetrics:
    """The stream-continuation families (see the module docstring), counted as continuations happen: the
    director's observer (``pdproxy.pd.continuation.ContinuationObserver``, set on the app's ``LiveStreams``).
    ``cause`` / ``reason`` come from closed enums there, ``api`` from the request's API label."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.continuations = Counter("pdproxy_continuations", "Started streams whose decoder was lost and that "
                                     "continued on another P/D pair, by cause (reset | no_end | error_event | stall "
                                     "| drain) and API.", ("cause", "api"), registry=registry)
        self.refusals = Counter("pdproxy_continuations_refused", "Started streams whose decoder was lost and that "
                                "ended with the typed error event instead, by reason and API.", ("reason", "api"),
                                registry=registry)
        self.prefill_tokens = Counter("pdproxy_continuation_prefill_tokens", "Prompt tokens of continuation legs "
                                      "(the original prompt + the delivered tokens), prefilled again; never in "
                                      "usage.", ("api",), registry=registry)
        self.gaps = Histogram("pdproxy_continuation_gap_seconds", "Client-visible gap of a continuation: the last "
                              "write before the loss to the continuation's first event.", ("api",),
                              buckets=TTFT_BUCKETS, registry=registry)
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, family: Any, *values: str) -> Any:
        child = self._children.get((family, values))
        if child is None:
            child = self._children[(family, values)] = family.labels(*values)
        return child

    def continued(self, cause: str, api: str) -> None:
        """One continuation of a lost stream."""
        self._child(self.continuations, str(cause), api).inc()

    def refused(self, reason: str, api: str) -> None:
        """One lost stream not continued."""
        self._child(self.refusals, str(reason), api).inc()

    def reprefilled(self, api: str, tokens: int) -> None:
        """One continuation leg's prompt tokens."""
        if tokens > 0:
            self._child(self.prefill_tokens, api).inc(tokens)

    def gap(self, api: str, seconds: float) -> None:
        """One continuation's client-visible gap (seconds)."""
        self._child(self.gaps, api).observe(seconds)


class ProxyMetrics:
    """The metric families of one app, its registry, and :meth:`render` for ``GET /metrics``.

    ``state``: returns the current ``ProxyState`` (None outside the lifespan).  ``multiprocess_dir``: the
    prometheus multiprocess directory; default ``$PROMETHEUS_MULTIPROC_DIR`` if set (then prometheus-client was
    imported in multiprocess mode too).
    """

    def __init__(self, state: Callable[[], MetricsState | None], multiprocess_dir: str | None = None,
                 known_model: Callable[[str], bool] | None = None) -> None:
        self._known_model = known_model or (lambda model: False)
        self.multiprocess_dir = multiprocess_dir or os.environ.get(MULTIPROC_ENV) or None
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        api = ("api",)
        per_model = ("api", "model_name")
        Hist = Histogram
        self.requests = Counter("pdproxy_requests", "Completion requests by API, HTTP status and outcome.",
                                ("api", "status", "outcome", "model_name"), registry=reg)
        self.rejections = Counter("pdproxy_rejections", "Requests pdproxy refused itself, by reason.",
                                  ("reason", "detail"), registry=reg)
        self.in_progress = Gauge("pdproxy_requests_in_progress", "Completion requests being served.", api,
                                 registry=reg, multiprocess_mode="livesum")
        self.ttft = Hist("pdproxy_time_to_first_token_seconds", "Client-visible time to first token.", per_model,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Hist("pdproxy_inter_token_latency_seconds",
                             "Client-visible inter-token latency: each gap between consecutive writes of a stream.",
                             per_model, buckets=GAP_BUCKETS, registry=reg)
        self.tpot = Hist("pdproxy_request_time_per_output_token_seconds",
                              "(last token − first token) / (completion_tokens − 1).", per_model, buckets=GAP_BUCKETS,
                              registry=reg)
        self.e2e = Hist("pdproxy_e2e_request_latency_seconds", "Arrival to the end of the response.",
                             ("api", "outcome", "model_name"), buckets=E2E_BUCKETS, registry=reg)
        self.phases = {key: Hist(name, doc, per_model, buckets=buckets, registry=reg)
                       for key, (name, doc, buckets) in PHASES.items()}
        self.admission = {
            "decode_only_total": Counter("pdproxy_decode_only", "Requests sent straight to a decoder (conditional "
                                         "disaggregation), by reason.", ("reason",), registry=reg),
            "counted_total": Counter("pdproxy_prompt_counts", "Prompts counted, by method (ids | bound | local | "
                                     "engine | estimate).", ("method",), registry=reg),
            "count_errors_total": Counter("pdproxy_prompt_count_errors", "Engine /tokenize calls that failed, or "
                                          "counts that found no place under tokenize_max_inflight in time.",
                                          registry=reg),
            "count_seconds_total": Counter("pdproxy_prompt_count_seconds", "Time spent counting prompts.",
                                           registry=reg),
            "tokenize_skipped_total": Counter("pdproxy_tokenize_skipped", "Precise prefix keys made from the text: "
                                              "the engine's tokenize_max_inflight places were taken.", registry=reg),
        }
        self.queue = {
            "waited_total": Counter("pdproxy_prefill_queue_waited", "Requests that waited for a prefill slot.",
                                    registry=reg),
            "wait_seconds_total": Counter("pdproxy_prefill_queue_wait_seconds", "Time spent waiting for prefill "
                                          "slots.", registry=reg),
            "rejected_full_total": Counter("pdproxy_prefill_queue_full", "Requests refused: prefill queue full.",
                                           registry=reg),
            "timed_out_total": Counter("pdproxy_prefill_queue_timed_out", "Requests that waited past the queue "
                                       "deadline.", registry=reg),
        }
        self.prefix_predicted = Counter(
            "pdproxy_prefix_predicted_cached_tokens", "Prefix routing: cached tokens predicted for the prefiller "
            "each request went to, by the prediction's source (precise | approximate | text).", ("source",),
            registry=reg)
        self.prefix_actual = Counter(
            "pdproxy_prefix_actual_cached_tokens", "Prefix routing: cached tokens the prefiller reported "
            "(usage.prompt_tokens_details.cached_tokens) for the same requests, by the prediction's source.",
            ("source",), registry=reg)
        self.prefix_predictions = Counter(
            "pdproxy_prefix_predictions", "Prefix routing: predictions by source and outcome against the "
            "prefiller's report (exact | over | under | unreported).", ("source", "outcome"), registry=reg)
        self.prompt_tokens = Counter("pdproxy_prompt_tokens", "Prompt tokens of requests sent to an engine (the "
                                     "prefiller's usage.prompt_tokens, else pdproxy's count).", per_model, registry=reg)
        self.generation_tokens = Counter("pdproxy_generation_tokens", "Generated tokens relayed to clients "
                                         "(completion_tokens).", per_model, registry=reg)
        self.retries = Counter("pdproxy_retries", "Leg attempts sent again on another endpoint after a failure, by "
                               "leg (prefill | decode) and the failure's outcome.", ("leg", "reason"), registry=reg)
        self.failovers = Counter("pdproxy_failovers", "Decode failures that moved the request to a new P/D pair "
                                 "(prefilled again: the KV handle was lost), by leg and the failure's outcome.",
                                 ("leg", "reason"), registry=reg)
        self.release_legs = Counter("pdproxy_kv_release_legs", "Release legs that free a prefiller's pinned KV no "
                                    "decoder will read, by outcome (sent | no_decoder).", ("outcome",),
                                    registry=reg)
        self._releases: ReleaseCounts | None = None
        self.continuations = ContinuationMetrics(reg)
        self.queue_depth = Gauge("pdproxy_prefill_queue_depth", "Requests waiting in pdproxy's prefill queue.",
                                 registry=reg, multiprocess_mode="livesum")
        self._synced: dict[tuple[str, str], float] = {}
        self._children: dict[Any, Any] = {}
        self._known: dict[str, bool] = {}
        self._in_progress: dict[str, Any] = {}
        self._gap_bounds = (*map(float, GAP_BUCKETS), float("inf"))
        """The ITL histogram's bounds, the tuple every :class:`GapCounts` shares (the compiled splice bisects it)."""
        self._state = state
        self.state_collector = StateCollector(state)
        self._collectors: list[Any] = [self.state_collector]
        if self.multiprocess_dir is None:
            reg.register(self.state_collector)

    def add_collector(self, collector: Any) -> None:
        """Serve one more scrape-time collector (e.g. ``pdproxy.prefix.metrics.PrefixCacheCollector``) from this
        app's ``/metrics``, in single-process and multiprocess mode alike."""
        self._collectors.append(collector)
        if self.multiprocess_dir is None:
            self.registry.register(collector)

    def follow_releases(self, releases: ReleaseCounts) -> None:
        """Export ``releases``' running totals as ``pdproxy_kv_release_legs_total`` (copied by :meth:`sync`)."""
        self._releases = releases

    def _sync_releases(self) -> None:
        releases = self._releases
        if releases is None:
            return
        for outcome, value in (("sent", releases.released), ("no_decoder", releases.failed)):
            last = self._synced.get(("release_legs", outcome), 0.0)
            if value > last:
                self._labelled(self.release_legs, outcome).inc(value - last)
                self._synced[("release_legs", outcome)] = value

    def sync(self) -> None:
        """Copy the admission and prefill-queue counters (plain ints in ``pdproxy/admission/admission.py`` and
        ``pdproxy/scheduling/queue.py``) into prometheus series, as increments since the last sync; multiprocess-safe
        because each worker adds only its own increments.  Runs before each scrape, and in multiprocess mode also when a
        request ends (another worker's scrape reads this one's files)."""
        self._sync_releases()
        st = self._state()
        if st is None:
            return
        adm, queue = st.admission_counts, st.queue_counts
        counts: tuple[tuple[str, int | float | Mapping[str, int]], ...] = (
            ("decode_only_total", adm.decode_only_total), ("counted_total", adm.counted_total),
            ("count_errors_total", adm.count_errors_total), ("count_seconds_total", adm.count_seconds_total),
            ("tokenize_skipped_total", adm.tokenize_skipped_total),
            ("waited_total", queue.waited_total), ("wait_seconds_total", queue.wait_seconds_total),
            ("rejected_full_total", queue.rejected_full_total), ("timed_out_total", queue.timed_out_total))
        families = {**self.admission, **self.queue}
        for attr, value in counts:
            counter = families[attr]
            items = value.items() if isinstance(value, Mapping) else (("", value),)
            for label, v in items:
                last = self._synced.get((attr, label), 0.0)
                if v > last:
                    (counter.labels(label) if label else counter).inc(v - last)
                    self._synced[(attr, label)] = v
        self.queue_depth.set(st.queue_depth)

    def _per_model(self, api: str, model: str) -> tuple[Any, ...]:
        """The histogram children of one API and ``model_name``, resolved once (``labels()`` costs ~1.5 µs a
        call)."""
        key = (api, model)
        children = self._children.get(key)
        if children is None:
            children = (self.ttft.labels(api, model), self.itl.labels(api, model), self.tpot.labels(api, model),
                        [(name, h.labels(api, model)) for name, h in self.phases.items()])
            self._children[key] = children
        return children

    def model_label(self, ctx: RequestContext) -> str:
        """The ``model_name`` label of a finished request: its model when an engine lists it (or the operator pinned
        it: ``ServedModels.known``), else ``""`` — a closed set, whatever names clients send."""
        model = ctx.model
        if not model:
            return ""
        known = self._known.get(model)
        if known is None:
            known = self._known_model(model)
            if known:                   # only listed names are kept: a client's unknown names cost one lookup
                if len(self._known) >= 4096:          # engines' lists change (admin API): stay bounded
                    self._known.clear()
                self._known[model] = True
        return model if known else ""

    def _labelled(self, family: Any, *values: str) -> Any:
        child = self._children.get((family, values))
        if child is None:
            child = self._children[(family, values)] = family.labels(*values)
        return child

    def _count(self, family: Any, *values: str) -> Any:
        """The value cell of one labelled ``Counter`` child, resolved once: its ``inc(n)`` (n ≥ 0) stores what
        ``Counter.inc(n)`` would, without that method's checks on every call (a request counts several)."""
        key = (family, values, "cell")
        cell = self._children.get(key)
        if cell is None:
            cell = self._children[key] = family.labels(*values)._value
        return cell

    def started(self, api: str) -> GapCounts:
        """A completion request arrived (``pdproxy_requests_in_progress`` + 1).  Returns the request's
        :class:`GapCounts` for the ITL histogram of this API (the relay fills it; :meth:`observe` adds it)."""
        gauge = self._in_progress.get(api)
        if gauge is None:
            gauge = self._in_progress[api] = self.in_progress.labels(api)
        gauge.inc()
        return GapCounts(self._gap_bounds)

    def observe(self, ctx: RequestContext, rejection: tuple[str, str] | None = None) -> None:
        """Record one finished request (call exactly once per :meth:`started`)."""
        if self.multiprocess_dir is not None:   # another worker's scrape reads this one's files: keep them current
            self.sync()
        api = ctx.api_label
        model = self.model_label(ctx)
        self._in_progress[api].dec()
        self._count(self.requests, api, str(ctx.status or 0), ctx.outcome, model).inc(1)
        if rejection is not None:
            self._count(self.rejections, *rejection).inc(1)
        for leg, reason, failover in ctx.retries:
            self._count(self.retries, leg, reason).inc(1)
            if failover:
                self._count(self.failovers, leg, reason).inc(1)
        prompt = ctx.engine_prompt_tokens or ctx.prompt_tokens
        if (prompt or 0) > 0 and (ctx.prefiller is not None or ctx.decoder is not None):
            self._count(self.prompt_tokens, api, model).inc(prompt)
        if (ctx.completion_tokens or 0) > 0:       # the engine's usage: a count, never taken back
            self._count(self.generation_tokens, api, model).inc(ctx.completion_tokens)
        if ctx.prefix_mode is not None and ctx.predicted_cached_tokens is not None:
            self._observe_prefix(ctx.prefix_mode, ctx.predicted_cached_tokens, ctx.cached_tokens)
        if not ctx.engine_request:          # a call about the model (tokenize...): vLLM times no such request (and
            return                          # its histograms get no empty series)
        ttft_h, itl_h, tpot_h, phase_hs = self._per_model(api, model)
        if ctx.gaps is not None:
            _add_gaps(itl_h, ctx.gaps)
        tl = ctx.timeline
        phases = tl.phases()
        for key, hist in phase_hs:
            value = phases[key]
            if value is not None:
                _observe(hist, value)
        ttft = phases["ttft_s"]
        if ttft is not None:
            _observe(ttft_h, ttft)
        e2e = phases["e2e_s"]
        if e2e is not None:
            _observe(self._labelled(self.e2e, api, ctx.outcome, model), e2e)
        if tl.first_token_at is not None and tl.last_token_at is not None:
            span = max(0.0, tl.last_token_at - tl.first_token_at)
            if ctx.events >= 2 and ctx.completion_tokens is not None and ctx.completion_tokens >= 2:
                _observe(tpot_h, span / (ctx.completion_tokens - 1))  # streamed only: JSON has one instant

    def _observe_prefix(self, source: str, predicted: int, actual: int | None) -> None:
        """One prefill's predicted cached tokens against what the prefiller reported (None — or a negative
        figure, which is no count — : not reported)."""
        self._count(self.prefix_predicted, source).inc(predicted)
        if actual is None or actual < 0:
            outcome = "unreported"
        else:
            self._count(self.prefix_actual, source).inc(actual)
            outcome = "exact" if actual == predicted else ("over" if predicted > actual else "under")
        self._count(self.prefix_predictions, source, outcome).inc(1)

    def render(self) -> bytes:
        """The exposition text (Prometheus text format 0.0.4)."""
        self.sync()
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry(auto_describe=False)
        MultiProcessCollector(registry, path=self.multiprocess_dir)
        for collector in self._collectors:
            registry.register(collector)
        return generate_latest(registry)
