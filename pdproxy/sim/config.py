"""Configuration of one simulated engine process (all ranks): :class:`SimConfig`.

Field names follow vLLM's engine arguments where a vLLM equivalent exists (``vllm/engine/arg_utils.py``):
``max_model_len``, ``block_size``, ``num_gpu_blocks_override``, ``max_num_seqs``, ``max_num_batched_tokens``,
``enable_prefix_caching``, ``long_prefill_token_threshold``, ``data_parallel_size``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["prefill", "decode", "both"]
KVConnector = Literal["nixl", "mooncake"]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Settings for ``pdproxy sim``. Units: tokens, seconds, tokens/s. A rate of 0 means free (no time).

    Timing model (one engine step, vLLM V1)::

        step_s = slow_factor * (step_overhead_s + prefill_tokens / prefill_tokens_per_s
                                + [1 / decode_tokens_per_s if any sequence samples] + samples * decode_seq_cost_s)

    ``decode_tokens_per_s`` is the per-step decode rate: each running sequence gets that many tokens/s,
    whatever the batch size (a memory-bound decode). ``decode_seq_cost_s`` adds a per-sequence cost, for
    batch-size sensitivity. A chunked-prefill step that also decodes pays both terms.

    ``enable_auto_tool_choice`` (vLLM's ``--enable-auto-tool-choice``): when False, a chat with ``tools`` and
    ``tool_choice`` absent or ``"auto"`` is refused with vLLM's 400, as a real engine started without a tool
    parser does. The simulator defaults to True (it then answers with a tool call).

    ``lora_modules`` (vLLM's ``--lora-modules``): adapters served besides the base model (``name=path`` or vLLM's
    JSON form; ``pdproxy/sim/models.py``). ``tool_call_parser`` (vLLM's ``--tool-call-parser``): ``tool_choice``
    ``"required"`` and named choices need one, ``"auto"`` needs it and ``enable_auto_tool_choice``; None = no
    parser (vLLM's 400s). ``enable_scale_out`` (vLLM's ``--enable-scale-out``): the render routes and
    ``/inference/v1/generate`` (off: vLLM's 403). ``runner``/``convert`` (vLLM's ``--runner pooling --convert
    embed|classify``): a pooling model serving ``pdproxy/sim/pooling.py``'s routes and no generation route, with
    ``embedding_size``-float vectors. ``transcription``: also serve ``/v1/audio/transcriptions`` (a speech-to-text
    model).

    ``max_tokens_overflow``: ``"clamp"`` (vLLM 0.32: ``max_tokens`` is lowered to ``max_model_len - prompt``) or
    ``"reject"`` (vLLM ≤ 0.26 and vLLM-Ascend builds on it: 400 when ``prompt + max_tokens > max_model_len``).

    ``api_key`` (vLLM's ``--api-key``): when given, requests under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
    need ``Authorization: Bearer <one of them>``, else 401 ``{"error": "Unauthorized"}``; ``/health``,
    ``/metrics``, ``/tokenize`` and ``/sim/*`` stay open (``vllm/entrypoints/serve/middleware/authenticate.py``).
    """

    host: str = "127.0.0.1"
    port: int = 8100
    served_model_name: str = "sim-model"
    max_model_len: int = 8192
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    tokenizer: str | None = None
    role: Role = "both"
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    decode_seq_cost_s: float = 0.0
    step_overhead_s: float = 0.0
    slow_factor: float = 1.0
    output_tokens: int = 16
    data_parallel_size: int = 1
    dp_ports: tuple[int, ...] = ()
    dp_single_port: bool = False
    kv_connector: KVConnector = "nixl"
    kv_pin_timeout_s: float = 480.0
    kv_transfer_tokens_per_s: float = 0.0
    hol_blocking: bool = True
    held_back: bool = False     # greedy text of non-ASCII words held back to the next token (pdproxy/sim/outputs.py)
    stream_interval: int = 1    # tokens per streamed event (vLLM's --stream-interval; pdproxy/sim/completion.py)
    recompute_stop: bool = False
    enable_auto_tool_choice: bool = True
    max_tokens_overflow: Literal["clamp", "reject"] = "clamp"
    refuse_connections: bool = False
    faults: tuple[dict[str, Any], ...] = ()
    seed: int = 0
    record_limit: int = 10_000
    engine_id: str = field(default="")
    api_key: tuple[str, ...] = ()
    kv_events_config: str | None = None
    """vLLM's ``--kv-events-config`` JSON: publish the prefix cache's KV events (``pdproxy/sim/kv_publisher.py``)."""
    kv_events_encoding: Literal["map", "array"] = "map"
    """Event encoding: ``map`` (newer vLLM) or ``array`` (vLLM <= 0.23, vLLM-Ascend 0.23)."""
    version: str = "0.32.0"
    lora_modules: tuple[str, ...] = ()
    tool_call_parser: str | None = "hermes"
    enable_scale_out: bool = True
    runner: Literal["generate", "pooling"] = "generate"
    convert: Literal["none", "embed", "classify"] = "none"
    embedding_size: int = 256
    transcription: bool = False

    @property
    def num_gpu_blocks(self) -> int:
        """KV pool size in blocks: the override, or enough for 4 × ``max_model_len`` tokens."""
        if self.num_gpu_blocks_override is not None:
            return self.num_gpu_blocks_override
        return -(-4 * self.max_model_len // self.block_size)

    @property
    def kv_cache_size_tokens(self) -> int:
        """KV pool size in tokens (``num_gpu_blocks × block_size``), as vLLM's ``kv_cache_size_tokens``."""
        return self.num_gpu_blocks * self.block_size

    def rank_ports(self) -> list[int]:
        """The listening port of each DP rank: ``dp_ports``, else ``port + k`` (all 0 when ``port`` is 0).

        With ``dp_single_port`` only one port is returned (internal DP behind one API server).
        Raises ``ValueError`` when ``dp_ports`` does not have one port per rank.
        """
        if self.dp_single_port:
            return [self.port]
        if self.dp_ports:
            if len(self.dp_ports) != self.data_parallel_size:
                raise ValueError(f"--dp-ports needs {self.data_parallel_size} ports, got {len(self.dp_ports)}")
            return list(self.dp_ports)
        if self.port == 0:
            return [0] * self.data_parallel_size
        return [self.port + k for k in range(self.data_parallel_size)]

    def replace(self, **changes: object) -> SimConfig:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
