"""SIGTERM drain with a real ``pdproxy serve`` process (pdproxy/app/shutdown.py).

After SIGTERM: new requests get 503 + ``Retry-After`` (and ``/health`` 503), the streams already in flight run to
their ``data: [DONE]``, and the process exits with status 0 once they are done — well within ``shutdown_grace_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.reliability.harness import CHAT, parse_sse
from tests.support import SimProcess, free_port, wait_until

pytestmark = pytest.mark.timeout(40)

STREAMS = 4
MAX_TOKENS = 60  # at 50 tokens/s: ~1.2 s per stream


@contextlib.contextmanager
def serving(pair: tuple[SimProcess, SimProcess], *args: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``pdproxy serve`` in front of ``pair`` (with ``args``), healthy; killed at the end if still running."""
    prefiller, decoder = pair
    for s in pair:
        s.reset()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "pdproxy", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--prefill", prefiller.url, "--decode", decoder.url, "--log-level", "warning", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            try:
                return httpx.get(url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(healthy, 20, 0.1, "pdproxy serve healthy")
        yield proc, url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stderr:
            proc.stderr.close()


def test_sigterm_refuses_new_work_and_lets_streams_finish(slow_pair: tuple[SimProcess, SimProcess]) -> None:
    prefiller, decoder = slow_pair
    with serving(slow_pair, "--shutdown-grace-s", "20") as (proc, url):
        async def scenario() -> tuple[list[bytes], httpx.Response, int, float]:
            started = [0] * STREAMS
            async with httpx.AsyncClient(timeout=30) as client:
                async def stream(i: int) -> bytes:
                    body = {**CHAT, "max_tokens": MAX_TOKENS}
                    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                        data = b""
                        async for chunk in r.aiter_raw():
                            started[i] = 1
                            data += chunk
                        return data
                tasks = [asyncio.create_task(stream(i)) for i in range(STREAMS)]
                while not all(started):
                    await asyncio.sleep(0.02)
                os.kill(proc.pid, signal.SIGTERM)
                signalled = time.monotonic()
                async with httpx.AsyncClient(timeout=5) as fresh:  # a new connection after SIGTERM
                    refused = None
                    while refused is None or refused.status_code != 503:
                        refused = await fresh.post(url + "/v1/chat/completions", json=CHAT)
                    health = (await fresh.get(url + "/health")).status_code
                return await asyncio.gather(*tasks), refused, health, signalled

        bodies, refused, health, signalled = asyncio.run(scenario())
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["code"] == 503
        assert health == 503
        for body in bodies:
            events, done, errors = parse_sse(body)
            assert done == 1 and not errors
            assert [e["usage"]["completion_tokens"] for e in events if e.get("usage")] == [MAX_TOKENS]
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - signalled < 10
        assert decoder.state()["active_streams"] == 0 and prefiller.state()["pinned_blocks"] == 0


def test_requests_still_running_when_the_grace_ends_get_a_503_or_the_error_event(
        slow_pair: tuple[SimProcess, SimProcess], tmp_path: Path) -> None:
    """``shutdown_grace_s`` (1.5 s here: the log says it as given) ends with two answers still generating (6 s each): the stream gets the typed
    error event and ``[DONE]``; the non-streamed request, of which nothing was sent yet, a 503 with ``Retry-After``
    in the API's shape (it was a bare close); both log lines say so."""
    decoder = slow_pair[1]
    log = tmp_path / "requests.jsonl"
    with serving(slow_pair, "--shutdown-grace-s", "1.5", "--request-log-path", str(log)) as (proc, url):
        async def scenario() -> tuple[httpx.Response, bytes]:
            async with httpx.AsyncClient(timeout=30) as client:
                whole = asyncio.create_task(client.post(url + "/v1/chat/completions",
                                                        json={"model": CHAT["model"], "messages": CHAT["messages"],
                                                              "max_tokens": 300}))
                async with client.stream("POST", url + "/v1/chat/completions",
                                         json={**CHAT, "max_tokens": 300, "stream": True}) as r:
                    chunks = r.aiter_raw()
                    data = await anext(chunks)
                    while decoder.state()["running"] < 2:           # both generating
                        assert not whole.done(), whole.result().text
                        await asyncio.sleep(0.02)
                    os.kill(proc.pid, signal.SIGTERM)
                    async for chunk in chunks:
                        data += chunk
                return await whole, data

        whole, streamed = asyncio.run(scenario())
        assert proc.wait(timeout=15) == 0
        said = proc.stderr.read().decode() if proc.stderr else ""
    # pdproxy cuts them itself at the grace's end: one WARNING, no ERROR from uvicorn cancelling them a second later
    assert "shutdown_grace_s (1.5 s) is over: cutting 2 request(s) still in flight" in said, said
    assert "waiting up to 1.5 s for 2 request(s)" in said and " ERROR " not in said, said
    assert "graceful shutdown exceeded" not in said, said
    assert whole.status_code == 503 and int(whole.headers["retry-after"]) >= 1, whole.text
    assert "shutting down" in whole.json()["error"]["message"]
    events, done, errors = parse_sse(streamed)
    assert events                                            # it had started
    assert done == 1 and errors and "shutting down" in errors[0]["error"]["message"]
    lines = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    assert sorted(line["status"] for line in lines) == [200, 503]
    assert all("shutting down" in line["error"] for line in lines)
    (cut,) = [line for line in lines if line["stream"]]
    assert cut["events"] > 0                                      # what the client got (it read 0 once)
