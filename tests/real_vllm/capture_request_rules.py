"""Record vLLM 0.32's verdicts on generated requests for the fast suite (not a test itself).

    .venv/bin/python -m tests.real_vllm.capture_request_rules [N]      # default 400 requests

writes ``tests/edges/request_rules_cases.json``: each request (``tests/edges/request_rules.py::requests``, drawn
with a fixed seed) with vLLM's ``(status, json)`` for every body the rule in ``request_rules.check`` asks about
(the client's, and the legs pdproxy builds from it), judged by ``tests/real_vllm/vllm_oracle.py`` (vLLM's own
code in the real-vLLM venv; no engine).  Re-run it when pdproxy changes what its legs send or vLLM is upgraded:
the replay test fails on a leg body it has no verdict for.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hypothesis import Phase, given, seed, settings

from tests.edges.request_rules import check, requests
from tests.real_vllm.vllm_oracle import Oracle

OUT = Path(__file__).resolve().parents[1] / "edges" / "request_rules_cases.json"


def main(n: int = 400) -> None:
    oracle = Oracle()
    cases: list[dict[str, Any]] = []
    verdicts: dict[str, Any] = {}

    def judge(api: str, raw: bytes) -> tuple[int, dict[str, Any]]:
        key = f"{api} {raw.decode()}"
        if key not in verdicts:
            verdicts[key] = oracle.judge(api, raw)
        status, body = verdicts[key]
        return status, body

    @seed(20260613)
    @settings(max_examples=n, deadline=None, database=None, phases=[Phase.generate])
    @given(requests())
    def collect(case: tuple[str, dict[str, Any]]) -> None:
        api, body = case
        check(api, body, judge)              # fails loudly if pdproxy breaks the rule while recording
        cases.append({"api": api, "body": body})

    try:
        collect()
    finally:
        oracle.close()
    OUT.write_text(json.dumps({"vllm": "0.32.0", "cases": cases, "verdicts": verdicts}, indent=0) + "\n")
    print(f"{len(cases)} requests, {len(verdicts)} verdicts -> {OUT}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 400)
