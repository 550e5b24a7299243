"""Command line: ``pdproxy serve | sim | demo | doctor``.  The only module that exits the process.

``pdproxy serve`` takes the vLLM-Ascend example proxy's flags (``--prefiller-hosts … --decoder-ports …``),
vllm-router's URL lists (``--prefill URL --decode URL``, repeatable) and every other setting as a flag; flags
win over ``PDPROXY_*`` environment variables, which win over the ``--config`` file.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from pdproxy import __version__
from pdproxy.endpoints import Role
from pdproxy.settings import Settings, load_settings

# Settings that get a CLI flag of the same name (dashes for underscores); list/bool types are derived.
_SKIP = {"endpoints"}
# The settings `pdproxy doctor` reads: which engines, how to reach them (the rest only matter to `serve`).
ENGINE_SETTINGS = ("prefill", "decode", "prefiller_hosts", "prefiller_ports", "decoder_hosts", "decoder_ports",
                   "decoder_dp_size", "prefiller_dp_size", "engine_api_key", "model_name")


def add_serve_arguments(p: argparse.ArgumentParser, only: tuple[str, ...] | None = None) -> None:
    """Add one flag per setting (``--decoder-dp-size``, ``--prefill-timeout-base-s`` …), all defaulting to None
    so that only flags actually given override the environment and the config file.  ``only``: just these
    settings (``pdproxy doctor`` takes the engine settings, :data:`ENGINE_SETTINGS`)."""
    p.add_argument("--config", help="YAML/JSON/TOML settings file (see config/)")
    for name, field in Settings.model_fields.items():
        if name in _SKIP or (only is not None and name not in only):
            continue
        flag = "--" + name.replace("_", "-")
        ann = str(field.annotation)
        default = field.default if field.default not in (None, [], "") else None
        help_text = " ".join(x for x in (field.description or "", f"(default: {default})" if default is not None
                                         else "") if x) or None
        if "list" in ann:
            p.add_argument(flag, nargs="+", action="extend", default=None, help=help_text)
        elif field.annotation is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            p.add_argument(flag, default=None, help=help_text)
    # vllm-router spelling for repeatable URL flags is --prefill/--decode (already added above, as lists).


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Build :class:`Settings` from parsed flags.  Raises ``ValidationError`` / ``ValueError`` on bad values."""
    overrides: dict[str, Any] = {}
    for name in Settings.model_fields:
        if name in _SKIP:
            continue
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return load_settings(args.config, **overrides)


def serve(settings: Settings) -> int:
    """Run the proxy (uvicorn's server, pdproxy's own HTTP protocol on uvloop + httptools) until interrupted."""
    from pdproxy.app.application import create_app
    from pdproxy.http.server import uvicorn_config
    from pdproxy.http.tls import apply_to_uvicorn, server_ssl_context
    from pdproxy.ops.logs import configure_logging, listen_urls, log_banner

    configure_logging(settings)
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
    from pdproxy.app.shutdown import DrainingServer

    app = create_app(settings)
    # SIGTERM drains first (503 + Retry-After for new requests, in-flight streams finish within shutdown_grace_s;
    # pdproxy/app/shutdown.py); uvicorn's own grace only covers what is left after that.
    config = uvicorn_config(app, host=settings.host, port=settings.port, timeout_graceful_shutdown=1,
                            log_config=None)  # pdproxy's own HTTP protocol (pdproxy/http/server.py)
    apply_to_uvicorn(config, tls)
    server = DrainingServer(config, app, grace_s=settings.shutdown_grace_s, delay_s=settings.shutdown_delay_s,
                            on_started=lambda addresses: log_banner(settings, listen_urls(addresses, tls)))
    server.run()
    if not server.started:  # e.g. the port is taken (uvicorn logged why)
        return 1
    return 0


def _format_validation(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "settings"
        lines.append(f"  {loc}: {err['msg']}")
    return "invalid settings:\n" + "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``pdproxy`` command: parse ``argv`` (default ``sys.argv[1:]``) and run one of the
    sub-commands ``serve``, ``sim``, ``demo`` or ``doctor``.  Never returns: exits the process with the
    sub-command's exit code; invalid settings (pydantic ``ValidationError`` / ``ValueError``) print to stderr and
    exit 2, Ctrl-C exits 130, argparse errors exit 2."""
    parser = argparse.ArgumentParser(prog="pdproxy", description="PD-disaggregation proxy for vLLM / vLLM-Ascend")
    parser.add_argument("--version", action="version", version=f"pdproxy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p_serve = sub.add_parser("serve", help="run the proxy")
    add_serve_arguments(p_serve)
    p_sim = sub.add_parser("sim", help="run a simulated vLLM engine (prefiller, decoder or both)")
    from pdproxy.sim import cli as sim_cli

    sim_cli.add_arguments(p_sim)
    p_demo = sub.add_parser("demo", help="1 simulated prefiller + 2 simulated decoders + the proxy on :8000")
    from pdproxy.tools import demo

    demo.add_arguments(p_demo)
    p_doctor = sub.add_parser("doctor", help="check every configured engine (KV pool vs max_model_len, idle "
                              "gauges, a P→D tool call, a cold long-context probe); ends within --budget-s")
    add_serve_arguments(p_doctor, only=ENGINE_SETTINGS)
    from pdproxy.tools import doctor

    doctor.add_arguments(p_doctor)
    args = parser.parse_args(argv)
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
    except ValidationError as exc:
        print(f"pdproxy: {_format_validation(exc)}", file=sys.stderr)
        code = 2
    except ValueError as exc:
        print(f"pdproxy: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)
