"""The routing-facing facade: precise predictions where the publisher is live, approximate elsewhere and after
it goes silent; its metrics on ``/metrics``; the settings that build it."""

from __future__ import annotations

import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineInfo
from pdproxy.ops.metrics import ProxyMetrics
from pdproxy.prefix.cache import Prediction, PrefixCache
from pdproxy.prefix.index import block_keys
from pdproxy.settings import load_settings
from tests.kv_events.support import FakePublisher, until
from tests.kv_events.test_subscriber import BS, A, E, chain

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
F = "http://other:8000"


async def test_precise_where_live_approximate_elsewhere_and_metrics() -> None:
    settings = load_settings(prefill=[E, F], decode=["http://d:1"], kv_events_silent_after_s=0.5)
    pub = FakePublisher()
    await pub.__aenter__()
    cache = PrefixCache(settings, sources=[pub.source()])
    metrics = ProxyMetrics(lambda: None)
    metrics.add_collector(cache.collector())
    async with cache:
        for name in (E, F):
            cache.update_engine(Endpoint(name, Role.PREFILL), EngineInfo(block_size=BS, num_gpu_blocks=100))
        assert cache.subscriber is not None
        await pub.prime(cache.subscriber)
        keys = block_keys(A + [0], BS)
        cache.record(E, keys)                                    # both get the request in the approximate view
        cache.record(F, keys)
        await pub.publish(chain(A[:8], 1000))                    # but E's engine reports only two blocks
        await until(lambda: cache.predict(keys, [E])[E].cached_tokens == 8)
        assert cache.predict(keys, [E, F]) == {E: Prediction(8, True), F: Prediction(12, False)}
        e_ep, f_ep, g_ep = (Endpoint(n, Role.PREFILL) for n in (E, F, "http://g:1"))
        hints = cache.hints(keys, [e_ep, f_ep, g_ep])             # the scheduler's seam (pdproxy/scheduling)
        assert dict(hints.cached_tokens) == {e_ep: 8, f_ep: 12} and hints.cached(g_ep) == 0
        assert hints.routing_key == cache.hints(block_keys(A[:4], BS), [g_ep]).routing_key is not None
        text = metrics.render().decode()
        for line in ('pdproxy_kv_events_batches_total{endpoint="http://engine:8000"}',
                     'pdproxy_kv_events_publisher_live{endpoint="http://engine:8000"} 1.0',
                     'pdproxy_prefix_index_entries{endpoint="http://engine:8000",medium="GPU"} 2.0',
                     'pdproxy_prefix_index_approx_entries{endpoint="http://other:8000"} 3.0',
                     "pdproxy_kv_events_decode_errors_total", "pdproxy_kv_events_gaps_total"):
            assert line in text, line
        await pub.close()                                        # E's publisher goes away
        await until(lambda: not cache.is_precise(E))
        assert cache.predict(keys, [E]) == {E: Prediction(12, False)}   # falls back to the approximate view
        assert 'pdproxy_kv_events_publisher_live{endpoint="http://engine:8000"} 0.0' in metrics.render().decode()


def test_settings_build_the_sources() -> None:
    s = load_settings(prefill=["http://p0:9100"], decode=["http://d0:9100"], decoder_dp_size=4,
                      kv_events=["http://p0:9100=tcp://p0:5557", "http://d0:9100=tcp://d0:5557"],
                      kv_events_replay=["http://d0:9100=tcp://d0:5600"], kv_events_topic="kv")
    sources = {src.endpoint: src for src in s.kv_event_sources()}
    assert sources["http://p0:9100"].publisher == "tcp://p0:5557" and sources["http://p0:9100"].replay is None
    assert [sources[f"http://d0:9100#dp{r}"].publisher for r in range(4)] == [f"tcp://d0:{5557 + r}" for r in
                                                                              range(4)]
    assert sources["http://d0:9100#dp3"].replay == "tcp://d0:5603" and sources["http://d0:9100#dp3"].dp_rank == 3
    with pytest.raises(ValueError, match="without a --kv-events entry"):
        load_settings(kv_events_replay=["http://x:1=tcp://x:2"])
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        load_settings(kv_events=["http://x:1=udp://x:2"])
    assert PrefixCache(load_settings()).subscriber is None   # no publishers configured: approximate only


def test_cli_flag_is_repeatable() -> None:
    import argparse

    from pdproxy.cli import add_serve_arguments, settings_from_args

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    args = p.parse_args(["--prefill", "http://p:1", "--decode", "http://d:1", "--kv-events", "http://p:1=tcp://p:7",
                         "--kv-events", "http://d:1=tcp://*:8"])
    assert settings_from_args(args).kv_events == ["http://p:1=tcp://p:7", "http://d:1=tcp://127.0.0.1:8"]
