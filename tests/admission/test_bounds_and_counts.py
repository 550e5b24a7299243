"""Token bounds and exact counts, without sockets: ``lower <= engine count <= upper`` for any text, the local
count equals the engine's (``pdproxy.tokens.prompt_token_ids``, what ``pdproxy sim`` counts), early stop past the
cap, and the block cache."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdproxy.admission.bounds import prompt_bounds, word_transitions
from pdproxy.admission.count import LocalCounter, TokenCount, tokenize_body, word_cuts
from pdproxy.tokens import load_tokenizer, prompt_token_ids, sim_prompt

pytestmark = pytest.mark.timeout(60)

WORDS = ["hello", "world", "x", "42", "naïve", "東京", "it's", ".", "!!", "<|im_start|>", "<|end|>", "<|user|>",
         "\n", "  ", "\t", "foo_bar", "{", "}", "a1b2", "\u00a0", "\u3000", "\x1c", "\r\n", "émoji🙂"]
texts = st.lists(st.tuples(st.sampled_from(["", " ", "  ", "\n", "\t"]), st.sampled_from(WORDS)), max_size=60).map(
    lambda parts: "".join(a + b for a, b in parts)) | st.text(max_size=200)


def bodies() -> st.SearchStrategy[tuple[dict[str, Any], bool]]:
    chat = st.builds(lambda sys, user, tools: ({"messages": [{"role": "system", "content": sys},
                                                            {"role": "user", "content": user}],
                                                **({"tools": [{"type": "function", "function": {
                                                    "name": "f", "description": tools}}], "tool_choice": "none"}
                                                   if tools else {})}, True),
                     texts, texts, st.none() | texts)
    completion = st.builds(lambda p: ({"prompt": p}, False), texts.filter(bool))
    return chat | completion


@pytest.fixture(scope="module")
def counters(tokenizer_dir: Path) -> dict[str, LocalCounter]:
    return {"sim": LocalCounter("sim", cache_entries=64), "hf": LocalCounter(str(tokenizer_dir), cache_entries=64)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=bodies())
def test_bounds_hold_and_local_count_is_the_engines(counters: dict[str, LocalCounter],
                                                    case: tuple[dict[str, Any], bool]) -> None:
    body, chat = case
    bounds = prompt_bounds(body, chat, template_overhead=64)
    for counter in counters.values():
        try:
            want = len(prompt_token_ids(counter.tokenizer, body, "chat" if chat else "completions"))
        except ValueError:
            continue
        got = counter.count(body, chat)
        assert got.exact and got.tokens == want
        assert bounds.lower <= want <= bounds.upper, (bounds, want)


@settings(max_examples=200, deadline=None)
@given(text=texts)
def test_word_cuts_split_where_pretokenizers_split(text: str) -> None:
    sim = load_tokenizer(None)
    pieces = list(word_cuts(text, 3))
    assert "".join(pieces) == text
    assert sum(len(sim.encode(p)) for p in pieces) == len(sim.encode(text))
    assert word_transitions(text) <= len(sim.encode(text))


def test_count_stops_early_past_the_cap(counters: dict[str, LocalCounter]) -> None:
    text = sim_prompt(100_000, unique=True, seed=7)
    for name, counter in counters.items():
        full = counter.count({"prompt": text}, False)
        capped = LocalCounter("sim" if name == "sim" else counter.tokenizer.name).count({"prompt": text}, False,
                                                                                         cap=5000)
        assert full.exact and not capped.exact
        assert 5000 < capped.tokens < full.tokens


def test_repeated_system_prompt_is_counted_once(counters: dict[str, LocalCounter]) -> None:
    system = sim_prompt(3000, unique=True, seed=3)
    for counter in counters.values():
        hits = counter.cache.hits
        for question in (" what is it", " and now", " one more time"):
            body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
            assert counter.count(body, True).tokens == len(prompt_token_ids(counter.tokenizer, body, "chat"))
        assert counter.cache.hits - hits >= 2


def test_token_id_prompts_are_exact_and_tokenize_body_keeps_prompt_fields() -> None:
    assert prompt_bounds({"prompt": [1, 2, 3]}, False, template_overhead=0).exact
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}], "tool_choice": "none",
            "max_tokens": 5, "stream": True}
    assert tokenize_body(body, True) == {"model": "m", "messages": body["messages"], "tools": [{"x": 1}]}
    assert tokenize_body({"model": "m", "prompt": "hi", "max_tokens": 3}, False) == {"model": "m", "prompt": "hi"}


def test_tools_count_with_tool_choice_none_as_vllm_counted_them(tokenizer_dir: Path) -> None:
    """vLLM 0.32 renders ``tools`` whatever ``tool_choice`` says: the capture ``chat_tools_none.json`` (real engine,
    the tiny model's tokenizer, which ``tokenizer_dir`` is) reports 91 prompt tokens, 24 without the tools."""
    capture = json.loads((Path(__file__).parents[1] / "real_vllm" / "captures" / "chat_tools_none.json").read_text())
    body = capture["request"]["body"]
    assert body["tool_choice"] == "none" and body["tools"]
    assert capture["response"]["json"]["usage"]["prompt_tokens"] == 91
    counter = LocalCounter(str(tokenizer_dir), cache_entries=0)
    assert counter.count(body, True) == TokenCount(91, True, "local")
    bare = {k: v for k, v in body.items() if k not in ("tools", "tool_choice")}
    assert counter.count(bare, True).tokens == 24
    assert tokenize_body(body, True)["tools"] == body["tools"]          # the engine's /tokenize sees them too
    assert prompt_bounds(body, True, template_overhead=64).upper >= 91   # the byte bound covers them
