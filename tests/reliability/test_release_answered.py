"""A KV release leg that the decoder answers — with anything, even a malformed answer — is over: only a leg that
never reached the decoder is tried again (pdproxy/pd/kv_release.py).

Found by an attacker: a decoder answering the release leg with a 204, a status line that is no HTTP or a 101 was
taken for one the leg never reached, so the leg was tried again for ``kv_release_retry_s`` (60 s) while the
prefiller's pool lease stayed held: ``pool.totals()`` showed the prefiller loaded for up to a minute."""

from __future__ import annotations

import time

import httpx
import orjson
import pytest

from tests.stand_in import MODEL, PREFILL_ANSWER, StandInEngine, StandInHandler
from tests.support import ProxyThread, wait_until

pytestmark = pytest.mark.timeout(60)

MALFORMED = {
    "204": b"HTTP/1.1 204 No Content\r\n\r\n",
    "garbage status line": b"FOO BAR\r\n\r\n",
    "101": b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
    "101 upgrade": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
}


class Prefiller(StandInEngine):
    def post(self, handler: StandInHandler, body: bytes) -> None:
        handler.answer(200, PREFILL_ANSWER)


class Decoder(StandInEngine):
    """Never answers a decode leg (held until the engine stops: the leg times out, no verdict, its KV released);
    answers a release leg (``max_tokens: 1``) with ``raw`` bytes, then closes."""

    def __init__(self, raw: bytes) -> None:
        super().__init__(MODEL)
        self.raw = raw
        self.releases = 0

    def post(self, handler: StandInHandler, body: bytes) -> None:
        if orjson.loads(body).get("max_tokens") != 1:
            self.release.wait(30)
            return
        self.releases += 1
        handler.wfile.write(self.raw)
        handler.wfile.flush()
        handler.close_connection = True


@pytest.mark.parametrize("answer", list(MALFORMED))
def test_a_release_leg_answered_malformed_ends_at_once_and_frees_the_prefillers_lease(answer: str) -> None:
    with Prefiller(MODEL).running() as prefiller, Decoder(MALFORMED[answer]).running() as decoder:
        proxy = ProxyThread(prefill=[prefiller.url], decode=[decoder.url], token_count="estimate",
                            request_log=False, retry_backoff_s=0.0, decode_attempts=1,
                            decode_nonstream_timeout_s=0.5, kv_release_retry_s=30).start()
        try:
            resp = httpx.post(proxy.url + "/v1/chat/completions", timeout=30, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert resp.status_code in (503, 504), resp.text
            releaser = proxy.app.director.kv_release if proxy.app.director else None
            assert releaser is not None
            started = time.monotonic()
            wait_until(lambda: releaser.released + releaser.failed >= 1, 5, 0.02,
                       f"the release leg over (releases sent {decoder.releases})")
            assert (releaser.released, releaser.failed) == (1, 0)
            assert decoder.releases == 1                    # answered: not tried again
            proxy.wait_idle()                               # the prefiller's lease given back
            assert time.monotonic() - started < 5
        finally:
            proxy.stop()
