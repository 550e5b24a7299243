"""Bad configuration fails at start, loudly: ``pdproxy serve`` exits 2 with one line naming the problem, instead
of starting and answering every request 503."""

from __future__ import annotations

import os

import pytest

from pdproxy.cli import main
from pdproxy.endpoints import Role, engine_identity, from_host_port_lists, normalize_url

pytestmark = pytest.mark.timeout(20)


@pytest.mark.parametrize(("argv", "message"), [
    (["--prefill", "notaurl", "--decode", "http://d:2"], "bad engine URL 'notaurl'"),
    (["--prefill", "http://p:1", "--decode", "10.0.0.5"], "bad engine URL '10.0.0.5'"),
    (["--prefill", "http://user:pw@p:1", "--decode", "http://d:2"], "credentials"),
    (["--prefill", "http://p:1?x=1", "--decode", "http://d:2"], "no query"),
    (["--prefill", "http://p:1/../x", "--decode", "http://d:2"], "no dot segments"),
    (["--prefill", "http://p:1/a/%2E%2e", "--decode", "http://d:2"], "no dot segments"),
    (["--prefill", "http://p:1", "--decode", "http://d:2/.\\x"], "no dot segments"),
    (["--prefill", "http://p_!:1", "--decode", "http://d:2"], "not a host name"),
    (["--prefill", "p:0", "--decode", "http://d:2"], "port must be 1-65535"),
    (["--prefiller-hosts", "p0", "--prefiller-ports", "9100", "9101", "--decode", "http://d:2"],
     "1 hosts but 2 ports"),
    (["--prefill", "http://p:1", "--decoder-hosts", "d0", "d1", "--decoder-ports", "9100"], "2 hosts but 1 ports"),
])
def test_bad_engine_lists_fail_at_start(argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("PDPROXY_")]:
        monkeypatch.delenv(key)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("pdproxy: ") and message in err and "Traceback" not in err


@pytest.mark.parametrize(("url", "normal"), [
    ("p0:9100", "http://p0:9100"),
    ("http://10.0.0.5:9100/v1/", "http://10.0.0.5:9100"),
    ("https://vllm-decode-0.vllm-decode:9100", "https://vllm-decode-0.vllm-decode:9100"),
    ("http://[fd00::5]:9100", "http://[fd00::5]:9100"),
    ("http://engine", "http://engine"),
    ("http://Decode-0.Example.:9100/v1", "http://decode-0.example.:9100"),   # a root dot kept: no search list
])
def test_good_urls_are_normalised(url: str, normal: str) -> None:
    assert normalize_url(url) == normal


@pytest.mark.parametrize(("a", "b", "same"), [
    ("http://127.0.0.1.:9100", "http://127.0.0.1:9100", True),
    ("http://decode.ns.svc.:9100", "http://decode.ns.svc:9100", True),
    ("https://h.:9100/base", "https://h:9100/base", True),
    ("http://h.", "http://h", True),
    ("http://h:9100", "http://h:9101", False),
    ("http://h.:9100", "https://h:9100", False),
    ("http://h", "http://h:80", True),
    ("https://h:443/base", "https://h/base", True),
    ("http://h:443", "https://h", False),
    ("http://[0:0:0:0:0:0:0:1]:9100", "http://[::1]:9100", True),
    ("http://H.Example:9100", "http://h.example.:9100", True),
])
def test_engine_identity_tells_one_engine_by_two_names(a: str, b: str, same: bool) -> None:
    assert (engine_identity(normalize_url(a)) == engine_identity(normalize_url(b))) is same


def test_hosts_and_ports_pair_one_to_one() -> None:
    assert from_host_port_lists(["d0", "d0", "fd00::5"], [9100, 9101, 9100], Role.DECODE) == [
        "http://d0:9100", "http://d0:9101", "http://[fd00::5]:9100"]
