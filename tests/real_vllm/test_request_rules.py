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
# (2026-12-07) n 0 with a list of prompts: vLLM's n check comes first, the list must not fan out past it
@example(("completions", {"prompt": ["a", "b"], "n": 0}))
@example(("completions", {"prompt": [[1], [2]], "n": "0", "max_tokens": 0}))
@example(("chat", {"messages": [{"role": "user", "content": "Hello there"}], "n": 0}))
@example(("chat", {"messages": [{"role": "user", "content": "Hello there"}], "n": None, "use_beam_search": True}))
@example(("completions", {"prompt": ["a", "b"], "n": 0, "use_beam_search": True}))
# echo without generation: vLLM runs it with max_tokens 1; pdproxy sends it to a decoder alone
@example(("completions", {"prompt": "The prefiller reads the whole prompt.", "guided_json": {"type": "object"},
                          "max_tokens": 0, "echo": True}))
# beam search checks none of SamplingParams' rules: max_tokens 0 is accepted
@example(("completions", {"prompt": "The prefiller reads the whole prompt.", "use_beam_search": True,
                          "max_tokens": 0}))
@example(("chat", {"messages": [{"role": "user", "content": "Hello there"}], "use_beam_search": True,
                   "max_tokens": -1}))
# greedy n > 1 comes after vLLM's other sampling checks
@example(("chat", {"messages": [{"role": "user", "content": "Hello there"}], "n": 2, "temperature": -1}))
@example(("chat", {"messages": [{"role": "user", "content": "Hello there"}], "n": 2, "temperature": 0,
                   "top_p": 1.5}))
def test_pdproxy_reads_requests_as_vllm_does(oracle: Oracle, case: tuple[str, dict[str, Any]]) -> None:
    api, body = case
    check(api, body, oracle.judge)
