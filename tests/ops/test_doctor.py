"""``pdproxy doctor`` (the real command, as a process) against simulated engines: a healthy fleet passes; an engine
configured like seed 000 (KV pool 4,584 tokens under max_model_len 133,120) is reported with the mismatch in
words and the cold-context cliff; a prefiller without a KV connector is reported.  Probes leave engines idle."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from tests.conftest import Fleet
from tests.support import SimProcess

pytestmark = pytest.mark.timeout(60)

SEED000 = ("--served-model-name", "glm", "--max-model-len", "133120", "--block-size", "4",
           "--num-gpu-blocks-override", "1146")


def doctor(prefill: list[str], decode: list[str], *extra: str, as_json: bool = True) -> tuple[int, Any]:
    cmd = [sys.executable, "-m", "pdproxy", "doctor", "--prefill", *prefill, "--decode", *decode,
           "--probe-timeout-s", "15", *extra] + (["--json"] if as_json else [])
    done = subprocess.run(cmd, capture_output=True, timeout=50)
    assert done.returncode in (0, 1), done.stderr.decode()[-2000:]
    return done.returncode, orjson.loads(done.stdout) if as_json else done.stdout.decode()


def rows(report: dict[str, Any], check: str) -> list[dict[str, Any]]:
    return [c for c in report["checks"] if c["check"] == check]


def assert_idle(sim: SimProcess) -> None:
    st = sim.state()
    assert (st["running"], st["waiting"], st["pinned_requests"]) == (0, 0, 0), st


def test_healthy_simulator_passes(sims: Fleet) -> None:
    code, report = doctor([s.url for s in sims.prefillers], [s.url for s in sims.decoders],
                          "--cold-timeout-s", "10")
    assert code == 0 and report["ok"], [c for c in report["checks"] if c["status"] != "ok"]
    assert report["counts"]["fail"] == 0
    assert {c["target"] for c in rows(report, "engine")} == {s.url for s in sims.all}
    assert all(c["data"]["max_model_len"] == 4096 for c in rows(report, "engine"))
    assert [c["status"] for c in rows(report, "kv_pool")] == ["ok"] * 3
    assert [c["status"] for c in rows(report, "idle")] == ["ok"] * 3
    assert [c["status"] for c in rows(report, "kv_connector")] == ["ok"] * 2  # one round trip per decoder
    assert [c["status"] for c in rows(report, "tool_call")] == ["ok"] * 2
    cold = rows(report, "cold_context")
    assert [c["status"] for c in cold] == ["ok"] * 3
    assert all(3800 <= c["data"]["largest_ok"] <= 4095 for c in cold)  # up to max_model_len − 1
    assert rows(report, "pd_models")[0]["status"] == "ok"
    # every probe cleaned up after itself: nothing running, queued or pinned on any engine
    for s in sims.all:
        assert_idle(s)
    # the prefiller got the PD handshake (stub + max_tokens=1) and the decoders got its params
    legs = [r for r in sims.prefillers[0].completions_received() if r["body"].get("kv_transfer_params")]
    assert legs and all(r["body"]["max_tokens"] == 1 for r in legs)


@pytest.fixture
def seed000() -> Iterator[list[SimProcess]]:
    engines = [SimProcess("prefill", *SEED000), SimProcess("decode", *SEED000)]
    try:
        for e in engines:
            e.start()
        yield engines
    finally:
        for e in engines:
            e.stop()


def test_seed000_pool_mismatch_and_cold_cliff(seed000: list[SimProcess]) -> None:
    p, d = seed000
    code, report = doctor([p.url], [d.url], "--cold-timeout-s", "1.5", "--cold-bisect-steps", "1")
    assert code == 1 and not report["ok"]
    for row in rows(report, "kv_pool"):
        assert row["status"] == "fail"
        assert "prompts between 4,585 and 133,120 tokens will queue forever" in row["detail"]
        assert (row["data"]["kv_pool_tokens"], row["data"]["max_model_len"]) == (4584, 133120)
    for row in rows(report, "cold_context"):
        assert row["status"] == "fail" and "stalled at" in row["detail"]
        ok, stalled = row["data"]["largest_ok"], row["data"]["stalled_at"]
        assert 2048 <= ok <= 4584 < stalled <= 8192, row  # the cliff is the KV pool, far below max_model_len
    assert [c["status"] for c in rows(report, "tool_call")] == ["ok"]  # small requests still work
    for e in seed000:  # the stalled probes were aborted by closing their connections
        assert_idle(e)


def test_table_output_and_missing_kv_connector(sims: Fleet) -> None:
    sims.prefillers[0].faults({"kind": "no_kv_params"})
    code, text = doctor([s.url for s in sims.prefillers], [s.url for s in sims.decoders], "--no-cold-probe",
                        as_json=False)
    assert code == 1
    assert "PROBLEMS FOUND" in text
    line = next(x for x in text.splitlines() if x.startswith("kv_connector"))
    assert "FAIL" in line and "without kv_transfer_params" in line
    assert "cold_context" in text and "--no-cold-probe" in text


def test_no_engines_is_a_usage_error() -> None:
    done = subprocess.run([sys.executable, "-m", "pdproxy", "doctor"], capture_output=True, timeout=30)
    assert done.returncode == 2 and b"no engines configured" in done.stderr


def test_engine_refusing_tools_still_gets_the_kv_check(sims: Fleet) -> None:
    body = {"error": {"message": '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                 "to be set", "type": "BadRequestError", "param": None, "code": 400}}
    sims.prefillers[0].faults({"kind": "status", "status": 400, "body": body, "on_request": 1,
                               "path": "/v1/chat/completions"})
    code, report = doctor([s.url for s in sims.prefillers], [s.url for s in sims.decoders[:1]], "--no-cold-probe")
    assert code == 0, report
    (kv,) = rows(report, "kv_connector")
    (tool,) = rows(report, "tool_call")
    assert kv["status"] == "ok"
    assert tool["status"] == "warn" and "enable-auto-tool-choice" in tool["detail"]
