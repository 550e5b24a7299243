"""A decoder's in-band error event mid-stream (vLLM's ``data: {"error": ...}``; ``event: error`` on Responses and
Messages) reaches the client as sent, and without ``--stream-continuation`` the request is counted and logged as
the failure it is — ``upstream_error`` with the reason — not as a success (pdproxy/pd/relay.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from pdproxy.pd.relay import carries_error_event
from tests.conftest import Fleet
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(60)

MESSAGES = [{"role": "user", "content": "tell me a story"}]
BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "sim-model", "messages": MESSAGES, "max_tokens": 12, "stream": True},
    "/v1/completions": {"model": "sim-model", "prompt": "tell me a story", "max_tokens": 12, "stream": True},
}


def test_an_error_event_mid_stream_is_logged_as_the_failure_it_is(sims: Fleet, tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                        request_log_path=str(log)).start()
    try:
        bodies = []
        for path, body in BODIES.items():
            for d in sims.decoders:
                d.reset()
                d.faults({"kind": "error_after_events", "events": 3, "times": 1})
            r = httpx.post(proxy.url + path, json=body, timeout=20)
            assert r.status_code == 200
            bodies.append(r.text)
        for d in sims.decoders:
            d.reset()                                                       # no fault left: a clean stream
        r = httpx.post(proxy.url + "/v1/chat/completions", json=BODIES["/v1/chat/completions"], timeout=20)
        assert r.status_code == 200 and '"error"' not in r.text
        for d in sims.decoders:                                             # an error as the first event: a status
            d.faults({"kind": "error_after_events", "events": 0, "times": 3})
        r = httpx.post(proxy.url + "/v1/chat/completions", json=BODIES["/v1/chat/completions"], timeout=20)
        assert r.status_code == 500 and r.json()["error"]["code"] == 500
        proxy.wait_idle()
    finally:
        proxy.stop()
    assert all("error" in text for text in bodies)                          # the client has the engine's words
    lines = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    assert [line["outcome"] for line in lines] == ["upstream_error"] * 2 + ["ok", "upstream_error"], lines
    assert all("error event mid-stream" in line["error"] for line in lines[:2])
    assert lines[2]["error"] is None
    first = lines[3]                                                        # the decoder named, as in every line
    assert first["error"] == f"decoder {first['decoder']} answered an error event (500) as its first event"


@pytest.mark.parametrize(("blocks", "error"), [
    (b'data: {"choices": []}\n\ndata: {"error": {"code": 500}}\n\ndata: [DONE]\n\n', True),
    (b'data: {"error": {"code": 500}}\n\n', True),
    (b'event: content_block_delta\ndata: {}\n\nevent: error\ndata: {"type": "error"}\n\n', True),
    (b'data: {"choices": [{"delta": {"content": "data: {\\"error\\" event: error\\n"}}]}\n\n', False),
    (b'data: {"choices": []}\n\ndata: [DONE]\n\n', False),
])
def test_an_error_event_is_found_at_a_line_start_only(blocks: bytes, error: bool) -> None:
    assert carries_error_event(blocks) is error
