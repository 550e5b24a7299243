"""The scrape-time half of ``GET /metrics``: a prometheus collector reading the proxy's state when scraped.

Per endpoint (labels ``role``, ``endpoint`` = ``Endpoint.name``, ``dp_rank``): in-flight requests and tokens from the
pool (with ``--workers N`` the pool's view sums every worker's row of the shared load board), health and draining
flags, the circuit breaker's state (``HealthMonitor.snapshot``), a prefiller's prefill budget now (the answering
worker's: :meth:`~pdproxy.scheduling.queue.PrefillLedger.budget`); per worker, the requests each one holds; and the
engines' own gauges as the health loop last read them from each engine's ``/metrics`` (``state.infos``: vLLM's
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:num_requests_waiting_by_reason``,
``vllm:kv_cache_usage_perc``, and the KV pool from ``vllm:cache_config_info``; ``docs/real-vllm.md``).  Nothing here is
stored between scrapes, so the collector needs no multiprocess files.  Names: see :mod:`pdproxy.ops.metrics`.

What ``/metrics`` reads of the running proxy is :class:`MetricsState` (``pdproxy/app/state.py``'s ``ProxyState``
provides it): ``ops/`` sits below ``admission/``, ``scheduling/`` and ``workers/``, so their counters are read
through the small protocols here, never by attribute name.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.breaker import BreakerState
from pdproxy.engines.control import EngineInfo
from pdproxy.engines.health import HealthMonitor
from pdproxy.engines.pool import EndpointPool


class AdmissionCounts(Protocol):
    """Admission's plain counters (``pdproxy/admission/admission.py``'s ``AdmissionStats``)."""

    @property
    def decode_only_total(self) -> Mapping[str, int]: ...
    @property
    def counted_total(self) -> Mapping[str, int]: ...
    @property
    def count_errors_total(self) -> int: ...
    @property
    def count_seconds_total(self) -> float: ...
    @property
    def tokenize_skipped_total(self) -> int: ...


class QueueCounts(Protocol):
    """The prefill queue's plain counters (``pdproxy/scheduling/queue.py``'s ``QueueStats``)."""

    @property
    def waited_total(self) -> int: ...
    @property
    def wait_seconds_total(self) -> float: ...
    @property
    def rejected_full_total(self) -> int: ...
    @property
    def timed_out_total(self) -> int: ...


class MetricsState(Protocol):
    """What ``/metrics`` reads of the running proxy: the pool, health (breakers), what each engine declared,
    admission's and the prefill queue's counters, the queue's depth (requests waiting) and, with ``--workers N``,
    the requests each worker holds (None with one process)."""

    @property
    def pool(self) -> EndpointPool: ...
    @property
    def health(self) -> HealthMonitor: ...
    @property
    def infos(self) -> Mapping[Endpoint, EngineInfo]: ...
    @property
    def admission_counts(self) -> AdmissionCounts: ...
    @property
    def queue_counts(self) -> QueueCounts: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def worker_requests(self) -> Sequence[int] | None: ...
    def prefill_budget_tokens(self, endpoint: Endpoint) -> int: ...


def _labels(e: Endpoint) -> tuple[str, str, str]:
    return e.role.value, e.name, "" if e.dp_rank is None else str(e.dp_rank)


class StateCollector:
    """A prometheus collector reading the proxy state at scrape time (see module docstring)."""

    ENDPOINT_LABELS = ("role", "endpoint", "dp_rank")

    def __init__(self, state: Callable[[], MetricsState | None]) -> None:
        self._state = state

    def describe(self) -> list[Metric]:
        """No families up front (an unchecked collector: the series depend on the configured endpoints)."""
        return []  # unchecked collector: families depend on the configured endpoints

    def collect(self) -> Iterator[Metric]:
        """Yield the ``pdproxy_*`` gauge families (and the breakers' opened counter) read from the current proxy state, labelled
        ``role``/``endpoint``/``dp_rank``; nothing before the state exists."""
        st = self._state()
        if st is None:
            return
        labels = self.ENDPOINT_LABELS

        def family(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels + extra)

        reqs = family("pdproxy_inflight_requests", "Requests in flight to the endpoint (all workers).")
        toks = family("pdproxy_inflight_tokens", "Tokens in flight on the endpoint: prefill = prompt tokens being "
                                                 "prefilled; decode = prompt + expected output tokens held.")
        healthy = family("pdproxy_endpoint_healthy", "1 if the endpoint's last /health probe succeeded.")
        draining = family("pdproxy_endpoint_draining", "1 if the endpoint is draining (no new requests).")
        breaker = family("pdproxy_endpoint_breaker_state", "Circuit breaker state (1 = current).", ("state",))
        opened = CounterMetricFamily("pdproxy_endpoint_breaker_opened", "Times the endpoint's breaker opened.",
                                     labels=labels)  # a counter: exposed as pdproxy_endpoint_breaker_opened_total
        budget = family("pdproxy_prefill_budget_tokens", "The prefiller's prefill budget now (tokens to compute in "
                                                         "flight): prefill_budget_tokens, or prefill_budget_s of its "
                                                         "measured rate when more; 0 = none.")
        snapshot = st.health.snapshot
        for e in st.pool.endpoints():
            lab = list(_labels(e))
            load = st.pool.load(e)
            reqs.add_metric(lab, load.requests)
            toks.add_metric(lab, load.tokens)
            healthy.add_metric(lab, 1.0 if load.healthy else 0.0)
            draining.add_metric(lab, 1.0 if load.draining else 0.0)
            snap = snapshot(e)
            for s in BreakerState:
                breaker.add_metric([*lab, s.value], 1.0 if s is snap.breaker else 0.0)
            opened.add_metric(lab, float(snap.opened_total))
            if e.role is Role.PREFILL:
                budget.add_metric(lab, st.prefill_budget_tokens(e))
        yield from (reqs, toks, healthy, draining, breaker, opened, budget)
        workers = st.worker_requests
        if workers is not None:
            per_worker = GaugeMetricFamily("pdproxy_worker_inflight_requests",
                                           "In-flight engine requests held by each worker process.",
                                           labels=("worker",))
            for row, requests in enumerate(workers):
                per_worker.add_metric([str(row)], requests)
            yield per_worker
        yield from self._engine_gauges(st)

    def _engine_gauges(self, st: MetricsState) -> Iterator[Metric]:
        labels = self.ENDPOINT_LABELS
        up = GaugeMetricFamily("pdproxy_engine_up", "1 if the engine answered /v1/models at the last refresh and "
                               "/health since (0 once a probe fails).", labels=labels)
        mml = GaugeMetricFamily("pdproxy_engine_max_model_len", "The engine's max_model_len (tokens), /v1/models.",
                                labels=labels)
        pool = GaugeMetricFamily("pdproxy_engine_kv_pool_tokens", "The engine's KV pool in tokens "
                                 "(vllm:cache_config_info num_gpu_blocks × block_size).", labels=labels)
        age = GaugeMetricFamily("pdproxy_engine_info_age_seconds", "Seconds since the engine info was refreshed.",
                                labels=labels)
        running = GaugeMetricFamily("pdproxy_engine_num_requests_running", "vllm:num_requests_running.",
                                    labels=labels)
        waiting = GaugeMetricFamily("pdproxy_engine_num_requests_waiting", "vllm:num_requests_waiting.",
                                    labels=labels)
        by_reason = GaugeMetricFamily("pdproxy_engine_num_requests_waiting_by_reason",
                                      "vllm:num_requests_waiting_by_reason (capacity | deferred).",
                                      labels=(*labels, "reason"))
        usage = GaugeMetricFamily("pdproxy_engine_kv_cache_usage_perc", "vllm:kv_cache_usage_perc (0–1).",
                                  labels=labels)
        now = time.monotonic()
        for e, info in list(st.infos.items()):
            lab = list(_labels(e))
            up.add_metric(lab, 1.0 if info.reachable else 0.0)
            if info.max_model_len is not None:
                mml.add_metric(lab, info.max_model_len)
            if info.kv_pool_tokens is not None:
                pool.add_metric(lab, info.kv_pool_tokens)
            if info.refreshed_at is not None:
                age.add_metric(lab, max(0.0, now - info.refreshed_at))
            g = info.gauges if info.reachable else {}      # a down engine's last figures are not its state
            for key, fam in (("vllm:num_requests_running", running), ("vllm:num_requests_waiting", waiting),
                             ("vllm:kv_cache_usage_perc", usage)):
                if key in g:
                    fam.add_metric(lab, g[key])
            prefix = "vllm:num_requests_waiting_by_reason:"
            for key, value in g.items():
                if key.startswith(prefix):
                    by_reason.add_metric([*lab, key[len(prefix):]], value)
        yield from (up, mml, pool, age, running, waiting, by_reason, usage)
