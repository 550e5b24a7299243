"""A tiny, deterministic Llama-shaped model and byte-level BPE tokenizer, generated locally.

Nothing may be downloaded from a model hub, so the real-vLLM test stage (``scripts/real-vllm.sh``) serves a
model made here: random weights with a fixed seed and a tokenizer trained on ``pdproxy/data/tokenizer_corpus.txt``.

Two entry points with different needs:

* :func:`write_tokenizer` needs only the ``tokenizers`` library (a pdproxy dependency). Tests use it to get a
  "local tokenizer directory" (``tokenizer.json`` + ``tokenizer_config.json``) like the one beside a real model.
* :func:`write_model` also needs ``torch`` and ``safetensors``; it runs in the real-vLLM venv only.

CLI: ``python -m pdproxy.tools.tinymodel tokenizer DIR`` or ``python -m pdproxy.tools.tinymodel model DIR``.

Shape facts (vLLM 0.32 on CPU): the CPU attention kernel rejects head_dim 16 (supported sizes:
``vllm/v1/attention/backends/cpu_attn.py::CPUAttentionBackend.get_supported_head_sizes``), so
hidden 256 / 4 heads gives head_dim 64; ``max_position_embeddings`` must cover the served ``--max-model-len``.
"""

from __future__ import annotations

import json
import sys
from importlib import resources
from pathlib import Path
from typing import Any

SEED = 20261129
VOCAB_SIZE = 4096  # target for the BPE trainer; the real size (tokenizer + specials) goes into config.json
HIDDEN_SIZE = 256
NUM_HEADS = 4  # head_dim = 64
NUM_KV_HEADS = 2
NUM_LAYERS = 2
INTERMEDIATE_SIZE = 512
MAX_POSITION_EMBEDDINGS = 4096

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END, PAD)  # ids 0..4, in this order

# ChatML-style template. Supports ``tools``, assistant ``tool_calls`` and ``tool`` messages; content must be a
# string (vLLM then detects the "string" content format). vLLM renders it with transformers'
# ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` whose ``tojson`` filter is
# ``json.dumps(x, ensure_ascii=False)`` (transformers/utils/chat_template_utils.py); jinja2's builtin ``tojson``
# sorts keys and HTML-escapes, so another renderer must override it the same way. vLLM also turns each tool
# call's ``arguments`` JSON string into a dict before rendering (vllm/renderers/chat_utils.py).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] ~ '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' ~ (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages and messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' ~ messages[0]['content'] ~ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] != 'system' %}"
    "{{ '<|im_start|>' ~ message['role'] ~ '\\n' }}"
    "{%- if message['content'] %}{{ message['content'] }}{% endif %}"
    "{%- if message.get('tool_calls') %}"
    "{%- for call in message['tool_calls'] %}"
    "{{ '<tool_call>' ~ (call['function'] | tojson) ~ '</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus_text() -> str:
    """Return the tokenizer training corpus shipped as package data (``pdproxy/data/tokenizer_corpus.txt``)."""
    return resources.files("pdproxy").joinpath("data/tokenizer_corpus.txt").read_text(encoding="utf-8")


def train_tokenizer() -> Any:
    """Train the byte-level BPE tokenizer on :func:`corpus_text` and return a ``tokenizers.Tokenizer``.

    Deterministic: the same corpus gives the same vocabulary and merges (checked by tests). Special tokens
    take ids 0..4 (:data:`SPECIAL_TOKENS`); encoding with ``add_special_tokens=True`` prepends :data:`BOS`,
    as vLLM's completions path does for this model. Vocabulary size is at most :data:`VOCAB_SIZE`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in corpus_text().splitlines() if line and not line.startswith("#")]
    tok.train_from_iterator(lines, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def write_tokenizer(out_dir: Path) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into ``out_dir``.

    Needs only the ``tokenizers`` library. Returns ``out_dir`` (created if missing). The chat template
    (:data:`CHAT_TEMPLATE`) is stored under ``chat_template`` in ``tokenizer_config.json``, where vLLM
    (via transformers' ``PreTrainedTokenizerFast``) and pdproxy read it.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(out_dir / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})
    return out_dir


def model_config(vocab_size: int) -> dict[str, Any]:
    """Return the Llama ``config.json`` dict for a vocabulary of ``vocab_size`` tokens (special ids 0..4)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HIDDEN_SIZE // NUM_HEADS,
        "num_hidden_layers": NUM_LAYERS,
        "vocab_size": vocab_size,
        "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "use_cache": True,
    }


def write_model(out_dir: Path) -> Path:
    """Write a complete model directory: tokenizer files, ``config.json``, ``generation_config.json`` and
    ``model.safetensors`` (bfloat16, about 5 MB) with random weights from seed :data:`SEED`.

    Needs ``torch`` and ``safetensors`` (the real-vLLM venv). The ``lm_head`` rows of the special tokens are
    zero and the others large, so sampled text practically never hits EOS: outputs run to ``max_tokens``
    (finish_reason "length"), which keeps token counts in tests exact. Returns ``out_dir``.
    """
    import torch
    from safetensors.torch import save_file

    out_dir = write_tokenizer(Path(out_dir))
    vocab = json.loads((out_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab_size = len(vocab["model"]["vocab"]) + sum(
        1 for t in vocab["added_tokens"] if t["content"] not in vocab["model"]["vocab"]
    )
    config = model_config(vocab_size)
    _write_json(out_dir / "config.json", config)
    eos_ids = [SPECIAL_TOKENS.index(EOS), SPECIAL_TOKENS.index(IM_END)]
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": eos_ids, "pad_token_id": config["pad_token_id"]},
    )
    gen = torch.Generator().manual_seed(SEED)
    hd = HIDDEN_SIZE // NUM_HEADS

    def normal(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": normal(vocab_size, HIDDEN_SIZE, std=1.0)}
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = torch.ones(HIDDEN_SIZE, dtype=torch.bfloat16)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(HIDDEN_SIZE, dtype=torch.bfloat16)
        tensors[p + "self_attn.q_proj.weight"] = normal(NUM_HEADS * hd, HIDDEN_SIZE)
        tensors[p + "self_attn.k_proj.weight"] = normal(NUM_KV_HEADS * hd, HIDDEN_SIZE)
        tensors[p + "self_attn.v_proj.weight"] = normal(NUM_KV_HEADS * hd, HIDDEN_SIZE)
        tensors[p + "self_attn.o_proj.weight"] = normal(HIDDEN_SIZE, NUM_HEADS * hd)
        tensors[p + "mlp.gate_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[p + "mlp.up_proj.weight"] = normal(INTERMEDIATE_SIZE, HIDDEN_SIZE)
        tensors[p + "mlp.down_proj.weight"] = normal(HIDDEN_SIZE, INTERMEDIATE_SIZE)
    tensors["model.norm.weight"] = torch.ones(HIDDEN_SIZE, dtype=torch.bfloat16)
    # logit std = |h| * std = sqrt(256) * 0.6 ≈ 10: special tokens (logit 0) are never sampled.
    lm_head = normal(vocab_size, HIDDEN_SIZE, std=0.6)
    lm_head[: len(SPECIAL_TOKENS)] = 0
    tensors["lm_head.weight"] = lm_head
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    """CLI: ``tokenizer DIR`` writes the tokenizer files; ``model DIR`` writes the whole model directory."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("tokenizer", "model"):
        print("usage: python -m pdproxy.tools.tinymodel tokenizer|model DIR", file=sys.stderr)
        return 2
    out = write_tokenizer(Path(args[1])) if args[0] == "tokenizer" else write_model(Path(args[1]))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
