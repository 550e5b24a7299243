"""A collector that is down does not fill pdproxy's log: the SDK's export failures pass once per interval
(``pdproxy/ops/tracing_otel.py`` ``ExportLogLimit``), the next one saying how many were held back."""

from __future__ import annotations

import logging

import pytest

from pdproxy.ops.tracing_otel import EXPORT_LOGGERS, ExportLogLimit, OtelTracing
from pdproxy.settings import Settings

pytestmark = pytest.mark.timeout(30)


def test_export_failures_are_logged_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    tracing = OtelTracing.from_settings(Settings(prefill=["http://p:1"], decode=["http://d:1"],
                                                 otlp_traces_endpoint="http://127.0.0.1:9"))
    sdk = logging.getLogger(EXPORT_LOGGERS[0])
    try:
        with caplog.at_level(logging.INFO, logger=EXPORT_LOGGERS[0]):
            for _ in range(5):
                sdk.warning("Transient error %s encountered while exporting traces", "UNAVAILABLE")
                sdk.error("Failed to export traces to %s", "127.0.0.1:9")
            sdk.info("not a failure: always passes")
        assert [r.getMessage() for r in caplog.records] == [
            "Transient error UNAVAILABLE encountered while exporting traces", "not a failure: always passes"]
        assert tracing.export_log_limit.suppressed == 9
    finally:
        tracing.shutdown(timeout_s=2)
    assert all(tracing.export_log_limit not in logging.getLogger(n).filters for n in EXPORT_LOGGERS)


def test_after_the_interval_the_next_failure_says_how_many_were_held_back() -> None:
    limit = ExportLogLimit(interval_s=0.0)
    first = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed %s", ("once",), None)
    assert limit.filter(first) and first.getMessage() == "failed once"
    limit.interval_s = 3600.0
    assert not limit.filter(logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), None))
    limit.interval_s = 0.0
    later = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed %s", ("again",), None)
    assert limit.filter(later)
    assert later.getMessage() == "failed again (1 more export messages held back in the last 0 s)"
