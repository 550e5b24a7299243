"""Per-rank engine statistics and their Prometheus text exposition under vLLM's metric names.

Names, HELP texts, labels and buckets are those vLLM 0.32 on CPU exposed (``tests/real_vllm/captures/
metrics_*.txt``, kept in step by ``tests/real_vllm/test_sim_contract.py``; docs/real-vllm.md). Every engine
series has ``engine="<dp_rank>"`` and ``model_name="<served name>"`` labels; counters get a ``_total`` suffix,
numbers are written the way ``prometheus_client`` writes them (Go float format). ``http_requests_total{handler,
method,status}`` (prometheus-fastapi-instrumentator, process-wide) counts API requests by status class, so a test
can tell whether a request reached an engine at all. ``sim_kv_pinned_blocks`` and ``sim_kv_pinned_requests`` are
simulator-only gauges for KV that a prefiller keeps pinned for decoders.

Token sources (``vllm:prompt_tokens_by_source_total``): ``local_compute`` (prefilled here), ``local_cache_hit``
(prefix cache), ``external_kv_transfer`` (pulled from a prefiller: a decoder counts the whole prompt there and
nothing as local, as vLLM 0.32 did).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Final

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
NIXL_XFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_POST_BUCKETS = (0.001, *NIXL_XFER_BUCKETS)
NIXL_BYTES_BUCKETS = tuple(2048.0 * 4**k for k in range(12))
NIXL_DESCRIPTOR_BUCKETS = (10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 200.0, 400.0, 1000.0, 2000.0, 4000.0, 10000.0,
                           20000.0, 50000.0)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
"""``vllm:request_success_total`` reasons vLLM 0.32 always exposes (zeros included)."""
UNCOUNTED_HANDLERS = frozenset({"/metrics", "/health", "/load", "/ping", "/version"})
"""Paths vLLM's HTTP instrumentation does not count in ``http_requests_total``."""

_HELP: Final = MappingProxyType({
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:num_requests_waiting_by_reason": (
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
        "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). Sum of all "
        "reasons equals vllm:num_requests_waiting."),
    "vllm:num_requests_kv_fetch_by_stage": (
        "Number of waiting requests by async KV load stage. Stage labels: 'waiting_to_start' = needs an async KV "
        "load that has not started; 'in_progress' = load started and not yet reported finished; "
        "'completed_waiting' = load finished, request not running yet."),
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "vllm:cache_config_info": "Information of the LLMEngine CacheConfig",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "vllm:external_prefix_cache_queries": (
        "External prefix cache queries from KV connector cross-instance cache sharing, in terms of number of "
        "queried tokens."),
    "vllm:external_prefix_cache_hits": (
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms of number of cached "
        "tokens."),
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:prompt_tokens_by_source": "Number of prompt tokens by source.",
    "vllm:prompt_tokens_cached": "Number of cached prompt tokens (local + external).",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
    "vllm:request_success": "Count of successfully processed requests.",
    "vllm:nixl_num_kv_expired_reqs": (
        "Number of requests that had their KV expire. NOTE: This metric is tracked on the P instance."),
    "vllm:nixl_num_failed_transfers": (
        "Number of failed NIXL KV Cache transfers, including handshake and notification failures. NOTE: KV "
        "expiry is tracked separately in vllm:nixl_num_kv_expired_reqs."),
    "vllm:nixl_num_failed_notifications": (
        "Number of failed NIXL KV Cache notifications. Retained for compatibility; these failures are also "
        "included in vllm:nixl_num_failed_transfers."),
    "vllm:nixl_xfer_time_seconds": "Histogram of transfer duration for NIXL KV Cache transfers.",
    "vllm:nixl_post_time_seconds": "Histogram of transfer post time for NIXL KV Cache transfers.",
    "vllm:nixl_bytes_transferred": "Histogram of bytes transferred per NIXL KV Cache transfers.",
    "vllm:nixl_num_descriptors": "Histogram of number of descriptors per NIXL  KV Cache transfers.",
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "http_requests_total": "Total number of requests by method, status and handler.",
})


def go_float(value: float) -> str:
    """A number as ``prometheus_client`` writes it (Go's format: ``2.097152e+06``, ``+Inf``, ``1.0``)."""
    d = float(value)
    if d == float("inf"):
        return "+Inf"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return s


class Histogram:
    """A cumulative Prometheus histogram with fixed upper bounds (unit: the metric's, e.g. seconds or bytes)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Record one observation."""
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str, labels: str) -> Iterable[str]:
        """Exposition lines ``name_bucket{...,le=...}``, ``name_count``, ``name_sum``."""
        running = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            running += n
            yield f'{name}_bucket{{{labels},le="{go_float(bound)}"}} {go_float(running)}'
        yield f'{name}_bucket{{{labels},le="+Inf"}} {go_float(self.count)}'
        yield f"{name}_count{{{labels}}} {go_float(self.count)}"
        yield f"{name}_sum{{{labels}}} {go_float(self.sum)}"


@dataclass(slots=True)
class EngineStats:
    """Counters and histograms of one rank (monotonic since start; tokens are token counts)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    prompt_tokens_local: int = 0
    prompt_tokens_cache_hit: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_external: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    kv_expired_reqs: int = 0
    kv_failed_transfers: int = 0
    kv_capacity_waits: int = 0
    """Requests a step could not place for want of free KV blocks (each counted once; ``/sim/state``)."""
    success: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    nixl_xfer_time: Histogram = field(default_factory=lambda: Histogram(NIXL_XFER_BUCKETS))
    nixl_post_time: Histogram = field(default_factory=lambda: Histogram(NIXL_POST_BUCKETS))
    nixl_bytes: Histogram = field(default_factory=lambda: Histogram(NIXL_BYTES_BUCKETS))
    nixl_descriptors: Histogram = field(default_factory=lambda: Histogram(NIXL_DESCRIPTOR_BUCKETS))


@dataclass(frozen=True, slots=True)
class RankGauges:
    """Gauge values of one rank at scrape time (requests; ``kv_usage`` in 0–1; blocks)."""

    running: int
    waiting_capacity: int
    waiting_deferred: int
    kv_usage: float
    pinned_blocks: int
    pinned_requests: int
    kv_fetch_in_progress: int = 0
    kv_fetch_completed_waiting: int = 0


def _label(key: str, value: str) -> str:
    return f'{key}="{value}"'


Ranks = Sequence[tuple[int, RankGauges, EngineStats]]


def render_metrics(model_name: str, cache_info: dict[str, str], ranks: Ranks, with_nixl: bool,
                   http_requests: Mapping[tuple[str, str, str], int] | None = None) -> str:
    """Prometheus text for all ``ranks`` (``(dp_rank, gauges, stats)``), label keys sorted like prometheus_client.

    ``http_requests`` maps ``(handler, method, status class "2xx")`` to a count.
    """
    out: list[str] = []

    def family(name: str, kind: str, samples: Iterable[str]) -> None:
        key = name[:-len("_total")] if kind == "counter" and name.startswith("vllm:") else name
        out.append(f"# HELP {name} {_HELP[key]}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(samples)

    def lab(rank: int, extra: str = "") -> str:
        base = f'engine="{rank}",model_name="{model_name}"'
        return f"{base},{extra}" if extra else base

    def gauge(name: str, get: Callable[[RankGauges], float]) -> None:
        family(name, "gauge", (f"{name}{{{lab(r)}}} {go_float(get(g))}" for r, g, _ in ranks))

    def counter(name: str, get: Callable[[EngineStats], float]) -> None:
        family(f"{name}_total", "counter", (f"{name}_total{{{lab(r)}}} {go_float(get(s))}" for r, _, s in ranks))

    def by_label(name: str, key: str, values: Iterable[tuple[str, Callable[[RankGauges, EngineStats], float]]],
                 kind: str) -> None:
        pairs = list(values)
        family(name, kind, (f"{name}{{{lab(r, _label(key, v))}}} {go_float(get(g, s))}"
                            for r, g, s in ranks for v, get in pairs))

    gauge("vllm:num_requests_running", lambda g: g.running)
    gauge("vllm:num_requests_waiting", lambda g: g.waiting_capacity + g.waiting_deferred)
    by_label("vllm:num_requests_waiting_by_reason", "reason", (
        ("capacity", lambda g, _s: g.waiting_capacity), ("deferred", lambda g, _s: g.waiting_deferred)), "gauge")
    by_label("vllm:num_requests_kv_fetch_by_stage", "stage", (
        ("waiting_to_start", lambda _g, _s: 0), ("in_progress", lambda g, _s: g.kv_fetch_in_progress),
        ("completed_waiting", lambda g, _s: g.kv_fetch_completed_waiting)), "gauge")
    gauge("vllm:kv_cache_usage_perc", lambda g: g.kv_usage)

    def cache_labels(rank: int) -> str:
        return ",".join(_label(k, v) for k, v in sorted({**cache_info, "engine": str(rank)}.items()))

    family("vllm:cache_config_info", "gauge", (f"vllm:cache_config_info{{{cache_labels(r)}}} 1.0" for r, _, _ in ranks))
    counter("vllm:prefix_cache_queries", lambda s: s.prefix_cache_queries)
    counter("vllm:prefix_cache_hits", lambda s: s.prefix_cache_hits)
    counter("vllm:external_prefix_cache_queries", lambda s: s.external_prefix_cache_queries)
    counter("vllm:external_prefix_cache_hits", lambda s: s.external_prefix_cache_hits)
    counter("vllm:num_preemptions", lambda s: s.num_preemptions)
    counter("vllm:prompt_tokens", lambda s: s.prompt_tokens)
    by_label("vllm:prompt_tokens_by_source_total", "source", (
        ("local_compute", lambda _g, s: s.prompt_tokens_local),
        ("local_cache_hit", lambda _g, s: s.prompt_tokens_cache_hit),
        ("external_kv_transfer", lambda _g, s: s.prompt_tokens_external)), "counter")
    counter("vllm:prompt_tokens_cached", lambda s: s.prompt_tokens_cached)
    counter("vllm:generation_tokens", lambda s: s.generation_tokens)
    reasons = (*FINISHED_REASONS, *sorted(k for r in ranks for k in r[2].success if k not in FINISHED_REASONS))
    def successes(reason: str) -> Callable[[RankGauges, EngineStats], float]:
        return lambda _g, s: s.success.get(reason, 0)

    by_label("vllm:request_success_total", "finished_reason",
             ((reason, successes(reason)) for reason in dict.fromkeys(reasons)), "counter")
    if with_nixl:
        histograms: tuple[tuple[str, Callable[[EngineStats], Histogram]], ...] = (
            ("vllm:nixl_xfer_time_seconds", lambda s: s.nixl_xfer_time),
            ("vllm:nixl_post_time_seconds", lambda s: s.nixl_post_time),
            ("vllm:nixl_bytes_transferred", lambda s: s.nixl_bytes),
            ("vllm:nixl_num_descriptors", lambda s: s.nixl_descriptors))
        for name, get in histograms:
            family(name, "histogram", (line for r, _, s in ranks for line in get(s).lines(name, lab(r))))
        counter("vllm:nixl_num_failed_transfers", lambda s: s.kv_failed_transfers)
        counter("vllm:nixl_num_failed_notifications", lambda _s: 0)
        counter("vllm:nixl_num_kv_expired_reqs", lambda s: s.kv_expired_reqs)
    for name, get in (("vllm:time_to_first_token_seconds", lambda s: s.ttft),
                      ("vllm:inter_token_latency_seconds", lambda s: s.itl),
                      ("vllm:e2e_request_latency_seconds", lambda s: s.e2e),
                      ("vllm:request_queue_time_seconds", lambda s: s.queue_time)):
        family(name, "histogram", (line for r, _, s in ranks for line in get(s).lines(name, lab(r))))
    out.append("# HELP sim_kv_pinned_blocks KV blocks a prefiller keeps pinned for decoders (simulator only).")
    out.append("# TYPE sim_kv_pinned_blocks gauge")
    out.extend(f"sim_kv_pinned_blocks{{{lab(r)}}} {go_float(g.pinned_blocks)}" for r, g, _ in ranks)
    out.append("# HELP sim_kv_pinned_requests Requests whose KV is pinned for a decoder (simulator only).")
    out.append("# TYPE sim_kv_pinned_requests gauge")
    out.extend(f"sim_kv_pinned_requests{{{lab(r)}}} {go_float(g.pinned_requests)}" for r, g, _ in ranks)
    if http_requests:
        family("http_requests_total", "counter", (
            f"http_requests_total{{{_label('handler', h)},{_label('method', m)},{_label('status', st)}}} {go_float(n)}"
            for (h, m, st), n in sorted(http_requests.items())))
    return "\n".join(out) + "\n"
