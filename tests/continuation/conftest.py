"""Fixtures for the stream-continuation tests: 2 simulated prefillers + 3 decoders that emit one token per event
(a decode rate, so a fault can cut a stream between tokens)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.reliability.harness import Fleet4
from tests.support import SimProcess, running

ARGS = ("--served-model-name", "sim-model", "--max-model-len", "4096", "--prefill-tokens-per-s", "0",
        "--decode-tokens-per-s", "400", "--kv-pin-timeout-s", "120", "--output-tokens", "64")


@pytest.fixture(scope="session")
def fleet5_session() -> Iterator[Fleet4]:
    with running(*(SimProcess("prefill", *ARGS) for _ in range(2)),
                 *(SimProcess("decode", *ARGS) for _ in range(3))) as sims:
        yield Fleet4(prefillers=list(sims[:2]), decoders=list(sims[2:]))


@pytest.fixture
def fleet5(fleet5_session: Fleet4) -> Fleet4:
    """The session fleet with recordings and faults cleared."""
    fleet5_session.reset()
    assert fleet5_session.pinned() == 0, "an earlier test left pinned KV on a prefiller"
    return fleet5_session
