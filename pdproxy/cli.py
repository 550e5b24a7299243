"""Command line: ``pdproxy serve | sim | demo | doctor``.  The only module that exits the process.

``pdproxy serve`` takes the vLLM-Ascend example proxy's flags (``--prefiller-hosts … --decoder-ports …``, its
retry flags: :data:`ASCEND_FLAGS`), vllm-router's command line as is (``--vllm-pd-disaggregation --prefill URL [BOOTSTRAP_PORT] --decode URL
--policy cache_aware``, its ``-secs`` and health flags: :data:`ROUTER_FLAGS`, :data:`ROUTER_POLICIES`; the side by
side table is docs/migrating.md) and every other setting as a flag; flags win over ``PDPROXY_*`` environment
variables, which win over the ``--config`` file.

A mistake a user can make (a malformed or unknown setting, a bad URL, a port in use) ends the process with one
line on stderr naming the culprit — the flag, the environment variable, or the config file's line — and exit code
2 (1 for a port that cannot be bound); never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from pydantic import ValidationError

from pdproxy import __version__
from pdproxy.endpoints import Role
from pdproxy.settings import Settings, check_request_log, config_line, load_settings, unknown_environment

# Settings that get a CLI flag of the same name (dashes for underscores); list/bool types are derived.
_SKIP: Final = frozenset({"endpoints"})
# The settings `pdproxy doctor` reads and lists in its --help: which engines, how to reach them (it takes serve's
# other flags too, so that serve's command line pastes, without listing them).
ENGINE_SETTINGS = ("prefill", "decode", "prefiller_hosts", "prefiller_ports", "decoder_hosts", "decoder_ports",
                   "decoder_dp_size", "prefiller_dp_size", "engine_api_key", "model_name")


def add_serve_arguments(p: argparse.ArgumentParser, shown: tuple[str, ...] | None = None) -> None:
    """Add one flag per setting (``--decoder-dp-size``, ``--prefill-timeout-base-s`` …), all defaulting to None
    so that only flags actually given override the environment and the config file.  ``shown``: only these
    settings' flags are listed in ``--help`` (``pdproxy doctor``: :data:`ENGINE_SETTINGS`); the rest are taken
    all the same."""
    p.add_argument("--config", help="YAML/JSON/TOML settings file (see config/)")
    for name, field in Settings.model_fields.items():
        if name in _SKIP:
            continue
        flag = "--" + name.replace("_", "-")
        # vllm-router's spelling of seconds: --request-timeout-secs for request_timeout_s
        # and vLLM's / uvicorn's, without a unit: --timeout-keep-alive for timeout_keep_alive_s
        seconds = name.endswith("_s") and not name.endswith("_per_s")      # a rate (tokens_per_s) is no duration
        flags = [flag, flag[:-2] + "-secs", flag[:-2]] if seconds else [flag]
        ann = str(field.annotation)
        default = field.default if field.default not in (None, [], "") else None
        help_text = " ".join(x for x in (field.description or "", f"(default: {default})" if default is not None
                                         else "") if x) or None
        if shown is not None and name not in shown:
            help_text = argparse.SUPPRESS
        if "list" in ann:
            p.add_argument(*flags, dest=name, nargs="+", action="extend", default=None, help=help_text)
        elif field.annotation is bool:
            p.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            p.add_argument(*flags, dest=name, default=None, help=help_text)
    # vllm-router's repeatable --prefill URL [BOOTSTRAP_PORT] / --decode URL are the list flags above; a bootstrap
    # port after a prefill URL is dropped by settings_from_args (:func:`split_bootstrap_ports`).


@dataclass(frozen=True)
class RouterFlag:
    """A vllm-router flag pdproxy accepts: ``flag`` sets ``settings`` to ``convert(value)`` (a switch when
    ``convert`` is None: sets them to ``value`` when given), or nothing when ``settings`` is empty (accepted for
    compatibility; ``note`` says why it has no effect).  A pdproxy flag given for the same setting wins."""

    flag: str
    settings: tuple[str, ...]
    convert: Callable[[Any], object] | None
    note: str
    value: object = None
    nargs: str | None = None
    """argparse's ``nargs`` (``"*"``: a list of values, as vllm-router's list flags), or ``"append"``: the flag
    repeats, each time one value (``convert`` then gets the list)."""


class FlagValueError(ValueError):
    """A peer's flag given a value pdproxy cannot honour; the message says why (one line)."""


def _kv_connector(text: str) -> None:
    """vllm-router's ``--kv-connector``: ``nixl`` is pdproxy's flow (returns None: no setting); raises
    :class:`FlagValueError` for any other value."""
    if text not in ("nixl", "mooncake", "moriio"):
        raise FlagValueError(f"{text!r}: vllm-router's values are nixl, mooncake and moriio; pdproxy takes nixl "
                             "(or leave the flag out)")
    if text != "nixl":
        raise FlagValueError(f"{text!r} is vllm-router's mode for vLLM's own {text} connector, which dispatches both "
                             "legs at once through a bootstrap server; pdproxy runs the pull flow (a one-token "
                             "prefill, then its kv_transfer_params to the decoder): NixlConnector, and vLLM-Ascend's "
                             "MooncakeConnectorV1, which answers the same way (docs/pd-protocol.md) — give nixl or "
                             "leave the flag out")


def _pd_kv_events(entries: list[str]) -> list[str]:
    """vllm-router's ``--pd-kv-events URL=ENDPOINT[,ENDPOINT...]`` (one endpoint per DP rank, in rank order) →
    pdproxy's ``kv_events`` entries ``URL=ENDPOINT``: a URL's ranks publish on consecutive ports, as vLLM's
    ``offset_endpoint_port`` puts them, which pdproxy derives from the first (pdproxy/endpoints.py)."""
    from pdproxy.endpoints import offset_port

    out = []
    for entry in entries:
        url, sep, endpoints = entry.partition("=")
        first, *rest = endpoints.split(",")
        if not sep or not first:
            raise FlagValueError(f"{entry!r}: expected URL=ENDPOINT[,ENDPOINT...]")
        for rank, endpoint in enumerate(rest, 1):
            try:
                expected, given = offset_port(first, rank), offset_port(endpoint, 0)
            except ValueError as exc:
                raise FlagValueError(str(exc)) from None
            if given != expected:
                raise FlagValueError(f"{entry!r}: pdproxy reads DP rank k's events on the first endpoint's port + k "
                                     f"(vLLM's offset_endpoint_port: {expected} for rank {rank}), not {endpoint}")
        out.append(f"{url}={first}")
    return out


def _ms(text: str) -> float:
    return float(text) / 1000.0


def _attempts(text: str) -> int:
    return min(int(text) + 1, 10)


def _tries(text: str) -> int:
    return min(max(int(text), 1), 10)


ROUTER_FLAGS: Final = (
    RouterFlag("--vllm-pd-disaggregation", (), None, "pdproxy always runs vLLM's PD flow"),
    RouterFlag("--worker-startup-timeout-secs", (), str, "pdproxy starts at once; engines join when healthy"),
    RouterFlag("--worker-startup-check-interval", (), str, "see --health-interval-s"),
    RouterFlag("--health-check-interval-secs", ("health_interval_s",), float, ""),
    RouterFlag("--health-check-timeout-secs", ("health_timeout_s",), float, ""),
    RouterFlag("--health-check-endpoint", (), str, "pdproxy probes vLLM's /health"),
    RouterFlag("--health-failure-threshold", ("health_unhealthy_threshold",), int, ""),
    RouterFlag("--health-success-threshold", ("health_healthy_threshold",), int, ""),
    RouterFlag("--cb-failure-threshold", ("breaker_failures",), int, ""),
    RouterFlag("--cb-timeout-duration-secs", ("breaker_open_s",), float, ""),
    RouterFlag("--cb-success-threshold", (), str, "one successful trial request closes the breaker"),
    RouterFlag("--cb-window-duration-secs", (), str, "failures count while consecutive"),
    RouterFlag("--disable-circuit-breaker", ("breaker_failures",), None, "", value=2**31),
    RouterFlag("--retry-max-retries", ("prefill_attempts", "decode_attempts"), _attempts, "N retries = N+1 "
                                                                                           "attempts, at most 10"),
    RouterFlag("--retry-initial-backoff-ms", ("retry_backoff_s",), _ms, ""),
    RouterFlag("--retry-max-backoff-ms", ("retry_backoff_max_s",), _ms, ""),
    RouterFlag("--retry-backoff-multiplier", (), str, "pdproxy doubles"),
    RouterFlag("--retry-jitter-factor", (), str, "pdproxy jitters ×0.5–1.5"),
    RouterFlag("--disable-retries", ("prefill_attempts", "decode_attempts"), None, "", value=1),
    RouterFlag("--queue-size", ("prefill_queue_max",), int, ""),
    RouterFlag("--queue-timeout-secs", ("prefill_queue_timeout_s",), float, ""),
    RouterFlag("--max-payload-size", ("max_body_bytes",), int, ""),
    RouterFlag("--api-key", ("engine_api_key",), str, ""),
    RouterFlag("--intra-node-data-parallel-size", ("prefiller_dp_size", "decoder_dp_size"), int, ""),
    RouterFlag("--prometheus-port", (), str, "pdproxy serves /metrics on --port"),
    RouterFlag("--prometheus-host", (), str, "pdproxy serves /metrics on --port"),
    RouterFlag("--kv-connector", (), _kv_connector, "nixl only: pdproxy runs vLLM's pull flow"),
    RouterFlag("--pd-kv-events", ("kv_events",), _pd_kv_events, "URL=ENDPOINT[,ENDPOINT...], one per DP rank",
               nargs="append"),
    RouterFlag("--cache-threshold", (), str, "pdproxy weighs cached tokens against load directly"),
    RouterFlag("--balance-abs-threshold", (), str, "pdproxy weighs cached tokens against load directly"),
    RouterFlag("--balance-rel-threshold", (), str, "pdproxy weighs cached tokens against load directly"),
    RouterFlag("--eviction-interval-secs", (), str, "see --prefix-index-max-blocks"),
    RouterFlag("--max-tree-size", (), str, "see --prefix-index-max-blocks"),
    RouterFlag("--max-concurrent-requests", (), str, "pdproxy admits by the engines' room and queues the rest: "
                                                     "--queue-size"),
    RouterFlag("--request-id-headers", (), list, "pdproxy reads X-Request-Id", nargs="*"),
    RouterFlag("--log-dir", (), str, "pdproxy logs to stderr; its request log: --request-log-path"),
    RouterFlag("--cors-allowed-origins", ("allowed_origins",), list, "", nargs="*"),
)
"""vllm-router's flags (its ``vllm-router --help``) that ``pdproxy serve`` accepts, besides ``--host``,
``--port``, ``--prefill``, ``--decode``, ``--log-level``, any ``-secs`` spelling of a ``*_s`` setting, and the
policies (:data:`ROUTER_POLICIES`)."""


ASCEND_FLAGS: Final = (
    RouterFlag("--max-retries", ("prefill_attempts", "decode_attempts"), _tries, "its N is the tries per leg, "
                                                                                 "at most 10"),
    RouterFlag("--retry-delay", ("retry_backoff_s",), float, ""),
    RouterFlag("--max-waiting-retries", (), str, "engines join when healthy; add them with POST /admin/endpoints"),
    RouterFlag("--waiting-retry-interval", (), str, "see --health-interval-s"),
)
"""The vLLM-Ascend example proxy's flags (``load_balance_proxy_server_example.py``) that ``pdproxy serve`` accepts
besides ``--host``, ``--port``, ``--workers``, ``--log-level`` and the host/port lists, which are pdproxy's own.  Its
``--max-retries N`` makes N tries of each leg (``max(1, N)``), where vllm-router's ``--retry-max-retries N`` makes
N + 1."""


@dataclass(frozen=True)
class RouterPolicy:
    """What a vllm-router policy becomes in pdproxy's scheduling pipeline (pdproxy/scheduling/): the picker
    (``routing_picker``) and whether prefix-cache affinity scores prefillers (``prefix_routing``)."""

    routing_picker: str
    prefix_routing: str


ROUTER_POLICIES: Final = MappingProxyType({
    "cache_aware": RouterPolicy("least_cost", "auto"),
    "kv_aware": RouterPolicy("least_cost", "auto"),
    "consistent_hash": RouterPolicy("least_cost", "auto"),
    "sticky_least_loaded": RouterPolicy("least_cost", "auto"),
    "round_robin": RouterPolicy("least_cost", "off"),
    "power_of_two": RouterPolicy("power_of_two", "auto"),
    "random": RouterPolicy("power_of_two", "off"),
})
"""vllm-router's ``--policy`` / ``--prefill-policy`` / ``--decode-policy`` values → pdproxy settings (the
prefill policy, else ``--policy``, decides; pdproxy has one picker for both roles).  docs/migrating.md says why."""


def _router_dest(flag: str) -> str:
    return "router_" + flag[2:].replace("-", "_")


def add_router_arguments(p: argparse.ArgumentParser, shown: bool = True) -> None:
    """Add vllm-router's flags (:data:`ROUTER_FLAGS`, the three policy flags) and the vLLM-Ascend example proxy's
    (:data:`ASCEND_FLAGS`) to ``p`` (``shown``: listed in its ``--help``)."""
    group = p.add_argument_group("vllm-router compatibility (docs/migrating.md)")
    ascend = p.add_argument_group("vLLM-Ascend example proxy compatibility (docs/migrating.md)")
    for peer, target, flags in (("vllm-router", group, ROUTER_FLAGS),
                                ("the vLLM-Ascend example proxy", ascend, ASCEND_FLAGS)):
        for rf in flags:
            effect = ("sets " + ", ".join(rf.settings)) if rf.settings else "no effect"
            help_text = f"{peer}'s flag: {effect}" + (f" ({rf.note})" if rf.note else "") if shown else argparse.SUPPRESS
            if rf.convert is None:
                target.add_argument(rf.flag, dest=_router_dest(rf.flag), action="store_true", default=None,
                                    help=help_text)
            elif rf.nargs == "append":
                target.add_argument(rf.flag, dest=_router_dest(rf.flag), action="append", default=None,
                                    metavar="VALUE", help=help_text)
            elif rf.nargs is not None:
                target.add_argument(rf.flag, dest=_router_dest(rf.flag), nargs=rf.nargs, default=None,
                                    metavar="VALUE", help=help_text)
            else:
                target.add_argument(rf.flag, dest=_router_dest(rf.flag), default=None, metavar="VALUE",
                                    help=help_text)
    for flag, effect in (("--policy", "sets routing_picker and prefix_routing"),
                         ("--prefill-policy", "sets routing_picker and prefix_routing, over --policy"),
                         ("--decode-policy", "no effect (pdproxy has one picker for both roles, from the prefill "
                                             "policy)")):
        group.add_argument(flag, dest=_router_dest(flag), choices=sorted(ROUTER_POLICIES), default=None,
                           help=f"vllm-router's flag: {effect} (docs/migrating.md)" if shown else argparse.SUPPRESS)


_BOOTSTRAP = re.compile(r"^(\d{1,5}|none)$", re.IGNORECASE)


def split_bootstrap_ports(values: list[str]) -> tuple[list[str], list[str]]:
    """vllm-router's ``--prefill URL [BOOTSTRAP_PORT]``: ``values`` as argparse collected them (URLs, each maybe
    followed by a port number or ``none``) → (the URLs, the bootstrap ports given).  vLLM's connectors need no
    bootstrap port, so pdproxy keeps them only to say so."""
    urls: list[str] = []
    ports: list[str] = []
    for value in values:
        if urls and _BOOTSTRAP.match(value):
            ports.append(value)
        else:
            urls.append(value)
    return urls, ports


def _router_overrides(args: argparse.Namespace, given: dict[str, Any],
                      spelled: dict[str, str] | None = None) -> dict[str, Any]:
    """The settings vllm-router's flags in ``args`` ask for, minus those a pdproxy flag in ``given`` sets;
    ``spelled`` gets each such setting's flag as the user typed it (for :func:`explain`)."""
    out: dict[str, Any] = {}
    for rf in (*ROUTER_FLAGS, *ASCEND_FLAGS):
        raw = getattr(args, _router_dest(rf.flag), None)
        if raw is None:
            continue
        try:
            value = rf.value if rf.convert is None else rf.convert(raw)
        except FlagValueError as exc:
            raise ValueError(f"flag {rf.flag}: {exc}") from None
        except ValueError:
            raise ValueError(f"flag {rf.flag}: not a number: {raw!r}") from None
        if not rf.settings:
            continue
        for name in rf.settings:
            out[name] = value
            if spelled is not None:
                spelled[name] = rf.flag
    prefill = getattr(args, "router_prefill_policy", None) or getattr(args, "router_policy", None)
    if prefill is not None:
        policy = ROUTER_POLICIES[prefill]
        out["routing_picker"] = policy.routing_picker
        out["prefix_routing"] = policy.prefix_routing
        if spelled is not None:
            spelled["routing_picker"] = spelled["prefix_routing"] = "--policy"
    return {k: v for k, v in out.items() if k not in given}


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Build :class:`Settings` from parsed flags (pdproxy's, and vllm-router's where ``args`` has them).  Raises
    ``ValueError`` whose message is one line naming the culprit: the flag, the ``PDPROXY_*`` variable, or the
    config file and line (:func:`explain`)."""
    overrides: dict[str, Any] = {}
    for name in Settings.model_fields:
        if name in _SKIP:
            continue
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    if "prefill" in overrides:
        overrides["prefill"], _ = split_bootstrap_ports(list(overrides["prefill"]))
    spelled: dict[str, str] = {}
    router = _router_overrides(args, overrides, spelled)
    config = args.config or os.environ.get("PDPROXY_CONFIG")
    try:
        settings = load_settings(args.config, **overrides, **router)
    except ValidationError as exc:
        raise ValueError(explain(exc, config, {**overrides, **router}, spelled)) from None
    if "kv_events" not in overrides:
        _check_pd_kv_events(getattr(args, _router_dest("--pd-kv-events"), None) or [], settings)
    return settings


def _check_pd_kv_events(entries: list[str], settings: Settings) -> None:
    """vllm-router's ``--pd-kv-events`` against the engines configured: an entry listing several endpoints must list
    one per DP rank of its URL (a rank's events would otherwise be read from no socket, or an endpoint ignored).
    An entry for an engine not configured is taken as ``--kv-events`` takes one (an engine added later through
    the admin API; the start-up banner warns of it: :func:`pdproxy.ops.logs.kv_events_warnings`).  Raises
    ``ValueError`` naming the flag."""
    from pdproxy.endpoints import engine_identity, normalize_url

    dp_ranks: dict[str, set[int | None]] = {}
    for e in settings.all_endpoints():
        dp_ranks.setdefault(engine_identity(e.url), set()).add(e.dp_rank if e.internal_dp else None)
    ranks = {url: len(r) for url, r in dp_ranks.items()}
    for entry in entries:
        name, _, endpoints = entry.partition("=")
        url = engine_identity(normalize_url(name))
        given = len(endpoints.split(","))
        if url in ranks and given > 1 and given != ranks[url]:
            raise ValueError(f"flag --pd-kv-events: {entry!r} lists {given} endpoints, one per DP rank, but {url} "
                             f"has {ranks[url]} DP rank(s) here (--intra-node-data-parallel-size, or "
                             "--prefiller-dp-size / --decoder-dp-size)")


def explain(exc: ValidationError, config: str | None, flags: dict[str, Any],
            spelled: Mapping[str, str] | None = None) -> str:
    """One line for the first error of ``exc`` (and how many more), naming where the bad value came from: a flag
    in ``flags`` (setting name → value given; ``spelled``: setting name → the peer's flag that set it, e.g.
    vllm-router's ``--queue-size``), a ``PDPROXY_*`` environment variable, or the line of ``config``."""

    def _flag(name: str) -> str:
        if spelled and name in spelled:
            return spelled[name]
        flag = "--" + name.replace("_", "-")
        return f"{flag} (or {flag}ecs)" if name.endswith("_s") and not name.endswith("_per_s") else flag

    errors = exc.errors()
    err = errors[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    loc = [str(x) for x in err["loc"]]
    msg = str(err["msg"]).removeprefix("Value error, ")
    name = loc[0] if loc else None
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(name or "", list(Settings.model_fields), n=1)
        msg = "unknown setting" + (f" (did you mean {close[0]}?)" if close else "")
    if name is None:  # a check over several settings (engine URLs): find the value it quotes
        quoted = re.search(r"'([^']+)'", msg)
        value = quoted[1] if quoted else None
        if value is not None:
            for setting, given in flags.items():
                if value in (given if isinstance(given, list) else [str(given)]):
                    return f"flag {_flag(setting)}: {msg}{more}"
            for key, text in os.environ.items():
                if key.startswith("PDPROXY_") and value in text:
                    return f"environment {key}: {msg}{more}"
            if config:
                line = config_line(config, "", value)
                return f"{config}{f':{line}' if line else ''}: {msg}{more}"
        return f"settings: {msg}{more}"
    where = ".".join(loc)
    if name in flags:
        return f"flag {_flag(name)}: {msg}{more}"
    if f"PDPROXY_{name.upper()}" in os.environ:
        return f"environment PDPROXY_{name.upper()}: {msg}{more}"
    if config:
        line = config_line(config, name)
        given = err.get("input")
        if line and len(loc) > 1 and isinstance(given, str | int | float) and not isinstance(given, bool):
            line = config_line(config, "", str(given), after=line) or line     # a nested value: its own line
        return f"{config}{f':{line}' if line else ''}: setting {where}: {msg}{more}"
    return f"setting {where}: {msg}{more}"


def check_listen(host: str, port: int) -> str | None:
    """Whether ``host:port`` can be bound now (as uvicorn will, ``SO_REUSEADDR``): None, or one line saying why
    not.  Run before anything else starts, so a port in use is reported at once."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        return f"flag --host: cannot listen on {host!r}: {exc}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return f"cannot listen on {host}:{port} (--port {port}): {exc.strerror or exc}"
    return None


def serve(settings: Settings, on_started: Callable[[], None] | None = None) -> int:
    """Run the proxy (uvicorn's server, pdproxy's own HTTP protocol on uvloop + httptools) until interrupted.
    ``on_started``: called once it listens, after its start-up line (one process; not with ``--workers``)."""
    from pdproxy.app.application import create_app
    from pdproxy.http.server import uvicorn_config
    from pdproxy.http.tls import apply_to_uvicorn, server_ssl_context
    from pdproxy.ops.heap import apply_heap_policy
    from pdproxy.ops.logs import configure_logging, listen_urls

    problem = check_listen(settings.host, settings.port) or check_request_log(
        settings.request_log_path if settings.request_log else None)
    if problem is not None:  # before any engine is probed
        print(f"pdproxy: {problem}", file=sys.stderr)
        return 1
    configure_logging(settings)
    for line in unknown_environment(os.environ):       # a typo pydantic-settings ignores: said, as vLLM says it
        logging.getLogger("pdproxy").warning(line)
    apply_heap_policy(settings.malloc_trim_threshold_mib)  # process-wide (--workers: each worker's own too)
    tls = server_ssl_context(settings)  # a bad certificate / key / CA file stops here (ValueError → exit 2)
    roles = {e.role for e in settings.all_endpoints()}
    if len(roles) < 2 and not settings.admin_key:
        missing = " and ".join(r.value for r in Role if r not in roles)
        print(f"pdproxy: no {missing} engines configured: give --prefill URL and --decode URL (or "
              "--prefiller-hosts/ports and --decoder-hosts/ports, or a --config file); with --admin-key they may "
              "be added later through the admin API", file=sys.stderr)
        return 2
    if settings.workers > 1:  # one socket, one load view across processes (pdproxy/app/supervisor.py)
        from pdproxy.app.supervisor import serve_workers

        return serve_workers(settings)
    from pdproxy.app.shutdown import CancelledLifespanFilter, DrainingServer

    app = create_app(settings)
    logging.getLogger("uvicorn.error").addFilter(CancelledLifespanFilter())
    # SIGTERM drains first (503 + Retry-After for new requests, in-flight streams finish within shutdown_grace_s;
    # pdproxy/app/shutdown.py); uvicorn's own grace only covers what is left after that.
    config = uvicorn_config(app, host=settings.host, port=settings.port, timeout_graceful_shutdown=1,
                            log_config=None)  # pdproxy's own HTTP protocol (pdproxy/http/server.py)
    apply_to_uvicorn(config, tls)
    server = DrainingServer(config, app, grace_s=settings.shutdown_grace_s, delay_s=settings.shutdown_delay_s,
                            handshake_timeout_s=settings.request_headers_timeout_s,
                            on_started=lambda addresses: _started(settings, listen_urls(addresses, tls), on_started))
    server.run()
    if not server.started:  # e.g. the port is taken (uvicorn logged why)
        return 1
    return 0


def _started(settings: Settings, urls: list[str], then: Callable[[], None] | None) -> None:
    from pdproxy.ops.logs import log_banner

    log_banner(settings, urls)
    if then is not None:
        then()


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``pdproxy serve: error: …``) without the usage block, which for
    ``serve`` would be a screenful of flags."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``pdproxy`` command: parse ``argv`` (default ``sys.argv[1:]``) and run one of the
    sub-commands ``serve``, ``sim``, ``demo`` or ``doctor``.  Never returns: exits the process with the
    sub-command's exit code; invalid settings (pydantic ``ValidationError`` / ``ValueError``) print to stderr and
    exit 2, Ctrl-C exits 130, argparse errors exit 2."""
    parser = _Parser(prog="pdproxy", description="PD-disaggregation proxy for vLLM / vLLM-Ascend")
    parser.add_argument("--version", action="version", version=f"pdproxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="run the proxy")
    add_serve_arguments(p_serve)
    add_router_arguments(p_serve)
    p_sim = sub.add_parser("sim", help="run a simulated vLLM engine (prefiller, decoder or both)")
    from pdproxy.sim import cli as sim_cli

    sim_cli.add_arguments(p_sim)
    p_demo = sub.add_parser("demo", help="1 simulated prefiller + 2 simulated decoders + the proxy on :8000")
    from pdproxy.tools import demo

    demo.add_arguments(p_demo)
    p_doctor = sub.add_parser("doctor", help="check every configured engine (KV pool vs max_model_len, idle "
                              "gauges, a P→D tool call, a cold long-context probe); ends within --budget-s")
    add_serve_arguments(p_doctor, shown=ENGINE_SETTINGS)    # serve's whole command line pastes
    add_router_arguments(p_doctor, shown=False)              # vllm-router's flags too, as serve takes them
    from pdproxy.tools import doctor

    doctor.add_arguments(p_doctor)
    given = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(given)
    if unknown:           # said by the parser it was given to: a sub-command's names it and its --help's flags
        before = given[:given.index(args.command)] if args.command in given else given
        commands = {"serve": p_serve, "sim": p_sim, "demo": p_demo, "doctor": p_doctor}
        (parser if any(u in before for u in unknown) else commands[args.command]).error(
            f"unrecognized arguments: {' '.join(unknown)}")
    try:
        if args.command == "serve":
            code = serve(settings_from_args(args))
        elif args.command == "sim":
            code = sim_cli.run(args)
        elif args.command == "demo":
            code = demo.run(args, serve)
        elif args.command == "doctor":
            code = doctor.run(settings_from_args(args), args)
        else:  # pragma: no cover - argparse enforces the choices
            code = 2
    except ValidationError as exc:  # settings built outside settings_from_args (the demo's)
        print(f"pdproxy: {explain(exc, None, {})}", file=sys.stderr)
        code = 2
    except ValueError as exc:
        print(f"pdproxy: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
