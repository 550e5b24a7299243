"""Data-plane HTTP client to the engines, and the one place its transport errors become pdproxy errors.

Why :mod:`pdproxy.http.client` here and httpx elsewhere: on this machine kind httpx's connection pool cost ~460 µs of
proxy CPU per relayed SSE event and queued requests for pool slots at ~100 concurrent streams (+5 s TTFT), and
aiohttp's ``ClientSession`` cost ~34 % of the proxy's CPU per PD request (README "Performance",
loadtest/RESULTS.md).  Control-plane calls (health, /metrics, /v1/models, /tokenize) use httpx (``pdproxy/engines/control.py``).

One keep-alive pool per proxy process (at most ``upstream_max_connections`` per engine, a caller past that waits
``upstream_pool_wait_s``), created by :meth:`Upstream.start` and closed by :meth:`Upstream.close` (the app's
lifespan owns both).  :func:`pdproxy.http.errors.transport_error` (the one error boundary of every engine client) maps the transport's exception tree (``pdproxy/http/client.py``) to
:class:`~pdproxy.errors.ProxyError`: every caller (the legs here, the relay, the JSON decode answer) uses it.

Stale keep-alive connections: engines (uvicorn under vLLM) close idle connections after 5 s
(``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, vllm/envs.py), so pooled connections are dropped after
:data:`KEEPALIVE_S` (4 s) on our side.  A POST that still fails on a *reused* connection with a disconnect/reset
before any response byte (the engine closed it between requests and never read the request) is sent once more on
a fresh connection (RFC 9112 §9.3.1.1).  A failure on a fresh connection, or after the response started, is
never retried here, so a request does not run twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import orjson

from pdproxy.endpoints import Endpoint
from pdproxy.errors import (  # noqa: F401  (UpstreamRefused, retry_after_seconds: re-exported for the legs)
    ProxyError,
    UpstreamHTTPError,
    UpstreamRefused,
    UpstreamTimeout,
    UpstreamUnavailable,
    retry_after_seconds,
)
from pdproxy.http.client import H1Pool, H1Response, PoolTimeout, TransportError
from pdproxy.http.errors import role_noun, transport_error

_MAX_ERROR_BODY_BYTES = 1 << 20
ERROR_BODY_GRACE_S = 1.0
"""Seconds a decode leg's error body may take after a head that came just before the leg's first-byte deadline."""
KEEPALIVE_S = 4.0
"""Seconds an idle upstream connection stays pooled: below vLLM's 5 s server keep-alive."""


def _retry_after(headers: Any) -> str | None:
    value = headers.get("Retry-After") if headers is not None else None
    return str(value) if value else None




def _answer_failure(exc: TransportError | TimeoutError, endpoint: Endpoint, timeout_s: float) -> ProxyError:
    """The error for a POST answered in full (:meth:`Upstream.post_json`, :meth:`Upstream.judge`) that failed with
    ``exc``: :class:`UpstreamTimeout` when its ``timeout_s`` seconds ran out, else the transport's
    (:func:`~pdproxy.http.errors.transport_error`: refused, reset, no pool slot in time)."""
    if isinstance(exc, TimeoutError) and not isinstance(exc, PoolTimeout):
        return UpstreamTimeout(f"{endpoint.role.value} {endpoint.name} did not answer within {timeout_s:.1f} s",
                               endpoint=endpoint.name)
    return transport_error(exc, f"{endpoint.role.value} {endpoint.name}", endpoint.name)


def answer_too_large(who: str, endpoint: str, limit: int) -> UpstreamUnavailable:
    """The failure of an engine whose whole answer passed ``limit`` bytes (setting ``engine_answer_max_bytes``): no
    engine answer of vLLM's comes near it, and reading on would hold it all in memory.  ``who``: the engine's role
    word and name (``"prefill http://…"``, ``"decoder http://…"``); the client reads only its role
    (:func:`pdproxy.http.errors.role_noun`)."""
    return UpstreamUnavailable(f"{who} answered more than {limit:,} bytes (engine_answer_max_bytes); connection "
                               "closed", endpoint=endpoint,
                               public=f"the {role_noun(who)} sent an answer too large to read")


async def read_answer(resp: H1Response, limit: int | None, who: str, endpoint: str) -> bytes:
    """The body of ``resp`` (its headers in): at most ``_MAX_ERROR_BODY_BYTES`` of an error answer (status 400 or
    more; the rest left unread), the whole of any other one.  Raises :class:`UpstreamUnavailable` as soon as a
    non-error body passes ``limit`` bytes (None: no limit), and the transport's errors.  Either way, what is left
    unread stays with the connection, which the caller's ``release`` then closes: an engine that sends a body
    without end no longer grows the proxy until a timeout (a 500 with 400 MB of body: 1 GB of RSS, and the error
    held back until the prefill timeout)."""
    if resp.status >= 400:
        return await resp.read(_MAX_ERROR_BODY_BYTES)
    if limit is None:
        return await resp.read()
    data = await resp.read(limit + 1)
    if len(data) > limit:
        raise answer_too_large(who, endpoint, limit)
    return data


class Upstream:
    """Sends the prefill leg (JSON) and opens the decode leg (stream) to one engine endpoint.

    ``max_connections``: per engine (0: unlimited); ``pool_wait_s``: how long a request waits for one;
    ``max_answer_bytes``: the largest answer body read whole (None: no bound; error bodies: 1 MiB)."""

    def __init__(self, *, connect_timeout_s: float, max_connections: int = 0, pool_wait_s: float = 10.0,
                 max_answer_bytes: int | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_answer_bytes = max_answer_bytes
        """The largest whole answer :meth:`post_json` reads (setting ``engine_answer_max_bytes``; None: any)."""
        self.max_connections = max_connections
        self.pool_wait_s = pool_wait_s
        self._pool: H1Pool | None = None
        self._targets: dict[str, tuple[tuple[str, int], bool, str, str]] = {}
        self.stale_retries = 0

    async def start(self) -> None:
        """Create the keep-alive connection pool (connect timeout ``connect_timeout_s`` seconds)."""
        self._pool = H1Pool(connect_timeout_s=self.connect_timeout_s, keepalive_s=KEEPALIVE_S,
                            max_per_endpoint=self.max_connections, wait_s=self.pool_wait_s)

    async def close(self) -> None:
        """Close idle pooled connections and drop the pool; a no-op if not started."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @property
    def pool(self) -> H1Pool:
        """The connection pool.  Raises ``RuntimeError`` before :meth:`start` or after :meth:`close`."""
        if self._pool is None:
            raise RuntimeError("Upstream.start() was not awaited")
        return self._pool

    def _target(self, url: str) -> tuple[tuple[str, int], bool, str, str]:
        """``((host, port), tls, host header, path)`` for an engine URL (cached per URL)."""
        hit = self._targets.get(url)
        if hit is None:
            parts = urlsplit(url)
            tls = parts.scheme == "https"
            host = parts.hostname or "127.0.0.1"
            port = parts.port or (443 if tls else 80)
            hit = self._targets[url] = ((host, port), tls, parts.netloc, parts.path or "/")
        return hit

    async def _post(self, url: str, body: bytes, headers: dict[str, str], idle_timeout_s: float | None, *,
                    headers_by: float, deadline_at: float | None = None) -> H1Response:
        """POST and return the response once its headers are in; sent once more on a fresh connection when a
        reused keep-alive connection turned out to be closed before any response byte (see module docstring).
        ``headers_by``/``deadline_at``: ``loop.time()`` seconds (timers in the connection, not ``asyncio.timeout``
        — two fewer per request).  Raises :class:`~pdproxy.http.client.TransportError` or ``TimeoutError``."""
        key, tls, netloc, path = self._target(url)
        head = "".join([f"POST {path} HTTP/1.1\r\nHost: {netloc}\r\nContent-Length: {len(body)}\r\n",
                        *(f"{k}: {v}\r\n" for k, v in headers.items()), "\r\n"]).encode("latin-1")
        pool = self.pool
        conn, reused = await pool.acquire(key, tls=tls, deadline=headers_by)
        if reused:
            try:
                return await conn.request(head, body, idle_timeout_s, headers_by=headers_by, deadline_at=deadline_at)
            except TransportError:
                if conn.got_bytes:
                    raise
            self.stale_retries += 1
            conn, _ = await pool.acquire(key, tls=tls, deadline=headers_by, fresh=True)
        return await conn.request(head, body, idle_timeout_s, headers_by=headers_by, deadline_at=deadline_at)

    async def post_json(self, endpoint: Endpoint, path: str, body: bytes, headers: dict[str, str], *,
                        timeout_s: float, parse: Callable[[bytes], Any] = orjson.loads) -> dict[str, Any]:
        """POST ``body`` (JSON bytes) and return the parsed JSON object answer (``parse``: the parser, one that
        raises ``orjson.JSONDecodeError`` for what it refuses; the prefill leg's keeps the handle as bytes,
        ``pdproxy/apis/kv_transfer.py::load_prefill_answer``).

        Raises :class:`UpstreamHTTPError` (engine answered ≥ 400; body kept verbatim), :class:`UpstreamTimeout`
        (no complete answer within ``timeout_s`` seconds; the connection is closed, which makes vLLM abort),
        :class:`UpstreamRefused` (connection refused: the engine never saw the request),
        :class:`UpstreamUnavailable` (reset, an answer that is not a JSON object, or one over ``max_answer_bytes``;
        ``answered`` once the engine sent anything: a status line, bytes that are not HTTP).
        """
        url = endpoint.url + path
        deadline = self.pool.loop.time() + timeout_s
        resp: H1Response | None = None
        try:
            resp = await self._post(url, body, headers, None, headers_by=deadline, deadline_at=deadline)
            with resp:
                data = await read_answer(resp, self.max_answer_bytes, f"{endpoint.role.value} {endpoint.name}",
                                         endpoint.name)
            if resp.status >= 400:
                raise UpstreamHTTPError(resp.status, data, endpoint=endpoint.name,
                                        content_type=resp.content_type or "application/json",
                                        retry_after=_retry_after(resp.headers))
        except (TransportError, TimeoutError) as exc:
            err = _answer_failure(exc, endpoint, timeout_s)
            if resp is not None and isinstance(err, UpstreamUnavailable):
                err.answered = True                # its status line came: the engine read the request
            raise err from None
        except UpstreamUnavailable as exc:         # an answer too large to read: an answer all the same
            exc.answered = True
            raise
        try:
            parsed = parse(data)
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise UpstreamUnavailable(f"{endpoint.role.value} {endpoint.name} answered HTTP {resp.status} with a "
                                      "body that is not a JSON object", endpoint=endpoint.name, answered=True)
        return parsed

    async def judge(self, endpoint: Endpoint, path: str, body: bytes, headers: dict[str, str], *,
                    timeout_s: float) -> dict[str, Any]:
        """POST a body pdproxy found invalid for the engine (``ProxyRequest.engine_judges``) for the engine to
        judge: returns ``{}`` once its status line says it accepted the body (below 400) — the answer unread, the
        connection closed at once, which makes vLLM abort a streamed answer (a JSON answer comes only once
        generated, within ``timeout_s``) — and raises :class:`UpstreamHTTPError` with the engine's refusal.
        Transport failures and ``timeout_s`` raise as in :meth:`post_json`; an answer of any shape is the engine's
        verdict, never its failure."""
        url = endpoint.url + path
        deadline = self.pool.loop.time() + timeout_s
        try:
            resp = await self._post(url, body, headers, None, headers_by=deadline, deadline_at=deadline)
            if resp.status < 400:
                resp.close()
                return {}
            with resp:
                data = await resp.read(_MAX_ERROR_BODY_BYTES)
        except (TransportError, TimeoutError) as exc:
            raise _answer_failure(exc, endpoint, timeout_s) from None
        raise UpstreamHTTPError(resp.status, data, endpoint=endpoint.name,
                                content_type=resp.content_type or "application/json",
                                retry_after=_retry_after(resp.headers))

    @asynccontextmanager
    async def open_stream(self, endpoint: Endpoint, path: str, body: bytes, headers: dict[str, str], *,
                          first_byte_timeout_s: float) -> AsyncIterator[H1Response]:
        """Open the decode leg and yield the response once its status line and headers are in.

        Error statuses are raised as :class:`UpstreamHTTPError` with the engine's body (so the client gets the
        engine's status and JSON, never a 200 with an empty body).  Body reads time out after
        ``first_byte_timeout_s`` seconds without data (:class:`~pdproxy.http.client.ReadTimeout`) until the caller switches
        to the inter-event timeout with ``resp.set_idle_timeout()`` once the first event is in (the relay does).
        On exit the connection is released to the pool if the body was read to the end, and closed otherwise
        (vLLM aborts the request when its client disconnects).
        An error status's body is read until ``first_byte_timeout_s`` after the leg was sent, at least
        :data:`ERROR_BODY_GRACE_S` after the head (then the error goes with what came of it).
        Raises :class:`UpstreamTimeout` if headers take longer than ``first_byte_timeout_s``,
        :class:`UpstreamRefused` when the connection cannot be opened and :class:`UpstreamUnavailable` when it
        breaks before the headers.
        """
        url = endpoint.url + path
        headers_by = self.pool.loop.time() + first_byte_timeout_s
        try:
            resp = await self._post(url, body, headers, first_byte_timeout_s, headers_by=headers_by)
        except (TransportError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError) and not isinstance(exc, PoolTimeout):
                raise UpstreamTimeout(f"decoder {endpoint.name} sent no response headers within "
                                      f"{first_byte_timeout_s:.1f} s", endpoint=endpoint.name) from None
            raise transport_error(exc, f"decoder {endpoint.name}", endpoint.name) from None
        try:
            if resp.status >= 400:
                try:   # by the same deadline as the head (vLLM writes an error's body with its status line), at
                    # least ERROR_BODY_GRACE_S after the head: not first_byte_timeout_s again from the head
                    async with asyncio.timeout_at(max(headers_by, self.pool.loop.time() + ERROR_BODY_GRACE_S)):
                        data = await resp.content.read(_MAX_ERROR_BODY_BYTES)
                except (TimeoutError, TransportError):
                    data = b""
                raise UpstreamHTTPError(resp.status, data, endpoint=endpoint.name,
                                        content_type=resp.content_type or "application/json",
                                        retry_after=_retry_after(resp.headers))
            yield resp
        finally:   # not ``with resp:`` (release): a complete message with bytes left unread is closed here
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()
