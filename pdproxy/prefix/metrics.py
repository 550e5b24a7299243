"""Prometheus families of the KV-event subscriber and the prefix indexes, read at scrape time.

:class:`PrefixCacheCollector` reads the components' own plain counters (``SourceStatus``, ``IndexStats``,
``ApproxStats``) when scraped, so nothing is counted twice and nothing needs multiprocess files; register it with
``ProxyMetrics.add_collector`` (each worker of ``--workers N`` subscribes on its own and reports its own view,
labelled ``worker`` by the caller if needed).  Families (``endpoint`` = ``Endpoint.name``):

- ``pdproxy_kv_events_batches_total{endpoint}``, ``pdproxy_kv_events_received_total{endpoint}`` (events),
  ``pdproxy_kv_events_gaps_total{endpoint}``, ``pdproxy_kv_events_replays_total{endpoint,outcome}``
  (``complete`` | ``partial`` | ``empty`` | ``timeout`` | ``none``), ``pdproxy_kv_events_restarts_total``,
  ``pdproxy_kv_events_forgotten_total`` (times the endpoint's entries were dropped),
  ``pdproxy_kv_events_decode_errors_total`` (messages), ``pdproxy_kv_events_bad_events_total`` (events inside
  otherwise good batches), ``pdproxy_kv_events_rank_mismatches_total``; gauges
  ``pdproxy_kv_events_publisher_live{endpoint}`` (1 = precise routing possible) and
  ``pdproxy_kv_events_last_message_age_seconds{endpoint}``;
- ``pdproxy_prefix_index_entries{endpoint,medium}`` (block entries), ``pdproxy_prefix_index_distinct_keys``,
  ``pdproxy_prefix_index_stored_blocks_total``, ``pdproxy_prefix_index_removed_blocks_total``,
  ``pdproxy_prefix_index_evicted_blocks_total`` (dropped by ``prefix_index_max_blocks``),
  ``pdproxy_prefix_index_orphan_blocks_total``, ``pdproxy_prefix_index_ignored_events_total{reason}``;
- ``pdproxy_prefix_index_approx_entries{endpoint}``, ``pdproxy_prefix_index_approx_recorded_blocks_total``,
  ``pdproxy_prefix_index_approx_evicted_blocks_total``, ``pdproxy_prefix_index_approx_expired_blocks_total``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdproxy.prefix.index import ApproxPrefixIndex, PrefixIndex
from pdproxy.prefix.subscriber import KVEventSubscriber

_SOURCE_COUNTERS = (
    ("batches", "pdproxy_kv_events_batches", "KV event batches applied, per publisher."),
    ("events", "pdproxy_kv_events_received", "KV events received (in applied batches), per publisher."),
    ("gaps", "pdproxy_kv_events_gaps", "Sequence gaps seen on the live stream."),
    ("restarts", "pdproxy_kv_events_restarts", "Publisher restarts detected (sequence reset, new process)."),
    ("forgotten", "pdproxy_kv_events_forgotten", "Times an endpoint's entries were dropped (gap without replay, "
                                                 "restart, silence)."),
    ("decode_errors", "pdproxy_kv_events_decode_errors", "Messages that did not decode (skipped)."),
    ("bad_events", "pdproxy_kv_events_bad_events", "Undecodable events inside decodable batches (skipped)."),
    ("rank_mismatches", "pdproxy_kv_events_rank_mismatches", "Batches stamped with another data_parallel_rank "
                                                             "than their port's."),
)


class PrefixCacheCollector:
    """Scrape-time collector over a subscriber and the indexes; each callable returns the component or None
    (not running yet / not configured)."""

    def __init__(self, subscriber: Callable[[], KVEventSubscriber | None],
                 index: Callable[[], PrefixIndex | None],
                 approx: Callable[[], ApproxPrefixIndex | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._subscriber, self._index, self._approx, self._clock = subscriber, index, approx, clock

    def describe(self) -> list[Metric]:
        """No families up front: the series depend on the configured publishers."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Yield the ``pdproxy_kv_events_*`` and ``pdproxy_prefix_index_*`` families."""
        yield from self._sources(self._subscriber())      # declared, empty, when nothing is followed
        index = self._index()
        if index is not None:
            yield from self._precise(index)
        approx = self._approx()
        if approx is not None:
            yield from self._approximate(approx)

    def _sources(self, sub: KVEventSubscriber | None) -> Iterator[Metric]:
        statuses = sub.statuses() if sub is not None else []
        for attr, name, doc in _SOURCE_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=("endpoint",))
            for st in statuses:
                family.add_metric((st.source.endpoint,), float(getattr(st, attr)))
            yield family
        replays = CounterMetricFamily("pdproxy_kv_events_replays", "Replay requests after a gap, by outcome.",
                                      labels=("endpoint", "outcome"))
        live = GaugeMetricFamily("pdproxy_kv_events_publisher_live", "1 when the publisher is connected (precise "
                                 "prefix routing), 0 when routing falls back to the approximate index.",
                                 labels=("endpoint",))
        age = GaugeMetricFamily("pdproxy_kv_events_last_message_age_seconds", "Seconds since the publisher's last "
                                "message (an idle engine publishes nothing).", labels=("endpoint",))
        now = self._clock()
        for st in statuses:
            name = st.source.endpoint
            for outcome, n in sorted(st.replays.items()):
                replays.add_metric((name, outcome), float(n))
            live.add_metric((name,), 1.0 if sub is not None and sub.is_live(name) else 0.0)
            if st.last_message_at is not None:
                age.add_metric((name,), max(now - st.last_message_at, 0.0))
        yield replays
        yield live
        yield age

    @staticmethod
    def _precise(index: PrefixIndex) -> Iterator[Metric]:
        entries = GaugeMetricFamily("pdproxy_prefix_index_entries", "Block entries held per engine location.",
                                    labels=("endpoint", "medium"))
        for endpoint, medium, n in index.locations():
            entries.add_metric((endpoint, medium), float(n))
        yield entries
        yield GaugeMetricFamily("pdproxy_prefix_index_distinct_keys", "Distinct block keys held by any engine.",
                                value=float(index.distinct_keys))
        stats = index.stats
        for attr, name, doc in (("stored_blocks", "pdproxy_prefix_index_stored_blocks", "Blocks stored (events)."),
                                ("removed_blocks", "pdproxy_prefix_index_removed_blocks", "Blocks removed (events)."),
                                ("evicted_blocks", "pdproxy_prefix_index_evicted_blocks",
                                 "Entries dropped to stay within prefix_index_max_blocks."),
                                ("orphan_blocks", "pdproxy_prefix_index_orphan_blocks",
                                 "Blocks stored under an unknown parent (never matched).")):
            yield CounterMetricFamily(name, doc, value=float(getattr(stats, attr)))
        ignored = CounterMetricFamily("pdproxy_prefix_index_ignored_events", "Events ignored, by reason.",
                                      labels=("reason",))
        for reason, n in sorted(stats.ignored_events.items()):
            ignored.add_metric((reason,), float(n))
        yield ignored

    @staticmethod
    def _approximate(approx: ApproxPrefixIndex) -> Iterator[Metric]:
        entries = GaugeMetricFamily("pdproxy_prefix_index_approx_entries", "Approximate index: block keys "
                                    "remembered per endpoint.", labels=("endpoint",))
        for endpoint in approx.endpoints():
            entries.add_metric((endpoint,), float(approx.entries(endpoint)))
        yield entries
        stats = approx.stats
        for attr in ("recorded_blocks", "evicted_blocks", "expired_blocks"):
            yield CounterMetricFamily(f"pdproxy_prefix_index_approx_{attr}", f"Approximate index: {attr.replace('_', ' ')}.",
                                      value=float(getattr(stats, attr)))
