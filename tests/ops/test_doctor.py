"""``pdproxy doctor`` (the real command, as a process) against simulated engines: a healthy fleet passes; an engine
configured as in docs/field-reports.md (KV pool 4,584 tokens under max_model_len 133,120) is reported with the
mismatch in words and the cliff confirmed at the pool's boundary, streaming its rows and ending well inside a
minute with default flags; a prefiller without a KV connector is reported.  Probes leave engines idle."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

import orjson
import pytest

from tests.conftest import Fleet
from tests.support import SimProcess, running

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


def cold_prompts(sim: SimProcess) -> list[dict[str, Any]]:
    return [r for r in sim.completions_received() if r["headers"]["x-request-id"].startswith("pdproxy-doctor-cold")]


def test_seed000_pool_mismatch_and_cliff_confirmed_at_the_boundary(seed000: list[SimProcess]) -> None:
    p, d = seed000
    code, report = doctor([p.url], [d.url], "--cold-min-timeout-s", "1.5")
    assert code == 1 and not report["ok"]
    assert sorted(row["target"] for row in rows(report, "kv_pool")) == sorted([p.url, d.url])
    for row in rows(report, "kv_pool"):
        assert row["status"] == "fail"
        # a decoder's pool must hold one output token too; a prompt of 133,120 is the engine's own 400
        first, role = ("4,581", "prefiller") if row["target"] == p.url else ("4,580", "decoder")   # 1,145 blocks
        assert f"prompts between {first} and 133,119 tokens will queue forever on this {role}" in row["detail"]
        assert (row["data"]["kv_pool_tokens"], row["data"]["max_model_len"]) == (4584, 133120)
    for row in rows(report, "cold_context"):
        assert row["status"] == "fail" and "KV-pool cliff confirmed" in row["detail"], row
        data = row["data"]
        assert data["plan"] == "boundary" and data["kv_pool_tokens"] == 4580    # less vLLM's null block
        # one prompt just under the pool completed, one just over it stalled: nothing near max_model_len
        assert [outcome for _, outcome, _, _ in data["attempts"]] == ["ok", "stalled"]
        assert 4580 - 128 <= data["largest_ok"] <= 4580 < data["stalled_at"] <= 4580 + 128, data
    assert [c["status"] for c in rows(report, "tool_call")] == ["ok"]  # small requests still work
    for e in seed000:
        sizes = [e.client.post("/tokenize", json={"model": "glm", "prompt": r["body"]["prompt"]}).json()["count"]
                 for r in cold_prompts(e)]  # what the engine received: two prompts, either side of the pool
        assert len(sizes) == 2 and sizes[0] <= 4584 < sizes[1], sizes
        assert_idle(e)  # the stalled probe was aborted by closing its connection
        assert e.state()["aborted"] >= 1


def _lines(stream: IO[str], into: list[tuple[float, str]]) -> threading.Thread:
    def read() -> None:
        for line in stream:
            into.append((time.monotonic(), line.rstrip("\n")))
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_seed000_default_flags_streams_rows_and_ends(seed000: list[SimProcess]) -> None:
    """As a new user runs it (table output, default flags): rows stream as checks complete (the engine rows come
    out before the cold probe ends) and the run ends by itself (about 1 s and 7 s on an idle machine; no speed is
    asserted: on a loaded CI machine the first row came 5.6 s late once), with cold-probe progress meanwhile."""
    p, d = seed000
    proc = subprocess.Popen([sys.executable, "-m", "pdproxy", "doctor", "--prefill", p.url, "--decode", d.url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[tuple[float, str]] = []
    err: list[tuple[float, str]] = []
    readers = [_lines(proc.stdout, out), _lines(proc.stderr, err)]  # type: ignore[arg-type]
    try:
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ended = time.monotonic()
    for r in readers:
        r.join(timeout=5)
    assert code == 1, (out, err)
    first_row = next(t for t, line in out if line.startswith("engine "))
    assert first_row < ended
    texts = [line for _, line in out]
    # rows were written as checks completed: the engine rows came out before the cold probe ended
    last_cold = max(t for t, line in out if line.startswith("cold_context"))
    assert first_row < last_cold
    assert sum("KV-pool cliff confirmed" in line for line in texts) == 2
    assert texts[-1].startswith("PROBLEMS FOUND")
    progress = [line for _, line in err]
    assert any("cold_context" in line and "sending 4," in line for line in progress), progress
    assert any("stalled" in line for line in progress), progress
    for e in seed000:
        assert_idle(e)


def test_kv_pool_words_give_admissions_figures_for_each_role() -> None:
    """The operator's sims (--max-model-len 16384 --num-gpu-blocks-override 100: a pool of 1,600 tokens) were
    reported with "prompts between 1,601 and 16,384 tokens will queue forever" on both engines, yet pdproxy
    refuses a 1,600-token prompt (a decoder needs room for the answer's first token) and the engine itself
    refuses one of 16,384 (no room for any output token).  Each figure is now admission's, for the engine's role;
    a pool that holds every prompt max_model_len allows is no cliff."""
    from pdproxy.endpoints import Endpoint, Role
    from pdproxy.engines.control import EngineInfo
    from pdproxy.tools.doctor import Report, check_engine

    def kv_row(role: Role, pool: int, mml: int = 16_384) -> tuple[str, str]:
        report = Report()
        info = EngineInfo(models=[{"id": "sim-model"}], max_model_len=mml, kv_pool_tokens=pool,
                          num_gpu_blocks=pool // 16, block_size=16, reachable=True)
        check_engine(report, Endpoint("http://127.0.0.1:15001", role), info, True, "0.1")
        (row,) = [c for c in report.checks if c.check == "kv_pool"]
        return row.status, row.detail

    pool = ("KV pool 1,600 tokens (num_gpu_blocks 100 × block_size 16; 1,584 for one request: vLLM keeps a block "
            "as its null block) < max_model_len 16,384: prompts between ")
    assert kv_row(Role.PREFILL, 1600) == (
        "fail", pool + "1,585 and 16,383 tokens will queue forever on this prefiller (declare --max-model-len ≤ "
        "1,584 or grow the pool)")
    assert kv_row(Role.DECODE, 1600) == (
        "fail", pool + "1,584 and 16,383 tokens will queue forever on this decoder (its pool must hold the answer's "
        "first token too; declare --max-model-len ≤ 1,584 or grow the pool)")
    # one token short: a decoder cannot hold the largest prompt; a prefiller holds it, and there is no cliff
    assert kv_row(Role.DECODE, 1040, mml=1025)[1].endswith(
        "a prompt of 1,024 tokens will queue forever on this decoder (its pool must hold the answer's first token "
        "too; declare --max-model-len ≤ 1,024 or grow the pool)")
    status, detail = kv_row(Role.PREFILL, 1040, mml=1025)
    assert status == "warn" and "largest size max_model_len 1,025 allows (1,024 tokens) but not two" in detail
    # a pool of max_model_len has a block less for requests (vLLM's null block; vLLM 0.32 would not start)
    assert kv_row(Role.PREFILL, 16_384)[0] == "fail"
    # pools a block above max_model_len and more: the largest prompt is max_model_len − 1, held once or twice
    for role in Role:
        status, detail = kv_row(role, 16_400)
        assert status == "warn" and "holds one prompt of the largest size max_model_len 16,384 allows (16,383 " \
            "tokens) but not two" in detail, detail
        status, detail = kv_row(role, 32_784)
        assert (status, detail) == ("ok", "KV pool 32,784 tokens (num_gpu_blocks 2,049 × block_size 16; 32,768 for "
                                    "one request: vLLM keeps a block as its null block) holds two prompts of the "
                                    "largest size max_model_len 16,384 allows (16,383 tokens)")
    # a prefiller holds two prompts of 16,383 in 32,766 tokens; a decoder needs 16,384 for each
    assert kv_row(Role.PREFILL, 32_782)[0] == "ok" and kv_row(Role.DECODE, 32_782)[0] == "warn"


def test_doctor_help_lists_engine_flags_only() -> None:
    done = subprocess.run([sys.executable, "-m", "pdproxy", "doctor", "--help"], capture_output=True, text=True,
                          timeout=30, check=True)
    for flag in ("--prefill", "--decoder-ports", "--engine-api-key", "--budget-s", "--cold-timeout-s", "--json"):
        assert flag in done.stdout
    for flag in ("--port", "--workers", "--shutdown-grace-s", "--api-keys", "--request-log", "--ssl-certfile",
                 "--prefill-budget-tokens"):
        assert f"{flag} " not in done.stdout and f"{flag}\n" not in done.stdout, flag


def test_engine_that_never_answers_completions_ends_within_the_budget(sims: Fleet) -> None:
    """A prefiller that accepts completions and never answers: the round trip and the cold probe are given
    bounded waits and the run still ends, with the budget named."""
    sims.prefillers[0].faults({"kind": "hang", "path": "/v1/completions"})
    code, report = doctor([s.url for s in sims.prefillers], [s.url for s in sims.decoders[:1]], "--no-round-trip",
                          "--budget-s", "6", "--cold-timeout-s", "3", "--cold-min-timeout-s", "1")
    assert code == 1
    cold = {c["target"]: c for c in rows(report, "cold_context")}
    stuck = cold[sims.prefillers[0].url]
    assert stuck["status"] == "fail" and stuck["data"]["stalled_at"] is not None, stuck
    assert stuck["data"]["largest_ok"] is None


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


def test_a_fleet_of_two_models_passes_and_a_split_name_is_named(sims: Fleet) -> None:
    """Two models, each on its own prefiller and decoder (the README's "Several models"): every P→D pair and
    engine is probed with a model it serves and the fleet passes (old code: one model for all — four false
    failures and "no model served by every engine: prefillers [], decoders []").  A prefiller and a decoder that
    serve different names: one failure that names both roles' models, no false failure on the engines."""
    other = ("--served-model-name", "other-model", "--max-model-len", "4096")
    with running(SimProcess("prefill", *other), SimProcess("decode", *other)) as (op, od):
        p, d = sims.prefillers[0].url, sims.decoders[0].url
        code, report = doctor([p, op.url], [d, od.url], "--cold-timeout-s", "10")
        assert code == 0 and report["ok"], [c for c in report["checks"] if c["status"] != "ok"]
        assert sorted(c["target"] for c in rows(report, "kv_connector")) == sorted(
            [f"{p} → {d}", f"{op.url} → {od.url}"])
        assert rows(report, "pd_models")[0]["data"]["models"] == ["other-model", "sim-model"]
        assert [c["status"] for c in rows(report, "cold_context")] == ["ok"] * 4
        code, report = doctor([p], [od.url], "--no-cold-probe")
        assert code == 1
        (models,) = rows(report, "pd_models")
        assert models["status"] == "fail" and "prefillers serve ['sim-model'], decoders ['other-model']" in \
            models["detail"], models
        assert [c["status"] for c in rows(report, "kv_connector")] == ["skip"]
        assert report["counts"]["fail"] == 1
