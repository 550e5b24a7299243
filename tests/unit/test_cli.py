"""``pdproxy serve`` refuses configurations that can never work, with one clear line and exit code 2."""

from __future__ import annotations

import os

import pytest

from pdproxy.cli import main
from pdproxy.settings import Settings

pytestmark = pytest.mark.timeout(20)


@pytest.mark.parametrize(("argv", "message"), [
    (["--prefill", "http://127.0.0.1:9"], "no decode engines configured"),
    (["--decode", "http://127.0.0.1:9"], "no prefill engines configured"),
    (["--prefill", "ftp://p:1", "--decode", "http://d:2"], "scheme must be http or https"),
    (["--prefill", "http://p:1", "http://p:1/", "--decode", "http://d:2"], "duplicate prefill endpoint http://p:1"),
    (["--prefiller-hosts", "p0", "p1", "p2", "--prefiller-ports", "1", "2", "--decode", "http://d:2"],
     "3 hosts but 2 ports"),
    (["--prefill", "http://p:1", "--decode", "http://d:2", "--port", "70000"], "port"),
    (["--prefill", "http://p:1", "--decode", "http://d:2", "--max-tokens-overflow", "sometimes"],
     "--max-tokens-overflow"),
    (["--prefill", "http://p:1", "--decode", "http://d:2", "--prefill-budget-s", "inf"],    # no bound at all
     "--prefill-budget-s (or --prefill-budget-secs): Input should be a finite number"),
    (["--prefill", "http://p:1", "--decode", "http://d:2", "--prefill-queue-timeout-s", "nan"],
     "--prefill-queue-timeout-s (or --prefill-queue-timeout-secs): Input should be a finite number"),
    # a peer's flag is named as typed, not as the setting it sets
    (["--prefill", "http://p:1", "--decode", "http://d:2", "--queue-size", "-1"], "flag --queue-size: Input"),
    (["--prefill", "http://p:1", "--decode", "http://d:2", "--max-payload-size", "1000"],
     "flag --max-payload-size: Input"),
    (["--prefill", "http://p:1", "--decode", "http://d:2", "--cb-timeout-duration-secs", "-1"],
     "flag --cb-timeout-duration-secs: Input"),
    (["--prefill", "http://p:1", "--decode", "http://d:2", "--decode-idle-timeout-secs", "-3"],
     "flag --decode-idle-timeout-s (or --decode-idle-timeout-secs): Input"),
    (["--config", "/"], "config file / is a directory, not a file"),
])
def test_bad_serve_configurations_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("PDPROXY_")]:
        monkeypatch.delenv(key)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pdproxy: ") and message in err and "Traceback" not in err


def test_doctor_never_prints_a_nonzero_kv_usage_as_zero() -> None:
    from pdproxy.tools.doctor import _percent

    assert _percent(0.000122) == "0.012%"     # one pinned block of a large pool
    assert _percent(0) == "0.0%" and _percent(0.5) == "50.0%"


@pytest.mark.parametrize(("environ", "lines"), [
    ({"PDPROXY_STREAM_CONTINUATON": "1"},
     ["environment PDPROXY_STREAM_CONTINUATON: unknown setting, ignored (did you mean PDPROXY_STREAM_CONTINUATION?)"]),
    ({"PDPROXY_CONFG": "x.yaml"}, ["environment PDPROXY_CONFG: unknown setting, ignored (did you mean PDPROXY_CONFIG?)"]),
    ({"pdproxy_port": "1", "PDPROXY_CONFIG": "x", "PDPROXY_SKIP_REAL_VLLM": "1", "PDPROXY_LOCUST_MODEL": "m",
      "PDPROXY_NO_EXTENSIONS": "1", "PDPROXY_FUZZ_EXAMPLES": "9", "HOME": "/root"}, []),
    ({"PDPROXY_ZZZZZZZZ": "1"}, ["environment PDPROXY_ZZZZZZZZ: unknown setting, ignored"]),
])
def test_unknown_pdproxy_variables_are_named(environ: dict[str, str], lines: list[str]) -> None:
    from pdproxy.settings import unknown_environment

    assert unknown_environment(environ) == lines


def test_a_bad_nested_value_in_a_config_file_is_named_on_its_own_line(tmp_path: os.PathLike[str],
                                                                     capsys: pytest.CaptureFixture[str],
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``endpoints.1.role`` is wrong on line 4, not on line 1 where ``endpoints:`` is written (old code: line 1)."""
    for key in [k for k in os.environ if k.startswith("PDPROXY_")]:
        monkeypatch.delenv(key)
    config = os.path.join(tmp_path, "bad.yaml")
    with open(config, "w") as f:
        f.write("endpoints:\n  - {url: http://p:1, role: prefill}\n  - {url: http://d:2, role: decode}\n"
                "  - {url: http://d:3, role: decod}\n")
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--config", config])
    assert exit_.value.code == 2
    assert f"{config}:4: setting endpoints.2.role: Input should be 'prefill' or 'decode'" in capsys.readouterr().err


def _serve_settings(argv: list[str]) -> Settings:
    from pdproxy.cli import _Parser, add_router_arguments, add_serve_arguments, settings_from_args

    p = _Parser(prog="pdproxy serve")
    add_serve_arguments(p)
    add_router_arguments(p)
    return settings_from_args(p.parse_args(argv))


def test_the_vllm_ascend_example_proxys_line_starts_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """The example proxy's own flags (its ``parse_args``: ``--max-retries``, ``--retry-delay``, the waiting-node
    flags, ``--log-level`` in upper case) are accepted; old code: "unrecognized arguments", then a --log-level
    error for ``INFO``."""
    for key in [k for k in os.environ if k.startswith("PDPROXY_")]:
        monkeypatch.delenv(key)
    s = _serve_settings(["--host", "0.0.0.0", "--port", "9000", "--workers", "2",
                         "--prefiller-hosts", "p0", "p1", "--prefiller-ports", "8100", "8101",
                         "--decoder-hosts", "d0", "--decoder-ports", "8200",
                         "--max-retries", "5", "--retry-delay", "0.2", "--max-waiting-retries", "3",
                         "--waiting-retry-interval", "10", "--log-level", "INFO"])
    assert (s.prefill_attempts, s.decode_attempts, s.retry_backoff_s) == (5, 5, 0.2)
    assert (s.workers, s.log_level) == (2, "info")
    assert _serve_settings(["--prefill", "http://p:1", "--decode", "http://d:2", "--max-retries", "0"]
                           ).prefill_attempts == 1                      # max(1, N) tries, as the example proxy
    # pdproxy's own flag wins over the peer's spelling
    assert _serve_settings(["--prefill", "http://p:1", "--decode", "http://d:2", "--max-retries", "5",
                            "--decode-attempts", "2"]).decode_attempts == 2


@pytest.mark.parametrize(("given", "level"), [("critical", "critical"), ("CRITICAL", "critical"),
                                              ("Warning", "warning"), ("DEBUG", "debug")])
def test_log_level_takes_the_peers_spellings(given: str, level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-router's ``--log-level`` choices include ``critical``; the vLLM-Ascend example proxy's are upper case."""
    for key in [k for k in os.environ if k.startswith("PDPROXY_")]:
        monkeypatch.delenv(key)
    assert _serve_settings(["--prefill", "http://p:1", "--decode", "http://d:2", "--log-level", given]
                           ).log_level == level


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_a_request_log_path_that_cannot_be_opened_stops_start_up_in_one_line(
        command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Said before any engine is probed or started (it was a uvicorn traceback after the demo said it was up)."""
    for key in [k for k in os.environ if k.startswith("PDPROXY_")]:
        monkeypatch.delenv(key)
    extra = (["--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:10", "--port", "0"]
             if command == "serve" else [])                   # the log's path is checked before the ports
    with pytest.raises(SystemExit) as exit_:
        main([command, *extra, "--request-log-path", "/nonexistent/dir/requests.jsonl"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert err.strip() == (f"pdproxy{' demo' if command == 'demo' else ''}: flag --request-log-path "
                           "/nonexistent/dir/requests.jsonl: cannot open it for appending: No such file or directory")


@pytest.mark.parametrize("command", ["serve", "sim", "demo", "doctor"])
def test_an_unknown_flag_is_named_by_its_sub_command(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``pdproxy serve --bogus 1`` says ``pdproxy serve: error: …`` and points to ``pdproxy serve --help`` (which
    lists the flags), as a bad value's error does; not the top-level ``pdproxy --help``, which lists none."""
    with pytest.raises(SystemExit) as exc:
        main([command, "--bogus", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == f"pdproxy {command}: error: unrecognized arguments: --bogus 1 (see pdproxy {command} --help)\n"


def test_an_unknown_flag_before_the_sub_command_is_the_top_level_parsers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--bogus", "serve"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == "pdproxy: error: unrecognized arguments: --bogus (see pdproxy --help)\n"


def test_a_seconds_flag_takes_uvicorns_spelling_without_a_unit(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--timeout-keep-alive 7`` (uvicorn's flag, as ``vllm serve`` users know it) sets ``timeout_keep_alive_s``;
    old code: "ambiguous option: --timeout-keep-alive could match --timeout-keep-alive-s, --timeout-keep-alive-secs"."""
    for key in [k for k in os.environ if k.startswith("PDPROXY_")]:
        monkeypatch.delenv(key)
    base = ["--prefill", "http://p:1", "--decode", "http://d:2"]
    assert _serve_settings([*base, "--timeout-keep-alive", "7"]).timeout_keep_alive_s == 7
    assert _serve_settings([*base, "--request-timeout", "30"]).request_timeout_s == 30
    from pdproxy.cli import _Parser, add_serve_arguments

    p = _Parser(prog="pdproxy serve")
    add_serve_arguments(p)
    flags = set(p._option_string_actions)
    assert {"--timeout-keep-alive", "--timeout-keep-alive-secs", "--timeout-keep-alive-s"} <= flags
    assert "--prefill-queue-aging-tokens-per-s" in flags        # a rate (tokens per second) is no duration:
    assert not {"--prefill-queue-aging-tokens-per", "--prefill-queue-aging-tokens-per-secs"} & flags   # no unit


def test_doctor_takes_serves_whole_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """A migrated ``serve`` line (vllm-router's flags, a bootstrap port, ``--api-key``, a policy) pastes into
    ``doctor``; old code: "unrecognized arguments" for everything but the engine flags."""
    from pdproxy import cli
    from pdproxy.tools import doctor

    for key in [k for k in os.environ if k.startswith("PDPROXY_")]:
        monkeypatch.delenv(key)
    seen: list[Settings] = []
    monkeypatch.setattr(doctor, "run", lambda settings, _args: seen.append(settings) or 0)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["doctor", "--vllm-pd-disaggregation", "--prefill", "http://p:1", "9000", "--decode", "http://d:2",
                  "--policy", "cache_aware", "--api-key", "k", "--timeout-keep-alive", "7", "--budget-s", "5"])
    assert exit_.value.code == 0
    (s,) = seen
    assert (s.prefill, s.decode) == (["http://p:1"], ["http://d:2"])
    assert s.engine_api_key == "k"
