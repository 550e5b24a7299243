"""``pdproxy sim`` samples at ``temperature > 0`` (seeded by ``seed``) and is greedy at 0, as vLLM: ``n`` sampled
choices differ, a seed repeats its answer, a greedy prompt always gets the same one."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdproxy.sim.outputs import WORDS
from tests.support import SimProcess, running

pytestmark = pytest.mark.timeout(60)
GREEDY_ORDER = "".join(WORDS) * 3  # greedy output is a run of WORDS in order, from some offset


@pytest.fixture(scope="module")
def sim() -> Iterator[SimProcess]:
    with running(SimProcess("both")) as (s,):
        yield s


def texts(sim: SimProcess, **body: Any) -> list[str]:
    r = httpx.post(sim.url + "/v1/completions", json={"prompt": "tell me", "max_tokens": 12, **body}, timeout=10)
    assert r.status_code == 200, r.text
    return [c["text"] for c in r.json()["choices"]]


def test_sampled_choices_differ_and_a_seed_repeats(sim: SimProcess) -> None:
    out_of_order = 0
    for seed in range(1, 6):
        first = texts(sim, n=2, temperature=0.8, seed=seed)
        assert first[0] != first[1]
        assert texts(sim, n=2, temperature=0.8, seed=seed) == first
        out_of_order += sum(t not in GREEDY_ORDER for t in first)
    assert out_of_order > 0  # sampled, not the greedy order from another offset


def test_greedy_repeats_and_keeps_the_order(sim: SimProcess) -> None:
    first = texts(sim, temperature=0)
    assert texts(sim, temperature=0) == first and first[0] in GREEDY_ORDER
