"""The one object routing asks "which engine holds how much of this prompt": precise where an engine's KV event
publisher is live, approximate elsewhere.

Built from :class:`~pdproxy.settings.Settings` (``kv_events*``, ``prefix_*``), used as ``async with
PrefixCache(settings) as cache`` in the app's lifespan::

    keys = block_keys(token_ids, block_size, namespace)      # pdproxy.prefix.index; once per request
    cache.hints(keys, prefillers)                            # PrefixHints for PickRequest (pdproxy/scheduling)
    cache.predict(keys, [e.name for e in prefillers])        # {name: Prediction(cached_tokens, precise)}
    cache.record(chosen.name, keys)                          # after dispatching: the approximate bookkeeping
    cache.update_engine(endpoint, info)                      # on each EngineInfo refresh (block size, pool)
    metrics.add_collector(cache.collector())                 # pdproxy_kv_events_*, pdproxy_prefix_index_*

``record`` is called for every dispatched prefill, also to engines with live events, so that the approximate
index is warm when a publisher goes silent.  Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdproxy.endpoints import Endpoint, KVEventSource
from pdproxy.engines.control import EngineInfo
from pdproxy.prefix.index import ApproxPrefixIndex, BlockKeys, DropListener, PrefixIndex, key_bytes
from pdproxy.prefix.metrics import PrefixCacheCollector
from pdproxy.prefix.subscriber import KVEventSubscriber
from pdproxy.scheduling import PrefixHints
from pdproxy.settings import Settings


@dataclass(frozen=True, slots=True)
class Prediction:
    """``cached_tokens``: tokens the engine is expected to report cached; ``precise``: from its own KV events
    (else from where pdproxy sent earlier prompts)."""

    cached_tokens: int
    precise: bool


_NONE = Prediction(0, False)


class PrefixCache:
    """Precise index + subscriber + approximate index (see the module docstring).  ``sources`` overrides the
    publishers of ``settings`` (tests); ``clock``: monotonic seconds."""

    def __init__(self, settings: Settings, sources: Iterable[KVEventSource] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = PrefixIndex(max_blocks=settings.prefix_index_max_blocks)
        self.approx = ApproxPrefixIndex(default_capacity_blocks=settings.prefix_approx_capacity_blocks,
                                        ttl_s=settings.prefix_approx_ttl_s, clock=clock)
        self.text_chunk_chars = settings.prefix_text_chunk_chars
        self._drop_listeners: list[DropListener] = []
        self.index.on_drop = self._dropped
        src = list(settings.kv_event_sources() if sources is None else sources)
        self.subscriber: KVEventSubscriber | None = (
            KVEventSubscriber(src, self.index, silent_after_s=settings.kv_events_silent_after_s,
                              replay_timeout_s=settings.kv_events_replay_timeout_s, clock=clock)
            if src else None)

    async def __aenter__(self) -> PrefixCache:
        if self.subscriber is not None:
            await self.subscriber.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.subscriber is not None:
            await self.subscriber.__aexit__(*exc)

    def is_precise(self, endpoint: str) -> bool:
        """Whether ``endpoint``'s predictions come from its own live KV events."""
        return self.subscriber is not None and self.subscriber.is_live(endpoint)

    def predict(self, keys: BlockKeys, endpoints: Iterable[str], *, precise: bool = True,
                approximate: bool = True) -> dict[str, Prediction]:
        """Per endpoint name, the cached tokens to expect for ``keys``' prompt (0 when nothing is known): from
        the precise index where the endpoint's publisher is live (unless ``precise`` is False), else from the
        approximate index (unless ``approximate`` is False: then such endpoints are left out of the answer)."""
        names = list(endpoints)
        live = [n for n in names if self.is_precise(n)] if precise else []
        other = [n for n in names if n not in set(live)] if approximate else []
        out: dict[str, Prediction] = {}
        if live:
            out.update((n, Prediction(t, True)) for n, t in self.index.match(keys, live).items())
        if other:
            out.update((n, Prediction(t, False)) for n, t in self.approx.match(keys, other).items())
        return out

    def hints(self, keys: BlockKeys, endpoints: Iterable[Endpoint]) -> PrefixHints:
        """The scheduler's :class:`~pdproxy.scheduling.PrefixHints` for ``keys``' prompt over ``endpoints``:
        the predicted cached tokens per endpoint, and the first block's key as the routing key (the same prompt
        start gives the same key in every replica), or None for a prompt shorter than one block."""
        eps = list(endpoints)
        predicted = self.predict(keys, [e.name for e in eps])
        cached = {e: predicted[e.name].cached_tokens for e in eps if predicted.get(e.name, _NONE).cached_tokens}
        key = key_bytes(keys.keys[0]) if keys.keys else None
        return PrefixHints(cached_tokens=cached, routing_key=key)

    def record(self, endpoint: str, keys: BlockKeys) -> None:
        """``keys``' prompt was sent to ``endpoint`` (approximate bookkeeping)."""
        self.approx.record(endpoint, keys)

    def update_engine(self, endpoint: Endpoint, info: EngineInfo) -> None:
        """Take the engine's block size and KV pool from a refreshed :class:`EngineInfo` (an endpoint of the pool:
        one added again after a removal has its KV events followed again)."""
        self.index.restore(endpoint.name)
        self.index.set_block_size(endpoint.name, info.block_size)
        self.approx.set_capacity(endpoint.name, info.num_gpu_blocks)

    def on_drop(self, listener: DropListener) -> None:
        """Call ``listener(endpoint, keys)`` whenever an engine's own word drops blocks from the precise index:
        ``keys`` None when everything it held went (``AllBlocksCleared``, a restart, a gap or silence), else the
        keys a ``BlockRemoved`` evicted (see :attr:`PrefixIndex.on_drop`)."""
        self._drop_listeners.append(listener)

    def _dropped(self, endpoint: str, keys: frozenset[int] | None) -> None:
        if keys is None:              # the engine's cache is empty: pdproxy's own record of it is stale too
            self.approx.forget(endpoint)
        for listener in self._drop_listeners:
            listener(endpoint, keys)

    def forget(self, endpoint: str) -> None:
        """Drop everything known about ``endpoint`` (it restarted, or left the configuration)."""
        self.index.forget(endpoint)
        self.approx.forget(endpoint)

    def remove_endpoint(self, endpoint: Endpoint) -> None:
        """``endpoint`` left the pool (admin API): drop its entries, locations and bounds in both indexes (an
        engine at the same address later starts from nothing; no metric series stays behind)."""
        self.index.remove_endpoint(endpoint.name)
        self.approx.remove_endpoint(endpoint.name)

    def collector(self) -> PrefixCacheCollector:
        """The prometheus collector of this cache's components (``ProxyMetrics.add_collector``)."""
        return PrefixCacheCollector(lambda: self.subscriber, lambda: self.index, lambda: self.approx)
