"""Every request vLLM 0.32 accepts, pdproxy accepts with vLLM's meaning; every one it refuses gets vLLM's own 400:
the rule of ``tests/edges/request_rules.py`` on requests generated from vLLM's request models, against the
verdicts vLLM's own code gave (recorded by ``tests/real_vllm/capture_request_rules.py``; the real-vLLM stage
checks fresh requests live in ``tests/real_vllm/test_request_rules.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.edges.request_rules import check

pytestmark = pytest.mark.timeout(60)

CASES = json.loads((Path(__file__).parent / "request_rules_cases.json").read_text())


def recorded(api: str, raw: bytes) -> tuple[int, dict[str, Any]]:
    key = f"{api} {raw.decode()}"
    assert key in CASES["verdicts"], (f"no recorded vLLM verdict for {key[:300]}: pdproxy's legs changed; re-run "
                                      "`python -m tests.real_vllm.capture_request_rules`")
    status, body = CASES["verdicts"][key]
    return int(status), body


def test_recorded_requests_follow_vllms_rules() -> None:
    assert len(CASES["cases"]) >= 300
    for case in CASES["cases"]:
        check(case["api"], case["body"], recorded)
