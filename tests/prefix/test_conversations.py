"""A conversation's turns go to the prefiller that holds its prefix — from the engines' KV events (precise), from
pdproxy's own record with events off (approximate, token keys), and without a tokenizer (text keys) — while the
conversations themselves spread by load; and two pdproxy replicas in front of the same engines agree."""

from __future__ import annotations

from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdproxy.admission.count import LocalCounter
from tests.prefix.conftest import BLOCK, Conversation, Fleet, log_lines, make_proxy

pytestmark = pytest.mark.timeout(120)

MODES: dict[str, dict[str, Any]] = {
    "precise": {"events": True},
    "precise_engine_ids": {"events": True, "tokenizer": None},     # no tokenizer: ids from the engines' /tokenize
    "approximate": {"events": False},
    "text": {"events": False, "tokenizer": None, "prefix_keys": "text"},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_turns_go_to_the_prefiller_holding_the_conversation(sims: Fleet, tmp_path: Path, mode: str) -> None:
    log = tmp_path / "requests.log"
    proxy = make_proxy(sims, log, **MODES[mode])
    conversations = [Conversation(seed) for seed in range(1, 7)]
    try:
        with httpx.Client() as client, ThreadPoolExecutor(len(conversations)) as pool:
            for _turn in range(4):   # every conversation's turn at once: first turns spread by load
                list(pool.map(lambda c: c.send(client, proxy.url), conversations))
        proxy.wait_idle()
    finally:
        proxy.stop()
    firsts = Counter(c.prefillers[0] for c in conversations)
    assert len(firsts) >= 2, firsts                 # the shared tool block alone would have put them on one
    for c in conversations:
        assert len(set(c.prefillers)) == 1, (c.seed, c.prefillers)
    lines = [x for x in log_lines(log) if x["outcome"] == "ok"]
    assert len(lines) == 24
    later = [x for x in lines if x["cached_tokens"] and x["cached_tokens"] > 600]
    assert len(later) == 18                         # turns 2-4 found their history cached
    if mode == "text":
        assert {x["prefix_mode"] for x in lines} == {"text"}
        # no tokenizer: the cached share of the text, in tokens at the engine's tokens per character (learnt
        # from the first answers' usage.prompt_tokens), so within a few percent of the engine's figure
        assert all(abs(x["predicted_cached_tokens"] - x["cached_tokens"]) <= 0.1 * x["cached_tokens"]
                   for x in later), [(x["predicted_cached_tokens"], x["cached_tokens"]) for x in later]
    else:
        assert {x["prefix_mode"] for x in lines} == {mode.removesuffix("_engine_ids")}
        assert [x["predicted_cached_tokens"] for x in later] == [x["cached_tokens"] for x in later]
        # first turns race on the shared tool block: one in flight on a prefiller counts as cached there for the
        # others routed meanwhile, and the engine has it computed or not depending on its step
        ids = [LocalCounter("sim").token_ids(Conversation(seed).body(), True) for seed in (1, 2)]
        same = next(i for i, (x, y) in enumerate(zip(ids[0], ids[1], strict=False)) if x != y)
        tools = same // BLOCK * BLOCK                                    # the full blocks every prompt starts with
        assert 0 < tools < 200
        assert all(abs(x["predicted_cached_tokens"] - x["cached_tokens"]) <= tools for x in lines)


@pytest.mark.parametrize("events", [False, True], ids=["approximate", "precise"])
def test_two_replicas_send_a_conversations_turns_to_one_prefiller(sims: Fleet, tmp_path: Path,
                                                                   events: bool) -> None:
    replicas = [make_proxy(sims, tmp_path / f"r{i}.log", events=events) for i in range(2)]
    conversations = [Conversation(seed) for seed in range(11, 19)]
    try:
        with httpx.Client() as client:
            for turn in range(4):
                for i, c in enumerate(conversations):
                    c.send(client, replicas[(i + turn) % 2].url)    # turns alternate between the replicas
        for r in replicas:
            r.wait_idle()
    finally:
        for r in replicas:
            r.stop()
    for c in conversations:
        assert len(set(c.prefillers)) == 1, (c.seed, c.prefillers)
    lines = log_lines(tmp_path / "r0.log") + log_lines(tmp_path / "r1.log")
    assert sum(1 for x in lines if (x["cached_tokens"] or 0) > 600) == 24   # every later turn hit


def test_with_prefix_routing_off_the_turns_scatter(sims: Fleet, tmp_path: Path) -> None:
    """The control for the tests above: load-only routing (ties by request id) does not keep conversations."""
    proxy = make_proxy(sims, tmp_path / "requests.log", prefix_routing="off")
    conversations = [Conversation(seed) for seed in range(21, 27)]
    try:
        with httpx.Client() as client:
            for _turn in range(4):
                for c in conversations:
                    c.send(client, proxy.url)
        proxy.wait_idle()
    finally:
        proxy.stop()
    assert sum(len(set(c.prefillers)) > 1 for c in conversations) >= 3
    assert {x["prefix_mode"] for x in log_lines(tmp_path / "requests.log")} == {None}
