"""The one error boundary of every engine client: the transports' exceptions become pdproxy's errors here.

Two transports talk to the engines: pdproxy's own HTTP/1.1 client (:mod:`pdproxy.http.client`, the prefill and
decode legs, the KV release leg) and httpx (the control plane, :mod:`pdproxy.engines.control`, and the passthrough
routes, :mod:`pdproxy.app.passthrough`).  Each one's exception tree is converted here, once, into the most
specific :class:`~pdproxy.errors.ProxyError` (the way httpx's ``map_httpcore_exceptions`` converts httpcore's), so
everything above ``http/`` catches only pdproxy's errors and :func:`pdproxy.errors.classify` judges them all alike:

===========================================  ================================  ==========================
pdproxy's HTTP/1.1 client                    httpx                             pdproxy error
===========================================  ================================  ==========================
``ConnectError``                             ``ConnectError``, ``ConnectTimeout``  ``UpstreamRefused``
``PoolTimeout``                              ``PoolTimeout``                   ``UpstreamTimeout``
``ReadTimeout``, ``TimeoutError``            other ``TimeoutException``        ``UpstreamTimeout``
``Disconnected``, ``ProtocolError``          any other ``HTTPError``           ``UpstreamUnavailable``
(an error status is read by the caller)      ``HTTPStatusError``               ``UpstreamHTTPError``
===========================================  ================================  ==========================

``who`` names the engine in the message (``"decoder http://…"``), ``endpoint`` is its name, ``when`` a phrase
placed after the verb (``" mid-stream"``).  The message keeps the transport's own words for the log; the client
reads the error's ``public`` sentence, fixed per failure kind and naming only the engine's role
(:class:`pdproxy.errors.ProxyError`):

=====================================  ============================================================
failure                                what the client reads (``when`` = ``" mid-stream"``)
=====================================  ============================================================
refused                                the decoder refused the connection mid-stream (a connect that timed
                                       out: did not accept the connection in time; a host name that does
                                       not resolve: could not be reached: its host name does not resolve)
no pooled connection in time           no connection to the decoder was free in time mid-stream
timed out                              the decoder timed out mid-stream (: its ``public`` sentence, e.g. a
                                       stream's stall: no token for 20.0 s …)
malformed HTTP (``ProtocolError``)     the decoder sent a malformed answer mid-stream (: its ``public`` sentence,
                                       e.g. an SSE event past its size limit)
broken (``Disconnected``, httpx's)     the connection to the decoder broke mid-stream
=====================================  ============================================================
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from pdproxy.endpoints import Role
from pdproxy.errors import ProxyError, UpstreamHTTPError, UpstreamRefused, UpstreamTimeout, UpstreamUnavailable
from pdproxy.http.client import ConnectError, PoolTimeout, ProtocolError, ReadTimeout, TransportError

_MAX_ERROR_BODY_BYTES = 1 << 20


def _not_connected(exc: BaseException) -> str:
    """What a failed connect is called in a message: "refused the connection" only when one was refused (what an
    operator reads as "nothing listens there"); a name that does not resolve (a typo in a host name) or a connect
    that timed out says so.  The causes are in the chain (``from None`` keeps ``__context__``)."""
    seen: BaseException | None = exc
    for _ in range(6):
        if seen is None:
            break
        if isinstance(seen, socket.gaierror):
            return "could not be reached: its host name does not resolve"
        if isinstance(seen, ConnectionRefusedError):
            return "refused the connection"
        if isinstance(seen, TimeoutError | httpx.ConnectTimeout):
            return "did not accept the connection in time"
        seen = seen.__cause__ or seen.__context__
    return "could not be connected to"


def role_noun(who: str) -> str:
    """The engine's role as the client may read it: ``who``'s first word (``"decode http://…"`` → ``"decoder"``,
    :attr:`pdproxy.endpoints.Role.noun`; a word that is no role, e.g. ``"decoder"`` or ``"engine"``, as it is;
    ``"engine"`` for an empty ``who``)."""
    word = who.split(" ", 1)[0] or "engine"
    try:
        return Role(word).noun
    except ValueError:
        return word


def transport_error(exc: TransportError | TimeoutError, who: str, endpoint: str, when: str = "") -> ProxyError:
    """The pdproxy error for a failure of pdproxy's HTTP/1.1 client (see the module docstring's tables)."""
    role = role_noun(who)
    if isinstance(exc, ConnectError):
        verb = _not_connected(exc)
        return UpstreamRefused(f"{who} {verb}{when}: {exc}", endpoint=endpoint, public=f"the {role} {verb}{when}")
    if isinstance(exc, PoolTimeout):
        return UpstreamTimeout(f"{who}: {exc}", endpoint=endpoint,
                               public=f"no connection to the {role} was free in time{when}")
    if isinstance(exc, ReadTimeout | TimeoutError):
        own = exc.public if isinstance(exc, TransportError) else None
        return UpstreamTimeout(f"{who} timed out{when}: {exc}", endpoint=endpoint,
                               public=f"the {role} timed out{when}" + (f": {own}" if own else ""))
    public = (f"the {role} sent a malformed answer{when}" if isinstance(exc, ProtocolError) else
              f"the connection to the {role} broke{when}")
    if isinstance(exc, TransportError) and exc.public:
        public += f": {exc.public}"
    return UpstreamUnavailable(f"{who} failed{when}: {exc.__class__.__name__}: {exc}", endpoint=endpoint,
                               public=public, answered=isinstance(exc, ProtocolError))


def httpx_error(exc: httpx.HTTPError, who: str, endpoint: str, when: str = "") -> ProxyError:
    """The pdproxy error for a failure of an httpx call (see the module docstring's table); an
    ``HTTPStatusError`` keeps the engine's status, body (already read) and ``Retry-After``."""
    if isinstance(exc, httpx.HTTPStatusError):
        resp = exc.response
        try:
            body = resp.content[:_MAX_ERROR_BODY_BYTES]
        except httpx.ResponseNotRead:
            body = b""
        return UpstreamHTTPError(resp.status_code, body, endpoint=endpoint,
                                 content_type=resp.headers.get("content-type", "application/json"),
                                 retry_after=resp.headers.get("retry-after"))
    role = role_noun(who)
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        verb = _not_connected(exc)
        return UpstreamRefused(f"{who} {verb}{when}: {exc.__class__.__name__}: {exc}", endpoint=endpoint,
                               public=f"the {role} {verb}{when}")
    if isinstance(exc, httpx.PoolTimeout):
        return UpstreamTimeout(f"{who}: no free connection{when}", endpoint=endpoint,
                               public=f"no connection to the {role} was free in time{when}")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"{who} did not answer in time{when}", endpoint=endpoint,
                               public=f"the {role} timed out{when}")
    public = (f"the {role} sent a malformed answer{when}" if isinstance(exc, httpx.RemoteProtocolError) else
              f"the connection to the {role} broke{when}")
    return UpstreamUnavailable(f"{who} failed{when}: {exc.__class__.__name__}: {exc}", endpoint=endpoint,
                               public=public)


@contextmanager
def httpx_errors(who: str, endpoint: str, when: str = "") -> Iterator[None]:
    """Raise :func:`httpx_error` of any ``httpx.HTTPError`` raised inside the block (the original is dropped
    from the chain: its text is in the message)."""
    try:
        yield
    except httpx.HTTPError as exc:
        raise httpx_error(exc, who, endpoint, when) from None
