"""Fixtures for admission tests: a local Hugging Face tokenizer directory (byte-level BPE with a chat template,
written by :func:`pdproxy.tools.tinymodel.write_tokenizer`) and body builders of exact token counts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pytest

from pdproxy.tokens import Tokenizer, prompt_token_ids
from pdproxy.tools.tinymodel import write_tokenizer

Api = Literal["chat", "completions"]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def exact_body(tok: Tokenizer, api: Api, tokens: int, *, unit: str = " ab.", pad: str = " x",
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A body whose prompt is exactly ``tokens`` tokens under ``tok`` (the engine's own count): ``unit`` repeated
    (more tokens than words, so the word bound cannot decide) then ``pad`` words of one token each."""
    extra = extra or {}

    def body(text: str) -> dict[str, Any]:
        if api == "chat":
            return {"messages": [{"role": "user", "content": text}], **extra}
        return {"prompt": text, **extra}

    def count(text: str) -> int:
        return len(prompt_token_ids(tok, body(text), api))

    per_unit = count(unit * 2 + pad) - count(unit + pad)
    base = count(pad)
    k = max(0, (tokens - base) // max(per_unit, 1) - 1)
    text = unit * k + pad
    n = count(text)
    while n < tokens:
        text += pad
        n = count(text)
    assert n == tokens, (n, tokens)
    return body(text)


BodyFactory = Callable[..., dict[str, Any]]


# --- simulated engine pairs (prefiller + decoder), started together once per session -----------------------------
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from tests.support import ProxyThread, SimProcess  # noqa: E402

SEED_ARGS = ("--max-model-len", "133120", "--block-size", "4", "--num-gpu-blocks-override", "1146")
"""Seed 000: 133K tokens declared, a KV pool of 1146 × 4 = 4,584 tokens."""
FLOW_ARGS = ("--max-model-len", "133120", "--prefill-tokens-per-s", "10000", "--max-num-batched-tokens", "8192",
             "--decode-tokens-per-s", "0")
"""The admission benchmark's engine (``loadtest/admission_bench.py``): 10K prefill tokens/s in 8,192-token chunks
(one step = 0.82 s)."""

KV18_ARGS = ("--max-model-len", "2048", "--block-size", "128", "--num-gpu-blocks-override", "18",
             "--prefill-tokens-per-s", "20000", "--kv-transfer-tokens-per-s", "4000", "--decode-tokens-per-s", "100")
"""The real-vLLM KV-pressure engine (``tests/real_vllm/test_kv_pressure.py``): 18 × 128 = 2,304 tokens of KV, a
little above max_model_len; a 2,000-token prefill takes 0.1 s and its pull 0.5 s (the KV stays pinned on the
prefiller meanwhile).  Its decoder has the default pool, as in the real test: only the prefiller is short."""
DECODER_ARGS = {"kv18": tuple(a for a in KV18_ARGS if a not in ("--num-gpu-blocks-override", "18"))}


@dataclass
class Pair:
    prefiller: SimProcess
    decoder: SimProcess

    @property
    def sims(self) -> list[SimProcess]:
        return [self.prefiller, self.decoder]

    def proxy(self, **settings: Any) -> ProxyThread:
        return ProxyThread(prefill=[self.prefiller.url], decode=[self.decoder.url], **settings).start()

    def completions(self) -> list[dict[str, Any]]:
        return [r for s in self.sims for r in s.completions_received()]

    def reset(self) -> None:
        for s in self.sims:
            s.reset()


@pytest.fixture(scope="session")
def pairs(tokenizer_dir: Path) -> Any:
    specs = {"sim512": ("--max-model-len", "512"), "seed": SEED_ARGS, "flow": FLOW_ARGS,
             "hf": ("--tokenizer", str(tokenizer_dir), "--max-model-len", "256"), "kv18": KV18_ARGS}
    made = {name: Pair(SimProcess("prefill", *args), SimProcess("decode", *DECODER_ARGS.get(name, args)))
            for name, args in specs.items()}
    procs = [s for p in made.values() for s in p.sims]
    try:
        with ThreadPoolExecutor(len(procs)) as pool:
            list(pool.map(lambda s: s.start(timeout_s=60), procs))
        yield made
    finally:
        for s in procs:
            s.stop()


@pytest.fixture
def pair_of(pairs: dict[str, Pair]) -> Callable[[str], Pair]:
    def get(name: str) -> Pair:
        pairs[name].reset()
        return pairs[name]
    return get
