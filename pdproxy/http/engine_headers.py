"""The headers of every request pdproxy sends an engine, and the one rule for the ``Authorization`` they carry.

Rule (settings ``engine_api_key`` and ``api_keys``):

- ``engine_api_key`` set: every call carries ``Authorization: Bearer <engine_api_key>`` — the prefill and decode
  legs, KV release legs, ``/tokenize``, and the control plane (``/v1/models``, ``/metrics``, ``/health``, doctor's
  probes) — and a client's own ``Authorization`` never reaches an engine;
- unset, with ``api_keys`` (pdproxy checks client keys itself): no ``Authorization`` at all, client keys are never
  forwarded;
- unset, without ``api_keys``: the client's ``Authorization`` passes through on the request's legs (an engine
  started with ``--api-key`` then answers a wrong key with its own 401); control-plane calls carry none.  A client
  that sends its key as ``x-api-key`` (the Anthropic SDKs do) and no ``Authorization`` has it passed through as
  ``Authorization: Bearer <key>`` (:func:`client_authorization`): vLLM's ``--api-key`` check reads only the bearer
  token.

vLLM 0.32's ``--api-key`` guards the paths under ``/v1``, ``/v2``, ``/inference`` and ``/cohere``
(``vllm/entrypoints/serve/middleware/authenticate.py``, ``GUARDED_PREFIX``): ``/v1/models`` and the completion
routes need the key, ``/health``, ``/metrics`` and ``/tokenize`` do not.  pdproxy sends it on every call anyway,
which also suits gateways in front of engines that guard every path.

Trace context (setting ``otlp_traces_endpoint``, :mod:`pdproxy.ops.tracing`): with tracing on, a request's legs also
carry the current span as W3C ``traceparent`` / ``tracestate``, so that an engine started with
``--otlp-traces-endpoint`` records its spans in the request's trace.  With tracing off, the client's own
``traceparent`` / ``tracestate`` pass through unchanged (as Envoy and vllm-router forward them), so the engine's spans
join the client's trace instead of starting orphan ones.  Control-plane calls carry none.

Control-plane calls also carry ``Via: 1.1 pdproxy`` (RFC 9110 §7.6.3): a pdproxy that receives it on ``GET /health``
answers 508 Loop Detected (:func:`names_pdproxy`), so a pdproxy given as an engine — itself or another, by a typo in
the configuration or through the admin API — is never judged healthy (its legs would run a second PD pass that
answers no KV handle, or loop back into itself).

A client's header value reaches an engine only as visible ASCII (:func:`forwardable`): trace context only within
W3C's sizes, a ``traceparent`` only in W3C's form, any other value with a byte outside 0x20–0x7E (a tab aside), or
with a space or tab at its end, is dropped — HTTP clients refuse to send such a value (httpx raises
``UnicodeEncodeError`` or h11's ``LocalProtocolError``), and an engine has no use for it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from pdproxy.endpoints import Endpoint

if TYPE_CHECKING:
    from pdproxy.settings import Settings


TRACE_HEADERS: tuple[bytes, ...] = (b"traceparent", b"tracestate")
"""The W3C trace-context headers (lower-case), passed through from the client when pdproxy's tracing is off."""
_VISIBLE_ASCII = re.compile(r"(?:[\x21-\x7e](?:[ \t]*[\x21-\x7e])*)?")
"""An HTTP field value HTTP clients send (h11's rule): visible ASCII, spaces and tabs only between visible bytes."""
_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[\x21-\x7e]*)?")
"""W3C Trace Context's ``traceparent``: version, trace id, parent id, flags (a later version may add fields)."""


TRACEPARENT_MAX_CHARS = 256
"""The longest ``traceparent`` passed on: version 00's is 55 characters; a later version may add fields."""
TRACESTATE_MAX_CHARS = 512
"""The longest ``tracestate`` passed on: what W3C Trace Context asks a vendor to propagate at least (a longer one
may be cut by whole entries; pdproxy drops it)."""
TRACESTATE_MAX_MEMBERS = 32
"""W3C Trace Context's most ``tracestate`` list-members."""


def forwardable(name: bytes, value: str) -> bool:
    """True when a client's header ``name`` (lower-case) with ``value`` (its bytes as latin-1 text) may be sent to
    an engine: visible ASCII, spaces and tabs only between visible bytes, a ``traceparent`` in W3C's form (module
    docstring) of at most :data:`TRACEPARENT_MAX_CHARS`, a ``tracestate`` within W3C's bounds (at most
    :data:`TRACESTATE_MAX_CHARS` characters and :data:`TRACESTATE_MAX_MEMBERS` members): a client's kilobytes of
    trace context once made the engine refuse the request (its header limit, 8,190 bytes in vLLM's server)."""
    if name == b"traceparent":
        return len(value) <= TRACEPARENT_MAX_CHARS and _TRACEPARENT.fullmatch(value) is not None
    if name == b"tracestate" and (len(value) > TRACESTATE_MAX_CHARS or value.count(",") >= TRACESTATE_MAX_MEMBERS):
        return False
    return _VISIBLE_ASCII.fullmatch(value) is not None


def client_authorization(authorization: str | None, x_api_key: str | None) -> str | None:
    """The client's credential as an ``Authorization`` value: its own ``Authorization`` when it sent one, else its
    ``x-api-key`` (the Anthropic clients' header) as ``Bearer <key>``, else None."""
    if authorization:
        return authorization
    return f"Bearer {x_api_key}" if x_api_key else None


VIA = "1.1 pdproxy"
"""The ``Via`` value of pdproxy's control-plane calls to engines (module docstring)."""


def names_pdproxy(via: str | None) -> bool:
    """Whether a request's ``Via`` header value (comma-separated ``protocol name`` entries) names a pdproxy: the
    call came from a pdproxy's control plane, so whoever answers it is being taken for an engine."""
    if not via or "pdproxy" not in via:
        return False
    return any(part.split()[1:2] == ["pdproxy"] for part in via.split(","))


class EngineHeaders:
    """Builds engine-call headers (see the module docstring).  ``engine_api_key``: the engines' ``--api-key``;
    ``forward_client_authorization``: pass a client's ``Authorization`` through when no engine key is set (False
    when pdproxy enforces its own ``api_keys``); ``propagate``: adds the current trace context to a leg's headers
    (:attr:`pdproxy.ops.tracing.Tracing.propagate`; None = tracing off)."""

    __slots__ = ("_control", "_key", "_propagate", "forward_client_authorization")

    def __init__(self, *, engine_api_key: str | None = None, forward_client_authorization: bool = True,
                 propagate: Callable[[dict[str, str]], None] | None = None) -> None:
        self._key = f"Bearer {engine_api_key}" if engine_api_key else None
        self.forward_client_authorization = forward_client_authorization
        self._control = {"Authorization": self._key} if self._key else {}
        self._control["Via"] = VIA
        self._propagate = propagate

    @classmethod
    def from_settings(cls, settings: Settings, propagate: Callable[[dict[str, str]], None] | None = None
                      ) -> EngineHeaders:
        """The rule for ``settings.engine_api_key`` / ``settings.api_keys``; ``propagate`` as in the class."""
        return cls(engine_api_key=settings.engine_api_key, forward_client_authorization=not settings.api_keys,
                   propagate=propagate)

    def authorization(self, client_authorization: str | None) -> str | None:
        """The ``Authorization`` value for a leg of a request whose client sent ``client_authorization``."""
        if self._key is not None:
            return self._key
        if client_authorization is None or not self.forward_client_authorization:
            return None
        return client_authorization if forwardable(b"authorization", client_authorization) else None

    def control(self) -> dict[str, str]:
        """Headers of a control-plane call (``/v1/models``, ``/metrics``, ``/health``): the engine key, if set, and
        :data:`VIA`."""
        return dict(self._control)

    def leg(self, endpoint: Endpoint, request_id: str, client_authorization: str | None = None,
            client_headers: Sequence[tuple[bytes, bytes]] = ()) -> dict[str, str]:
        """Headers of a JSON POST to ``endpoint`` for request ``request_id``: ``Content-Type``, ``X-Request-Id``
        (one id across a request's legs, so engine logs line up), ``Authorization`` per the rule, the DP-rank
        pin (``X-data-parallel-rank``) of an internal-DP endpoint, and the trace context: with tracing on
        ``traceparent`` (and ``tracestate``) of the current span, with tracing off the client's own, read from
        ``client_headers`` (the client's request headers as lower-case name / value byte pairs)."""
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        auth = self.authorization(client_authorization)
        if auth:
            headers["Authorization"] = auth
        headers.update(endpoint.extra_headers())
        if self._propagate is not None:
            self._propagate(headers)
        elif client_headers:
            for name, value in client_headers:
                if name in TRACE_HEADERS and forwardable(name, text := value.decode("latin-1")):
                    headers[name.decode()] = text
        return headers
