"""Fixtures of the real-vLLM stage (``@pytest.mark.real_vllm`` tests): real engines and pdproxy in front of them.

- ``real_engines`` (session): runs ``scripts/real-vllm.sh setup`` (idempotent; a registry failure fails the stage
  loudly) and stops every engine it started at the end of the session;
- ``engines`` / ``small_pool_engines`` (module): the engines in the standard configuration, or restarted with a
  prefiller KV pool of 18 blocks (2,304 tokens) for the KV-pressure tests (``tracing_engines``, exporting their
  spans to the test's OTLP receiver, is defined in ``test_tracing.py``; ``extra_decoder``, a second decoder beside
  the standard ones that the test kills, in ``test_continuation.py``). Tests are ordered so that each
  configuration starts once (standard first), and the test that triggers a start gets the start time added to
  its timeout;
- ``make_proxy``: pdproxy (``tests.support.ProxyThread``) in front of the running engines, waited on until it has
  read every engine's ``max_model_len`` and KV pool; at teardown its load counters must be back to zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.real_vllm.support import SMALL_POOL, STANDARD, START_TIMEOUT_S, Engines, Prompts, RealEngines
from tests.support import ProxyThread, wait_until

ENGINE_FIXTURES = {"engines": 0, "small_pool_engines": 1, "tracing_engines": 2}  # tracing: test_tracing.py


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run real-vLLM tests grouped by engine configuration (standard, then small pool): one start each."""
    def group(item: pytest.Item) -> int:
        names = getattr(item, "fixturenames", ())
        return max((rank for fixture, rank in ENGINE_FIXTURES.items() if fixture in names), default=-1)

    items.sort(key=lambda item: (group(item) if item.get_closest_marker("real_vllm") else -1))
    seen: set[int] = set()
    for item in items:
        g = group(item)
        if g >= 0 and item.get_closest_marker("real_vllm") and g not in seen:
            seen.add(g)
            marker = item.get_closest_marker("timeout")
            base = float(marker.args[0]) if marker and marker.args else 60.0
            item.add_marker(pytest.mark.timeout(base + START_TIMEOUT_S + 90))


TIMINGS = pytest.StashKey[dict[str, float]]()


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """One line with the engine set-up times of this session (seconds), when engines were used."""
    timings = config.stash.get(TIMINGS, None)
    if timings:
        terminalreporter.write_line("real vLLM: " + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()))


@pytest.fixture(scope="session")
def real_engines(request: pytest.FixtureRequest) -> Iterator[RealEngines]:
    manager = RealEngines()
    request.config.stash[TIMINGS] = manager.timings
    manager.setup()
    try:
        yield manager
    finally:
        manager.stop(final=True)


@pytest.fixture(scope="module")
def engines(real_engines: RealEngines) -> Engines:
    """Prefiller + decoder, default KV pools."""
    return real_engines.ensure(STANDARD)


@pytest.fixture(scope="module")
def small_pool_engines(real_engines: RealEngines) -> Engines:
    """Prefiller with ``--num-gpu-blocks-override 18`` (2,304 tokens, just above max_model_len 2,048)."""
    return real_engines.ensure(SMALL_POOL)


@pytest.fixture(scope="module")
def prompts(real_engines: RealEngines) -> Prompts:
    """Token-exact prompts counted with the served model's tokenizer."""
    return Prompts(real_engines.model_dir())


def start_proxy(e: Engines, **settings: Any) -> ProxyThread:
    """pdproxy in front of ``e``, once it knows every engine's max_model_len and KV pool."""
    proxy = ProxyThread(prefill=[e.prefill_url], decode=[e.decode_url], **settings).start()
    try:
        wait_until(lambda: proxy.state is not None and len(proxy.state.infos) == 2 and all(
            i.max_model_len and i.kv_pool_tokens for i in proxy.state.infos.values()), 30, 0.05,
            "engine limits read")
    except BaseException:
        proxy.stop()
        raise
    return proxy


@pytest.fixture
def make_proxy() -> Iterator[Callable[..., ProxyThread]]:
    """``make_proxy(engines, **settings)``; every proxy made is checked idle and stopped after the test."""
    made: list[ProxyThread] = []

    def make(e: Engines, **settings: Any) -> ProxyThread:
        made.append(start_proxy(e, **settings))
        return made[-1]

    try:
        yield make
        for proxy in made:
            proxy.wait_idle(10)
    finally:
        for proxy in made:
            proxy.stop()
