"""Fixtures for the reliability tests: a session fleet of 2 prefillers + 2 decoders (zero-cost sims)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.reliability.harness import SIM_ARGS, Fleet4
from tests.support import SimProcess, running


@pytest.fixture(scope="session")
def fleet4_session() -> Iterator[Fleet4]:
    with running(SimProcess("prefill", *SIM_ARGS, "--kv-pin-timeout-s", "120"),
                 SimProcess("prefill", *SIM_ARGS, "--kv-pin-timeout-s", "120"),
                 SimProcess("decode", *SIM_ARGS), SimProcess("decode", *SIM_ARGS)) as sims:
        yield Fleet4(prefillers=list(sims[:2]), decoders=list(sims[2:]))


@pytest.fixture
def fleet4(fleet4_session: Fleet4) -> Fleet4:
    """The session fleet with recordings and faults cleared (and no pinned KV left by an earlier test)."""
    fleet4_session.reset()
    assert fleet4_session.pinned() == 0, "an earlier test left pinned KV on a prefiller"
    return fleet4_session


@pytest.fixture(scope="session")
def slow_pair() -> Iterator[tuple[SimProcess, SimProcess]]:
    """A slow prefiller (4000 prompt tokens/s) and a slow decoder (50 tokens/s per sequence): long phases to
    disconnect in."""
    with running(SimProcess("prefill", *SIM_ARGS[:2], "--prefill-tokens-per-s", "4000", "--decode-tokens-per-s",
                            "0", "--max-model-len", "16384"),
                 SimProcess("decode", *SIM_ARGS[:2], "--prefill-tokens-per-s", "0", "--decode-tokens-per-s", "50",
                            "--max-model-len", "16384")) as (prefiller, decoder):
        yield prefiller, decoder
