"""Data-plane HTTP client to the engines (aiohttp), mapping transport failures to pdproxy errors.

Why aiohttp here and httpx elsewhere: on this machine kind httpx's connection pool cost ~460 µs of proxy CPU per
relayed SSE event and queued requests for pool slots at ~100 concurrent streams (+5 s TTFT), its per-chunk cost
growing from 138 to 539 µs as streams went from 16 to 256; aiohttp's client stayed at 23–30 µs per chunk
(issue 2 / README "Why aiohttp on the hot path").  Control-plane calls (health, /metrics, /v1/models,
/tokenize) use httpx (``engines.py``).

One ``aiohttp.ClientSession`` per proxy process, unlimited keep-alive pool, created inside the running loop by
:meth:`Upstream.start` and closed by :meth:`Upstream.close` (the app's lifespan owns both).

Stale keep-alive connections: engines (uvicorn under vLLM) close idle connections after 5 s
(``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, vllm/envs.py), so pooled connections are dropped after
:data:`KEEPALIVE_S` (4 s) on our side.  A POST that still fails on a *reused* connection with a disconnect/reset
before any response byte (the engine closed it between requests and never read the request) is sent once more on
a fresh connection (RFC 9112 §9.3.1.1; aiohttp retries only idempotent methods itself).  A failure on a fresh
connection, or after the response started, is never retried here, so a request does not run twice.
"""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson

from pdproxy.endpoints import Endpoint
from pdproxy.errors import UpstreamHTTPError, UpstreamTimeout, UpstreamUnavailable

_MAX_ERROR_BODY_BYTES = 1 << 20
KEEPALIVE_S = 4.0
"""Seconds an idle upstream connection stays pooled: below vLLM's 5 s server keep-alive."""


def _retry_after(headers: Any) -> str | None:
    value = headers.get("Retry-After") if headers is not None else None
    return str(value) if value else None


def retry_after_seconds(value: str | None) -> float | None:
    """Parse a ``Retry-After`` header (delta-seconds or an HTTP-date, RFC 9110 §10.2.3) into seconds ≥ 0;
    None when absent or unparseable."""
    if not value:
        return None
    text = value.strip()
    try:
        return max(0.0, float(text))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time())


class UpstreamRefused(UpstreamUnavailable):
    """The connection could not be opened (refused, unreachable, connect timeout): the engine never saw the
    request, so e.g. the prefiller's KV handle is still intact and may go to another decoder."""


async def _on_reuse(_session: Any, trace_ctx: Any, _params: Any) -> None:
    mark = trace_ctx.trace_request_ctx
    if isinstance(mark, dict):
        mark["reused"] = True


class Upstream:
    """Sends the prefill leg (JSON) and opens the decode leg (stream) to one engine endpoint."""

    def __init__(self, *, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self.stale_retries = 0

    async def start(self) -> None:
        trace = aiohttp.TraceConfig()
        trace.on_connection_reuseconn.append(_on_reuse)
        common: dict[str, Any] = {
            "auto_decompress": False, "skip_auto_headers": ("User-Agent", "Accept-Encoding"),
            "timeout": aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)}
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=KEEPALIVE_S, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(connector=connector, trace_configs=[trace], **common)
        # stale keep-alive retries go out on a connection of their own, never a pooled one
        self._fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True), **common)

    async def close(self) -> None:
        for session in (self._session, self._fresh):
            if session is not None:
                await session.close()
        self._session = self._fresh = None

    async def _post(self, url: str, body: bytes, headers: dict[str, str],
                    timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
        """POST and return the response once its headers are in; retried once on a fresh connection when a
        reused keep-alive connection turned out to be closed (see module docstring)."""
        mark = {"reused": False}
        try:
            return await self.session.post(url, data=body, headers=headers, timeout=timeout,
                                           trace_request_ctx=mark)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if not mark["reused"] or isinstance(exc, aiohttp.ClientConnectorError) or self._fresh is None:
                raise
        self.stale_retries += 1
        return await self._fresh.post(url, data=body, headers=headers, timeout=timeout)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() was not awaited")
        return self._session

    async def post_json(self, endpoint: Endpoint, path: str, body: bytes, headers: dict[str, str], *,
                        timeout_s: float) -> dict[str, Any]:
        """POST ``body`` (JSON bytes) and return the parsed JSON object answer.

        Raises :class:`UpstreamHTTPError` (engine answered ≥ 400; body kept verbatim), :class:`UpstreamTimeout`
        (no complete answer within ``timeout_s`` seconds; the connection is closed, which makes vLLM abort),
        :class:`UpstreamRefused` (connection refused: the engine never saw the request),
        :class:`UpstreamUnavailable` (reset, or an answer that is not a JSON object).
        """
        url = endpoint.url + path
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._post(url, body, headers,
                                        aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s))
                async with resp:
                    data = await resp.read()
                if resp.status >= 400:
                    raise UpstreamHTTPError(resp.status, data[:_MAX_ERROR_BODY_BYTES], endpoint=endpoint.name,
                                            content_type=resp.content_type or "application/json",
                                            retry_after=_retry_after(resp.headers))
        except TimeoutError:
            raise UpstreamTimeout(f"{endpoint.role.value} {endpoint.name} did not answer within {timeout_s:.1f} s",
                                  endpoint=endpoint.name) from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamRefused(f"{endpoint.role.value} {endpoint.name} refused the connection: {exc}",
                                  endpoint=endpoint.name) from None
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(f"{endpoint.role.value} {endpoint.name} failed: {exc.__class__.__name__}: "
                                      f"{exc}", endpoint=endpoint.name) from None
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise UpstreamUnavailable(f"{endpoint.role.value} {endpoint.name} answered HTTP {resp.status} with a "
                                      "body that is not a JSON object", endpoint=endpoint.name)
        return parsed

    @asynccontextmanager
    async def open_stream(self, endpoint: Endpoint, path: str, body: bytes, headers: dict[str, str], *,
                          first_byte_timeout_s: float, idle_timeout_s: float
                          ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Open the decode leg and yield the response once its status line and headers are in.

        Error statuses are raised as :class:`UpstreamHTTPError` with the engine's body (so the client gets the
        engine's status and JSON, never a 200 with an empty body).  Body reads time out after
        ``idle_timeout_s`` seconds without data (aiohttp ``sock_read``).  On exit the connection is released
        to the pool if the body was read to the end, and closed otherwise (vLLM aborts the request when its
        client disconnects, reference §1.5).
        Raises :class:`UpstreamTimeout` if headers take longer than ``first_byte_timeout_s``,
        :class:`UpstreamRefused` when the connection cannot be opened and :class:`UpstreamUnavailable` when it
        breaks before the headers.
        """
        url = endpoint.url + path
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s, sock_read=idle_timeout_s)
        try:
            async with asyncio.timeout(first_byte_timeout_s):
                resp = await self._post(url, body, headers, timeout)
        except TimeoutError:
            raise UpstreamTimeout(f"decoder {endpoint.name} sent no response headers within "
                                  f"{first_byte_timeout_s:.1f} s", endpoint=endpoint.name) from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamRefused(f"decoder {endpoint.name} refused the connection: {exc}",
                                  endpoint=endpoint.name) from None
        except aiohttp.ClientError as exc:
            raise UpstreamUnavailable(f"decoder {endpoint.name} failed: {exc.__class__.__name__}: {exc}",
                                      endpoint=endpoint.name) from None
        try:
            if resp.status >= 400:
                try:
                    async with asyncio.timeout(first_byte_timeout_s):
                        data = await resp.content.read(_MAX_ERROR_BODY_BYTES)
                except (TimeoutError, aiohttp.ClientError):
                    data = b""
                raise UpstreamHTTPError(resp.status, data, endpoint=endpoint.name,
                                        content_type=resp.content_type or "application/json",
                                        retry_after=_retry_after(resp.headers))
            yield resp
        finally:
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()
