"""What ``pdproxy serve`` (the real command) says about itself, read from its log: the banner; each engine found
with its limits, unreachable, back, with changed limits; a breaker opening and closing; the drain at SIGTERM —
each once per change however many probes and requests pass meanwhile, in the JSON log format (every line one
JSON object, request lines included as they are) and in the text format."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import httpx
import pytest

from pdproxy import __version__
from pdproxy.endpoints import Role
from pdproxy.engines.limits import EngineLimits
from pdproxy.settings import load_settings
from tests.conftest import Fleet
from tests.ops.serveproc import ServeProcess
from tests.support import SimProcess, free_port, wait_until

pytestmark = pytest.mark.timeout(90)

SIM = ("--served-model-name", "sim-model", "--decode-tokens-per-s", "0")


def chat(url: str) -> int:
    r = httpx.post(url + "/v1/chat/completions", timeout=20, json={
        "model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    return r.status_code


def test_json_log_says_each_change_once(sims: Fleet, tmp_path: Path) -> None:
    p_url, d_url = sims.prefillers[0].url, sims.decoders[0].url
    x_port = free_port()
    x_url = f"http://127.0.0.1:{x_port}"
    proxy = ServeProcess(tmp_path / "serve.log", "--prefill", p_url, "--decode", d_url, x_url, "--log-format", "json",
                         "--engine-refresh-interval-s", "0.2", "--shutdown-grace-s", "5", "--policy", "round_robin",
                         "--admin-key", "admin-secret-1234")
    x: SimProcess | None = None
    try:
        proxy.start()
        wait_until(lambda: proxy.events("serve_started"), 10, what="banner")
        (banner,) = proxy.events("serve_started")
        assert banner["version"] == __version__ and banner["listen"] == [proxy.url]
        assert (banner["prefillers"], banner["decoders"], banner["tls"]) == (1, 2, False)
        assert banner["level"] == "INFO" and f"listening on {proxy.url}" in banner["message"]
        (effect,) = proxy.events("settings")      # what the command line became, vllm-router's --policy included
        assert effect["settings"]["prefix_routing"] == "off" and effect["settings"]["shutdown_grace_s"] == 5.0
        assert effect["settings"]["decode"] == [d_url, x_url] and effect["settings"]["admin_key"] == "***"
        assert "routing_picker" not in effect["settings"] and "prefix_routing=off" in effect["message"]
        assert "admin-secret-1234" not in proxy.text()
        for url, role in ((p_url, "prefill"), (d_url, "decode")):
            (up,) = proxy.events("engine_up", endpoint=url)
            assert (up["role"], up["max_model_len"], up["level"]) == (role, 4096, "INFO")
            assert up["kv_pool_tokens"] == 4 * 4096 and "max_model_len 4,096" in up["message"]
        (down,) = proxy.events("engine_unreachable", endpoint=x_url)
        assert down["level"] == "WARNING" and down["error"]

        # the engine comes up (many probes of the dead port happened meanwhile: still one line), goes away, and
        # comes back with a smaller max_model_len
        x = SimProcess("decode", *SIM, "--max-model-len", "4096", port=x_port).start()
        wait_until(lambda: proxy.events("engine_up", endpoint=x_url), 10, what="x up")
        assert len(proxy.events("engine_unreachable", endpoint=x_url)) == 1
        x.stop()
        wait_until(lambda: len(proxy.events("engine_unreachable", endpoint=x_url)) == 2, 10, what="x down")
        x = SimProcess("decode", *SIM, "--max-model-len", "2048", port=x_port).start()
        wait_until(lambda: proxy.events("engine_reachable", endpoint=x_url), 10, what="x back")
        (changed,) = wait_until(lambda: proxy.events("engine_limits_changed", endpoint=x_url), 10, what="limits")
        assert (changed["previous_max_model_len"], changed["max_model_len"]) == (4096, 2048)
        assert changed["level"] == "WARNING" and "max_model_len 4,096 → 2,048" in changed["message"]

        # a 503 with Retry-After opens x's breaker; once x answers again a request closes it
        x.faults({"kind": "status", "status": 503, "retry_after": 1, "times": 1})

        def opened() -> bool:
            assert chat(proxy.url) == 200  # the decode leg moved to the other decoder
            return bool(proxy.events("breaker_opened", endpoint=x_url))

        wait_until(opened, 20, 0.05, "breaker opened")
        wait_until(lambda: chat(proxy.url) == 200 and proxy.events("breaker_closed", endpoint=x_url), 20, 0.05,
                   "breaker closed")
        (bo,) = proxy.events("breaker_opened", endpoint=x_url)
        assert bo["level"] == "WARNING" and bo["role"] == "decode"
        assert len(proxy.events("breaker_closed", endpoint=x_url)) == 1
        for url in (p_url, d_url):  # nothing changed for the others: nothing more said about them
            assert [r["event"] for r in proxy.json_lines() if r.get("endpoint") == url] == ["engine_up"]

        # the client has its last answer a moment before the proxy's bookkeeping of it ends (a loaded machine can
        # run this test in between): the drain below is of an idle proxy
        wait_until(lambda: httpx.get(proxy.url + "/debug/load", timeout=5).json()["in_flight"] == 0, 10, 0.02,
                   "proxy idle")
        assert proxy.terminate() == 0
        (started,) = proxy.events("shutdown_started")
        assert started["signal"] == "SIGTERM" and started["in_flight"] == 0
        assert proxy.events("shutdown_done")
        lines = [line for line in proxy.text().splitlines() if line.strip()]
        records = proxy.json_lines()
        assert len(records) == len(lines), [line for line in lines if not line.startswith("{")]  # all JSON
        requests = [r for r in records if r.get("event") == "request"]
        assert requests and all("message" not in r and r["status"] == 200 for r in requests)  # as they are
    finally:
        proxy.stop()
        if x is not None:
            x.stop()


def test_text_log_banner_engines_and_shutdown(sims: Fleet, tmp_path: Path) -> None:
    """The banner, each engine once, the shutdown; and a mistyped ``PDPROXY_*`` variable (which pydantic-settings
    ignores) is named with the setting it resembles, as vLLM names an unknown ``VLLM_*`` variable."""
    env = {**os.environ, "PDPROXY_STREAM_CONTINUATON": "true", "PDPROXY_CONFIG_DIR_X": "1"}
    proxy = ServeProcess(tmp_path / "serve.log", "--prefill", sims.prefillers[0].url, "--decode",
                         *(s.url for s in sims.decoders), "--no-request-log", env=env)
    try:
        proxy.start()
        wait_until(lambda: "listening on" in proxy.text(), 10, what="banner")
        text = proxy.text()
        assert ("WARNING pdproxy environment PDPROXY_STREAM_CONTINUATON: unknown setting, ignored (did you mean "
                "PDPROXY_STREAM_CONTINUATION?)") in text, text
        assert "environment PDPROXY_CONFIG_DIR_X: unknown setting, ignored" in text
        assert "environment PDPROXY_CONFIG:" not in text and "PDPROXY_SKIP" not in text
        assert re.search(rf"INFO pdproxy pdproxy {re.escape(__version__)} listening on {re.escape(proxy.url)}: "
                         r"1 prefiller\(s\), 2 decoder\(s\); TLS off; 1 worker\(s\)", text), text
        for s in sims.all:
            assert len(re.findall(rf"INFO pdproxy\.engines engine {re.escape(s.url)} \(\w+\) up: model sim-model, "
                                  r"max_model_len 4,096", text)) == 1, text
        assert chat(proxy.url) == 200
        assert "no model is served by both" not in text                  # they agree: nothing said
        assert proxy.terminate() == 0
        text = proxy.text()
        # "shutting down (nothing in flight)", or "draining" if the last request was still being recorded
        assert re.search(r"SIGTERM: (shutting down|draining)", text) and "shutdown complete" in text
    finally:
        proxy.stop()


def test_prefillers_and_decoders_serving_different_names_are_named_at_start(sims: Fleet, tmp_path: Path) -> None:
    """A decoder started with another ``--served-model-name`` than the prefiller: ``serve`` says so once at start
    (``models_disjoint``, each role's models), and the 404 a request then gets says which role lacks the model
    (old code: "engine … up" lines only, and 404s whose "Valid aliases" sent the user back and forth)."""
    other = SimProcess("decode", "--served-model-name", "other-model", "--decode-tokens-per-s", "0").start()
    proxy = ServeProcess(tmp_path / "serve.log", "--prefill", sims.prefillers[0].url, "--decode", other.url,
                         "--log-format", "json", "--engine-refresh-interval-s", "0.2")
    try:
        proxy.start()
        wait_until(lambda: proxy.events("serve_started"), 10, what="banner")
        wait_until(lambda: len(proxy.events("engine_up")) == 2, 10, what="both engines up")
        (said,) = proxy.events("models_disjoint")
        assert said["level"] == "WARNING" and (said["prefill_models"], said["decode_models"]) == (
            ["sim-model"], ["other-model"]), said
        r = httpx.post(proxy.url + "/v1/chat/completions", timeout=20, json={
            "model": "sim-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and "served by prefill engines but by no decode engine" in \
            r.json()["error"]["message"], r.text
        assert len(proxy.events("models_disjoint")) == 1                 # said once, however many refreshes
    finally:
        proxy.stop()
        other.stop()


def test_an_engine_line_names_the_largest_prompt_its_role_takes() -> None:
    """Seed 000's pool of 4,584 tokens, 4,580 for requests (vLLM keeps a block as its null block): a prefiller
    takes a prompt of 4,580, a decoder one of 4,579 (the answer's first token must fit too).  The prefiller's line said "prompts over 4,584 tokens are refused with a 400" — yet
    a request needs a decoder too, and a 4,584-token prompt was refused: the line now names the engine's own
    figure and what a decoder with the same pool takes, and says when pdproxy refuses."""
    from pdproxy.endpoints import Role
    from pdproxy.engines.control import EngineInfo
    from pdproxy.engines.events import describe

    info = EngineInfo(models=[{"id": "glm"}], max_model_len=133_120, kv_pool_tokens=4584, num_gpu_blocks=1146,
                      block_size=4)
    assert describe(info, Role.PREFILL).endswith(
        "— below max_model_len: this prefiller takes prompts of at most 4,580 tokens and a decoder with the same "
        "pool 4,579 (the answer's first token must fit too); longer ones would queue forever in the engine, so a "
        "prompt is refused with a 400 unless some prefiller and some decoder take it")
    assert describe(info, Role.DECODE).endswith(
        "— below max_model_len: this decoder takes prompts of at most 4,579 tokens (the answer's first token must "
        "fit too); longer ones would queue forever in the engine, so a prompt is refused with a 400 unless some "
        "prefiller and some decoder take it")
    assert "prompts over" not in describe(info, Role.PREFILL)
    assert "KV pool 4,584 tokens (1,146 blocks × 4, one of them vLLM's null block)" in describe(info, Role.DECODE)


def test_an_engine_line_gives_admissions_figures_for_both_roles_and_any_pool() -> None:
    """Every figure an engine line prints is admission's (EngineLimits.allowed_prompt): the operator's sims with
    --max-model-len 16384 --num-gpu-blocks-override 100 (a pool of 1,600 tokens, 1,584 for requests: pdproxy
    admits 1,583 and refuses 1,584), and pools at and above max_model_len, where the pool bounds nothing and the line says nothing
    more — including a prefiller's pool of max_model_len − 1, which holds the largest prompt max_model_len allows."""
    import re

    from pdproxy.endpoints import Role
    from pdproxy.engines.control import EngineInfo
    from pdproxy.engines.events import describe
    from pdproxy.engines.limits import EngineLimits

    def line(pool: int, role: Role) -> str:
        return describe(EngineInfo(models=[{"id": "sim-model"}], max_model_len=16_384, kv_pool_tokens=pool,
                                   num_gpu_blocks=pool // 16, block_size=16), role)

    for role in Role:
        at_most = re.search(r"this \w+ takes prompts of at most ([\d,]+) tokens", line(1600, role))
        assert at_most is not None, line(1600, role)
        allowed = EngineLimits(max_model_len=16_384, kv_pool_tokens=1600, block_size=16).allowed_prompt(role, None)
        assert int(at_most.group(1).replace(",", "")) == allowed == (1584 if role is Role.PREFILL else 1583)
    assert "and a decoder with the same pool 1,583 " in line(1600, Role.PREFILL)
    for pool in (16_400, 16_401, 40_000):          # a block more than max_model_len: the pool bounds nothing
        for role in Role:
            assert line(pool, role).endswith(f"KV pool {pool:,} tokens ({pool // 16:,} blocks × 16, one of them "
                                             "vLLM's null block)"), line(pool, role)
    assert "below max_model_len" not in line(16_399, Role.PREFILL)                    # takes 16,383 either way
    assert "this decoder takes prompts of at most 16,382 tokens" in line(16_399, Role.DECODE)


@pytest.mark.parametrize("role", [Role.PREFILL, Role.DECODE])
@pytest.mark.parametrize(("mml", "pool"), [(16384, 1600), (16384, 16383), (16384, 16384), (16384, 16385), (4096, None),
                                           (None, 1600), (None, None)])
def test_the_printed_bounds_are_the_ones_admission_takes_the_smaller_of(role: Role, mml: int | None,
                                                                        pool: int | None) -> None:
    """EngineLimits.prompt_bounds (the start-up line's and doctor's figures) and allowed_prompt (admission's hot
    path) are written apart: they must agree, or the words would again say one limit while admission uses another."""
    limits = EngineLimits(max_model_len=mml, kv_pool_tokens=pool)
    bounds = [b for b in limits.prompt_bounds(role) if b is not None]
    assert (min(bounds) if bounds else None) == limits.allowed_prompt(role, None)


@pytest.mark.parametrize(("prefill", "decode", "named"), [
    (["http://h:8100"], ["http://h:8100"], ["http://h:8100"]),
    (["http://h:8100", "http://p:8100"], ["http://h.:8100/", "http://d:8100"], ["http://h:8100"]),  # one engine
    (["http://p:8100"], ["http://d:8100", "http://p:8101"], []),
])
def test_an_engine_in_both_roles_is_warned_of_at_start(prefill: list[str], decode: list[str],
                                                       named: list[str]) -> None:
    """``--prefill URL --decode URL`` with one URL in both: the prompt's KV is held twice on that engine during the
    handoff, which admission does not count — the start-up banner says so once per such URL, naming it and the
    consequence (old code: nothing; a prompt fitting the pool once but not twice hung inside the engine)."""
    from pdproxy.ops.logs import log_banner

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("pdproxy")
    logger.addHandler(handler)
    try:
        log_banner(load_settings(prefill=prefill, decode=decode), ["http://127.0.0.1:15000"])
    finally:
        logger.removeHandler(handler)
    warned = [r for r in records if getattr(r, "event", None) == "engine_in_both_roles"]
    assert len(warned) == len(named)
    for record, url in zip(warned, named, strict=True):
        text = record.getMessage()
        assert record.levelno == logging.WARNING and f"engine {url} is both a prefiller and a decoder" in text
        assert "held twice" in text and "waits inside the engine forever" in text, text


def test_kv_events_for_an_engine_not_configured_are_warned_of_at_start() -> None:
    """``--kv-events URL=…`` whose URL is written unlike every ``--prefill`` / ``--decode`` one (another host name,
    a typo) reads events that route nothing: the banner names it (old code: silent, the settings line only); a URL
    that matches — an internal-DP engine's too — is not named."""
    from pdproxy.ops.logs import kv_events_warnings

    s = load_settings(prefill=["http://p:8100", "http://[::1]"], decode=["http://d:8200"], decoder_dp_size=2,
                      kv_events=["http://p.:8100/=tcp://p:5557", "http://d:8200=tcp://d:5557",
                                 "http://[0:0::1]:80=tcp://p:5559", "http://localhost:8100=tcp://p:5558"])
    warned = kv_events_warnings(s)
    assert len(warned) == 1 and warned[0].startswith("kv_events names http://localhost:8100, which is no configured")
    # another spelling of a configured engine feeds that engine's entries (its name as configured)
    assert {src.endpoint for src in s.kv_event_sources()} == {
        "http://p:8100", "http://d:8200#dp0", "http://d:8200#dp1", "http://[::1]", "http://localhost:8100"}


def test_the_settings_line_shows_no_secret() -> None:
    """The start-up settings line (``event: settings``) shows the keys as ``***`` and a URL's ``user:password@``
    as ``***@`` (an OTLP endpoint's userinfo is sent as basic auth), and leaves the defaults out."""
    from pdproxy.ops.logs import redact_url, settings_in_effect

    s = load_settings(prefill=["http://p:1"], decode=["http://d:1"], api_keys=["sk-1"], engine_api_key="ek",
                      metrics_key="mk", admin_key="ak", otlp_traces_endpoint="https://u:s3cret@collector:4318/v1/traces")
    shown = settings_in_effect(s)
    assert {k: shown[k] for k in ("api_keys", "engine_api_key", "metrics_key", "admin_key")} == dict.fromkeys(
        ("api_keys", "engine_api_key", "metrics_key", "admin_key"), "***")
    assert shown["otlp_traces_endpoint"] == "https://***@collector:4318/v1/traces"
    assert "s3cret" not in repr(shown) and "port" not in shown and shown["prefill"] == ["http://p:1"]
    assert redact_url("http://h:1/a@b") == "http://h:1/a@b"          # an @ in the path is not userinfo
