"""Shared fixtures: a session-wide fleet of simulated engines (1 prefiller, 2 decoders) and a proxy per test.

Every test that uses ``proxy`` ends by asserting that the proxy's per-endpoint load counters are back to zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.support import ProxyThread, SimProcess, running


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
