"""CORS for the generation routes pdproxy's own server answers (``pdproxy/http/server.py``): the headers Starlette's
``CORSMiddleware`` — what vLLM serves with (``vllm/entrypoints/serve/middleware/register.py``), and what wraps
pdproxy's ASGI routes and answers every preflight (``OPTIONS`` with ``Access-Control-Request-Method``) — adds to
every response (:meth:`CorsPolicy.headers`).  Settings: ``allowed_origins`` (empty: off, vLLM's default),
``allow_credentials``, ``allowed_methods``, ``allowed_headers``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdproxy.settings import Settings

ALLOW_ORIGIN = b"access-control-allow-origin"
ALLOW_CREDENTIALS = b"access-control-allow-credentials"
VARY_ORIGIN = (b"vary", b"Origin")


@dataclass(frozen=True, slots=True)
class CorsPolicy:
    """``origins``: the allowed origins (``*``: any); ``credentials``: ``Access-Control-Allow-Credentials``."""

    origins: frozenset[bytes]
    any_origin: bool
    credentials: bool

    @classmethod
    def of(cls, s: Settings) -> CorsPolicy | None:
        """The policy of the settings; None when ``allowed_origins`` is empty (no CORS header is ever added)."""
        if not s.allowed_origins:
            return None
        return cls(frozenset(o.encode("latin-1") for o in s.allowed_origins), "*" in s.allowed_origins,
                   s.allow_credentials)

    def headers(self, origin: bytes | None) -> list[tuple[bytes, bytes]]:
        """The CORS response headers (lower-case names) for a request whose first ``Origin`` value is ``origin``
        (None: no ``Origin``), by the rule of the Starlette pdproxy ships (``starlette/middleware/cors.py``
        ``CORSMiddleware.send``): with an origin, ``*`` when any origin is allowed and ``…-Credentials: true``
        when credentials are; the origin itself (and ``Vary: Origin``) when any origin is allowed with
        credentials, or it is listed; otherwise only ``Vary: Origin`` (also without an origin)."""
        if origin is None:
            return [VARY_ORIGIN]
        out: list[tuple[bytes, bytes]] = []
        if self.any_origin:
            out.append((ALLOW_ORIGIN, b"*"))
        if self.credentials:
            out.append((ALLOW_CREDENTIALS, b"true"))
        if (self.any_origin and self.credentials) or (not self.any_origin and origin in self.origins):
            out = [(n, v) for n, v in out if n != ALLOW_ORIGIN] + [(ALLOW_ORIGIN, origin)]
        out.append(VARY_ORIGIN)
        return out
