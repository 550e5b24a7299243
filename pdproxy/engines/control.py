"""Control plane to the engines (httpx): ``/v1/models``, ``/health``, ``/metrics``, ``/tokenize``.

What each engine declares is cached in :class:`EngineInfo` and refreshed in the background by the app
(``engine_refresh_interval_s``): served model ids and ``max_model_len`` from ``/v1/models`` (vLLM
``vllm/entrypoints/serve/engine/protocol.py::ModelCard`` has ``max_model_len``), and the KV pool from
``vllm:cache_config_info`` on ``/metrics`` (``num_gpu_blocks × block_size`` tokens, or
``kv_cache_size_tokens`` where vLLM ≥ 0.32 exports it; ``vllm/config/cache.py``, ``docs/real-vllm.md``).

Errors: httpx's exceptions never leave this module; they become pdproxy's (:mod:`pdproxy.http.errors`: a refused
connection :class:`~pdproxy.errors.UpstreamRefused`, a timeout :class:`~pdproxy.errors.UpstreamTimeout`, an error
status :class:`~pdproxy.errors.UpstreamHTTPError`, anything else :class:`~pdproxy.errors.UpstreamUnavailable`).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import httpx

from pdproxy.endpoints import Endpoint
from pdproxy.errors import ProxyError, UpstreamHTTPError
from pdproxy.http.engine_headers import EngineHeaders
from pdproxy.http.errors import httpx_errors

MAX_CONTROL_BODY_BYTES: Final = 16 << 20
"""The longest answer to a control-plane call (``/health``, ``/v1/models``, ``/metrics``) pdproxy reads: a vLLM
``/metrics`` is tens to hundreds of KiB; an engine sending more is failing, not informing (the call fails)."""

_LABELS_RE = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(slots=True)
class EngineInfo:
    """What one endpoint declared at the last refresh (None = unknown).

    ``max_model_len`` and ``kv_pool_tokens`` are tokens; ``refreshed_at`` is ``time.monotonic()`` seconds;
    ``auth_failed``: ``/v1/models`` answered 401 or 403 at the last refresh (the engine's ``--api-key`` is not the
    key pdproxy sends, ``engine_api_key``).
    """

    models: list[dict[str, Any]] = field(default_factory=list)
    max_model_len: int | None = None
    kv_pool_tokens: int | None = None
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    gauges: dict[str, float] = field(default_factory=dict)
    reachable: bool = False
    refreshed_at: float | None = None
    error: str | None = None
    auth_failed: bool = False

    def model_ids(self) -> frozenset[str]:
        """The ids of the models the engine listed (``/v1/models`` cards' ``id``; empty while unknown)."""
        return frozenset(m["id"] for m in self.models if isinstance(m.get("id"), str))


def parse_cache_config(metrics_text: str) -> dict[str, str] | None:
    """Labels of the first ``vllm:cache_config_info`` sample in Prometheus text, or None if absent."""
    for line in metrics_text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            end = line.rfind("}")        # a line cut before its closing brace: its labels as far as they go
            return dict(_LABELS_RE.findall(line[line.index("{"):end if end >= 0 else len(line)]))
    return None


def kv_pool_tokens(labels: dict[str, str]) -> tuple[int | None, int | None, int | None]:
    """``(pool tokens, block_size, num_gpu_blocks)`` from cache_config_info labels.

    Prefers ``kv_cache_size_tokens`` (vLLM ≥ 0.32); else ``num_gpu_blocks × block_size`` (vLLM
    ``config/cache.py::metrics_info``).  Values of ``"None"`` count as unknown.
    """
    def num(key: str) -> int | None:
        v = labels.get(key)
        try:
            return int(float(v)) if v not in (None, "None", "") else None
        except (ValueError, OverflowError):     # not a number; inf (1e400)
            return None

    block_size, blocks, size = num("block_size"), num("num_gpu_blocks"), num("kv_cache_size_tokens")
    if size is None and block_size and blocks:
        size = block_size * blocks
    return size, block_size, blocks


def request_pool(pool_tokens: int | None, block_size: int | None) -> int | None:
    """The KV tokens one request can hold in a pool of ``pool_tokens`` (``num_gpu_blocks × block_size``): the pool
    less one block, which vLLM's block pool keeps as its null block and never allocates
    (``vllm/v1/core/block_pool.py``, ``null_block``; vLLM 0.32's start-up check counts so too: "the estimated
    maximum model length is 1920" for 16 blocks of 128); the whole pool when ``block_size`` is unknown; None when
    the pool is."""
    if pool_tokens is None:
        return None
    return pool_tokens - (block_size or 0)


_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
MAX_WAITING_REASONS = 8
"""The most ``reason`` values of ``vllm:num_requests_waiting_by_reason`` kept per answer (vLLM has two: ``capacity``
and ``deferred``), each at most :data:`MAX_REASON_CHARS`: they become label values of
``pdproxy_engine_num_requests_waiting_by_reason``, so an answer cannot mint series without bound."""
MAX_REASON_CHARS = 64


def parse_gauges(metrics_text: str) -> dict[str, float]:
    """Sum of each engine gauge across its series (DP engines), plus waiting by reason as
    ``vllm:num_requests_waiting_by_reason:<reason>`` (at most :data:`MAX_WAITING_REASONS` reasons, the first
    listed; a longer reason than :data:`MAX_REASON_CHARS` is left out)."""
    out: dict[str, float] = {}
    reasons = 0
    for line in metrics_text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if not rest:
            name, _, value = line.partition(" ")
            labels = ""
        else:
            labels, _, value = rest.rpartition("} ")
        key = name
        if name == "vllm:num_requests_waiting_by_reason":
            m = re.search(r'reason="([^"]*)"', labels)
            key = f"{name}:{m.group(1) if m else ''}"
            if key not in out:
                if reasons >= MAX_WAITING_REASONS or len(key) - len(name) - 1 > MAX_REASON_CHARS:
                    continue
                reasons += 1
        elif name not in _GAUGES:
            continue
        try:
            out[key] = out.get(key, 0.0) + float(value.split()[0])
        except (ValueError, IndexError):
            continue
    return out


LOOP_FAILURE = "GET /health answered 508 Loop Detected: it is a pdproxy (this one or another), not an engine"
"""Why an endpoint that is a pdproxy is never healthy (:func:`pdproxy.http.engine_headers.names_pdproxy`)."""


class EngineClient:
    """httpx client for control-plane calls; one per proxy process (owned by the app lifespan).  Every call carries
    the engine key when one is set (``engine_api_key``; vLLM guards ``/v1/models``)."""

    def __init__(self, *, timeout_s: float, api_key: str | None = None) -> None:
        """``timeout_s``: per call (seconds), the whole call — httpx's own timeout bounds each read, so an engine
        trickling its answer would hold a call (and the health round waiting for it) for ever; ``api_key``: the
        engines' ``--api-key``, sent on every call (:class:`~pdproxy.http.engine_headers.EngineHeaders`)."""
        headers = EngineHeaders(engine_api_key=api_key).control()
        self._timeout_s = timeout_s
        self._health_failures: dict[Endpoint, str] = {}
        self._client = httpx.AsyncClient(timeout=timeout_s, headers=headers,
                                         limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))

    async def _get(self, url: str, headers: Mapping[str, str] | None = None) -> httpx.Response:
        """``GET url``, its body read whole within ``timeout_s`` seconds for the whole call and at most
        :data:`MAX_CONTROL_BODY_BYTES` long.  Raises ``httpx.TimeoutException`` when the deadline passes (also
        mid-body), ``httpx.DecodingError`` for a longer body, any other ``httpx.HTTPError`` as httpx does."""
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._client.stream("GET", url, headers=headers) as r:
                    body = bytearray()
                    async for chunk in r.aiter_bytes():
                        body += chunk
                        if len(body) > MAX_CONTROL_BODY_BYTES:
                            raise httpx.DecodingError(f"answer longer than {MAX_CONTROL_BODY_BYTES} bytes")
                    return httpx.Response(r.status_code, headers=r.headers, content=bytes(body), request=r.request)
        except TimeoutError:
            raise httpx.ReadTimeout(f"no whole answer within {self._timeout_s:g} s") from None

    async def aclose(self) -> None:
        """Close the underlying httpx client and its connections."""
        await self._client.aclose()

    async def health(self, endpoint: Endpoint) -> bool:
        """True if ``GET /health`` answers 200 (vLLM answers 503 when the engine is dead); when not, why is
        :meth:`health_failure`'s until the next call."""
        try:
            with httpx_errors(f"{endpoint.role.value} {endpoint.name}", endpoint.name, " on GET /health"):
                r = await self._get(endpoint.url + "/health", headers=endpoint.extra_headers())
            if r.status_code == 200:
                self._health_failures.pop(endpoint, None)
                return True
            self._health_failures[endpoint] = (LOOP_FAILURE if r.status_code == 508 else
                                               f"GET /health answered HTTP {r.status_code}")
        except ProxyError as exc:
            if len(self._health_failures) > 4096:       # endpoints come and go (admin API): stay bounded
                self._health_failures.clear()
            self._health_failures[endpoint] = exc.message
        return False

    def health_failure(self, endpoint: Endpoint) -> str | None:
        """Why the last :meth:`health` of ``endpoint`` was not 200 (the transport's words or the status); None
        after a 200 or before any call."""
        return self._health_failures.get(endpoint)

    async def get_json(self, endpoint: Endpoint, path: str) -> Any:
        """GET ``path`` and parse JSON.  Raises :class:`~pdproxy.errors.ProxyError` on transport errors
        (:mod:`pdproxy.http.errors`), :class:`~pdproxy.errors.UpstreamHTTPError` on an error status, ``ValueError``
        when the body is not JSON."""
        with httpx_errors(f"{endpoint.role.value} {endpoint.name}", endpoint.name, f" on GET {path}"):
            r = await self._get(endpoint.url + path, headers=endpoint.extra_headers())
            r.raise_for_status()
        return r.json()

    async def models_as_client(self, endpoint: Endpoint, authorization: str | None) -> tuple[int, bytes]:
        """``GET /v1/models`` on ``endpoint`` with the client's ``authorization`` instead of pdproxy's headers (the
        engines refuse pdproxy's own calls and pdproxy passes client credentials through): ``(status, body)`` as
        the engine answered — its list for a key it accepts, its own 401 otherwise.  Raises
        :class:`~pdproxy.errors.ProxyError` on transport errors (:mod:`pdproxy.http.errors`)."""
        headers = dict(endpoint.extra_headers())
        if authorization:
            headers["Authorization"] = authorization
        with httpx_errors(f"{endpoint.role.value} {endpoint.name}", endpoint.name, " on GET /v1/models"):
            r = await self._get(endpoint.url + "/v1/models", headers=headers)
        return r.status_code, r.content

    async def metrics_text(self, endpoint: Endpoint) -> str:
        """The engine's ``GET /metrics`` body (Prometheus text exposition).  No DP-rank header:
        one ``/metrics`` per API server covers every internal-DP rank (``engine`` label).  Raises
        :class:`~pdproxy.errors.ProxyError` on transport errors or error statuses (as :meth:`get_json`)."""
        with httpx_errors(f"{endpoint.role.value} {endpoint.name}", endpoint.name, " on GET /metrics"):
            r = await self._get(endpoint.url + "/metrics")
            r.raise_for_status()
        return r.text

    async def refresh(self, endpoint: Endpoint, info: EngineInfo) -> EngineInfo:
        """Update ``info`` in place from ``/v1/models`` and ``/metrics``; never raises (errors go to
        ``info.error`` and ``info.reachable``)."""
        try:
            models = await self.get_json(endpoint, "/v1/models")
            data = models.get("data")       # vLLM's list; anything else (null, an object, a number) lists none
            info.models = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
            lens = [m["max_model_len"] for m in info.models
                    if isinstance(m.get("max_model_len"), int) and not isinstance(m["max_model_len"], bool)
                    and m["max_model_len"] > 0]             # 0 or less: no limit an engine could serve under
            info.max_model_len = min(lens) if lens else None
            info.reachable = True
            info.error = None
            info.auth_failed = False
        except UpstreamHTTPError as exc:
            status = exc.status_code
            info.reachable = False
            info.auth_failed = status in (401, 403)
            info.error = f"GET /v1/models answered HTTP {status}" + (
                " (the engine requires an API key: engine_api_key)" if info.auth_failed else "")
            return info
        except (ProxyError, ValueError, AttributeError) as exc:
            info.reachable = False
            info.auth_failed = False
            info.error = exc.message if isinstance(exc, ProxyError) else f"/v1/models: {exc.__class__.__name__}: {exc}"
            return info
        try:
            text = await self.metrics_text(endpoint)
            labels = parse_cache_config(text)
            if labels:
                info.kv_pool_tokens, info.block_size, info.num_gpu_blocks = kv_pool_tokens(labels)
            info.gauges = parse_gauges(text)
        except ProxyError as exc:
            info.error = exc.message
        info.refreshed_at = time.monotonic()
        return info
