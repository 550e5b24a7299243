"""The control plane's error boundary (pdproxy/engines/control.py): httpx's exceptions never leave
:class:`EngineClient`; a call that cannot reach the engine raises pdproxy's own error, with the engine's address
kept out of what a client reads."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import orjson
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


async def probe(endpoint: Endpoint) -> tuple[bool, str | None]:
    """One ``/health`` probe of ``endpoint``: (healthy, the failure the log would name)."""
    client = EngineClient(timeout_s=5)
    try:
        return await client.health(endpoint), client.health_failure(endpoint)
    finally:
        await client.aclose()


def test_a_failed_health_probe_says_why() -> None:
    """The log's "engine … unreachable: <why>" names the transport's failure (it said "/health did not answer
    200" for a refused connection too); a 200 forgets it."""
    with socket.socket() as held:                 # bound, never listening: a connection to it is refused
        held.bind(("127.0.0.1", 0))
        endpoint = Endpoint(f"http://127.0.0.1:{held.getsockname()[1]}", Role.DECODE)

        healthy, why = asyncio.run(probe(endpoint))
    assert not healthy and why is not None and "refused the connection" in why, why


def test_a_host_name_that_does_not_resolve_is_not_called_a_refused_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A typo in an engine's host name (``--prefill http://prefil1:8000``) is said as such in the log and in
    ``pdproxy doctor``, not as "refused the connection" (which reads as: the host is up, nothing listens)."""
    endpoint = Endpoint("http://pdproxy-no-such-host.invalid:9100", Role.PREFILL)   # RFC 6761: never resolves
    real = socket.getaddrinfo

    def getaddrinfo(host: object, *args: Any, **kwargs: Any) -> Any:   # the resolver's answer without asking one
        if host == "pdproxy-no-such-host.invalid":                     # (a machine without DNS would time out)
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    healthy, why = asyncio.run(probe(endpoint))
    assert not healthy and why is not None and "does not resolve" in why and "refused" not in why, why


async def _misbehaving_engine(mode: str) -> tuple[asyncio.AbstractServer, Endpoint]:
    """An engine on loopback whose every answer is 200 with a chunked body that either trickles (one byte every
    0.1 s, never ending) or floods (1 MiB chunks, never ending)."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"1\r\nx\r\n" if mode == "trickle" else b"100000\r\n" + b"x" * (1 << 20) + b"\r\n"
        try:
            while True:
                writer.write(piece)
                await writer.drain()
                if mode == "trickle":
                    await asyncio.sleep(0.1)
        except (ConnectionError, asyncio.CancelledError):
            writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, Endpoint(f"http://127.0.0.1:{port}", Role.DECODE)


@pytest.mark.parametrize("mode", ["trickle", "flood"])
def test_an_engine_that_never_ends_its_answer_fails_the_call_in_time(mode: str) -> None:
    """httpx's timeout bounds each read, so an engine trickling ``/health`` held the probe — and the health round
    gathering every engine's probe, start-up and SIGTERM with it — for as long as it trickled (an attacker round
    saw 357 s); a flood of ``/metrics`` grew pdproxy by GBs.  Now each call ends within ``timeout_s`` and
    :data:`MAX_CONTROL_BODY_BYTES`: the probe says down, the refresh records why."""
    from pdproxy.engines.control import EngineInfo

    async def call() -> tuple[bool, EngineInfo, float]:
        server, endpoint = await _misbehaving_engine(mode)
        client = EngineClient(timeout_s=1.0)
        try:
            loop = asyncio.get_running_loop()
            began = loop.time()
            healthy = await client.health(endpoint)
            info = await client.refresh(endpoint, EngineInfo())
            return healthy, info, loop.time() - began
        finally:
            await client.aclose()
            server.close()

    healthy, info, took = asyncio.run(call())
    assert not healthy and not info.reachable and info.error
    assert took < 5.0                                      # two calls of at most 1 s each, with slack for load
    assert ("did not answer in time" in info.error) if mode == "trickle" else ("failed" in info.error), info.error


@pytest.mark.parametrize("data", [None, 5, {"id": "m"}, "sim-model", [{"id": "m", "max_model_len": True}],
                                  [{"id": "m", "max_model_len": 0}], [{"id": "m", "max_model_len": -5}]])
def test_a_model_list_of_the_wrong_shape_lists_no_model_and_never_raises(data: Any) -> None:
    """``refresh`` never raises: a ``/v1/models`` answer whose ``data`` is no list (an engine, or another server on
    its port, answering ``{"data": null}``) raised ``TypeError`` from the list comprehension — out of
    ``HealthMonitor.start`` (pdproxy's start-up failed with a traceback) and, later, out of every probe of that
    engine, whose health verdict then never changed; ``max_model_len: true`` was read as a limit of 1."""
    from pdproxy.engines.control import EngineInfo
    from tests.support import free_port

    body = orjson.dumps({"object": "list", "data": data})

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                     b"connection: close\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    async def call() -> EngineInfo:
        server = await asyncio.start_server(answer, "127.0.0.1", free_port())
        port = server.sockets[0].getsockname()[1]
        client = EngineClient(timeout_s=2.0)
        try:
            return await client.refresh(Endpoint(f"http://127.0.0.1:{port}", Role.DECODE), EngineInfo())
        finally:
            await client.aclose()
            server.close()

    info = asyncio.run(call())
    assert info.max_model_len is None
    assert info.models == ([] if not isinstance(data, list) else data)


@pytest.mark.parametrize("line", ['vllm:cache_config_info{block_size="1e400",num_gpu_blocks="10"} 1.0',
                                  'vllm:cache_config_info{block_size="16",num_gpu_blocks="10" 1.0'])
def test_a_cache_config_line_of_the_wrong_shape_is_read_as_far_as_it_goes_and_never_raises(line: str) -> None:
    """``/metrics`` is read by ``refresh``, which never raises: a ``cache_config_info`` label of ``1e400`` raised
    ``OverflowError`` (``int(inf)``) and a line without its closing brace ``ValueError`` (``rindex``) — out of
    start-up (pdproxy failed to start with a traceback) and out of every later probe of that engine."""
    from pdproxy.engines.control import kv_pool_tokens, parse_cache_config

    labels = parse_cache_config(f"# HELP x\n{line}\n")
    assert labels is not None and labels["num_gpu_blocks"] == "10"
    size, block_size, blocks = kv_pool_tokens(labels)
    assert blocks == 10 and (size, block_size) in ((None, None), (160, 16))


def test_waiting_reasons_are_a_bounded_set() -> None:
    # vLLM's reasons are "capacity" and "deferred"; a /metrics answer (a non-engine host, a misbehaving engine)
    # naming 10,000 more made 10,000 pdproxy_engine_num_requests_waiting_by_reason series per endpoint
    from pdproxy.engines.control import parse_gauges
    lines = ['vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 2.0',
             'vllm:num_requests_waiting_by_reason{engine="0",reason="deferred"} 1.0',
             *(f'vllm:num_requests_waiting_by_reason{{engine="0",reason="r{i}"}} 1.0' for i in range(10_000)),
             'vllm:num_requests_waiting_by_reason{engine="0",reason="' + "x" * 100_000 + '"} 1.0',
             'vllm:num_requests_waiting_by_reason{engine="1",reason="capacity"} 3.0',
             'vllm:num_requests_running{engine="0"} 4.0']
    gauges = parse_gauges("\n".join(lines))
    reasons = [k for k in gauges if k.startswith("vllm:num_requests_waiting_by_reason:")]
    assert len(reasons) <= 8 and all(len(k) < 200 for k in reasons)
    assert gauges["vllm:num_requests_waiting_by_reason:capacity"] == 5.0
    assert gauges["vllm:num_requests_waiting_by_reason:deferred"] == 1.0
    assert gauges["vllm:num_requests_running"] == 4.0
