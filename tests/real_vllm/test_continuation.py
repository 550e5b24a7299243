"""Stream continuation on real vLLM (docs/stream-continuation.md): the process in a stream's decoder path is
SIGKILLed mid-stream and the client's stream completes through another decoder endpoint, with the text of an
uninterrupted greedy run.

The stage runs one real decoder (a second one does not fit the 2-core machine), so pdproxy is given two decoder
endpoints on that engine: a forwarding process (a TCP relay, its own process) and the engine itself.  The first
leg is routed through the relay (the direct endpoint is drained until the stream started); SIGKILL of the relay
resets the decoder connection exactly as the death of a decoder process does (vLLM aborts the request on its
side).  The continuation — real ``return_token_ids``, a real token-id ``prompt`` on ``/v1/completions``, a real
NIXL handoff from the prefiller — then runs on the direct endpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from pdproxy.endpoints import Role
from tests.real_vllm.ports import engine_ports
from tests.real_vllm.support import Engines, Prompts
from tests.support import ProxyThread, wait_until

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(240)]
MAX_TOKENS = 40
RELAY = r"""
import asyncio, sys

async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()

async def handle(reader, writer):
    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", int(sys.argv[2]))
    await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    async with server:
        await server.serve_forever()

asyncio.run(main())
"""


def _body(api: str, engines: Engines, prompt: str) -> dict[str, Any]:
    base: dict[str, Any] = {"model": engines.served_model, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if api == "chat":
        return {**base, "messages": [{"role": "user", "content": prompt}]}
    return {**base, "prompt": prompt}


def _stream(url: str, path: str, body: dict[str, Any], on_event: Callable[[int], None] | None = None
            ) -> tuple[str, list[dict[str, Any]], bytes]:
    """(text, parsed events, raw body) of one stream; ``on_event(k)`` after the k-th token event: a choice that
    carries a token and is not the last one.  Counted by events, not by non-empty text: the tiny model's random
    weights (made anew by each setup) can answer tokens whose text is empty (part of a UTF-8 sequence)."""
    raw = b""
    events: list[dict[str, Any]] = []
    content = 0
    with httpx.stream("POST", url + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            raw += line.encode() + b"\n"
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = orjson.loads(line[6:])
            events.append(obj)
            for choice in obj.get("choices") or []:
                delta = choice.get("delta") or {}
                if "role" not in delta and choice.get("finish_reason") is None:
                    content += 1
                    if on_event is not None:
                        on_event(content)
    text = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                   for e in events for c in e.get("choices") or [])
    return text, events, raw


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_sigkill_in_the_decoder_path_mid_stream_continues(engines: Engines, prompts: Prompts, api: str) -> None:
    (port,) = engine_ports(1)
    relay = subprocess.Popen([sys.executable, "-c", RELAY, str(port), engines.decode_url.rsplit(":", 1)[1]],
                             start_new_session=True)
    try:
        relay_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: _healthy(relay_url), 20, 0.05, "the relay forwarding /health")
        proxy = ProxyThread(prefill=[engines.prefill_url], decode=[relay_url, engines.decode_url],
                            stream_continuation=True, expose_routing_headers=True).start()
        try:
            wait_until(lambda: len(proxy.state.infos) == 3 and all(
                i.max_model_len for i in proxy.state.infos.values()), 30, 0.05, "engine limits read")
            path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
            body = _body(api, engines, prompts.unique(24, seed=700 + len(api)))
            reference, _, _ = _stream(proxy.url, path, body)
            assert reference

            direct = next(e for e in proxy.state.pool.endpoints(Role.DECODE) if e.url == engines.decode_url)
            proxy.state.pool.load(direct).draining = True      # the first leg goes through the relay

            killed_at: list[int] = []

            def kill(k: int) -> None:
                if k == 4 and not killed_at:
                    killed_at.append(k)
                    proxy.state.pool.load(direct).draining = False
                    os.killpg(relay.pid, signal.SIGKILL)

            text, events, raw = _stream(proxy.url, path, body, kill)
            assert killed_at == [4], "the stream ended before its 4th token: the relay was not killed mid-stream"
            assert relay.wait(timeout=10) == -signal.SIGKILL
            assert b'"error"' not in raw, raw[-400:]
            assert raw.rstrip().endswith(b"data: [DONE]")
            assert text == reference, (text, reference)
            usage = [e["usage"] for e in events if e.get("usage")]
            assert len(usage) == 1 and usage[0]["completion_tokens"] == MAX_TOKENS
            assert len({e["id"] for e in events}) == 1
            roles = sum(1 for e in events for c in e.get("choices") or [] if "role" in (c.get("delta") or {}))
            assert roles == (1 if api == "chat" else 0)
            proxy.wait_idle(20)
        finally:
            proxy.stop()
    finally:
        if relay.poll() is None:
            os.killpg(relay.pid, signal.SIGKILL)
        relay.wait(timeout=10)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        time.sleep(0.05)
        return False
