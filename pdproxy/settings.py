"""Settings: one pydantic-settings model for every knob.

Sources, highest first: CLI flags (passed as init values by ``cli.py``) > environment ``PDPROXY_*`` >
config file (YAML, JSON or TOML, ``--config`` / ``PDPROXY_CONFIG``) > defaults.  List values from the
environment may be comma- or space-separated (``PDPROXY_DECODE="http://d0:9100,http://d0:9101"``) or JSON.
Units are in the names: ``*_s`` seconds, ``*_bytes`` bytes, ``*_tokens`` tokens.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tomllib
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

    model_config = SettingsConfigDict(env_prefix="PDPROXY_", extra="forbid", validate_default=True)

    # --- listening
    host: str = Field("0.0.0.0", description="listen address")
    port: int = Field(8000, ge=0, le=65535, description="listen port of the OpenAI-compatible front door")
    workers: int = Field(1, ge=1, le=64, description="worker processes sharing the port and one load view "
                                                     "(pdproxy/app/supervisor.py); 1 = a single process")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = Field("text", description="log lines as text or as one JSON object each "
                                                                    "(pdproxy/ops/logs.py)")
    ssl_keyfile: str | None = Field(None, description="TLS private key file (PEM); serves HTTPS with ssl_certfile")
    ssl_certfile: str | None = Field(None, description="TLS certificate chain file (PEM); turns HTTPS on")
    ssl_ca_certs: str | None = Field(None, description="CA certificates (PEM) client certificates are checked against")
    ssl_cert_reqs: int = Field(0, ge=0, le=2, description="client certificates: 0 = not asked (ssl.CERT_NONE), "
                                                          "1 = optional, 2 = required (as vllm serve / uvicorn)")
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
                                "Go ReadHeaderTimeout, nginx client_header_timeout)")
    request_body_timeout_s: float = Field(
        60.0, gt=0, description="longest gap between two reads of a request body, else 408 and close (nginx "
                                "client_body_timeout; Envoy stream_idle_timeout)")
    max_client_connections: int | None = Field(
        None, ge=1, description="open client connections; one more is answered 503 and closed.  Unset: half of "
                                "the open-file limit left after 64 (the other half is for engine connections); "
                                "pdproxy raises its soft RLIMIT_NOFILE to the hard limit (at most 65535, as vLLM) at start")
    gc_full_interval_s: float = Field(
        300.0, ge=0, description="run CPython's full garbage collection on this timer instead of whenever the "
                                 "live set grows by a quarter (which pauses the loop ~1 µs per live object, mid-ramp); "
                                 "0 keeps CPython's policy (pdproxy/ops/gcpolicy.py)")
    upstream_max_connections: int = Field(4096, ge=0, description="open connections per engine (0: unlimited); "
                                                                  "one per in-flight request")
    upstream_pool_wait_s: float = Field(10.0, gt=0, description="how long a request waits for a connection to an "
                                                                "engine at upstream_max_connections (seconds)")
    fan_out_max_sequences: int = Field(
        16, ge=1, le=1024, description="most sequences one request may fan out to (n x prompts of a completion "
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
                                                               "502/503/504; a 500 once more; a 4xx never)")
    decode_attempts: int = Field(3, ge=1, le=10, description="decoders tried per request before its first event")
    retry_backoff_s: float = Field(0.05, ge=0, description="first retry backoff; doubles per retry, ×0.5–1.5 jitter")
    retry_backoff_max_s: float = Field(1.0, ge=0, description="cap of one retry backoff (seconds)")
    kv_release_timeout_s: float = Field(
        5.0, gt=0, description="bound of the release leg that frees a prefiller's pinned KV when a request leaves "
                               "between prefill and decode (seconds)")
    recompute_continuation: bool = Field(
        True, description="continue vLLM-Ascend 'stop_reason: recomputed' streams on a new P/D pair (forces "
                          "stream_options.include_usage upstream and strips it for clients that did not ask)")
    recompute_max_attempts: int = Field(3, ge=0, le=20, description="recomputed continuations per request")
    recompute_decoders: StrList = Field(
        [], description="decoder URLs that can end a stream with 'stop_reason: recomputed' (vLLM-Ascend), or '*' "
                        "for all; a decoder that sends one is added for the rest of the process (detected). Only "
                        "their streams keep a transcript and force usage upstream")

    # --- health
    health_interval_s: float = Field(2.0, gt=0)
    health_timeout_s: float = Field(1.0, gt=0)
    engine_refresh_interval_s: float = Field(10.0, gt=0)
    breaker_failures: int = Field(3, ge=1, description="consecutive engine failures that open an endpoint's breaker")
    breaker_open_s: float = Field(3.0, gt=0, description="first open period of a breaker (doubles per failed trial)")

    # --- auth
    api_keys: StrList = Field([], description="client API keys pdproxy enforces (never forwarded to engines)")
    engine_api_key: str | None = Field(None, description="the engines' --api-key: sent on every engine call (request "
                                                         "legs, /tokenize, /v1/models, /metrics, /health) instead of "
                                                         "the client's Authorization")
    admin_key: str | None = Field(None, description="enables the /admin API (Authorization: Bearer <key>); also "
                                                    "guards /debug/load whenever api_keys is set")
    metrics_key: str | None = Field(None, description="when set, GET /metrics needs Authorization: Bearer <key> "
                                                      "(Prometheus: authorization.credentials); unset = open")

    # --- admission
    max_model_len: int | None = Field(None, ge=1, description="override the engines' max_model_len")
    max_tokens_overflow: Literal["clamp", "reject"] = Field(
        "clamp", description="prompt + max_tokens over max_model_len: 'clamp' admits it (vLLM 0.32 lowers max_tokens "
                             "to the room left), 'reject' answers 400 up front (vLLM <= 0.26 and vLLM-Ascend)")
    tokenizer: str | None = Field(None, description="local tokenizer directory (tokenizer.json + chat template), "
                                                    "or 'sim' for pdproxy sim's; default: count with the engine's "
                                                    "/tokenize when the byte bound cannot decide")
    token_count: Literal["auto", "engine", "local", "estimate"] = "auto"
    model_tokenizers: StrList = Field([], description="MODEL=TOKENIZER pairs (a directory, 'sim' or 'engine') that "
                                                      "override `tokenizer` per served model")
    token_count_threads: int = Field(2, ge=1, le=64, description="worker threads that count large prompts")
    token_count_cache_entries: int = Field(4096, ge=0, description="counted blocks (system prompts, tool blocks) "
                                                                   "and engine counts kept")
    tokenize_timeout_s: float = Field(10.0, gt=0, description="deadline of an engine /tokenize call")
    chat_template_max_overhead_tokens: int = Field(
        1024, ge=0, description="upper bound on tokens an engine's chat template adds beyond the messages and "
                                "tools; lets small prompts skip /tokenize")
    word_bound: bool = Field(True, description="reject without tokenizing when the prompt has more words than the "
                                               "limit (BPE and SentencePiece never merge across whitespace)")
    prefill_budget_tokens: int = Field(32768, ge=0, description="prefill tokens in flight per prefiller before "
                                                                "prompts wait in pdproxy's queue (0 = no budget)")
    prefill_queue_max: int = Field(1024, ge=0, description="requests waiting for a prefill slot before 429")
    prefill_queue_timeout_s: float = Field(120.0, gt=0, description="longest wait for a prefill slot before 503")
    prefill_queue_aging_tokens_per_s: float = Field(
        8192.0, ge=0, description="queue priority gained per second of waiting (tokens), so large prompts are "
                                  "never starved by small ones")
    prefill_busy_tokens: int = Field(8192, ge=1, description="in-flight prefill tokens that make a prefiller "
                                                             "'busy with long work'")
    prefill_tied_to_decoders: bool = Field(True, description="dispatch a prefill only when the decoders' free KV "
                                                             "pool can take it")
    decoder_max_requests: int = Field(0, ge=0, description="decode requests per decoder before prefills wait "
                                                           "(0 = no limit)")
    decode_only_max_prompt_tokens: int = Field(0, ge=0, description="prompts up to this many tokens skip the "
                                                                    "prefiller and go straight to a decoder (0 = off)")
    decode_only_busy_max_prompt_tokens: int = Field(
        1024, ge=0, description="while every prefiller is busy with long work, prompts up to this many tokens go "
                                "straight to a decoder (0 = off)")

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
    prefix_text_chunk_chars: int = Field(256, ge=1, description="without a tokenizer: characters per key of the "
                                                                "rendered prompt (approximate index only)")
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
                                     "tokenizer keeps for prefix routing, in tokens (4 bytes each)")

    # --- tracing (pdproxy/ops/tracing.py)
    otlp_traces_endpoint: str | None = Field(
        None, description="OpenTelemetry collector that receives pdproxy's request spans (vLLM's "
                          "--otlp-traces-endpoint): gRPC by default, e.g. http://collector:4317; OTLP/HTTP with "
                          "otlp_traces_protocol http/protobuf, e.g. http://collector:4318/v1/traces; an https URL "
                          "uses TLS. Unset = tracing off. Needs pip install 'pdproxy[tracing]'")
    otlp_traces_protocol: Literal["grpc", "http/protobuf"] | None = Field(
        None, description="OTLP protocol of otlp_traces_endpoint; default: the OTEL_EXPORTER_OTLP_TRACES_PROTOCOL "
                          "environment variable, else grpc (as vLLM)")

    _split = field_validator(
        "prefill", "decode", "prefiller_hosts", "prefiller_ports", "decoder_hosts", "decoder_ports", "api_keys",
        "model_tokenizers", "kv_events", "kv_events_replay",
        mode="before")(_split_list)

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


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Parse a config file into settings values.  Raises ``ValueError`` if it is missing or not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {p} not found")
    text = p.read_text()
    if p.suffix == ".toml":
        data = tomllib.loads(text)
    elif p.suffix == ".json":
        data = json.loads(text)
    else:
        data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} must hold a mapping of setting names to values")
    return {k.replace("-", "_"): v for k, v in data.items()}


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
