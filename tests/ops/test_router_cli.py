"""vllm-router's documented PD command lines start ``pdproxy serve`` unchanged (only the engine URLs point at
simulated engines) and route a request through a prefiller and a decoder; its policies become pdproxy settings as
docs/migrating.md says; a bootstrap port after a prefill URL is accepted and dropped.

The command lines are the examples of vllm-router's launcher (``vllm-router --help``, the same as its README's PD
section); when vllm-router is installed in this environment, the test checks they are still there word for word.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdproxy.cli import ROUTER_POLICIES, _Parser, add_router_arguments, add_serve_arguments, settings_from_args
from pdproxy.settings import Settings
from tests.conftest import SIM_ARGS, Fleet
from tests.ops.serveproc import ServeProcess
from tests.support import SimProcess, running

pytestmark = pytest.mark.timeout(90)

# vllm-router's own examples (its launcher's --help "Examples", its README's PD section), as printed.
DOCUMENTED = [
    """vllm-router --vllm-pd-disaggregation \\
    --prefill http://prefill1:8000 9000 --prefill http://prefill2:8000 \\
    --decode http://decode1:8001 --decode http://decode2:8001 \\
    --policy cache_aware""",
    """vllm-router --vllm-pd-disaggregation \\
    --prefill http://prefill1:8000 9000 \\
    --prefill http://prefill2:8000 none \\
    --prefill http://prefill3:8000 \\
    --decode http://decode1:8001 --decode http://decode2:8001""",
    """vllm-router --vllm-pd-disaggregation \\
    --prefill http://prefill1:8000 --prefill http://prefill2:8000 \\
    --decode http://decode1:8001 --decode http://decode2:8001 \\
    --prefill-policy cache_aware --decode-policy power_of_two""",
]


def router_args(line: str) -> list[str]:
    """The flags of a documented command line (the program name dropped)."""
    words = shlex.split(line.replace("\\\n", " "))
    assert words[0] == "vllm-router"
    return words[1:]


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("\\\n", " ")).strip()


def test_the_lines_are_vllm_routers_own() -> None:
    exe = Path(sys.executable).parent / "vllm-router"
    found = str(exe) if exe.exists() else shutil.which("vllm-router")
    if found is None:
        pytest.skip("vllm-router is not installed here (make install brings it)")
    # its help indents each line and may annotate with comments: compare flag words only
    help_text = subprocess.run([found, "--help"], capture_output=True, text=True, timeout=30).stdout
    examples = _squash(re.sub(r"#[^\n]*", "", help_text).replace("\\", " "))
    for line in DOCUMENTED:
        assert _squash(line.replace("\\", " ")) in examples


NOT_TAKEN = ("--worker-urls", "--enable-program-scheduling", "--program-scheduling-config-json", "--router-temperature",
             "--kv-penalty-host", "--kv-penalty-external", "--kv-penalty-disk", "--kv-aware-session-affinity-ttl-secs",
             "--kv-event-source", "--kv-event-replay-source", "--kv-event-block-size", "--kv-event-model",
             "--mini-lb", "--wasm-middleware", "--wasm-middleware-sha256", "--wasm-middleware-route", "--enable-igw",
             "--service-discovery", "--selector", "--service-discovery-port", "--service-discovery-namespace",
             "--prefill-selector", "--decode-selector", "--vllm-discovery-address", "--rate-limit-tokens-per-second")
"""vllm-router's flags of its other modes, which docs/migrating.md lists as not taken."""


def test_every_router_flag_is_taken_or_listed_as_not_taken() -> None:
    """A vllm-router command line runs under ``pdproxy serve`` as it is (docs/migrating.md) unless it uses a flag
    of the router's other modes, which the doc names: checked against the installed router's ``--help``."""
    exe = Path(sys.executable).parent / "vllm-router"
    found = str(exe) if exe.exists() else shutil.which("vllm-router")
    if found is None:
        pytest.skip("vllm-router is not installed here (make install brings it)")
    help_text = subprocess.run([found, "--help"], capture_output=True, text=True, timeout=30).stdout
    flags = set(re.findall(r"^\s+(--[a-z0-9-]+)", help_text, re.MULTILINE))
    assert len(flags) > 50, help_text
    p = _Parser(prog="pdproxy serve")
    add_serve_arguments(p)
    add_router_arguments(p)
    taken = set(p._option_string_actions)
    assert sorted(flags - taken - set(NOT_TAKEN)) == []
    assert sorted(set(NOT_TAKEN) & taken) == []
    doc = (Path(__file__).parents[2] / "docs" / "migrating.md").read_text()
    assert [f for f in NOT_TAKEN if f"`{f}`" not in doc] == []


@pytest.fixture(scope="module")
def engines(fleet: Fleet) -> Iterator[Fleet]:
    """Three prefillers (the session's and two more) and the session's two decoders."""
    with running(SimProcess("prefill", *SIM_ARGS), SimProcess("prefill", *SIM_ARGS)) as extra:
        yield Fleet(prefillers=[*fleet.prefillers, *extra], decoders=list(fleet.decoders))


def pointed_at(args: list[str], engines: Fleet) -> list[str]:
    """``args`` with vllm-router's example hosts replaced by the simulated engines' URLs, in order."""
    prefill = iter(s.url for s in engines.prefillers)
    decode = iter(s.url for s in engines.decoders)
    return [next(prefill) if a.startswith("http://prefill") else next(decode) if a.startswith("http://decode")
            else a for a in args]


@pytest.mark.parametrize("line", DOCUMENTED, ids=["policy", "bootstrap-ports", "two-policies"])
def test_documented_line_routes_through_p_and_d(line: str, engines: Fleet, tmp_path: Path) -> None:
    for sim in engines.all:
        sim.reset()
    proc = ServeProcess(tmp_path / "serve.log", *pointed_at(router_args(line), engines))
    try:
        proc.start()
        body = {"model": "sim-model", "prompt": "hello there", "max_tokens": 4}
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        legs_p = [q for s in engines.prefillers for q in s.completions_received()]
        legs_d = [q for s in engines.decoders for q in s.completions_received()]
        assert len(legs_p) == 1 and len(legs_d) == 1
        assert legs_p[0]["body"]["kv_transfer_params"]["do_remote_decode"] is True
        assert legs_d[0]["body"]["kv_transfer_params"]["do_remote_prefill"] is True
    finally:
        proc.stop()
    assert "Traceback" not in proc.text()


def parse(*argv: str) -> tuple[str, str, list[str]]:
    p = _Parser(prog="pdproxy serve")
    add_serve_arguments(p)
    add_router_arguments(p)
    s = settings_from_args(p.parse_args(["--prefill", "http://p:1", "--decode", "http://d:2", *argv]))
    return s.routing_picker, s.prefix_routing, s.prefill


@pytest.mark.parametrize("policy", sorted(ROUTER_POLICIES))
def test_policy_becomes_picker_and_prefix_routing(policy: str) -> None:
    want = ROUTER_POLICIES[policy]
    assert parse("--policy", policy)[:2] == (want.routing_picker, want.prefix_routing)
    # --prefill-policy decides over --policy; pdproxy's own flag decides over both
    assert parse("--policy", "random", "--prefill-policy", policy)[:2] == (want.routing_picker,
                                                                           want.prefix_routing)
    assert parse("--policy", policy, "--routing-picker", "power_of_two")[0] == "power_of_two"


def test_router_flags_set_settings() -> None:
    p = _Parser(prog="pdproxy serve")
    add_serve_arguments(p)
    add_router_arguments(p)
    s = settings_from_args(p.parse_args([
        "--prefill", "http://p:1", "9000", "http://p:2", "none", "--decode", "http://d:2",
        "--health-check-interval-secs", "7", "--health-check-timeout-secs", "2", "--request-timeout-secs", "60",
        "--cb-failure-threshold", "5", "--retry-max-retries", "2", "--retry-initial-backoff-ms", "100",
        "--queue-timeout-secs", "9", "--api-key", "k", "--prometheus-port", "29000",
        "--health-failure-threshold", "7", "--health-success-threshold", "4"]))
    assert s.prefill == ["http://p:1", "http://p:2"]
    assert (s.health_interval_s, s.health_timeout_s, s.request_timeout_s) == (7.0, 2.0, 60.0)
    assert (s.breaker_failures, s.prefill_attempts, s.decode_attempts) == (5, 3, 3)
    assert (s.retry_backoff_s, s.prefill_queue_timeout_s, s.engine_api_key) == (0.1, 9.0, "k")
    # vllm-router's probe thresholds are pdproxy's (docs/health.md), not accepted and dropped
    assert (s.health_unhealthy_threshold, s.health_healthy_threshold) == (7, 4)


def test_router_pd_and_cache_aware_flags_are_taken() -> None:
    """vllm-router's PD-mode flags that a vllm-router line carries (``vllm-router --help``, 0.1.17): its KV events
    per prefiller become pdproxy's (one endpoint per DP rank, on consecutive ports), its CORS origins pdproxy's;
    ``--kv-connector nixl``, the cache_aware tuning, the concurrency cap, request-id headers and the log directory
    are accepted with no effect (old code: ``unrecognized arguments``, start-up stopped)."""
    p = _Parser(prog="pdproxy serve")
    add_serve_arguments(p)
    add_router_arguments(p)

    def parse_line(*argv: str) -> Settings:
        return settings_from_args(p.parse_args(["--prefill", "http://p:1", "--decode", "http://d:2", *argv]))

    s = parse_line("--prefill", "http://p:3", "--prefiller-dp-size", "2", "--kv-connector", "nixl",
                   "--pd-kv-events", "http://p:1=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558",
                   "--pd-kv-events", "http://p:3=tcp://h:6000", "--policy", "cache_aware", "--cache-threshold", "0.5",
                   "--balance-abs-threshold", "32", "--balance-rel-threshold", "1.2", "--eviction-interval-secs",
                   "60", "--max-tree-size", "1000", "--max-concurrent-requests", "64", "--request-id-headers",
                   "x-request-id", "x-trace-id", "--log-dir", "/tmp/x", "--cors-allowed-origins", "http://a.example",
                   "https://b.example")
    assert s.kv_events == ["http://p:1=tcp://10.0.0.1:5557", "http://p:3=tcp://h:6000"]
    assert s.allowed_origins == ["http://a.example", "https://b.example"]
    assert (s.routing_picker, s.prefix_routing) == ("least_cost", "auto")
    assert parse_line("--pd-kv-events", "http://q:1=tcp://h:1").kv_events == ["http://q:1=tcp://h:1"]   # warned of
    spelled = parse_line("--prefill", "http://[::1]:80", "--pd-kv-events", "http://[0::1]=tcp://h:7")
    assert [src.endpoint for src in spelled.kv_event_sources()] == ["http://[::1]:80"]  # one engine, two spellings
    assert parse_line("--cors-allowed-origins", "http://a", "--allowed-origins", "http://b").allowed_origins == [
        "http://b"]                                                       # pdproxy's own flag wins
    for argv, words in ((("--kv-connector", "mooncake"), ("--kv-connector", "bootstrap", "nixl")),
                        (("--kv-connector", "p2p"), ("--kv-connector", "nixl, mooncake and moriio")),
                        (("--prefiller-dp-size", "2", "--pd-kv-events", "http://p:1=tcp://h:1,tcp://h:5"),
                         ("--pd-kv-events", "tcp://h:2")),
                        (("--pd-kv-events", "http://p:1=tcp://h:1,tcp://h:2"),
                         ("--pd-kv-events", "2 endpoints", "1 DP rank", "--intra-node-data-parallel-size")),
                        (("--pd-kv-events", "nope"), ("--pd-kv-events", "URL=ENDPOINT"))):
        with pytest.raises(ValueError) as bad:
            parse_line(*argv)
        assert all(w in str(bad.value) for w in words) and "\n" not in str(bad.value), bad.value


def test_vllm_routers_probe_routes_answer_as_its_probes_expect(sims: Fleet) -> None:
    """A k8s Deployment moved from vllm-router (or a SageMaker endpoint from vLLM, ``/ping``) keeps its probes:
    ``/health_generate``, ``/ping`` and ``/readiness`` are 200
    with a serving prefill/decode pair and 503 + ``Retry-After`` without one (``/readiness`` says why, with each
    role's counts, in the router's JSON), ``/liveness`` is 200 either way."""
    from tests.support import ProxyThread, wait_until

    up = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders]).start()
    try:
        assert httpx.get(up.url + "/health_generate").status_code == 200
        r = httpx.get(up.url + "/readiness")
        p, d = len(sims.prefillers), len(sims.decoders)
        assert r.status_code == 200 and r.json() == {"status": "ready", "prefill": {"healthy": p, "total": p},
                                                     "decode": {"healthy": d, "total": d}}
        assert httpx.get(up.url + "/liveness").text == "OK"
        for ping in (httpx.get(up.url + "/ping"), httpx.post(up.url + "/ping")):   # vLLM's SageMaker check
            assert ping.status_code == 200 and ping.content == b""
    finally:
        up.stop()
    down = ProxyThread(prefill=[sims.prefillers[0].url], decode=["http://127.0.0.1:9"])
    down.thread.start()                                     # not .start(): it waits for a healthy proxy
    try:
        wait_until(lambda: down.server.started and down.state is not None, 15, 0.02, "proxy started")
        wait_until(lambda: httpx.get(down.url + "/readiness").json()["prefill"]["healthy"] == 1, 15, 0.05,
                   "the prefiller judged healthy")
        g, r = httpx.get(down.url + "/health_generate"), httpx.get(down.url + "/readiness")
        assert g.status_code == r.status_code == 503 and g.headers["retry-after"] == r.headers["retry-after"] == "1"
        assert httpx.get(down.url + "/ping").status_code == httpx.post(down.url + "/ping").status_code == 503
        assert r.json() == {"status": "not_ready", "reason": "no healthy decode engine",
                            "prefill": {"healthy": 1, "total": 1}, "decode": {"healthy": 0, "total": 1}}
        live = httpx.get(down.url + "/liveness")
        assert live.status_code == 200 and live.text == "OK"
        status = httpx.get(down.url + "/healthcheck")     # the vLLM-Ascend example proxy's: 404 in old code
        assert status.status_code == 200 and status.json() == {"status": "ok", "prefill_instances": 1,
                                                               "decode_instances": 1, "request_num": 0}
    finally:
        down.stop()
