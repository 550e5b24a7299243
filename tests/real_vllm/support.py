"""Helpers for the real-vLLM tests: engine configurations, ``scripts/real-vllm.sh`` control, /metrics reading,
token-exact prompts built with the tiny model's own tokenizer.

:class:`RealEngines` runs ``scripts/real-vllm.sh start|stop`` with one :class:`EngineConfig` at a time (the
script's facts and traps: docs/real-vllm.md and the script's header); :meth:`RealEngines.extra_decoder` adds a
second decoder beside the running configuration's (``REAL_VLLM_ROLES=decode`` on ports of its own), for a test that
kills one. Ports are picked free at session start, below the kernel's ephemeral range (``loadtest/ports.py``;
``REAL_VLLM_*_PORT`` from the environment win), never 8100/8200 (``pdproxy demo``'s). The NIXL lease
(``kv_lease_duration``) is cut to 10 s, so KV a test abandons on a prefiller is freed quickly instead of keeping it
busy for 30 s.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.ports import engine_ports
from pdproxy.tokens import HFTokenizer, prompt_token_ids

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "real-vllm.sh"
KV_CONFIG = ('{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu",'
             '"kv_connector_extra_config":{"kv_lease_duration":10}}')
KV_EVENTS_TOPIC = "kv-events"
START_TIMEOUT_S = 420
"""Seconds ``start`` may take (40–75 s warm; the first compile took ~3.5 min on a loaded 2-core machine)."""
STOP_GRACE_S = 15
COMPLETION_HANDLERS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine set-up: extra ``api_server`` arguments for the prefiller and the decoder."""

    name: str
    prefill_args: str = ""
    decode_args: str = ""


TOOL_PARSER = "--enable-auto-tool-choice --tool-call-parser pythonic"
"""A tool-call parser on both engines (pythonic needs no special tokens), so tool_choice "required" and named
functions run as in production (without one vLLM refuses them); tool_choice "auto" is then accepted too."""
STANDARD = EngineConfig("standard", prefill_args=TOOL_PARSER, decode_args=TOOL_PARSER)
SMALL_POOL_BLOCKS = 18
SMALL_POOL = EngineConfig("small_pool", prefill_args=f"--num-gpu-blocks-override {SMALL_POOL_BLOCKS}")
"""A prefiller whose KV pool (18 blocks × 128 = 2,304 tokens) is only a little above max_model_len (2,048)."""


@dataclass(frozen=True, slots=True)
class Engines:
    """A running prefiller + decoder (``config``), their URLs, the model directory and ``max_model_len``."""

    config: EngineConfig
    prefill_url: str
    decode_url: str
    model_dir: Path
    served_model: str
    max_model_len: int
    prefill_kv_events: str = ""
    """The prefiller's KV event PUB address (``tcp://127.0.0.1:PORT``): every configuration starts the prefiller
    with ``--enable-prefix-caching --kv-events-config`` (a PUB and a replay ROUTER socket; no cost when idle)."""
    prefill_kv_replay: str = ""


@dataclass(frozen=True, slots=True)
class ExtraDecoder:
    """A second real decoder beside the running configuration's (:meth:`RealEngines.extra_decoder`)."""

    url: str
    pgid: int
    """Its process group (``setsid``: the API server and its EngineCore), e.g. for ``os.killpg``."""


class RealEngines:
    """Starts/stops the engines through ``scripts/real-vllm.sh`` with one configuration at a time (session-wide)."""

    def __init__(self) -> None:
        names = ("REAL_VLLM_PREFILL_PORT", "REAL_VLLM_DECODE_PORT", "REAL_VLLM_PREFILL_SIDE_PORT",
                 "REAL_VLLM_DECODE_SIDE_PORT", "REAL_VLLM_KV_EVENTS_PORT", "REAL_VLLM_KV_REPLAY_PORT")
        spare = iter(engine_ports(len(names)))          # below the ephemeral range (loadtest/ports.py)
        ports = {name: os.environ.get(name) or str(next(spare)) for name in names}
        self.kv_events_port = int(ports["REAL_VLLM_KV_EVENTS_PORT"])
        self.kv_replay_port = int(ports["REAL_VLLM_KV_REPLAY_PORT"])
        self.env = {**os.environ, **ports, "REAL_VLLM_KV_CONFIG": KV_CONFIG,
                    "REAL_VLLM_START_TIMEOUT": str(START_TIMEOUT_S), "REAL_VLLM_STOP_GRACE": str(STOP_GRACE_S)}
        self.keep = os.environ.get("REAL_VLLM_KEEP") == "1"
        self.current: Engines | None = None
        self.timings: dict[str, float] = {}

    def _run(self, *args: str, timeout_s: float, **extra_env: str) -> str:
        proc = subprocess.run(["bash", str(SCRIPT), *args], env={**self.env, **extra_env}, capture_output=True,
                              text=True, timeout=timeout_s, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"scripts/real-vllm.sh {' '.join(args)} failed ({proc.returncode}):\n"
                               f"{proc.stderr[-3000:]}")
        return proc.stdout

    def setup(self) -> None:
        """Idempotent install + tiny model (~4 s when cached; fails loudly if the registry is unreachable)."""
        started = time.monotonic()
        self._run("setup", timeout_s=900)
        self.timings["setup_s"] = time.monotonic() - started

    def script_env(self) -> dict[str, str]:
        """The ``REAL_VLLM_*`` values ``scripts/real-vllm.sh env`` prints (URLs, model directory, ...)."""
        return dict(re.findall(r"export (REAL_VLLM_\w+)='([^']*)'", self._run("env", timeout_s=30)))

    def model_dir(self) -> Path:
        """The tiny model's directory (its tokenizer is the one the engines use)."""
        return Path(self.script_env()["REAL_VLLM_MODEL_DIR"])

    def ensure(self, config: EngineConfig) -> Engines:
        """The engines running with ``config`` (stops and restarts them when another configuration runs)."""
        if self.current is not None and self.current.config == config:
            return self.current
        self.stop()
        started = time.monotonic()
        self._run("start", timeout_s=START_TIMEOUT_S + 60,
                  REAL_VLLM_PREFILL_ARGS=f"{config.prefill_args} {self.kv_events_args()}".strip(),
                  REAL_VLLM_DECODE_ARGS=config.decode_args)
        self.timings[f"start_{config.name}_s"] = time.monotonic() - started
        env = self.script_env()
        self.current = Engines(config, env["REAL_VLLM_PREFILL_URL"], env["REAL_VLLM_DECODE_URL"],
                               Path(env["REAL_VLLM_MODEL_DIR"]), env["REAL_VLLM_SERVED_MODEL"],
                               int(env["REAL_VLLM_MAX_MODEL_LEN"]), f"tcp://127.0.0.1:{self.kv_events_port}",
                               f"tcp://127.0.0.1:{self.kv_replay_port}")
        return self.current

    @contextmanager
    def extra_decoder(self) -> Iterator[ExtraDecoder]:
        """A second decoder like the running configuration's (same model, KV connector and decoder arguments) on
        ports of its own, started by ``scripts/real-vllm.sh`` with ``REAL_VLLM_ROLES=decode``; stopped on exit
        (a no-op when the test killed it). Requires a running configuration (:meth:`ensure`)."""
        assert self.current is not None, "start a configuration first"
        port, side = engine_ports(2)
        env = {"REAL_VLLM_ROLES": "decode", "REAL_VLLM_DECODE_PORT": str(port),
               "REAL_VLLM_DECODE_SIDE_PORT": str(side), "REAL_VLLM_DECODE_ARGS": self.current.config.decode_args}
        started = time.monotonic()
        try:
            self._run("start", timeout_s=START_TIMEOUT_S + 60, **env)
            self.timings["start_extra_decoder_s"] = time.monotonic() - started
            status = self._run("status", timeout_s=30, **env)
            pid = re.search(r"^decode pid=(\d+) ", status, re.M)
            assert pid, status
            yield ExtraDecoder(f"http://127.0.0.1:{port}", int(pid.group(1)))
        finally:
            self._run("stop", timeout_s=4 * STOP_GRACE_S + 30, **env)

    def kv_events_args(self) -> str:
        """The prefiller's prefix-cache and KV-event flags (no spaces: the script splits its extra args on them)."""
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.kv_events_port}",
                  "replay_endpoint": f"tcp://*:{self.kv_replay_port}", "topic": KV_EVENTS_TOPIC}
        return "--enable-prefix-caching --kv-events-config " + json.dumps(config, separators=(",", ":"))

    def stop(self, final: bool = False) -> None:
        """Stop whatever runs (SIGTERM to each engine's process group, SIGKILL after the grace period).

        ``final`` with ``REAL_VLLM_KEEP=1`` leaves them running (development: with fixed ``REAL_VLLM_*_PORT``s
        the next session's ``start`` reuses them; only for the standard configuration)."""
        if final and self.keep:
            return
        if self.current is not None:
            name, started = self.current.config.name, time.monotonic()
            self.current = None
            self._run("stop", timeout_s=4 * STOP_GRACE_S + 30)
            self.timings[f"stop_{name}_s"] = time.monotonic() - started


# ---------------------------------------------------------------------------------------------------- metrics
def scrape(url: str) -> str:
    """An engine's ``/metrics`` page."""
    resp = httpx.get(url + "/metrics", timeout=10)
    resp.raise_for_status()
    return resp.text


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels`` (0 if none)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            head, _, value = line.rpartition(" ")
            found = dict(re.findall(r'(\w+)="([^"]*)"', head))
            if all(found.get(k) == v for k, v in labels.items()):
                total += float(value)
    return total


def completion_requests(url: str) -> float:
    """``http_requests_total`` of the completion routes (every status): has this engine been asked anything?"""
    text = scrape(url)
    return sum(metric(text, "http_requests_total", handler=h) for h in COMPLETION_HANDLERS)


# ---------------------------------------------------------------------------------------------------- prompts
class Prompts:
    """Token-exact prompts for the tiny model, counted with its own tokenizer (``HFTokenizer`` renders the chat
    template as vLLM does; ``tests/real_vllm/test_tinymodel.py`` keeps that true)."""

    def __init__(self, model_dir: Path) -> None:
        self.tok = HFTokenizer(model_dir)

    def count(self, body: dict[str, Any], api: str) -> int:
        return len(prompt_token_ids(self.tok, body, "chat" if api == "chat" else "completions"))

    def completion(self, n: int) -> str:
        """A completions prompt of exactly ``n`` tokens, BOS included (``capture.py``'s ``" the" * (n - 1)``)."""
        text = " the" * (n - 1)
        assert self.count({"prompt": text}, "completions") == n
        return text

    def chat(self, n: int) -> list[dict[str, str]]:
        """One user message whose rendered chat prompt is exactly ``n`` tokens."""
        overhead = self.count({"messages": [{"role": "user", "content": ""}]}, "chat")
        for k in range(max(n - overhead - 3, 0), n + 3):
            messages = [{"role": "user", "content": " the" * k}]
            if self.count({"messages": messages}, "chat") == n:
                return messages
        raise AssertionError(f"no ' the' * k message renders to {n} tokens")

    def unique(self, n: int, seed: int) -> str:
        """A completions prompt of at most ``n`` tokens (within a few of it) sharing no prefix block with the
        prompt of another ``seed`` (distinct words from the first one on)."""
        words = [f" s{seed}w{i}" for i in range(n)]
        lo, hi = 1, len(words)
        while lo < hi:                                   # the longest word prefix with at most n tokens
            mid = (lo + hi + 1) // 2
            if self.count({"prompt": "".join(words[:mid])}, "completions") <= n:
                lo = mid
            else:
                hi = mid - 1
        return "".join(words[:lo])
