"""pdproxy/tokens.py: the sim tokenizer's counting rules, prompt_token_ids, and a local HF tokenizer directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdproxy.tokens import (
    MEDIA_PART_TOKENS,
    HFTokenizer,
    SimTokenizer,
    Tokenizer,
    load_tokenizer,
    prompt_token_ids,
    sim_prompt,
)

pytestmark = pytest.mark.timeout(15)

TEXTS = ["hello world", " a b c", "naïve 世界 café!!! 12345 __x__  \n\n x", "it's 3.14, don't", "", "\r\n\t",
         "supercalifragilistic", "emoji 😀😀 done", "a_b-c/d\\e"]


@pytest.mark.parametrize("text", TEXTS)
def test_sim_tokenizer_round_trips_and_is_byte_bounded(text: str) -> None:
    tok = SimTokenizer()
    ids = tok.encode(text)
    assert "".join(tok.pieces(text)) == text
    assert tok.decode(ids) == text
    assert len(ids) <= len(text.encode())


@pytest.mark.parametrize("text", [*TEXTS, sim_prompt(50), sim_prompt(50, True, 1), " abcdefghijklmnopq rs", "word",
                                  " lead", "trail ", "dbl  space", "Ⅻ roman", "x²"])
def test_count_equals_len_encode(text: str) -> None:
    assert SimTokenizer().count(text) == len(SimTokenizer().encode(text))


def test_ids_are_stable_across_instances() -> None:
    assert SimTokenizer().encode("the same text") == SimTokenizer().encode("the same text")


@pytest.mark.parametrize("n", [0, 1, 2, 17, 1000, 10_000])
@pytest.mark.parametrize("unique", [False, True])
def test_sim_prompt_has_exactly_n_tokens(n: int, unique: bool) -> None:
    assert len(SimTokenizer().encode(sim_prompt(n, unique=unique, seed=3))) == n


def test_n_short_words_with_leading_space_are_n_tokens() -> None:
    assert len(SimTokenizer().encode(" alpha beta gamma delta")) == 4
    assert len(SimTokenizer().encode(" abcdefghijklmnop")) == 2  # letter runs split every 8 letters


def test_unique_prompts_differ_and_filler_repeats() -> None:
    tok = SimTokenizer()
    a, b = tok.encode(sim_prompt(64, True, 1)), tok.encode(sim_prompt(64, True, 2))
    assert not set(a) & set(b)
    assert len(set(a)) == 64
    assert len(set(tok.encode(sim_prompt(64)))) < 16


def test_sim_chat_template_overhead_is_two_per_message_plus_generation_prompt() -> None:
    tok = SimTokenizer()
    messages = [{"role": "system", "content": sim_prompt(5)}, {"role": "user", "content": sim_prompt(7)}]
    assert len(prompt_token_ids(tok, {"messages": messages}, "chat")) == 5 + 7 + 2 * 2 + 1
    no_gen = prompt_token_ids(tok, {"messages": messages, "add_generation_prompt": False}, "chat")
    assert len(no_gen) == 5 + 7 + 4
    cont = tok.render_chat(messages, continue_final_message=True)
    assert cont.endswith(sim_prompt(7))


def test_multipart_content_joins_text_and_counts_media() -> None:
    tok = SimTokenizer()
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": " one"}, {"type": "image_url", "image_url": {"url": "data:..."}},
        {"type": "text", "text": " two"}]}]}
    ids = prompt_token_ids(tok, body, "chat")
    assert len(ids) == len(tok.encode(tok.render_chat([{"role": "user", "content": " one\n two"}]))) + MEDIA_PART_TOKENS


def test_tools_are_part_of_the_chat_prompt_even_with_tool_choice_none() -> None:
    """vLLM 0.32 renders tools whatever tool_choice says (captures/chat_tools_none.json: 91 prompt tokens)."""
    tok = SimTokenizer()
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    base = {"messages": [{"role": "user", "content": "hi"}]}
    with_tools = prompt_token_ids(tok, {**base, "tools": tools}, "chat")
    assert len(with_tools) > len(prompt_token_ids(tok, base, "chat"))
    assert prompt_token_ids(tok, {**base, "tools": tools, "tool_choice": "none"}, "chat") == with_tools


@pytest.mark.parametrize(("body", "expected"), [({"prompt": [5, 6, 7]}, [5, 6, 7]), ({"prompt": ["x"]}, None),
                                               ({"prompt": []}, []), ({"prompt": [[]]}, [])])
def test_completion_prompts(body: dict, expected: list[int] | None) -> None:
    tok = SimTokenizer()
    ids = prompt_token_ids(tok, body, "completions")
    assert ids == (expected if expected is not None else tok.encode("x"))


@pytest.mark.parametrize("body", [{"prompt": ["a", "b"]}, {"prompt": [[1, 2], [3, 4]]}, {}, {"prompt": None}])
def test_uncountable_completion_bodies_raise(body: dict) -> None:
    with pytest.raises(ValueError, match="prompt"):
        prompt_token_ids(SimTokenizer(), body, "completions")


def test_a_prompt_of_another_type_is_named() -> None:
    with pytest.raises(ValueError, match=r"'prompt' must be a string, .* got dict"):
        prompt_token_ids(SimTokenizer(), {"prompt": {"a": 1}}, "completions")


@pytest.mark.parametrize("body", [{}, {"messages": []}, {"messages": ["x"]}, {"messages": [{"role": "User!"}]}])
def test_uncountable_chat_bodies_raise(body: dict) -> None:
    with pytest.raises(ValueError):
        prompt_token_ids(SimTokenizer(), body, "chat")


CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[TOOLS]{{ tools | tojson }}[/TOOLS]{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'bad' %}{{ raise_exception('bad role') }}{% endif %}"
    "<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}{% if enable_thinking %}<think>{% endif %}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny locally trained BPE tokenizer directory (no downloads)."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    directory = tmp_path_factory.mktemp("hf_tok")
    tok = HFTok(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world the quick brown fox"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}))
    return directory


def test_hf_tokenizer_renders_the_template_like_transformers(hf_dir: Path) -> None:
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    messages = [{"role": "user", "content": "hello"}]
    assert tok.render_chat(messages) == "<s><user>hello</s><assistant>"
    assert tok.render_chat(messages, add_generation_prompt=False, chat_template_kwargs={"enable_thinking": True}) \
        == "<s><user>hello</s><think>"
    assert tok.render_chat(messages, continue_final_message=True) == "<s><user>hello"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert '"name": "f"' in tok.render_chat(messages, tools=tools)
    with pytest.raises(ValueError, match="bad role"):
        tok.render_chat([{"role": "bad", "content": "x"}])


def test_hf_chat_has_no_added_bos_but_completions_do(hf_dir: Path) -> None:
    tok = load_tokenizer(str(hf_dir))
    chat = prompt_token_ids(tok, {"messages": [{"role": "user", "content": "hello"}]}, "chat")
    assert chat == tok.encode("<s><user>hello</s><assistant>")
    completion = prompt_token_ids(tok, {"prompt": "hello world"}, "completions")
    assert completion[0] == 1 and completion[1:] == tok.encode("hello world")
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_load_tokenizer_defaults_and_errors(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), SimTokenizer)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path))


def test_hf_template_marks_of_generation_render_their_body_and_request_fields_win(hf_dir: Path) -> None:
    """transformers' ``{% generation %}`` (its ``AssistantTracker``) renders its body, and the request's own
    ``add_generation_prompt`` wins over ``chat_template_kwargs``' as vLLM merges them; a kwarg naming the
    template's ``messages`` is a ``ValueError`` (vLLM: 400), not a ``TypeError``."""
    tok = load_tokenizer(str(hf_dir))
    assert isinstance(tok, HFTokenizer)
    tok._templates = {"default": "{% for m in messages %}{% generation %}<{{ m['role'] }}>{% endgeneration %}"
                                 "{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"}
    messages = [{"role": "user", "content": "hello"}]
    assert tok.render_chat(messages) == "<user><a>"
    assert tok.render_chat(messages, chat_template_kwargs={"add_generation_prompt": False}) == "<user><a>"
    with pytest.raises(ValueError, match="TypeError"):
        tok.render_chat(messages, chat_template_kwargs={"messages": 1})
