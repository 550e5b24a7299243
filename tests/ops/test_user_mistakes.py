"""What a user can get wrong ends ``pdproxy`` with one line naming the culprit — the config file and line, the
flag, the port — a non-zero exit code and no traceback; a second Ctrl-C during a stream included.

Each case runs the real command line as a child process.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import SIM_ARGS, Fleet
from tests.support import SimProcess, free_port, running, wait_until

pytestmark = pytest.mark.timeout(60)

ENGINES = ("--prefill", "http://127.0.0.1:9", "--decode", "http://127.0.0.1:7")  # never reached


@dataclass(frozen=True)
class Mistake:
    args: tuple[str, ...]
    culprit: tuple[str, ...]  # what the one line must name
    files: tuple[tuple[str, str], ...] = ()  # (name, text) written to the test's directory first


MISTAKES = {
    "yaml-syntax": Mistake(("serve", "--config", "{d}/bad.yaml"), ("bad.yaml:3:", "YAML"),
                           (("bad.yaml", "port: 8000\nprefill: [http://p:1\n  x: y\n"),)),
    "json-syntax": Mistake(("serve", "--config", "{d}/bad.json"), ("bad.json:3:", "JSON"),
                           (("bad.json", '{"port": 8000,\n "prefill": [1,\n}\n'),)),
    "toml-syntax": Mistake(("serve", "--config", "{d}/bad.toml"), ("bad.toml:3:", "TOML"),
                           (("bad.toml", 'port = 8000\nprefill = ["http://p:1"\ndecode = 3\n'),)),
    "unknown-key": Mistake(("serve", "--config", "{d}/c.yaml"), ("c.yaml:2:", "prefil", "did you mean prefill"),
                           (("c.yaml", "port: 8000\nprefil: [http://p:1]\n"),)),
    "unknown-key-json": Mistake(("serve", "--config", "{d}/c.json"), ("c.json:3:", "helth_interval_s"),
                                (("c.json", '{\n  "port": 8000,\n  "helth_interval_s": 1\n}\n'),)),
    "bad-value-in-file": Mistake(("serve", "--config", "{d}/c.toml"), ("c.toml:2:", "health_interval_s"),
                                 (("c.toml", 'port = 8000\nhealth_interval_s = "soon"\n'),)),
    "bad-url-in-file": Mistake(("serve", "--config", "{d}/c.yaml"), ("c.yaml:3:", "htp:/x"),
                               (("c.yaml", "decode: [http://d:1]\nprefill:\n  - htp:/x\n"),)),
    "bad-url-flag": Mistake(("serve", "--prefill", "ftp://p:1", "--decode", "http://d:1"), ("--prefill", "ftp://p:1")),
    "bad-number-flag": Mistake(("serve", *ENGINES, "--health-check-interval-secs", "soon"), ("--health-check-interval-secs", "soon")),
    "unknown-flag": Mistake(("serve", *ENGINES, "--prefill-polciy", "random"), ("--prefill-polciy",)),
    "missing-config": Mistake(("serve", "--config", "{d}/nope.yaml"), ("nope.yaml", "not found")),
    "port-out-of-range": Mistake(("serve", *ENGINES, "--port", "70000"), ("--port", "65535")),
    "demo-engine-port": Mistake(("demo", "--engine-base-port", "65500"), ("--engine-base-port", "65500")),
    "demo-port": Mistake(("demo", "--port", "0"), ("--port",)),
    "busy-port": Mistake(("serve", *ENGINES, "--host", "127.0.0.1", "--port", "{busy}"),
                         ("127.0.0.1:{busy}", "in use")),
}


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.parametrize("name", list(MISTAKES))
def test_one_line_names_the_culprit(name: str, tmp_path: Path, busy_port: int) -> None:
    case = MISTAKES[name]
    for file, text in case.files:
        (tmp_path / file).write_text(text)
    args = [a.format(d=tmp_path, busy=busy_port) for a in case.args]
    run = subprocess.run([sys.executable, "-m", "pdproxy", *args], capture_output=True, text=True, timeout=45,
                         cwd=tmp_path)
    out = (run.stdout + run.stderr).strip()
    assert run.returncode != 0, out
    assert "Traceback" not in out
    assert len(out.splitlines()) == 1, out  # nothing before it: a busy port is found before any engine is probed
    for word in case.culprit:
        assert word.format(busy=busy_port) in out, out


@contextmanager
def serving(log: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """``pdproxy serve --host 127.0.0.1 ARGS`` as a child process writing to ``log``; killed on the way out if it is
    still running (the test's assertions decide how it should have ended)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pdproxy", "serve", "--host", "127.0.0.1", *args],
                                stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("workers", [1, 2])
def test_second_ctrl_c_during_a_stream(sims: Fleet, tmp_path: Path, workers: int) -> None:
    """SIGINT drains; a second SIGINT cuts the open stream: the process exits without a traceback — with
    ``--workers 2`` too, whose supervisor sends its workers SIGTERM again on the second (old code: it sent one
    SIGTERM, ignored the second, and the stream ran to its end, up to ``shutdown_grace_s``)."""
    with running(SimProcess("decode", *SIM_ARGS[:-1], "20")) as (slow,):
        port = free_port()
        log = tmp_path / "serve.log"
        with serving(log, "--port", str(port), "--prefill", sims.prefillers[0].url, "--decode", slow.url,
                     "--workers", str(workers)) as proc:
                def healthy() -> bool:
                    assert proc.poll() is None, log.read_text()
                    try:
                        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
                    except httpx.HTTPError:
                        return False

                wait_until(healthy, 30, 0.1, "pdproxy serve")
                streaming = threading.Event()
                ended = threading.Event()

                def client() -> None:
                    body = {"model": "sim-model", "prompt": "hi", "max_tokens": 1000, "stream": True}
                    try:
                        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                                          timeout=30) as r:
                            for _ in r.iter_lines():
                                streaming.set()
                    except httpx.HTTPError:
                        pass
                    ended.set()

                thread = threading.Thread(target=client, daemon=True)
                thread.start()
                assert streaming.wait(20)
                proc.send_signal(signal.SIGINT)
                wait_until(lambda: "second signal" in log.read_text(), 20, 0.05, "the drain notice")
                assert not ended.is_set()  # the stream is still open when the second Ctrl-C comes
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=15)                   # the stream had 40 s to go
                assert ended.wait(10)
    text = log.read_text()
    assert "Traceback" not in text and "CancelledError" not in text, text


def test_ctrl_c_while_workers_start_ends_quietly(sims: Fleet, tmp_path: Path) -> None:
    """Ctrl-C in the ~2 s a ``--workers 2`` worker takes to start (importing, building its app: no signal handler
    yet) stops everything with exit code 0 and no traceback — the supervisor sends workers SIGTERM, whose default
    ends a starting worker quietly (passing SIGINT on raised ``KeyboardInterrupt`` in each)."""
    log = tmp_path / "serve.log"
    with serving(log, "--port", str(free_port()), "--prefill", sims.prefillers[0].url, "--decode",
                 sims.decoders[0].url, "--workers", "2") as proc:
        wait_until(lambda: "worker 1 started" in log.read_text(), 30, 0.01, "the workers spawned")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, log.read_text()
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text

