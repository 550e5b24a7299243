"""``pdproxy demo``: one simulated prefiller and two simulated decoders on loopback, the proxy on :8000.

The request log (one JSON line per request, pdproxy/ops/reqlog.py) goes to a file, ``--request-log-path`` (default
``pdproxy-demo-requests-UID.jsonl`` in the temporary directory, one per user: a shared ``/tmp`` holds each user's,
emptied when a demo starts so that it holds that run's requests; a file given with the flag is appended to), so the
terminal stays readable under load.

The engines are child processes (``pdproxy sim``) in their own process group; they are stopped when the proxy
exits (Ctrl-C / SIGTERM) or if any of them fails to start.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from pdproxy.settings import Settings, check_request_log, load_settings

SNIPPET = """
pdproxy demo is up: proxy http://127.0.0.1:{port}  (prefiller {p}, decoders {d})

  curl -N http://127.0.0.1:{port}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "stream": true, "max_tokens": 16}}'

  {python} - <<'EOF'
  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:{port}/v1", api_key="none")
  for chunk in client.chat.completions.create(model="{model}", stream=True, max_tokens=16,
                                              messages=[{{"role": "user", "content": "Hello!"}}]):
      print(chunk.choices[0].delta.content or "", end="", flush=True) if chunk.choices else None
  print()
  EOF

{request_log}
Ctrl-C stops the proxy (open streams get up to shutdown_grace_s to finish) and then the simulated engines.
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Add the ``pdproxy demo`` flags to ``p``: proxy ``--port``/``--host``, ``--engine-base-port`` (first of
    the three simulated engine ports), ``--model``, ``--max-model-len`` (tokens), ``--decode-tokens-per-s`` and
    ``--prefill-tokens-per-s`` (simulated speeds, tokens per second)."""
    p.add_argument("--port", type=int, default=8000, help="proxy port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="proxy listen address (default 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--engine-base-port", type=int, default=8100, help="first simulated engine port (default 8100)")
    p.add_argument("--model", default="sim-model", help="served model name of the simulated engines")
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--decode-tokens-per-s", type=float, default=50.0, help="simulated decode speed per sequence")
    p.add_argument("--prefill-tokens-per-s", type=float, default=20000.0)
    p.add_argument("--request-log-path", default=None,
                   help="file the request log is appended to ('-' = the terminal; default: "
                        "pdproxy-demo-requests-UID.jsonl in the temporary directory, emptied at start)")


ENGINE_PORT_OFFSETS = (0, 100, 101)
"""The simulated engines' ports: ``--engine-base-port`` plus these (prefiller, decoder, decoder)."""


def check_ports(args: argparse.Namespace) -> None:
    """Raise :class:`DemoError` naming the flag whose port is outside 1–65535 (the engines' ports included)."""
    if not 0 < args.port <= 65535:
        raise DemoError(f"--port {args.port} is not a TCP port (1-65535)")
    top = 65535 - max(ENGINE_PORT_OFFSETS)
    if not 0 < args.engine_base_port <= top:
        raise DemoError(f"--engine-base-port {args.engine_base_port} is out of range: the engines use B, B+100 and "
                        f"B+101, so B must be 1-{top}")


def request_log_path(args: argparse.Namespace) -> str:
    """Where the demo's request log goes: ``--request-log-path``, else a file in the temporary directory."""
    return str(args.request_log_path or Path(tempfile.gettempdir()) / f"pdproxy-demo-requests-{os.getuid()}.jsonl")


def empty_own_log(path: str) -> None:
    """Empty the demo's default request log ``path`` when it is a regular file of this user's (never through a
    symbolic link or someone else's file in a shared temporary directory): each run's log holds that run's."""
    with contextlib.suppress(OSError):
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_size:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)


def request_log_hint(path: str) -> str:
    """The demo banner's line saying where the request log goes (``-``: this terminal, nothing to ``tail``)."""
    if path == "-":
        return "Request log (one JSON line per request): this terminal (--request-log-path -)"
    return f"Request log (one JSON line per request): {path}   e.g. tail -f {path}"


class DemoError(RuntimeError):
    """The demo could not start (a port in use, an engine that died or never became healthy)."""


def _check_free(host: str, ports: list[int]) -> None:
    """Raise :class:`DemoError` naming the first of ``ports`` already in use on ``host`` (before anything starts)."""
    for port in ports:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
            try:
                sock.bind((host, port))
            except OSError:
                raise DemoError(f"port {port} is already in use; stop what holds it or choose other ports with "
                                   "`pdproxy demo --port P --engine-base-port B` (engines use B, B+100, B+101)"
                                   ) from None


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the demo process dies, however it dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``), so a closed terminal or a SIGKILL never leaves engines behind."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _command(proc: subprocess.Popen[bytes]) -> str:
    """The command line ``proc`` was started with, for messages."""
    args = proc.args
    return " ".join(str(a) for a in args) if isinstance(args, list | tuple) else str(args)


def _wait_healthy(urls: list[str], procs: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    while pending:
        for proc in procs:
            if proc.poll() is not None:
                raise DemoError(f"simulated engine exited with code {proc.returncode}: {_command(proc)}")
        url = pending[0]
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise DemoError(f"simulated engine {url} not healthy after {timeout_s:.0f} s")
        time.sleep(0.1)


@contextlib.contextmanager
def simulated_engines(args: argparse.Namespace) -> Iterator[tuple[list[str], list[str]]]:
    """Start 1 prefiller + 2 decoders; yield their URLs; stop them on exit (SIGTERM, then SIGKILL)."""
    base = args.engine_base_port
    roles = [(role, base + offset) for role, offset in zip(("prefill", "decode", "decode"), ENGINE_PORT_OFFSETS,
                                                            strict=True)]
    _check_free("127.0.0.1", [port for _, port in roles])
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for role, port in roles:
            cmd = [sys.executable, "-m", "pdproxy", "sim", "--role", role, "--port", str(port),
                   "--served-model-name", args.model, "--max-model-len", str(args.max_model_len),
                   "--decode-tokens-per-s", str(args.decode_tokens_per_s),
                   "--prefill-tokens-per-s", str(args.prefill_tokens_per_s)]
            # own session: Ctrl-C reaches the demo only, which drains the proxy and then stops the engines; their
            # stdout (the sim_ready JSON line, for scripts) is not the user's: readiness is their /health
            procs.append(subprocess.Popen(cmd, start_new_session=True, preexec_fn=_die_with_parent,
                                          stdout=subprocess.DEVNULL))
        urls = [f"http://127.0.0.1:{port}" for _, port in roles]
        _wait_healthy(urls, procs)
        yield urls[:1], urls[1:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run(args: argparse.Namespace, serve: Callable[[Settings, Callable[[], None]], int]) -> int:
    """Run the demo until Ctrl-C; returns the exit code.  ``serve`` runs the proxy on ``Settings`` until it stops
    (``pdproxy.cli.serve``), calling its second argument once the proxy listens (the demo says it is up and how
    to try it only then), and returns its exit code."""
    problem = check_request_log(request_log_path(args))
    if problem is not None:                                    # before any engine starts
        if args.request_log_path is None:                      # the demo's own choice, not a flag the user gave
            problem = (problem.replace("flag --request-log-path ", "the request log ", 1) +
                       " (give --request-log-path FILE, or - for this terminal)")
        print(f"pdproxy demo: {problem}", file=sys.stderr)
        return 1
    try:
        check_ports(args)
        _check_free(args.host, [args.port])
    except DemoError as exc:
        print(f"pdproxy demo: {exc}", file=sys.stderr)
        return 1
    if args.request_log_path is None:
        empty_own_log(request_log_path(args))
    signal.signal(signal.SIGHUP, _hang_up)
    try:
        with simulated_engines(args) as (prefill, decode):
            settings = load_settings(host=args.host, port=args.port, prefill=prefill, decode=decode, workers=1,
                                     expose_routing_headers=True, health_interval_s=1.0,
                                     request_log_path=request_log_path(args))
            snippet = SNIPPET.format(port=args.port, p=prefill[0], d=", ".join(decode), model=args.model,
                                     python=sys.executable, request_log=request_log_hint(request_log_path(args)))
            return serve(settings, lambda: print(snippet, flush=True))   # this interpreter has the openai client
    except DemoError as exc:
        print(f"pdproxy demo: {exc}", file=sys.stderr)
        return 1


def _hang_up(signum: int, frame: object) -> None:
    """The demo's terminal closed (SIGHUP): drain and stop as on SIGTERM, which it raises (said first, so that the
    log's "SIGTERM: shutting down" is not read as someone else's)."""
    print("pdproxy demo: SIGHUP (terminal closed): stopping as on SIGTERM", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
