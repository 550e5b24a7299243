"""Per-rank engine statistics and their Prometheus text exposition under vLLM's metric names.

Names, labels and buckets follow ``vllm/v1/metrics/loggers.py`` (v0.26) and what vLLM 0.32 on CPU exposed
(reference §3 and §7). Every series has ``engine="<dp_rank>"`` and ``model_name="<served name>"`` labels.
Counters get a ``_total`` suffix. ``sim_kv_pinned_blocks`` and ``sim_kv_pinned_requests`` are simulator-only
gauges for KV that a prefiller keeps pinned for decoders.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """A cumulative Prometheus histogram (seconds) with fixed upper bounds."""

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
            yield f'{name}_bucket{{{labels},le="{bound}"}} {float(running)}'
        yield f'{name}_bucket{{{labels},le="+Inf"}} {float(self.count)}'
        yield f"{name}_count{{{labels}}} {float(self.count)}"
        yield f"{name}_sum{{{labels}}} {self.sum}"


@dataclass(slots=True)
class EngineStats:
    """Counters and histograms of one rank (monotonic since start; tokens are token counts)."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_external: int = 0
    generation_tokens: int = 0
    num_preemptions: int = 0
    kv_expired_reqs: int = 0
    kv_failed_transfers: int = 0
    success: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))


@dataclass(frozen=True, slots=True)
class RankGauges:
    """Gauge values of one rank at scrape time."""

    running: int
    waiting_capacity: int
    waiting_deferred: int
    kv_usage: float
    pinned_blocks: int
    pinned_requests: int


def _label(key: str, value: str) -> str:
    return f'{key}="{value}"'


def render_metrics(model_name: str, cache_info: dict[str, str],
                   ranks: Sequence[tuple[int, RankGauges, EngineStats]], with_nixl: bool) -> str:
    """Prometheus text for all ``ranks`` (``(dp_rank, gauges, stats)``), label keys sorted like prometheus_client."""
    out: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: Iterable[str]) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(samples)

    def lab(rank: int, extra: str = "") -> str:
        base = f'engine="{rank}",model_name="{model_name}"'
        return f"{base},{extra}" if extra else base

    family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
           (f"vllm:num_requests_running{{{lab(r)}}} {float(g.running)}" for r, g, _ in ranks))
    family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
           (f"vllm:num_requests_waiting{{{lab(r)}}} {float(g.waiting_capacity + g.waiting_deferred)}"
            for r, g, _ in ranks))
    family("vllm:num_requests_waiting_by_reason", "gauge", "Number of requests waiting, by reason.",
           (line for r, g, _ in ranks for line in (
               f'vllm:num_requests_waiting_by_reason{{{lab(r)},reason="capacity"}} {float(g.waiting_capacity)}',
               f'vllm:num_requests_waiting_by_reason{{{lab(r)},reason="deferred"}} {float(g.waiting_deferred)}')))
    family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
           (f"vllm:kv_cache_usage_perc{{{lab(r)}}} {g.kv_usage}" for r, g, _ in ranks))
    def cache_labels(rank: int) -> str:
        return ",".join(_label(k, v) for k, v in sorted({**cache_info, "engine": str(rank)}.items()))

    family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
           (f"vllm:cache_config_info{{{cache_labels(r)}}} 1.0" for r, _, _ in ranks))
    counters = (
        ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
         lambda s: s.prefix_cache_queries),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
         lambda s: s.prefix_cache_hits),
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", lambda s: s.prompt_tokens),
        ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
         lambda s: s.prompt_tokens_cached),
        ("vllm:generation_tokens", "Number of generation tokens processed.", lambda s: s.generation_tokens),
        ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", lambda s: s.num_preemptions),
    )
    for name, help_text, get in counters:
        family(f"{name}_total", "counter", help_text,
               (f"{name}_total{{{lab(r)}}} {float(get(s))}" for r, _, s in ranks))
    family("vllm:request_success_total", "counter", "Count of successfully processed requests.",
           (f"vllm:request_success_total{{{lab(r, _label('finished_reason', reason))}}} {float(n)}"
            for r, _, s in ranks for reason, n in sorted(s.success.items())))
    if with_nixl:
        family("vllm:nixl_num_kv_expired_reqs_total", "counter", "Requests whose pinned KV expired before a pull.",
               (f"vllm:nixl_num_kv_expired_reqs_total{{{lab(r)}}} {float(s.kv_expired_reqs)}" for r, _, s in ranks))
        family("vllm:nixl_num_failed_transfers_total", "counter", "Failed KV pulls.",
               (f"vllm:nixl_num_failed_transfers_total{{{lab(r)}}} {float(s.kv_failed_transfers)}"
                for r, _, s in ranks))
    family("sim_kv_pinned_blocks", "gauge", "KV blocks a prefiller keeps pinned for decoders (simulator only).",
           (f"sim_kv_pinned_blocks{{{lab(r)}}} {float(g.pinned_blocks)}" for r, g, _ in ranks))
    family("sim_kv_pinned_requests", "gauge", "Requests whose KV is pinned for a decoder (simulator only).",
           (f"sim_kv_pinned_requests{{{lab(r)}}} {float(g.pinned_requests)}" for r, g, _ in ranks))
    histograms = (
        ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", lambda s: s.ttft),
        ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", lambda s: s.itl),
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", lambda s: s.e2e),
        ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
         lambda s: s.queue_time),
    )
    for name, help_text, get in histograms:
        family(name, "histogram", help_text, (line for r, _, s in ranks for line in get(s).lines(name, lab(r))))
    return "\n".join(out) + "\n"
