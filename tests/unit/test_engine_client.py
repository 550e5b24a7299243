"""The control plane's error boundary (pdproxy/engines/control.py): httpx's exceptions never leave
:class:`EngineClient`; a call that cannot reach the engine raises pdproxy's own error, with the engine's address
kept out of what a client reads."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineClient
from pdproxy.errors import ProxyError, UpstreamRefused

pytestmark = pytest.mark.timeout(30)


def test_models_as_client_raises_pdproxys_error_when_the_engine_refuses() -> None:
    """``GET /v1/models`` with the client's key (the route answering when the engines refuse pdproxy's own
    calls) on an engine that refuses the connection: :class:`UpstreamRefused`, not ``httpx.ConnectError``."""
    with socket.socket() as held:                 # bound, never listening: a connection to it is refused
        held.bind(("127.0.0.1", 0))
        endpoint = Endpoint(f"http://127.0.0.1:{held.getsockname()[1]}", Role.PREFILL)

        async def call() -> None:
            client = EngineClient(timeout_s=5)
            try:
                await client.models_as_client(endpoint, "Bearer sk-client")
            finally:
                await client.aclose()

        with pytest.raises(ProxyError) as caught:
            asyncio.run(call())
    assert isinstance(caught.value, UpstreamRefused) and not isinstance(caught.value, httpx.HTTPError)
    assert caught.value.status_code == 502 and "127.0.0.1" not in caught.value.body()["error"]["message"]
