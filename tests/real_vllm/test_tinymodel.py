"""The tiny tokenizer and chat template agree with what real vLLM 0.32 computed from them.

Fast (no engines, no torch): these compare ``pdproxy.tools.tinymodel.write_tokenizer`` output with the captures
that ``tests/real_vllm/capture.py`` recorded from real engines serving the same tokenizer. If the corpus or
the trainer changes, regenerate the captures (scripts/real-vllm.sh setup && start, then capture.py).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from pdproxy.tools import tinymodel

CAPTURES = Path(__file__).parent / "captures"

pytestmark = pytest.mark.timeout(20)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tinymodel.write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tok_dir / "tokenizer.json"))


def capture(name: str) -> dict[str, Any]:
    return json.loads((CAPTURES / f"{name}.json").read_text(encoding="utf-8"))


def render_like_vllm(template: str, body: dict[str, Any], bos: str) -> str:
    """Render as vLLM 0.32 does (seen in the captures): transformers' sandbox with a json.dumps ``tojson``;
    each tool call's ``function`` becomes ``{"arguments": <parsed dict>, "name": ...}`` (that key order);
    each tool's ``function`` is the pydantic dump ``{"name", "description" (null if absent), "parameters"}``."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    messages = copy.deepcopy(body["messages"])
    for m in messages:
        for call in m.get("tool_calls") or []:
            fn = call["function"]
            call["function"] = {"arguments": json.loads(fn["arguments"]), "name": fn["name"]}
    tools = None
    if body.get("tools"):
        tools = [
            {
                "type": t["type"],
                "function": {
                    "name": t["function"]["name"],
                    "description": t["function"].get("description"),
                    "parameters": t["function"].get("parameters"),
                },
            }
            for t in body["tools"]
        ]
    return env.from_string(template).render(messages=messages, tools=tools, add_generation_prompt=True, bos_token=bos)


def test_tokenizer_is_deterministic(tok_dir: Path, tmp_path: Path) -> None:
    again = tinymodel.write_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (again / name).read_bytes() == (tok_dir / name).read_bytes(), name


def test_special_tokens_and_config(tok: Tokenizer, tok_dir: Path) -> None:
    assert [tok.token_to_id(t) for t in tinymodel.SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert 1000 < tok.get_vocab_size() <= tinymodel.VOCAB_SIZE
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["bos_token"] == tinymodel.BOS and config["eos_token"] == tinymodel.EOS
    assert config["chat_template"] == tinymodel.CHAT_TEMPLATE
    enc = tok.encode("Hello world")
    assert enc.ids[0] == 0 and tok.decode(enc.ids) == "Hello world"


def test_completion_prompt_tokens_match_vllm(tok: Tokenizer) -> None:
    cap = capture("tokenize_completion")
    assert tok.encode(cap["request"]["body"]["prompt"]).ids == cap["response"]["json"]["tokens"]


@pytest.mark.parametrize("name", ["tokenize_chat", "tokenize_chat_tools"])
def test_chat_template_tokens_match_vllm(tok: Tokenizer, name: str) -> None:
    cap = capture(name)
    text = render_like_vllm(tinymodel.CHAT_TEMPLATE, cap["request"]["body"], tinymodel.BOS)
    assert tok.encode(text, add_special_tokens=False).ids == cap["response"]["json"]["tokens"]


@pytest.mark.parametrize("n", [2047, 2049, 3000])
def test_exact_length_prompts_match_vllm_usage(tok: Tokenizer, n: int) -> None:
    """capture.py builds n-token prompts as " the" * (n - 1); vLLM counted the same."""
    name = f"length_prompt{n}_max{16 if n == 2047 else 1}"
    cap = capture(name)
    prompt = cap["request"]["body"]["prompt"]
    assert len(tok.encode(prompt).ids) == n
    if n <= 2048:
        assert cap["response"]["json"]["usage"]["prompt_tokens"] == n
    else:  # vLLM reports at most max_model_len + 1 ("at least 2049 input tokens")
        assert "value=2049)" in cap["response"]["json"]["error"]["message"]


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tinymodel.main(["tokenizer", str(tmp_path)]) == 0
    assert (tmp_path / "tokenizer.json").is_file()
    assert tinymodel.main(["bogus"]) == 2
    assert "usage" in capsys.readouterr().err
