"""Shared fixtures: a session-wide fleet of simulated engines (1 prefiller, 2 decoders) and a proxy per test.

Every test that uses ``proxy`` ends by asserting that the proxy's per-endpoint load counters are back to zero.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import settings as hypothesis_settings

from tests.support import ProxyThread, SimProcess, running

hypothesis_settings.register_profile("ci", derandomize=True, database=None)
"""``make test`` (scripts/test-all.sh: ``--hypothesis-profile=ci``): every property test draws the same examples
on every run (a seed from the test's own code), so the gate is repeatable; a plain ``pytest`` run (``make
fast-test``) draws new ones each time, which is how latent edge cases surface."""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Fleet:
    prefillers: list[SimProcess]
    decoders: list[SimProcess]

    @property
    def all(self) -> list[SimProcess]:
        return self.prefillers + self.decoders

    def reset(self) -> None:
        for s in self.all:
            s.reset()


SIM_ARGS = ("--served-model-name", "sim-model", "--max-model-len", "4096", "--prefill-tokens-per-s", "0",
            "--decode-tokens-per-s", "0")


@pytest.fixture(scope="session")
def fleet() -> Iterator[Fleet]:
    with running(SimProcess("prefill", *SIM_ARGS), SimProcess("decode", *SIM_ARGS),
                 SimProcess("decode", *SIM_ARGS)) as sims:
        yield Fleet(prefillers=list(sims[:1]), decoders=list(sims[1:]))


@pytest.fixture
def sims(fleet: Fleet) -> Fleet:
    """The session fleet, with recordings and faults cleared for this test."""
    fleet.reset()
    return fleet


@pytest.fixture
def proxy(sims: Fleet) -> Iterator[ProxyThread]:
    """A proxy in front of the fleet; after the test, its load counters must be back to zero."""
    p = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders]).start()
    try:
        yield p
        p.wait_idle()
    finally:
        p.stop()


# --- test layers: each runs alone with ``pytest -m unit|middle|loopback|real_vllm`` (docs/architecture.md) --------

LAYERS = ("unit", "middle", "loopback", "real_vllm")
_PROCESS_FIXTURES = frozenset({"fleet", "sims", "proxy"})
"""Fixtures that start simulated engines (separate processes) or a proxy on loopback sockets."""
_PROCESS_HELPERS = frozenset({"SimProcess", "ProxyThread", "running", "subprocess", "multiprocessing", "serveproc",
                              "envoyproc", "ServeProc", "EnvoyProc", "Popen"})
"""Names whose presence in a test module means it starts processes (tests/support.py, tests/ops/serveproc.py,
tests/envoy/envoyproc.py, the standard library's process modules)."""


def layer(item: pytest.Item) -> str:
    """The layer of one test: ``real_vllm`` (marked so by hand), ``middle`` (tests/middle/: the real director and
    relay on fake engines, in process), ``unit`` (tests/unit/, and any other test that starts no process: it may
    open loopback sockets inside its own process, e.g. an in-process simulator or a raw asyncio server), else
    ``loopback`` (the test or one of its fixtures starts simulated engines, pdproxy or Envoy as processes, or
    pdproxy on loopback sockets in a thread)."""
    if item.get_closest_marker("real_vllm"):
        return "real_vllm"
    parts = item.path.parts
    if "middle" in parts:
        return "middle"
    if "unit" in parts:
        return "unit"
    if _PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return "loopback"
    modules = [getattr(item, "module", None)]
    info = getattr(item, "_fixtureinfo", None)
    for defs in (info.name2fixturedefs.values() if info is not None else ()):
        modules.extend(sys.modules.get(getattr(d.func, "__module__", "")) for d in defs
                       if getattr(d.func, "__module__", "") != __name__)   # this file's: _PROCESS_FIXTURES
    if any(m is not None and _PROCESS_HELPERS.intersection(vars(m)) for m in modules):
        return "loopback"           # the test, or a fixture it uses, starts processes
    return "unit"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with its layer (:func:`layer`), so ``pytest -m unit`` runs only the unit layer."""
    for item in items:
        name = layer(item)
        if name != "real_vllm":
            item.add_marker(getattr(pytest.mark, name))
