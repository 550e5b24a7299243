"""The client API key check (setting ``api_keys``), as vLLM's ``--api-key`` check reads a key
(``vllm/entrypoints/serve/middleware/authenticate.py``): ``Authorization: Bearer <key>``, or ``x-api-key: <key>``
as the Anthropic SDKs send it.

The HTTP server applies it to a generation route's request once its head is read, before any of its body is
(``pdproxy/http/server.py``: a 401 and the connection closed, no ``100 Continue``, nothing counted against
``max_pending_body_bytes``); the application applies it to every other route it guards (``pdproxy/app/
application.py``)."""

from __future__ import annotations

import hmac
from collections.abc import Callable, Sequence


def presented_key(header: Callable[[bytes], str | None]) -> str | None:
    """The key a request presents (``header``: its header by lower-case name): the bearer token of its
    ``Authorization``, else its ``x-api-key``, else None."""
    auth = header(b"authorization")
    return auth[7:] if auth and auth[:7].lower() == "bearer " else header(b"x-api-key")


def key_accepted(keys: Sequence[str], header: Callable[[bytes], str | None]) -> bool:
    """Whether a request (``header``: its header by lower-case name) presents one of ``keys`` (compared in
    constant time); True when ``keys`` is empty (no key required)."""
    if not keys:
        return True
    token = presented_key(header)
    return token is not None and any(hmac.compare_digest(token.encode(), k.encode()) for k in keys)


INVALID_KEY = "invalid or missing API key"
"""The message of the 401 that refuses a request without an accepted key."""
