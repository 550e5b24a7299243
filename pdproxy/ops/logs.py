"""How ``pdproxy serve`` logs: one root handler on stderr, text or JSON lines (setting ``log_format``), and the
start-up banner.  The handler writes through a :class:`pdproxy.ops.linesink.LineSink`: to a stderr that is not a
file (a pipe, a terminal, a socket) by a writer thread, so a reader that falls behind holds lines (up to
``log_buffer_bytes``) and then drops them, counted and reported, instead of stopping the event loop.

- ``text``: ``2025-01-01 12:00:00,000 INFO pdproxy.engines.control engine http://p0:9100 (prefill) up: …``;
- ``json``: one object per line, ``{"ts": 1735732800.123, "level": "INFO", "logger": "pdproxy.engines.control",
  "message": "engine … up: …", "event": "engine_up", "endpoint": "http://p0:9100", …}`` — the fields a record
  carries in ``extra`` (``event`` names what happened: :mod:`pdproxy.engines.events`, ``serve_started``,
  ``shutdown_started``, ``shutdown_done``) are top-level keys.  Request-log lines (``pdproxy.requests``, already
  JSON: :mod:`pdproxy.ops.reqlog`) are written as they are.

uvicorn is started with ``log_config=None`` so its own warnings and errors go through the same handler.  With
``--workers N`` each worker's lines carry its row (``[w1]`` in text, ``"worker": 1`` in JSON), and only worker 0
reports what every worker sees alike (engines found, unreachable, limits changed: ``SHARED_EVENTS``); breakers
are per worker and every worker reports its own.
"""

from __future__ import annotations

import logging
import ssl
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import Any

import orjson

from pdproxy import __version__
from pdproxy.endpoints import Role, engine_identity
from pdproxy.ops.linesink import LineSink
from pdproxy.settings import Settings, is_loopback_host

SHARED_EVENTS = frozenset({"engine_up", "engine_unreachable", "engine_reachable", "engine_limits_changed"})
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime", "raw_json"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record (see module docstring); ``worker``: the worker row, added to every line."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON (``raw_json`` records — already JSON — as they are)."""
        if getattr(record, "raw_json", False):
            return record.getMessage()
        out: dict[str, Any] = {"ts": round(record.created, 3), "level": record.levelname, "logger": record.name,
                               "message": record.getMessage()}
        if self.worker is not None:
            out["worker"] = self.worker
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    """The ``text`` format: ``%(asctime)s %(levelname)s %(name)s{tag} %(message)s`` (``tag``: ``[w1]`` for worker
    1, else empty); :meth:`line` gives the same line without a ``LogRecord``."""

    def __init__(self, tag: str = "") -> None:
        super().__init__(f"%(asctime)s %(levelname)s %(name)s{tag} %(message)s")
        self.tag = tag
        self._stamp: tuple[int, str] = (-1, "")   # (whole second, its date and time): one tuple, swapped whole

    def line(self, name: str, levelname: str, message: str, created: float) -> str:
        """What :meth:`format` gives for a record of logger ``name`` at ``levelname`` created at ``created``
        (``time.time()`` seconds) whose message is ``message`` (no args, no exception): the date and time are
        formatted once per second, the milliseconds as ``LogRecord`` computes them on Python 3.11 and 3.12."""
        second = int(created)
        stamp = self._stamp
        if stamp[0] != second:
            stamp = self._stamp = (second, time.strftime(self.default_time_format, self.converter(created)))
        return f"{stamp[1]},{int((created - second) * 1000):03d} {levelname} {name}{self.tag} {message}"


class _WorkerFilter(logging.Filter):
    """Drops :data:`SHARED_EVENTS` in workers other than 0 (worker 0 reports them for all)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "event", None) not in SHARED_EVENTS


class SinkHandler(logging.Handler):
    """A handler that writes each formatted record as one line through a :class:`LineSink` on ``fd`` (a pipe,
    terminal or socket by the sink's writer thread, never by the caller); its dropped-lines report is a WARNING
    record (``event: log_lines_dropped``, ``dropped``: how many) formatted like the rest.  It takes no handler
    lock per record: the sink serialises, and a second lock taken in the other order by a finalizer that logs on
    the sink's writer thread would deadlock the two.  A record that fails to format is reported through the sink
    too (the base class would write its traceback to ``sys.stderr`` directly, from the caller)."""

    def __init__(self, fd: int, max_buffer_bytes: int) -> None:
        super().__init__()
        self.sink = LineSink(fd, max_buffer_bytes=max_buffer_bytes, dropped_line=self._dropped_line)

    def handle(self, record: logging.LogRecord) -> bool:
        """As ``logging.Handler.handle`` without taking the handler's lock (class docstring)."""
        rv: object = self.filter(record)
        if isinstance(rv, logging.LogRecord):  # Python 3.12+: a filter may return a replacement record
            record = rv
        if rv:
            self.emit(record)
        return bool(rv)

    def handleError(self, record: logging.LogRecord) -> None:
        """A record that failed to format or write: one line naming its logger, source and message, then the
        traceback, through the sink (nothing when ``logging.raiseExceptions`` is off, as the base class)."""
        if not logging.raiseExceptions:
            return
        text = "".join(traceback.format_exception(*sys.exc_info())) if sys.exc_info()[0] else ""
        self.sink.write(f"--- logging error in record from {record.name} ({record.pathname}:{record.lineno}): "
                        f"{record.msg!r}\n{text}".encode("utf-8", "backslashreplace"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.write(self._line(record))
        except Exception:
            self.handleError(record)

    def write_json_line(self, name: str, levelno: int, line: bytes) -> bool:
        """Write what :meth:`handle` would for a ``raw_json`` record of logger ``name`` at ``levelno`` whose message
        is ``line`` (one JSON object, UTF-8) — without making a ``LogRecord`` (the request log's line per request:
        ~20 µs less, ``loadtest/request_cost_bench.py``).  False, writing nothing, when this handler needs the
        record: a formatter or a filter that is not pdproxy's own (the caller then logs it)."""
        if levelno < self.level:
            return True
        if any(type(f) is not _WorkerFilter for f in self.filters):   # it passes records without ``event``
            return False
        fmt = self.formatter
        if type(fmt) is JsonFormatter:
            self.sink.write(line + b"\n")
        elif type(fmt) is TextFormatter:
            text = fmt.line(name, logging.getLevelName(levelno), line.decode(), time.time())
            self.sink.write((text + "\n").encode("utf-8", "backslashreplace"))
        else:
            return False
        return True

    def close(self) -> None:
        self.sink.close()
        super().close()

    def _dropped_line(self, n: int) -> bytes:
        record = logging.LogRecord("pdproxy", logging.WARNING, __file__, 0,
                                   "%d log lines dropped: the log's reader fell behind by more than "
                                   "log_buffer_bytes (%d bytes)", (n, self.sink.max_buffer_bytes), None)
        record.event = "log_lines_dropped"
        record.dropped = n
        return self._line(record)

    def _line(self, record: logging.LogRecord) -> bytes:
        """``record`` formatted, as one UTF-8 line ending in ``\\n`` (unencodable characters escaped)."""
        return (self.format(record) + "\n").encode("utf-8", "backslashreplace")


def sole_sink(logger: logging.Logger) -> SinkHandler | None:
    """The root's :class:`SinkHandler` when it is the one handler ``logger``'s records reach and nothing on the
    way can change or drop them (``logger`` has no filters and is not disabled; it and its parents below the root
    have no handlers and propagate; the root has that handler alone), else None.  The caller still checks
    ``logger.isEnabledFor(level)``."""
    if logger.filters or logger.disabled:
        return None
    c = logger
    while c.parent is not None:
        if c.handlers or not c.propagate:
            return None
        c = c.parent
    handlers = c.handlers
    return handlers[0] if len(handlers) == 1 and type(handlers[0]) is SinkHandler else None


def configure_logging(settings: Settings, worker: int | None = None) -> None:
    """Install the root handler for ``settings.log_level`` / ``settings.log_format``; ``worker``: this process's
    worker row with ``--workers N`` (None for a single process or the supervisor).  Replaces (and closes) earlier
    handlers."""
    handler: logging.Handler
    try:
        sys.stderr.flush()
        handler = SinkHandler(sys.stderr.fileno(), settings.log_buffer_bytes)
    except (AttributeError, OSError, ValueError):   # a stderr with no descriptor (replaced by a test harness)
        handler = logging.StreamHandler(sys.stderr)
    if settings.log_format == "json":
        handler.setFormatter(JsonFormatter(worker))
    else:
        tag = f"[w{worker}]" if worker is not None else ""
        handler.setFormatter(TextFormatter(tag))
    if worker:
        handler.addFilter(_WorkerFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        if isinstance(old, SinkHandler):
            old.close()
    root.addHandler(handler)
    root.setLevel(settings.log_level.upper())
    _route_python_reports()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per health probe otherwise
    logging.getLogger("httpcore").setLevel(logging.WARNING)


def _route_python_reports() -> None:
    """What Python itself writes to ``sys.stderr`` — warnings, exceptions ignored in ``__del__`` and callbacks
    (``sys.unraisablehook``), uncaught exceptions in threads (``threading.excepthook``) — goes through the
    logging handler instead, so an unread stderr never holds the event loop for them either."""
    logging.captureWarnings(True)
    log = logging.getLogger("pdproxy")

    def unraisable(args: Any) -> None:
        log.error("%s: %r", args.err_msg or "Exception ignored in", args.object,
                  exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    def thread_exception(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        log.error("uncaught exception in thread %s", args.thread.name if args.thread else "?",
                  exc_info=(args.exc_type, args.exc_value, args.exc_traceback))  # type: ignore[arg-type]

    sys.unraisablehook = unraisable
    threading.excepthook = thread_exception


def listen_urls(addresses: Sequence[tuple[Any, ...]], tls: ssl.SSLContext | bool | None) -> list[str]:
    """``http(s)://host:port`` for each bound socket address (IPv6 hosts in brackets)."""
    scheme = "https" if tls else "http"
    urls = []
    for addr in addresses:
        host, port = str(addr[0]), int(addr[1])
        urls.append(f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}")
    return urls


def exposure_warning(settings: Settings) -> str | None:
    """The start-up warning for an open door, or None: pdproxy listens beyond loopback (``host``), enforces no
    client keys (``api_keys``) and has operator routes on — the admin API (``admin_key``), or debug routes open to
    anyone (``debug_routes: open``).  ``docs/threat-model.md`` says how to run on 0.0.0.0 safely."""
    if is_loopback_host(settings.host) or settings.api_keys:
        return None
    on = [name for name, yes in (("the admin API", bool(settings.admin_key)),
                                 ("the debug routes (debug_routes: open)", settings.debug_routes == "open")) if yes]
    if not on:
        return None
    return (f"pdproxy listens on {settings.host}, beyond loopback, with no client keys (api_keys) and "
            f"{' and '.join(on)} on: anyone who reaches this port may generate and reach {' and '.join(on)}; set "
            "api_keys, or listen on 127.0.0.1 behind a gateway (docs/threat-model.md)")


def engine_key_warning(settings: Settings) -> str | None:
    """The start-up warning for an engine key without client keys, or None: ``engine_api_key`` (vllm-router's
    ``--api-key``, which ``pdproxy serve`` accepts) is the key pdproxy *sends* to the engines, while ``vllm serve
    --api-key`` is one its clients must present — an operator with vLLM's meaning in mind would think the proxy
    guarded when it asks no client for anything (``api_keys`` does that; none when TLS requires client
    certificates)."""
    if not settings.engine_api_key or settings.api_keys or (settings.ssl_certfile
                                                             and settings.ssl_cert_reqs == ssl.CERT_REQUIRED):
        return None                       # client keys, or client certificates required: clients are asked
    return ("engine_api_key (--api-key, as vllm-router's) is the key pdproxy sends to the engines; no client is asked "
            "for a key: `vllm serve --api-key` checks clients, and here that is api_keys (--api-keys), which is empty")


def both_roles_warnings(settings: Settings) -> list[str]:
    """One warning per engine URL configured as both a prefiller and a decoder (``--prefill URL --decode URL``;
    compared as :func:`pdproxy.endpoints.engine_identity` does, every DP rank of it at once), naming the URL: a
    request it prefills and then decodes holds its prompt's KV twice on it during the handoff — pinned by the
    prefill leg until the decode leg has pulled it, and allocated again by the decode leg — which admission does
    not count (it bounds a prompt by one engine's pool, pdproxy/engines/limits.py), so a prompt that fits the KV
    pool once but not twice waits inside the engine forever (README.md "A real deployment")."""
    roles: dict[str, set[Role]] = {}
    for e in settings.all_endpoints():
        roles.setdefault(engine_identity(e.url), set()).add(e.role)
    return [f"engine {url} is both a prefiller and a decoder: when it decodes a request it prefilled, the prompt's "
            "KV is held twice on it during the handoff (pinned by the prefill, allocated again by the decode), "
            "which admission does not count — a prompt that fits its KV pool once but not twice waits inside the "
            "engine forever (a non-streamed request until decode_nonstream_timeout_s); give each engine one role"
            for url, both in roles.items() if len(both) > 1]


def kv_events_warnings(settings: Settings) -> list[str]:
    """One warning per ``kv_events`` entry whose engine URL is no configured endpoint: its events are read (an
    engine of that URL may be added later through the admin API, pdproxy/endpoints.py ``build_sources``) but route
    nothing until then — most often a URL written differently from the ``--prefill`` / ``--decode`` one."""
    configured = {e.url for e in settings.all_endpoints()}
    return [f"kv_events names {src.endpoint.partition('#')[0]}, which is no configured engine: its KV events are "
            "read but route nothing until an engine with that URL is added (admin API); write the URL as the "
            "--prefill / --decode one"
            for src in settings.kv_event_sources()
            if src.endpoint.partition("#")[0] not in configured]


SECRET_SETTINGS = ("api_keys", "engine_api_key", "admin_key", "metrics_key")
"""Settings whose values never reach a log (shown as ``***``)."""


def redact_url(text: str) -> str:
    """``text`` with a URL's userinfo (``user:password@``) shown as ``***@``; any other text as it is."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    netloc, slash, path = rest.partition("/")
    if "@" not in netloc:
        return text
    return f"{scheme}://***@{netloc.rpartition('@')[2]}{slash}{path}"


def _redacted(value: Any) -> Any:
    """A setting's JSON value with :func:`redact_url` applied to each string in it (a list's too)."""
    if isinstance(value, str):
        return redact_url(value)
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    return value


def settings_in_effect(settings: Settings) -> dict[str, Any]:
    """Every setting whose value is not its default, whichever way it was given (flag, a peer's flag such as
    vllm-router's ``--policy``, ``PDPROXY_*``, config file), secrets as ``***`` (the keys, and any URL's
    ``user:password@``, e.g. an OTLP endpoint's): what ``pdproxy serve`` logs at start (``event: settings``), so an
    operator sees what a command line became."""
    out: dict[str, Any] = {}
    plain = settings.model_dump(mode="json")          # enums as their values, nested models as dicts
    for name, field in type(settings).model_fields.items():
        value = getattr(settings, name)
        if value == field.get_default(call_default_factory=True):
            continue
        out[name] = "***" if name in SECRET_SETTINGS and value else _redacted(plain.get(name, str(value)))
    return out


def log_banner(settings: Settings, urls: Sequence[str], *, workers: int = 1) -> None:
    """The start-up line: version, where it listens, the engines it was given, TLS and workers (INFO); then the
    :func:`exposure_warning` (WARNING, ``event: exposed``), the :func:`engine_key_warning` (WARNING, ``event:
    clients_unauthenticated``), the :func:`both_roles_warnings` (WARNING, ``event: engine_in_both_roles``) and
    the :func:`kv_events_warnings` (WARNING, ``event: kv_events_unmatched``) when there are."""
    endpoints = settings.all_endpoints()
    n_p = sum(e.role is Role.PREFILL for e in endpoints)
    n_d = sum(e.role is Role.DECODE for e in endpoints)
    tls = "off"
    if settings.ssl_certfile:
        tls = "client certificates " + ("required" if settings.ssl_cert_reqs == ssl.CERT_REQUIRED else
                                        "optional" if settings.ssl_cert_reqs == ssl.CERT_OPTIONAL else "not asked")
    logging.getLogger("pdproxy").info(
        "pdproxy %s listening on %s: %d prefiller(s), %d decoder(s); TLS %s; %d worker(s); admin API %s",
        __version__, ", ".join(urls), n_p, n_d, tls, workers, "on" if settings.admin_key else "off",
        extra={"event": "serve_started", "version": __version__, "listen": list(urls), "prefillers": n_p,
               "decoders": n_d, "tls": bool(settings.ssl_certfile), "workers": workers})
    changed = settings_in_effect(settings)
    logging.getLogger("pdproxy").info(
        "pdproxy: settings other than the defaults: %s",
        " ".join(f"{k}={v}" for k, v in changed.items()) or "none", extra={"event": "settings", "settings": changed})
    warning = exposure_warning(settings)
    if warning is not None:
        logging.getLogger("pdproxy").warning(warning, extra={"event": "exposed", "host": settings.host})
    warning = engine_key_warning(settings)
    if warning is not None:
        logging.getLogger("pdproxy").warning(warning, extra={"event": "clients_unauthenticated"})
    for warning in both_roles_warnings(settings):
        logging.getLogger("pdproxy").warning(warning, extra={"event": "engine_in_both_roles"})
    for warning in kv_events_warnings(settings):
        logging.getLogger("pdproxy").warning(warning, extra={"event": "kv_events_unmatched"})
