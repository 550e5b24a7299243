"""CORS for the generation routes pdproxy's own server answers (``pdproxy/http/server.py``): the headers Starlette's
``CORSMiddleware`` — what vLLM serves with (``vllm/entrypoints/serve/middleware/register.py``), and what wraps
pdproxy's ASGI routes and answers every preflight (``OPTIONS`` with ``Access-Control-Request-Method``) — adds to
a response to a request that carries an ``Origin``.  Settings: ``allowed_origins`` (empty: off, vLLM's default),
``allow_credentials``, ``allowed_methods``, ``allowed_headers``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdproxy.settings import Settings

ALLOW_ORIGIN = b"access-control-allow-origin"
ALLOW_CREDENTIALS = b"access-control-allow-credentials"


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

    def headers(self, origin: bytes, has_cookie: bool) -> list[tuple[bytes, bytes]]:
        """The CORS response headers (lower-case names) for a request from ``origin`` (its ``Origin`` value)
        carrying a ``Cookie`` or not: Starlette's simple-response rule — ``*`` when any origin is allowed, the
        origin itself (with ``Vary: Origin``) when it is listed or a cookie came with it; nothing for an origin
        not allowed (the browser then withholds the answer from the page)."""
        out: list[tuple[bytes, bytes]] = []
        explicit = (self.any_origin and has_cookie) or (not self.any_origin and origin in self.origins)
        if explicit:
            out += ((ALLOW_ORIGIN, origin), (b"vary", b"Origin"))
        elif self.any_origin:
            out.append((ALLOW_ORIGIN, b"*"))
        if self.credentials and out:
            out.append((ALLOW_CREDENTIALS, b"true"))
        return out
