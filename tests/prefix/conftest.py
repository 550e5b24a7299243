"""Prefix-routing tests: one fleet for the directory — three simulated prefillers with prefix caching that publish
vLLM's KV events (ZMQ, with a replay socket), at 20k prefill tokens/s so that queued prefill work is visible, and a
decoder — and helpers to run conversations through pdproxy and read its request log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdproxy.tokens import sim_prompt
from tests.support import ProxyThread, SimProcess, free_port, running, wait_until

BLOCK = 16
ENGINE_ARGS = ("--served-model-name", "sim-model", "--max-model-len", "32768", "--block-size", str(BLOCK),
               "--enable-prefix-caching", "--decode-tokens-per-s", "0")


def kv_events_config(port: int, replay: int | None = None) -> str:
    """vLLM's ``--kv-events-config`` JSON for a publisher on ``port`` (and a replay socket)."""
    cfg: dict[str, Any] = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    if replay is not None:
        cfg["replay_endpoint"] = f"tcp://*:{replay}"
    return json.dumps(cfg)


@dataclass
class Fleet:
    prefillers: list[SimProcess]
    decoders: list[SimProcess]
    events: dict[str, tuple[int, int]]
    """prefiller URL → (publisher port, replay port)"""

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.prefillers]

    def kv_events(self) -> dict[str, list[str]]:
        """The ``kv_events`` / ``kv_events_replay`` settings that follow every prefiller."""
        return {"kv_events": [f"{u}=tcp://127.0.0.1:{p}" for u, (p, _r) in self.events.items()],
                "kv_events_replay": [f"{u}=tcp://127.0.0.1:{r}" for u, (_p, r) in self.events.items()]}

    def reset(self) -> None:
        for s in self.prefillers + self.decoders:
            s.reset()


def start_fleet(n: int, *extra: str, prefill_tokens_per_s: int = 20_000) -> tuple[Fleet, list[SimProcess]]:
    """``n`` publishing prefillers (``extra`` engine flags) and one decoder, not started."""
    events: dict[str, tuple[int, int]] = {}
    prefillers = []
    for _ in range(n):
        pub, replay = free_port(), free_port()
        sim = SimProcess("prefill", *ENGINE_ARGS, "--prefill-tokens-per-s", str(prefill_tokens_per_s), *extra,
                         "--kv-events-config", kv_events_config(pub, replay))
        events[sim.url] = (pub, replay)
        prefillers.append(sim)
    decoder = SimProcess("decode", *ENGINE_ARGS, "--prefill-tokens-per-s", "0")
    fleet = Fleet(prefillers, [decoder], events)
    return fleet, [*prefillers, decoder]


@pytest.fixture(scope="session")
def fleet() -> Iterator[Fleet]:
    f, sims = start_fleet(3)
    with running(*sims):
        yield f


@pytest.fixture
def sims(fleet: Fleet) -> Fleet:
    """The fleet with its prefix caches, recordings and faults cleared."""
    fleet.reset()
    return fleet


def make_proxy(fleet: Fleet, log: Path, *, events: bool = True, **settings: Any) -> ProxyThread:
    """pdproxy in front of ``fleet`` with the sim tokenizer (exact token ids), routing headers and a request log
    at ``log``; ``events``: follow the prefillers' KV events.  Started, and — with ``events`` — waited on until
    every publisher is live and every block size known."""
    settings.setdefault("tokenizer", "sim")
    settings = {**(fleet.kv_events() if events else {}), **settings}
    proxy = ProxyThread(prefill=fleet.urls, decode=[d.url for d in fleet.decoders], expose_routing_headers=True,
                        request_log_path=str(log), **settings).start()
    try:
        cache = proxy.state.prefix_cache
        wait_until(lambda: all(cache.is_precise(u) or not events for u in fleet.urls)
                   and all(i.block_size for i in proxy.state.infos.values()), 15, 0.05, "publishers live")
    except BaseException:
        proxy.stop()
        raise
    return proxy


def log_lines(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def system_prompt(seed: int, tokens: int = 600) -> str:
    """A system prompt of its own (no block shared with another seed's)."""
    return sim_prompt(tokens, unique=True, seed=seed)


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository "
                                                                                 "and return its text " * 4,
                                           "parameters": {"type": "object", "properties": {"path": {
                                               "type": "string"}}}}}]
"""One tool block every conversation sends first (the sim template renders tools first): every prompt starts
with the same blocks, so the picker's tie-break alone would send every conversation to one prefiller."""


class Conversation:
    """A multi-turn chat with the shared tool block, a system prompt of its own and a growing history."""

    def __init__(self, seed: int, system_tokens: int = 600) -> None:
        self.seed = seed
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt(seed, system_tokens)}]
        self.turn = 0
        self.prefillers: list[str] = []

    def body(self) -> dict[str, Any]:
        self.turn += 1
        user = sim_prompt(60, unique=True, seed=self.seed * 100 + self.turn)
        return {"model": "sim-model", "tools": TOOLS, "messages": [*self.messages, {"role": "user", "content": user}],
                "max_tokens": 8}

    def send(self, client: httpx.Client, url: str) -> httpx.Response:
        """Send the next turn to ``url`` (a proxy); the answer joins the history."""
        body = self.body()
        r = client.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        self.messages = [*body["messages"], {"role": "assistant",
                                             "content": r.json()["choices"][0]["message"]["content"]}]
        self.prefillers.append(r.headers["x-pdproxy-prefiller"])
        return r
