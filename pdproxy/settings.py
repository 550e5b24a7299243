"""Settings: one pydantic-settings model for every knob.

Sources, highest first: CLI flags (passed as init values by ``cli.py``) > environment ``PDPROXY_*`` >
config file (YAML, JSON or TOML, ``--config`` / ``PDPROXY_CONFIG``) > defaults.  List values from the
environment may be comma- or space-separated (``PDPROXY_DECODE="http://d0:9100,http://d0:9101"``) or JSON.
Units are in the names: ``*_s`` seconds, ``*_bytes`` bytes, ``*_tokens`` tokens.
"""

from __future__ import annotations

import difflib
import importlib.util
import ipaddress
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import yaml
from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from pdproxy.endpoints import Endpoint, Role, expand, from_host_port_lists, normalize_url


def _split_list(value: Any) -> Any:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [v for v in text.replace(",", " ").split() if v]
    return value


StrList = Annotated[list[str], NoDecode]
IntList = Annotated[list[int], NoDecode]


# What tracing (otlp_traces_endpoint, pdproxy/ops/tracing.py) needs: checked when the settings are read.
OTEL_PACKAGES: Final = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http",
                        "opentelemetry.exporter.otlp.proto.grpc")
INSTALL_HINT: Final = "install them with: pip install 'pdproxy[tracing]'"
PROTOCOL_ENV: Final = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOLS: Final = ("grpc", "http/protobuf")


MAX_JSON_DEPTH: Final = 200
"""Default and largest ``max_json_depth``: about what pydantic's JSON parser (jiter) accepts (201 levels); orjson
parses up to 1024 levels but writes at most 254, and engine legs are re-encoded (and re-read with this limit)."""


MAX_JSON_ITEMS: Final = 1_000_000
"""Default ``max_json_items``: arrays, objects and element separators (``{``, ``[``, ``,``) a client's JSON body may
hold.  Parsed, an empty object costs ~85 bytes of memory for its 3 bytes of JSON and ~0.2 µs of event loop, so a
64 MiB body of them was 1.7 GB and 4 s; at this bound a body costs at most ~100 MB and ~0.1–0.25 s.  A 1M-token id
prompt (1M elements) fits; no chat of real messages comes near."""


FAN_OUT_CEILING: Final = 1024
"""The most sequences ``fan_out_max_sequences`` may allow: a completions ``prompt`` listing more prompts is refused
before any of them is read (``pdproxy/apis/request.py``)."""


def is_loopback_host(host: str) -> bool:
    """True when ``host`` (a listen address or name) is reachable from this machine only: ``localhost``,
    127.0.0.0/8, ``::1``."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def otel_missing() -> list[str]:
    """The OpenTelemetry packages tracing needs that are not installed (empty when all are)."""
    missing = []
    for name in OTEL_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            missing.append(name)
    return missing


def traces_protocol(configured: str | None) -> str:
    """The OTLP protocol: ``configured`` (``otlp_traces_protocol``), else ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``,
    else ``"grpc"`` (vLLM 0.32's default).  Raises ``ValueError`` for anything but ``grpc`` / ``http/protobuf``."""
    protocol = configured or os.environ.get(PROTOCOL_ENV) or "grpc"
    if protocol not in PROTOCOLS:
        source = "otlp_traces_protocol" if configured else PROTOCOL_ENV
        raise ValueError(f"unsupported OTLP protocol {protocol!r} (from {source}): use one of {', '.join(PROTOCOLS)}")
    return protocol


class EndpointConfig(BaseModel):
    """An endpoint written out in a config file: ``{url, role, dp_size, models}``.  ``models``: pin the endpoint
    to these model ids (served names or LoRA adapters; empty = whatever its ``/v1/models`` lists,
    pdproxy/engines/models.py)."""

    url: str
    role: Role
    dp_size: int = Field(1, ge=1, le=1024)
    models: list[str] = []

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return normalize_url(v)


class Settings(BaseSettings):
    """Every pdproxy setting.  See ``config/*.yaml`` for commented examples and README "Configuration"."""

    model_config = SettingsConfigDict(env_prefix="PDPROXY_", extra="forbid", validate_default=True,
                                      allow_inf_nan=False)   # an infinite timeout or budget is no bound

    # --- listening
    host: str = Field("0.0.0.0", description="listen address")
    port: int = Field(8000, ge=0, le=65535, description="listen port of the OpenAI-compatible front door")
    workers: int = Field(1, ge=1, le=64, description="worker processes sharing the port and one load view "
                                                     "(pdproxy/app/supervisor.py); 1 = a single process")
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field(
        "info", description="debug, info, warning, error or critical, in any case (vllm-router's lower-case "
                            "names, the vLLM-Ascend example proxy's DEBUG … CRITICAL)")
    log_format: Literal["text", "json"] = Field("text", description="log lines as text or as one JSON object each "
                                                                    "(pdproxy/ops/logs.py)")
    ssl_keyfile: str | None = Field(None, description="TLS private key file (PEM); serves HTTPS with ssl_certfile")
    ssl_certfile: str | None = Field(None, description="TLS certificate chain file (PEM); turns HTTPS on")
    ssl_ca_certs: str | None = Field(None, description="CA certificates (PEM) client certificates are checked against")
    ssl_cert_reqs: int = Field(0, ge=0, le=2, description="client certificates: 0 = not asked (ssl.CERT_NONE), "
                                                          "1 = optional, 2 = required (as vllm serve / uvicorn)")
    log_buffer_bytes: int = Field(4 * 1024 * 1024, ge=4096, le=1 << 30,
                                  description="log lines held for a stderr / stdout / request-log reader that "
                                              "fell behind; past it lines are dropped and counted: the event loop "
                                              "never waits on a log's pipe, terminal or socket "
                                              "(pdproxy/ops/linesink.py)")
    log_prompts: bool = Field(False, description="include the prompt / messages in request log lines")
    request_log: bool = Field(True, description="one JSON line per request at completion (pdproxy/ops/reqlog.py)")
    request_log_path: str | None = Field(None, description="where request lines go: unset = the pdproxy.requests "
                                                           "logger, '-' = stdout, else a file appended to")

    # --- backends (any combination; all are merged)
    prefill: StrList = Field([], description="prefiller base URLs (repeatable), e.g. http://10.0.0.5:9100")
    decode: StrList = Field([], description="decoder base URLs (repeatable), one per DP rank port")
    prefiller_hosts: StrList = Field([], description="vLLM-Ascend proxy style: prefiller hosts")
    prefiller_ports: IntList = Field([], description="prefiller ports, paired with --prefiller-hosts")
    decoder_hosts: StrList = Field([], description="vLLM-Ascend proxy style: decoder hosts (one per DP rank port)")
    decoder_ports: IntList = Field([], description="decoder ports, paired with --decoder-hosts")
    decoder_dp_size: int = Field(1, ge=1, le=1024, description="internal DP ranks behind each decode URL")
    prefiller_dp_size: int = Field(1, ge=1, le=1024, description="internal DP ranks behind each prefill URL")
    endpoints: list[EndpointConfig] = []

    # --- PD protocol
    allow_decode_side_prefill: bool = Field(
        False, description="if a prefiller answers without kv_transfer_params, let the decoder prefill locally "
                           "(vLLM's degraded mode) instead of answering 502")
    expose_routing_headers: bool = Field(False, description="add x-pdproxy-prefiller / x-pdproxy-decoder headers")
    routing_picker: Literal["least_cost", "power_of_two"] = Field(
        "least_cost", description="how the scheduler picks among scored endpoints: 'least_cost' (lowest cost, ties "
                                  "by rendezvous hashing, the same in every replica) or 'power_of_two' (two "
                                  "sampled at random, the cheaper wins)")
    prefill_cost_resolution_tokens: int = Field(
        256, ge=0, description="queued prefill work is compared in steps of this many tokens: prefillers whose "
                               "queues differ by less tie on load, and in-flight requests then the rendezvous "
                               "tie-break decide (prefix hits count exactly; 0 = exact)")
    max_body_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    engine_answer_max_bytes: int = Field(
        256 * 1024 * 1024, ge=1024, description="largest whole answer read from an engine (a prefill leg's, a "
                                                "non-streamed decode leg's, /tokenize's, a release leg's): a larger "
                                                "one is that engine's failure (502), its connection closed; an error "
                                                "answer's body is read up to 1 MiB")
    max_pending_body_bytes: int = Field(
        1 << 30, ge=1024, description="bytes of request bodies, all connections together: those still arriving "
                                      "(every route's) and the generation requests' until each request ends; a "
                                      "body that would pass it is refused with 503 (at least max_body_bytes is "
                                      "always allowed)")
    max_request_head_bytes: int = Field(64 * 1024, ge=1024, description="largest request line + header fields a "
                                                                         "client may send (431 above)")
    timeout_keep_alive_s: float = Field(
        75.0, gt=0, description="how long an idle client connection stays open; longer than clients' own pools "
                                "keep idle connections (httpx 5 s, aiohttp 15 s), so the client always closes "
                                "first and never reuses a connection the proxy is closing")
    # the client edge's other limits (pdproxy/http/server.py, docs/limits.md)
    request_headers_timeout_s: float = Field(
        30.0, gt=0, description="a request head (request line + header fields) must arrive whole within this "
                                "many seconds of its first byte, else 408 and close (Envoy request_headers_timeout, "
                                "Go ReadHeaderTimeout, nginx client_header_timeout); with TLS, the handshake too")
    request_body_timeout_s: float = Field(
        60.0, gt=0, description="longest gap between two reads of a request body, else 408 and close (nginx "
                                "client_body_timeout; Envoy stream_idle_timeout)")
    client_send_timeout_s: float = Field(
        60.0, gt=0, description="longest time bytes written to a client may wait without any of them being taken, "
                                "else the connection is aborted (nginx send_timeout): a connection that closes, "
                                "waits for its client to take an answer before the next (keep-alive, "
                                "pipelining) or to take a part of a response sent in parts (passthrough and "
                                "control-plane streams) or to take a PD stream's next events (the decode is then "
                                "aborted, freeing the decoder's reservation)")
    max_client_connections: int | None = Field(
        None, ge=1, description="open client connections; one more is answered 503 and closed.  Unset: half of "
                                "the open-file limit left after 64 (the other half is for engine connections); "
                                "pdproxy raises its soft RLIMIT_NOFILE to the hard limit (at most 65535, as vLLM) at start")
    gc_full_interval_s: float = Field(
        300.0, ge=0, description="run CPython's full garbage collection on this timer instead of whenever the "
                                 "live set grows by a quarter (which pauses the loop ~1 µs per live object, mid-ramp); "
                                 "0 keeps CPython's policy (pdproxy/ops/gcpolicy.py)")
    gc_young_threshold: int = Field(
        10_000, ge=0, description="CPython's young-generation threshold (allocations less deallocations of tracked "
                                  "objects between young collections; CPython's is 700, at which they took ~6 percent "
                                  "of the proxy's CPU under load), the middle generation then collected after every "
                                  "two young collections; 0 keeps CPython's thresholds (pdproxy/ops/gcpolicy.py)")
    malloc_trim_threshold_mib: int = Field(
        64, ge=0, le=2047, description="glibc malloc: MiB of freed memory kept at the top of the heap instead of "
                                       "given back to the kernel, and blocks under half of it taken from the heap, not "
                                       "mmap (long prompts' bodies, faulted in again on every request otherwise); "
                                       "0, another C library, or MALLOC_TRIM_THRESHOLD_ and the like in the "
                                       "environment leave malloc's policy alone (pdproxy/ops/heap.py)")
    upstream_max_connections: int = Field(4096, ge=0, description="open connections per engine (0: unlimited); "
                                                                  "one per in-flight request")
    upstream_pool_wait_s: float = Field(10.0, gt=0, description="how long a request waits for a connection to an "
                                                                "engine at upstream_max_connections (seconds)")
    fan_out_max_sequences: int = Field(
        16, ge=1, le=FAN_OUT_CEILING, description="most sequences one request may fan out to (n x prompts of a completion "
                                       "prompt list), each served by its own prefill/decode pair; more is a 400")
    model_name: str | None = Field(None, description="served model name to advertise if engines cannot be asked")

    # --- timeouts (seconds)
    connect_timeout_s: float = Field(3.0, gt=0)
    prefill_timeout_base_s: float = Field(30.0, gt=0)
    prefill_timeout_per_1k_tokens_s: float = Field(2.0, ge=0)
    decode_first_byte_timeout_s: float = Field(120.0, gt=0)
    decode_idle_timeout_s: float = Field(120.0, gt=0)
    decode_nonstream_timeout_s: float = Field(600.0, gt=0, description="whole non-streaming decode leg")
    request_timeout_s: float | None = Field(None, gt=0, description="optional end-to-end deadline")
    shutdown_grace_s: float = Field(30.0, ge=0)
    shutdown_delay_s: float = Field(0.0, ge=0, description="after SIGTERM, /health answers 503 at once but new "
                                                           "requests are still served this long (a load "
                                                           "balancer's health check takes the replica out first)")

    # --- retries (see director.py for the policy)
    prefill_attempts: int = Field(3, ge=1, le=10, description="prefillers tried per request (refuse/reset/timeout/"
                                                               "502/503/504; a 500 once more only when its engine "
                                                               "died; a 4xx never)")
    prefill_relax_constraints: bool = Field(
        True, description="on the one-token prefill leg only, a forced tool call (tool_choice required / named) "
                          "becomes auto and structured outputs are dropped (the decoder keeps them); false for a "
                          "model whose chat template renders tool_choice or response_format (Kimi K3)")
    decode_attempts: int = Field(3, ge=1, le=10, description="decoders tried per request before its first event")
    retry_backoff_s: float = Field(0.05, ge=0, description="first retry backoff; doubles per retry, ×0.5–1.5 jitter")
    retry_backoff_max_s: float = Field(1.0, ge=0, description="cap of one retry backoff (seconds)")
    prefill_cancel_grace_s: float = Field(
        0.5, ge=0, description="a request that leaves (client gone, deadline) while its prefill leg is in flight: "
                               "wait this long for the prefiller's answer and release the KV it pinned, then "
                               "close the connection (vLLM aborts the request); 0 closes at once, leaving the KV "
                               "of a prefill that had just finished pinned until the connector's timeout (seconds)")
    kv_release_timeout_s: float = Field(
        5.0, gt=0, description="bound of the release leg that frees a prefiller's pinned KV when a request leaves "
                               "between prefill and decode (seconds)")
    kv_release_retry_s: float = Field(
        60.0, ge=0, description="how long a release leg keeps trying when no decoder can take it (all refused, "
                                "breakers open) or the one it reached closed the connection unanswered (one that "
                                "timed out: once more, on another decoder), before the KV is left pinned until the "
                                "connector's timeout (seconds; 0: one try)")
    recompute_continuation: bool = Field(
        True, description="continue vLLM-Ascend 'stop_reason: recomputed' streams on a new P/D pair (forces "
                          "stream_options.include_usage upstream and strips it for clients that did not ask)")
    stream_continuation: bool = Field(
        False, description="continue a chat / completions / Responses / Messages stream whose decoder is lost "
                           "after the first byte on another P/D pair, token-exact (asks decoders for "
                           "return_token_ids; docs/stream-continuation.md)")
    stream_continuation_max: int = Field(2, ge=0, le=20, description="continuations per stream")
    stream_continuation_stall_factor: float = Field(
        20.0, gt=1, description="a continuable stream's decoder silent for this many times the stream's own mean "
                                "inter-token time (at least stream_continuation_stall_min_s) is lost")
    stream_continuation_stall_min_s: float = Field(2.0, gt=0, description="the shortest silence that counts as "
                                                                          "a lost decoder (seconds)")
    stream_continuation_timeout_s: float = Field(
        20.0, gt=0, description="the longest a client waits from a lost decoder's detection to its continuation's "
                                "first event (seconds; re-prefill, handoff and first token, retries included); past "
                                "it the stream ends with the typed error event")
    recompute_max_attempts: int = Field(3, ge=0, le=20, description="recomputed continuations per request")
    recompute_decoders: StrList = Field(
        [], description="decoder URLs that can end a stream with 'stop_reason: recomputed' (vLLM-Ascend), or '*' "
                        "for all; a decoder that sends one is added for the rest of the process (detected). Only "
                        "their streams keep a transcript and force usage upstream")

    # --- health
    health_interval_s: float = Field(2.0, gt=0)
    health_timeout_s: float = Field(1.0, gt=0)
    health_unhealthy_threshold: int = Field(
        3, ge=1, description="consecutive failed /health probes that take an engine out of rotation, counted only "
                             "while no request to it succeeds (Envoy's unhealthy_threshold; docs/health.md)")
    health_healthy_threshold: int = Field(
        2, ge=1, description="consecutive good /health probes that bring an engine taken out by probes back "
                             "(Envoy's healthy_threshold)")
    engine_refresh_interval_s: float = Field(10.0, gt=0)
    breaker_failures: int = Field(3, ge=1, description="consecutive engine failures that open an endpoint's breaker")
    breaker_open_s: float = Field(3.0, gt=0, description="first open period of a breaker (doubles per failed trial)")

    # --- auth
    api_keys: StrList = Field([], description="client API keys pdproxy enforces (never forwarded to engines)")
    engine_api_key: str | None = Field(None, description="the engines' --api-key: sent on every engine call (request "
                                                         "legs, /tokenize, /v1/models, /metrics, /health) instead of "
                                                         "the client's Authorization")
    admin_key: str | None = Field(None, description="enables the /admin API (Authorization: Bearer <key>); also "
                                                    "opens /debug/*, /docs, /openapi.json where debug_routes "
                                                    "keeps them behind it")
    metrics_key: str | None = Field(None, description="when set, GET /metrics needs Authorization: Bearer <key> "
                                                      "(Prometheus: authorization.credentials); unset = open")

    # --- browsers (CORS): vLLM's flags and defaults (vllm/entrypoints/launchers/cli_args.py)
    allowed_origins: StrList = Field([], description="origins whose browser pages may call pdproxy (CORS), e.g. "
                                                     "'[\"https://app.example\"]' or '[\"*\"]'; empty = cross-origin "
                                                     "browser access disabled (vLLM's --allowed-origins)")
    allow_credentials: bool = Field(False, description="CORS: allow credentials (vLLM's --allow-credentials)")
    allowed_methods: StrList = Field(["*"], description="CORS: methods a preflight allows (vLLM's --allowed-methods)")
    allowed_headers: StrList = Field(["*"], description="CORS: request headers a preflight allows (vLLM's "
                                                        "--allowed-headers)")

    # --- admission
    max_model_len: int | None = Field(None, ge=1, description="cap the engines' max_model_len (tokens; never "
                                      "raises it) and stand in for an engine that declares none")
    max_tokens_overflow: Literal["clamp", "reject"] = Field(
        "clamp", description="prompt + max_tokens over max_model_len: 'clamp' admits it (vLLM 0.32 lowers max_tokens "
                             "to the room left), 'reject' answers 400 up front (vLLM <= 0.26 and vLLM-Ascend); over "
                             "a decoder's KV pool: 'clamp' lowers it there on the decode leg, 'reject' answers 400")
    tokenizer: str | None = Field(None, description="local tokenizer directory (tokenizer.json + chat template), "
                                                    "or 'sim' for pdproxy sim's; default: count with the engine's "
                                                    "/tokenize when the byte bound cannot decide")
    token_count: Literal["auto", "engine", "local", "estimate"] = "auto"
    model_tokenizers: StrList = Field([], description="MODEL=TOKENIZER pairs (a directory, 'sim' or 'engine') that "
                                                      "override `tokenizer` per served model")
    token_count_threads: int = Field(2, ge=1, le=64, description="worker threads that count large prompts")
    token_count_cache_entries: int = Field(4096, ge=0, description="counted blocks (system prompts, tool blocks) "
                                                                   "and engine counts kept")
    tokenize_timeout_s: float = Field(10.0, gt=0, description="deadline of an engine /tokenize call, the wait for "
                                                              "a place under tokenize_max_inflight included")
    tokenize_max_inflight: int = Field(16, ge=1, description="/tokenize calls in flight at once per engine: a count "
                                                             "waits for a place (within tokenize_timeout_s, then "
                                                             "goes on with the estimate); prefix keys do not wait "
                                                             "(text keys instead)")
    engine_count_max_bytes_per_token: int = Field(
        32, ge=0, description="a prompt counted by an engine's /tokenize (no local tokenizer) whose text (media data "
                              "and earlier turns' reasoning left out) passes this many bytes per token of the limit "
                              "(at least 1,024 tokens' worth) is answered as over it (vLLM's 400) without asking "
                              "the engine: only a chat template that drops nearly all of it could make it fit; 0 = "
                              "always ask")
    chat_template_max_overhead_tokens: int = Field(
        1024, ge=0, description="upper bound on tokens an engine's chat template adds beyond the messages and "
                                "tools; lets small prompts skip /tokenize")
    word_bound: bool = Field(True, description="reject without tokenizing when the prompt has more words than the "
                                               "limit (BPE and SentencePiece never merge across whitespace)")
    prefill_budget_tokens: int = Field(32768, ge=0, description="prefill tokens in flight per prefiller before "
                                                                "prompts wait in pdproxy's queue (0 = no budget)")
    prefill_budget_s: float = Field(0.5, ge=0, description="the prefill budget is also the tokens a prefiller "
                                                           "computes in this many seconds at its measured rate, when "
                                                           "more than prefill_budget_tokens (0 = tokens only)")
    prefill_queue_max: int = Field(1024, ge=0, description="requests waiting for a prefill slot before 429")
    prefill_queue_timeout_s: float = Field(120.0, gt=0, description="longest wait for a prefill slot before 503")
    prefill_queue_aging_tokens_per_s: float = Field(
        8192.0, ge=0, description="queue priority gained per second of waiting (tokens), so large prompts are "
                                  "never starved by small ones")
    prefill_busy_tokens: int = Field(8192, ge=1, description="a prefill of at least this many uncached tokens is "
                                                             "'long work': its prefiller is busy with it while it "
                                                             "runs (docs/decode-only.md)")
    prefill_tied_to_decoders: bool = Field(True, description="dispatch a prefill only when the decoders' free KV "
                                                             "pool can take it")
    decoder_max_requests: int = Field(0, ge=0, description="decode requests per decoder before prefills wait "
                                                           "(0 = no limit)")
    decode_reserved_output_tokens: int = Field(
        1024, ge=0, description="decoder KV a decoding request is counted for beyond its prompt: min(its max_tokens, "
                                "this) tokens. vLLM allocates output blocks as it generates, so counting every "
                                "max_tokens up front let a few large limits hold the decoders' whole pool while "
                                "it stood free (max_model_len: the worst case, never over-committed)")
    decode_only_max_prompt_tokens: int = Field(0, ge=0, description="prompts up to this many tokens skip the "
                                                                    "prefiller and go straight to a decoder (0 = off)")
    decode_only_busy_max_prompt_tokens: int = Field(
        1024, ge=0, description="while every prefiller is computing a long prefill (prefill_busy_tokens), prompts "
                                "up to this many tokens go straight to a decoder (0 = off; docs/decode-only.md)")

    # --- prefix cache: the engines' KV events (pdproxy/prefix/subscriber.py) and the index (pdproxy/prefix/index.py)
    kv_events: StrList = Field([], description="ENGINE_URL=tcp://HOST:PORT: subscribe to that engine's KV events "
                                               "(vLLM --kv-events-config endpoint; repeatable). An engine URL with "
                                               "internal DP ranks: rank k on PORT+k")
    kv_events_replay: StrList = Field([], description="ENGINE_URL=tcp://HOST:PORT: the engine's replay endpoint "
                                                      "(vLLM replay_endpoint), asked after a sequence gap")
    kv_events_topic: str = Field("", description="topic to subscribe to (vLLM --kv-events-config topic)")
    kv_events_silent_after_s: float = Field(
        10.0, gt=0, description="a KV event publisher whose connection is down this long is not live: its entries "
                                "are forgotten and routing uses the approximate index for it (seconds)")
    kv_events_replay_timeout_s: float = Field(2.0, gt=0, description="longest wait for one replay answer (s)")
    prefix_index_max_blocks: int = Field(
        2_000_000, ge=1, description="block entries the precise prefix index keeps over all engines (memory "
                                     "bound; see docs/kv-events.md for the bytes per entry)")
    prefix_approx_capacity_blocks: int = Field(
        65536, ge=1, description="approximate index: blocks remembered per engine when its KV pool size is unknown")
    prefix_approx_ttl_s: float = Field(600.0, gt=0, description="approximate index: forget a block sent this long "
                                                                "ago (seconds)")
    prefix_text_chunk_chars: int = Field(256, ge=1, le=1 << 20,
                                         description="without a tokenizer: UTF-8 bytes per key of the rendered "
                                                     "prompt (approximate index only; at most 1 MiB)")
    prefix_routing: Literal["auto", "precise", "approximate", "off"] = Field(
        "auto", description="prefix-cache-aware prefill routing (pdproxy/prefix/routing.py): 'auto' = from the "
                            "engine's KV events where its publisher is live, else from where pdproxy sent earlier "
                            "prompts; 'precise' = KV events only; 'approximate' = pdproxy's own record only; "
                            "'off' = load only")
    prefix_keys: Literal["auto", "text"] = Field(
        "auto", description="what prefix routing hashes: 'auto' = the prompt's token ids (local tokenizer, else the "
                            "engine's /tokenize; text when neither answers); 'text' = chunks of the rendered text "
                            "(no tokenizer work; approximate only)")
    token_ids_cache_tokens: int = Field(
        4_000_000, ge=0, description="token ids of rendered blocks (system prompts, earlier turns) the local "
                                     "tokenizer keeps for prefix routing, in tokens (4 bytes each; each block "
                                     "is charged 80 more for its entry: about the cache's memory / 4)")

    # --- tracing (pdproxy/ops/tracing.py)
    otlp_traces_endpoint: str | None = Field(
        None, description="OpenTelemetry collector that receives pdproxy's request spans (vLLM's "
                          "--otlp-traces-endpoint): gRPC by default, e.g. http://collector:4317; OTLP/HTTP with "
                          "otlp_traces_protocol http/protobuf, e.g. http://collector:4318/v1/traces; an https URL "
                          "uses TLS. Unset = tracing off. Needs pip install 'pdproxy[tracing]'")
    otlp_traces_protocol: Literal["grpc", "http/protobuf"] | None = Field(
        None, description="OTLP protocol of otlp_traces_endpoint; default: the OTEL_EXPORTER_OTLP_TRACES_PROTOCOL "
                          "environment variable, else grpc (as vLLM)")

    # --- exposure: what a client on an open port may reach (docs/threat-model.md)
    max_json_depth: int = Field(
        MAX_JSON_DEPTH, ge=8, le=MAX_JSON_DEPTH,
        description="deepest nesting of arrays/objects accepted in a client's JSON body, on every route; deeper "
                    "bodies get vLLM's 400 json_invalid (default and most 200: about what pydantic's JSON parser accepts, "
                    "within the 254 levels orjson writes engine legs with)")
    max_json_items: int = Field(
        MAX_JSON_ITEMS, ge=10_000,
        description="most arrays, objects and elements ({, [ and , bytes) in a client's JSON body, on every route; more "
                    "gets a 400 json_invalid before it is parsed (a body of empty objects costs ~28× its bytes in memory)")
    debug_routes: Literal["auto", "admin", "open", "off"] = Field(
        "auto", description="/debug/load, /debug/prefix, /docs, /openapi.json: admin (the admin key), open, off; "
                            "auto = open when pdproxy listens on loopback only and enforces no api_keys, else admin")
    admin_endpoint_allow: Annotated[list[str], NoDecode] = Field(
        [], description="where POST /admin/endpoints may add an engine: networks (10.0.0.0/8) or host names; empty = "
                        "the configured engines' host names and the /24 (IPv4) or /64 (IPv6) of their addresses")

    _split_exposure = field_validator("admin_endpoint_allow", mode="before")(_split_list)

    _split = field_validator(
        "prefill", "decode", "prefiller_hosts", "prefiller_ports", "decoder_hosts", "decoder_ports", "api_keys",
        "model_tokenizers", "kv_events", "kv_events_replay",
        mode="before")(_split_list)

    @field_validator("allowed_origins", "allowed_methods", "allowed_headers", mode="before")
    @classmethod
    def _cors_list(cls, v: Any) -> Any:
        """vLLM reads these as one JSON list (``--allowed-origins '["*"]'``); a list of words is accepted too."""
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str) and v[0].strip().startswith("["):
            v = v[0]
        return _split_list(v)

    @field_validator("log_level", mode="before")
    @classmethod
    def _log_level(cls, v: Any) -> Any:
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _kv_events(cls, v: list[str]) -> list[str]:
        from pdproxy.endpoints import parse_engine_address

        return [f"{url}={address}" for url, address in (parse_engine_address(e) for e in v)]

    @field_validator("otlp_traces_endpoint")
    @classmethod
    def _tracing_installed(cls, v: str | None) -> str | None:
        if v:
            missing = otel_missing()
            if missing:
                raise ValueError(f"needs the OpenTelemetry packages {', '.join(missing)}; {INSTALL_HINT}")
        return v or None

    @model_validator(mode="after")
    def _check_traces_protocol(self) -> Settings:
        if self.otlp_traces_endpoint:
            traces_protocol(self.otlp_traces_protocol)  # ValueError for a bad OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
        return self

    @model_validator(mode="after")
    def _check_endpoints(self) -> Settings:
        self.all_endpoints()  # raises ValueError on bad/duplicate URLs
        self.kv_event_sources()  # raises ValueError on a replay entry without its --kv-events entry
        return self

    def kv_event_sources(self) -> list[Any]:
        """The KV event publishers to follow (``pdproxy.endpoints.KVEventSource``), one per engine DP rank."""
        from pdproxy.endpoints import build_sources

        return build_sources(self.kv_events, self.kv_events_replay, self.all_endpoints(), self.kv_events_topic)

    def model_pins(self) -> dict[tuple[Role, str], frozenset[str]]:
        """``(role, url) → model ids`` of the ``endpoints`` entries that pin models (pdproxy/engines/models.py)."""
        return {(ec.role, ec.url): frozenset(ec.models) for ec in self.endpoints if ec.models}

    def all_endpoints(self) -> list[Endpoint]:
        """Every configured endpoint, prefillers first.  Raises ``ValueError`` on duplicates or bad URLs."""
        out: list[Endpoint] = []
        for role, urls, hosts, ports, dp in (
            (Role.PREFILL, self.prefill, self.prefiller_hosts, self.prefiller_ports, self.prefiller_dp_size),
            (Role.DECODE, self.decode, self.decoder_hosts, self.decoder_ports, self.decoder_dp_size),
        ):
            merged = list(urls) + from_host_port_lists(list(hosts), [int(p) for p in ports], role)
            out.extend(expand(merged, role, dp))
        for ec in self.endpoints:
            out.extend(expand([ec.url], ec.role, ec.dp_size))
        keys = [(e.role, e.name) for e in out]
        dup = {k for k in keys if keys.count(k) > 1}
        if dup:
            raise ValueError(f"duplicate endpoint(s): {', '.join(sorted(n for _, n in dup))}")
        return out


class ConfigFileError(ValueError):
    """A config file that cannot be used; the message is one line: ``FILE[:LINE[:COLUMN]]: problem``."""


def _parse_config_text(p: Path, text: str) -> Any:
    """Parse ``text`` by ``p``'s suffix (``.toml``, ``.json``, else YAML).  Raises :class:`ConfigFileError` naming
    the file, line and column of a syntax error."""
    try:
        if p.suffix == ".toml":
            return tomllib.loads(text)
        if p.suffix == ".json":
            return json.loads(text)
        return yaml.safe_load(text) or {}
    except json.JSONDecodeError as exc:
        raise ConfigFileError(f"{p}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}") from None
    except tomllib.TOMLDecodeError as exc:  # its message ends "(at line L, column C)"
        words = str(exc)
        where = re.search(r"\(at line (\d+), column (\d+)\)$", words)
        if where:
            words = words[:where.start()].rstrip()
            raise ConfigFileError(f"{p}:{where[1]}:{where[2]}: not valid TOML: {words}") from None
        if words.endswith("(at end of document)"):
            words = words.removesuffix("(at end of document)").rstrip()
            raise ConfigFileError(f"{p}:{len(text.splitlines())}: not valid TOML: {words} at the end") from None
        raise ConfigFileError(f"{p}: not valid TOML: {words}") from None
    except yaml.MarkedYAMLError as exc:
        detail = ", ".join(x for x in (exc.context, exc.problem) if x) or "syntax error"
        if exc.problem_mark is not None:
            mark = exc.problem_mark
            raise ConfigFileError(f"{p}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {detail}") from None
        raise ConfigFileError(f"{p}: not valid YAML: {detail}") from None
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{p}: not valid YAML: {str(exc).splitlines()[0]}") from None


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a config file into settings values.  Raises :class:`ConfigFileError` (a ``ValueError``; one line
    naming the file, and the line and column of a syntax error) if it is missing, unreadable, malformed or not a
    mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigFileError(f"config file {p} {'is a directory, not a file' if p.is_dir() else 'not found'}")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigFileError(f"{p}: cannot be read: {exc}") from None
    data = _parse_config_text(p, text)
    if not isinstance(data, dict):
        raise ConfigFileError(f"{p}: must hold a mapping of setting names to values")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def config_line(path: str | os.PathLike[str], setting: str, value: str | None = None, after: int = 0) -> int | None:
    """The 1-based line of ``path`` where ``setting`` (either spelling, ``_`` or ``-``) is written as a top-level
    key — or, with ``value``, the first line past line ``after`` holding that text as a whole word (a list item
    such as a bad engine URL, a nested value).  None when not found or the file cannot be read.  For error
    messages only."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    if value is not None:
        whole = re.compile(rf"(?<![\w.-]){re.escape(value)}(?![\w.-])")      # "decod" is not in "decode"
        return next((i for i, line in enumerate(lines, 1) if i > after and whole.search(line)), None)
    spellings = "|".join(re.escape(s) for s in {setting, setting.replace("_", "-")})
    key = re.compile(rf'^\s*["\']?(?:{spellings})["\']?\s*[:=]')
    return next((i for i, line in enumerate(lines, 1) if key.match(line)), None)


NON_SETTING_VARIABLES = frozenset({"CONFIG", "SKIP_REAL_VLLM", "NO_EXTENSIONS", "FUZZ_EXAMPLES"})
"""``PDPROXY_*`` variables that are not settings: ``PDPROXY_CONFIG`` (the config file) and the test suite's own
(``scripts/test-all.sh``, ``pdproxy/pd/record.py``, ``tests/security/test_server_fuzz.py``); with
``PDPROXY_LOCUST_*`` (``loadtest/locustfile.py``)."""


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """One line per ``PDPROXY_*`` variable of ``environ`` that names no setting (a typo pydantic-settings would
    ignore), with the closest setting's variable when there is one; ``cli.serve`` logs them as warnings, as vLLM
    warns of an unknown ``VLLM_*`` variable (``vllm/envs.py``)."""
    names = [*Settings.model_fields, *(n.lower() for n in NON_SETTING_VARIABLES)]
    lines = []
    for key in sorted(environ):
        if not key.upper().startswith("PDPROXY_"):
            continue
        name = key[len("PDPROXY_"):]
        if name.lower() in Settings.model_fields or name.upper() in NON_SETTING_VARIABLES or (
                name.upper().startswith("LOCUST_")):
            continue
        close = difflib.get_close_matches(name.lower(), names, n=1)
        hint = f" (did you mean PDPROXY_{close[0].upper()}?)" if close else ""
        lines.append(f"environment {key[:100]}: unknown setting, ignored{hint}")
    return lines


def load_settings(config: str | None = None, **overrides: Any) -> Settings:
    """Build settings from an optional config file, the environment and explicit overrides (CLI flags).

    ``overrides`` whose value is None are ignored (flag not given).  Raises ``pydantic.ValidationError`` or
    ``ValueError`` with a readable message on bad values.
    """
    values = {k: v for k, v in overrides.items() if v is not None}
    config = config or os.environ.get("PDPROXY_CONFIG")
    file_values = read_config_file(config) if config else {}
    # Precedence: overrides > env > file.  pydantic-settings ranks init values above the environment, so file
    # values are passed only for the settings the environment does not set.
    env_names = {k[len("PDPROXY_"):].lower() for k in os.environ if k.upper().startswith("PDPROXY_")}
    merged = {k: v for k, v in file_values.items() if k not in env_names}
    merged.update(values)
    return Settings(**merged)


def check_request_log(path: str | None) -> str | None:
    """Whether the request log file ``path`` (setting ``request_log_path``; None and ``-`` need no file) can be
    opened for appending now, as the server will open it: None, or one line saying why not.  Run before anything
    else starts, so a bad path is reported before any engine is probed."""
    if not path or path == "-":
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        return f"flag --request-log-path {path}: cannot open it for appending: {exc.strerror or exc}"
    os.close(fd)
    return None
