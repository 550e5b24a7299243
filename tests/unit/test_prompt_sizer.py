"""``PromptSizer.build`` (pdproxy/tools/doctor_probes.py): the doctor's cold prompts land inside the size window the
engine's ``/tokenize`` counts, and never over its upper end when a smaller prompt exists (over ``max_model_len``
is the engine's 400, which the doctor would report as a failed engine)."""

from __future__ import annotations

import asyncio
import re

import httpx
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pdproxy.endpoints import Endpoint, Role
from pdproxy.tools.doctor_probes import PromptSizer

_PARAGRAPH = re.compile(r"Section (\d+) of cold probe")


class CountingSizer(PromptSizer):
    """A sizer whose engine counts ``sizes[i % len(sizes)]`` tokens for paragraph ``i`` (how many tokens a
    paragraph costs depends on its digits and the tokenizer), plus ``overhead`` per prompt (BOS, template)."""

    def __init__(self, sizes: list[int], overhead: int) -> None:
        super().__init__(httpx.AsyncClient(), Endpoint("http://engine:1", Role.PREFILL), "m", None, 1.0)
        self.sizes, self.overhead, self.calls = sizes, overhead, 0

    async def count(self, text: str) -> int | None:
        self.calls += 1
        return self.overhead + sum(self.sizes[int(i) % len(self.sizes)] for i in _PARAGRAPH.findall(text))


def build(sizer: CountingSizer, lo: int, hi: int) -> int:
    text, tokens = asyncio.run(sizer.build(lo, hi))
    assert tokens == asyncio.run(sizer.count(text))
    return tokens


def test_the_last_ladder_step_lands_under_max_model_len() -> None:
    """The ladder's last size on the real-vLLM stage's engines: a 2,047-token limit (max_model_len 2,048),
    paragraphs of uneven size (there, a search that took the closest count sent 2,051 tokens: a 400)."""
    sizer = CountingSizer([31, 29, 33, 30, 35, 28, 32], overhead=1)
    tokens = build(sizer, 1_800, 2_047)
    assert 1_800 <= tokens <= 2_047 and sizer.calls <= 9


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 200), min_size=1, max_size=12), overhead=st.integers(0, 50),
       lo=st.integers(1, 20_000), width=st.integers(0, 4_000))
@example(sizes=[1], overhead=26, lo=25, width=2)     # a fixed part far over a paragraph: the ratio search crept
def test_never_over_the_window_when_a_smaller_prompt_exists(sizes: list[int], overhead: int, lo: int,
                                                           width: int) -> None:
    hi = lo + width
    sizer = CountingSizer(sizes, overhead)
    text, tokens = asyncio.run(sizer.build(lo, hi))
    assert tokens == asyncio.run(sizer.count(text))                    # the size it reports is the engine's count
    one = overhead + sizes[0]                                          # the smallest prompt: one paragraph
    if one <= hi:
        assert tokens <= hi
    if width >= 2 * max(sizes) and lo > one:                           # a window wider than any paragraph
        assert lo <= tokens <= hi
