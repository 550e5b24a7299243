"""``/metrics`` passes Prometheus's own lint (``promtool check metrics``; the same naming rules in Python when
promtool is not installed), and the counters operators expect count what happened: a decode leg that was dropped
before any answer is retried on the other decoder (``pdproxy_retries_total``), moved to a new P/D pair
(``pdproxy_failovers_total``) with a release leg for the prefiller's KV (``pdproxy_kv_release_legs_total``); the
tokens through the proxy add up to what the clients were told (``pdproxy_prompt_tokens_total``,
``pdproxy_generation_tokens_total``)."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Fleet
from tests.ops.metrics_lint import lint, promtool_problems
from tests.ops.promtext import Samples, scrape
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(60)


def test_lint_rules_catch_a_total_gauge() -> None:
    bad = ("# HELP x_opened_total Times.\n# TYPE x_opened_total gauge\nx_opened_total 1.0\n"
           "# HELP y Things.\n# TYPE y counter\ny_total 1.0\n")
    assert any("non-counter" in p for p in lint(bad))
    problems = promtool_problems(bad)
    assert problems is None or problems  # promtool, when installed, objects too


def test_metrics_pass_the_lint_and_count_retries_tokens_and_release_legs(proxy: ProxyThread, sims: Fleet) -> None:
    # every decoder drops its first connection unanswered: a decode leg meeting it fails over (and a release leg
    # meeting it is still a release leg sent)
    for d in sims.decoders:
        d.faults({"kind": "refuse", "times": 1})
    usage = {"prompt": 0, "completion": 0}
    for i in range(4):
        r = httpx.post(proxy.url + "/v1/completions", json={"model": "sim-model", "prompt": f"count me {i}",
                                                            "max_tokens": 3}, timeout=20)
        assert r.status_code == 200, r.text
        usage["prompt"] += r.json()["usage"]["prompt_tokens"]
        usage["completion"] += r.json()["usage"]["completion_tokens"]
    proxy.wait_idle()

    def settled() -> Samples | None:
        m = scrape(proxy.url)
        return m if m.total("pdproxy_kv_release_legs_total") >= m.total("pdproxy_failovers_total") > 0 else None

    m = wait_until(settled, 10, 0.05, "release legs counted")
    retries = m.total("pdproxy_retries_total", leg="decode")
    assert 1 <= retries <= 2 and m.total("pdproxy_retries_total", leg="prefill") == 0
    assert m.value("pdproxy_requests_total", api="completions", status="200", outcome="ok") == 4
    assert m.total("pdproxy_failovers_total", leg="decode") == retries  # a reset loses the KV handle
    assert m.value("pdproxy_kv_release_legs_total", outcome="sent") == retries
    assert m.value("pdproxy_prompt_tokens_total", api="completions") == usage["prompt"]
    assert m.value("pdproxy_generation_tokens_total", api="completions") == usage["completion"]
    assert "# TYPE pdproxy_endpoint_breaker_opened_total counter" in m.text
    assert lint(m.text) == []
    problems = promtool_problems(m.text)
    if problems is None:
        pytest.skip("promtool not installed (scripts/install-promtool.sh): the Python lint above passed")
    assert problems == []
