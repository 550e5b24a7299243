"""Every request vLLM 0.32 accepts, pdproxy accepts with vLLM's meaning; every one it refuses gets vLLM's own 400
(from pdproxy, or from the engine leg that judges it): generated requests (``tests/edges/request_rules.py``)
checked against vLLM's own request models and handlers (``tests/real_vllm/vllm_oracle.py``: vLLM's code in the
real-vLLM venv, no engine).  The same rule runs in the fast suite on the verdicts recorded in
``tests/edges/request_rules_cases.json``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings

from tests.edges.request_rules import check, requests
from tests.real_vllm.vllm_oracle import Oracle

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def oracle() -> Iterator[Oracle]:
    o = Oracle()
    try:
        yield o
    finally:
        o.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(requests())
# cases earlier runs drew and that once failed (2026-12-05): a refusal only the decode leg can see, in a fan-out;
# beam search, which verifies no min_tokens
@example(("chat", {"messages": [{"role": "user", "content": "Hello there"}], "min_tokens": 3000, "n": 2}))
@example(("completions", {"prompt": "The prefiller reads the whole prompt.", "min_tokens": 3000,
                          "use_beam_search": True}))
def test_pdproxy_reads_requests_as_vllm_does(oracle: Oracle, case: tuple[str, dict[str, Any]]) -> None:
    api, body = case
    check(api, body, oracle.judge)
