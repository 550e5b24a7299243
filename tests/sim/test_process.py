"""The simulator as a real process (``python -m pdproxy.sim``): ready line, serving, flags, shutdown."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import free_port

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def sim_process(*args: str) -> Iterator[tuple[subprocess.Popen[str], dict]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "pdproxy.sim", "--port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded by the test timeout
        assert line, proc.stderr.read() if proc.stderr else ""
        yield proc, json.loads(line)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


@pytest.mark.timeout(30)
def test_process_serves_dp_ranks_and_stops_on_sigterm() -> None:
    with sim_process("--data-parallel-size", "2", "--role", "decode", "--fault",
                     '{"kind": "status", "status": 503, "on_request": 1}') as (proc, ready):
        assert ready["event"] == "sim_ready" and len(ready["ports"]) == 2 and ready["role"] == "decode"
        assert ready["engine_ids"][1].endswith("_dp1")
        with httpx.Client(timeout=10) as client:
            url = ready["base_urls"][0] + "/v1/completions"
            assert client.post(url, json={"prompt": "x", "max_tokens": 2}).status_code == 503
            ok = client.post(url, json={"prompt": "x", "max_tokens": 2})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
            second = client.post(ready["base_urls"][1] + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert second.status_code == 503  # each rank's port has its own copy of the --fault
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


@pytest.mark.timeout(30)
def test_refuse_connections_binds_without_listening() -> None:
    with sim_process("--refuse-connections") as (_proc, ready), socket.socket() as sock, \
            pytest.raises(ConnectionRefusedError):
        sock.connect(("127.0.0.1", ready["ports"][0]))


@pytest.mark.timeout(30)
def test_bad_configuration_exits_with_2() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "pdproxy.sim", "--data-parallel-size", "2", "--dp-ports", "9"],
                          capture_output=True, text=True, env=env, timeout=20)
    assert done.returncode == 2 and "--dp-ports" in done.stderr


@pytest.mark.timeout(30)
def test_a_port_in_use_is_one_line_and_exit_1() -> None:
    """``pdproxy sim --port P`` on a taken port says so in one line naming the port and the flag, and exits 1 as
    ``pdproxy serve`` and ``pdproxy demo`` do for a taken port: no uvloop traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        for extra in ((), ("--refuse-connections",)):
            done = subprocess.run([sys.executable, "-m", "pdproxy", "sim", "--port", str(port), *extra],
                                  capture_output=True, text=True, env=env, timeout=20)
            assert done.returncode == 1 and done.stdout == "", (extra, done.stderr)
            assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
            assert f"port {port} is already in use" in done.stderr and "--port" in done.stderr
