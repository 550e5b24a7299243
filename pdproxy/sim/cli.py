"""``pdproxy sim`` command line: vLLM's flag names where vLLM has one, plus the simulator's own flags.

The lead wires :func:`add_arguments` and :func:`run` into ``pdproxy sim``; ``python -m pdproxy.sim`` works
meanwhile. On start it prints one JSON line to stdout, for scripts and tests::

    {"event": "sim_ready", "ports": [8100], "base_urls": ["http://127.0.0.1:8100"], "role": "both", ...}

It then serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys

from pdproxy.sim.config import SimConfig
from pdproxy.sim.faults import parse_fault
from pdproxy.sim.models import parse_lora_modules


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every ``pdproxy sim`` flag to ``parser`` (see :class:`SimConfig` for meanings and units)."""
    d = SimConfig()
    v = parser.add_argument_group("vLLM engine flags (same names as `vllm serve`)")
    v.add_argument("--host", default=d.host, help="listen address (default 127.0.0.1)")
    v.add_argument("--port", type=int, default=d.port, help="HTTP port; 0 = any free port; DP rank k uses port+k")
    v.add_argument("--served-model-name", default=d.served_model_name)
    v.add_argument("--max-model-len", type=int, default=d.max_model_len, help="context limit in tokens")
    v.add_argument("--block-size", type=int, default=d.block_size, help="KV block size in tokens")
    v.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV pool size in blocks (default: 4 x max-model-len worth of blocks)")
    v.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    v.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget per engine step")
    v.add_argument("--long-prefill-token-threshold", type=int, default=0,
                   help="cap per-step tokens of one prefill (0 = off, vLLM's default)")
    v.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    v.add_argument("--tokenizer", default=None, help="local HF tokenizer dir (default: built-in sim tokenizer)")
    v.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction, default=True,
                   help="answer chats with tools by calling one (off: vLLM's 400 for tool_choice auto)")
    s_overflow = ("what prompt + max_tokens > max-model-len gets: clamp = max_tokens lowered to the room left "
                  "(vLLM 0.32); reject = 400 (vLLM <= 0.26, vLLM-Ascend)")
    v.add_argument("--max-tokens-overflow", choices=("clamp", "reject"), default="clamp", help=s_overflow)
    v.add_argument("--data-parallel-size", type=int, default=1, help="DP ranks served by this process")
    v.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters listed in /v1/models with their parent (name=path or vLLM's JSON form)")
    v.add_argument("--enable-lora", action=argparse.BooleanOptionalAction, default=False,
                   help="accepted for vLLM launch-line compatibility (adapters come from --lora-modules)")
    v.add_argument("--max-lora-rank", type=int, default=16, help="accepted for vLLM launch-line compatibility")
    v.add_argument("--tool-call-parser", default=d.tool_call_parser,
                   help="tool parser name ('none' = no parser: tool_choice required/named/auto get vLLM's 400)")
    v.add_argument("--enable-scale-out", action=argparse.BooleanOptionalAction, default=d.enable_scale_out,
                   help="serve the render routes and /inference/v1/generate (off: vLLM's 403)")
    v.add_argument("--runner", choices=("generate", "pooling"), default=d.runner,
                   help="pooling: an embedding/classification model (pooling routes, no generation routes)")
    v.add_argument("--convert", choices=("none", "embed", "classify"), default=d.convert,
                   help="the pooling task of --runner pooling (none = embed)")
    v.add_argument("--seed", type=int, default=0)
    v.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                   help="require one of these keys (Authorization: Bearer KEY) on /v1/* routes, as vLLM does")
    v.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish KV cache events like vLLM, e.g. \'{"enable_kv_cache_events": true, "publisher": '
                        '"zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (DP rank k: port+k)')
    s = parser.add_argument_group("simulator flags")
    s.add_argument("--role", choices=("prefill", "decode", "both"), default="both",
                   help="kv_producer / kv_consumer / plain engine that also accepts both")
    s.add_argument("--prefill-tokens-per-s", type=float, default=0.0, help="prefill throughput (0 = free)")
    s.add_argument("--decode-tokens-per-s", type=float, default=0.0,
                   help="per-step decode rate: tokens/s each running sequence gets (0 = free)")
    s.add_argument("--decode-seq-cost-s", type=float, default=0.0,
                   help="extra step time per sequence that samples a token (batch-size sensitivity)")
    s.add_argument("--step-overhead-s", type=float, default=0.0, help="fixed cost of every engine step")
    s.add_argument("--slow-factor", type=float, default=1.0, help="multiply every step time")
    s.add_argument("--output-tokens", type=int, default=d.output_tokens,
                   help="tokens generated when max_tokens is absent (completions: length; chat: stop)")
    s.add_argument("--dp-ports", type=int, nargs="+", default=None, help="one port per DP rank")
    s.add_argument("--dp-single-port", action="store_true",
                   help="serve all DP ranks on --port (internal DP), routed by X-data-parallel-rank")
    s.add_argument("--kv-connector", choices=("nixl", "mooncake"), default="nixl",
                   help="shape of kv_transfer_params")
    s.add_argument("--kv-pin-timeout-s", type=float, default=d.kv_pin_timeout_s,
                   help="free pinned prefill KV not pulled within this time")
    s.add_argument("--kv-transfer-tokens-per-s", type=float, default=0.0,
                   help="decoder's KV pull speed (0 = instant)")
    s.add_argument("--hol-blocking", choices=("on", "off"), default="on",
                   help="on: a waiting request that cannot get KV blocks stops admission (vLLM 0.32 on CPU, vLLM-Ascend"
                        " 0.23: docs/field-reports.md);"
                        " off: smaller requests that fit go ahead")
    s.add_argument("--held-back", action="store_true",
                   help="greedy outputs: a non-ASCII word's chunk has empty text and the next chunk starts with it, as"
                        " vLLM's detokenizer holds back a token that ends inside a UTF-8 character")
    s.add_argument("--stream-interval", type=int, default=1,
                   help="streamed outputs: the first token alone, then one event per this many tokens (vLLM's"
                        " --stream-interval; the simulator cuts events at fixed positions 1 + k*N, the last may be"
                        " shorter)")
    s.add_argument("--recompute-stop", action="store_true",
                   help='on preemption finish the victim with stop_reason "recomputed" (vLLM-Ascend)')
    s.add_argument("--refuse-connections", action="store_true",
                   help="bind the port(s) without listening: connections are refused")
    s.add_argument("--fault", action="append", default=[], metavar="JSON",
                   help='fault spec, e.g. \'{"kind":"status","status":503,"on_request":2}\' (repeatable)')
    s.add_argument("--engine-id", default="", help="engine id base (default: random uuid)")
    s.add_argument("--kv-events-encoding", choices=("map", "array"), default="map",
                   help="KV event encoding: map (newer vLLM) or array (vLLM <= 0.23, vLLM-Ascend 0.23)")
    s.add_argument("--record-limit", type=int, default=d.record_limit, help="requests kept for /sim/received")
    s.add_argument("--embedding-size", type=int, default=d.embedding_size, help="floats per embedding vector")
    s.add_argument("--transcription", action="store_true",
                   help="also serve /v1/audio/transcriptions and /v1/audio/translations (a speech-to-text model)")


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Build a :class:`SimConfig` from parsed args. Raises ``ValueError`` for a bad fault spec."""
    faults = tuple(json.loads(f) for f in args.fault)
    for spec in faults:
        parse_fault(spec)
    if args.kv_events_config is not None:
        from pdproxy.sim.kv_publisher import parse_kv_events_config

        parse_kv_events_config(args.kv_events_config)
    parse_lora_modules(args.lora_modules)
    return SimConfig(
        host=args.host, port=args.port, served_model_name=args.served_model_name, max_model_len=args.max_model_len,
        block_size=args.block_size, num_gpu_blocks_override=args.num_gpu_blocks_override,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_prefix_caching=args.enable_prefix_caching, tokenizer=args.tokenizer, role=args.role,
        prefill_tokens_per_s=args.prefill_tokens_per_s, decode_tokens_per_s=args.decode_tokens_per_s,
        decode_seq_cost_s=args.decode_seq_cost_s,
        step_overhead_s=args.step_overhead_s, slow_factor=args.slow_factor, output_tokens=args.output_tokens,
        data_parallel_size=args.data_parallel_size, dp_ports=tuple(args.dp_ports or ()),
        dp_single_port=args.dp_single_port, kv_connector=args.kv_connector, kv_pin_timeout_s=args.kv_pin_timeout_s,
        kv_transfer_tokens_per_s=args.kv_transfer_tokens_per_s, hol_blocking=args.hol_blocking == "on",
        held_back=args.held_back, stream_interval=max(1, args.stream_interval),
        recompute_stop=args.recompute_stop, enable_auto_tool_choice=args.enable_auto_tool_choice,
        max_tokens_overflow=args.max_tokens_overflow,
        refuse_connections=args.refuse_connections, faults=faults,
        seed=args.seed, record_limit=args.record_limit, engine_id=args.engine_id,
        api_key=tuple(args.api_key or ()),
        kv_events_config=args.kv_events_config, kv_events_encoding=args.kv_events_encoding,
        lora_modules=tuple(args.lora_modules), enable_scale_out=args.enable_scale_out,
        tool_call_parser=None if args.tool_call_parser in ("", "none") else args.tool_call_parser,
        runner=args.runner, convert=args.convert, embedding_size=args.embedding_size,
        transcription=args.transcription)


async def serve(config: SimConfig) -> None:
    """Run the simulator until SIGINT/SIGTERM, after printing the ``sim_ready`` line."""
    from pdproxy.sim.server import SimServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    async with SimServer(config) as server:
        ready = {"event": "sim_ready", "ports": server.ports, "base_urls": server.base_urls, "role": config.role,
                 "data_parallel_size": config.data_parallel_size,
                 "engine_ids": [rank.engine_id for rank in server.ranks]}
        if server.kv_event_publishers:
            ready["kv_events_endpoints"] = [p.endpoint for p in server.kv_event_publishers]
            ready["kv_events_replay_endpoints"] = [p.replay_endpoint for p in server.kv_event_publishers]
        sys.stdout.write(json.dumps(ready) + "\n")
        sys.stdout.flush()
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    """Entry point for ``pdproxy sim``: returns the process exit code (2 on a bad configuration, 1 for a port
    that cannot be bound, as ``pdproxy serve`` and ``pdproxy demo`` answer it: one line, no traceback)."""
    from pdproxy.sim.server import ListenError

    try:
        config = config_from_args(args)
        config.rank_ports()
    except ValueError as exc:
        sys.stderr.write(f"pdproxy sim: {exc}\n")
        return 2
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(serve(config))
        else:
            uvloop.run(serve(config))
    except ListenError as exc:
        sys.stderr.write(f"pdproxy sim: {exc}\n")
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m pdproxy.sim [flags]``."""
    parser = argparse.ArgumentParser(prog="pdproxy sim", description="Simulated vLLM engine (PD roles, faults)")
    add_arguments(parser)
    return run(parser.parse_args(argv))
