"""A release leg that no decoder could take is tried again (pdproxy/pd/kv_release.py): the prefiller's KV that a
failed request left pinned is freed once a decoder answers, not after the connector's timeout."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from pdproxy.pd.kv_release import KVReleaser
from tests.apis.support import pinned
from tests.conftest import SIM_ARGS
from tests.support import ProxyThread, SimProcess, running, wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def pair() -> Iterator[tuple[SimProcess, SimProcess]]:
    with running(SimProcess("prefill", *SIM_ARGS), SimProcess("decode", *SIM_ARGS)) as (p, d):
        yield p, d


def test_kv_pinned_by_a_request_whose_decoder_refused_is_freed_once_it_answers(
        pair: tuple[SimProcess, SimProcess]) -> None:
    """The only decoder closes its first five connections unanswered.  The request's decode legs and the release
    legs of the KV each failed attempt's prefill pinned (sent in the background, as the director moves on) meet
    those refusals in whatever order the loop runs them: the request ends in a 503 with ``Retry-After`` (every
    decode attempt refused: ``DecodeLeg.gave_up``) or, when releases took enough of them, a later decode leg
    answers (200).  Either way some release leg was refused, and without another try its KV would stay pinned
    until the connector's timeout: every one is tried again until the decoder answers."""
    p, d = pair
    proxy = ProxyThread(prefill=[p.url], decode=[d.url]).start()
    try:
        d.faults({"kind": "refuse", "times": 5})
        r = httpx.post(proxy.url + "/v1/chat/completions", timeout=30, json={
            "model": "sim-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4})
        assert r.status_code in (200, 503), r.text
        assert r.status_code == 200 or int(r.headers["retry-after"]) >= 1
        prefills = [x for x in p.received() if x["path"] == "/v1/chat/completions"]
        assert len(prefills) >= 2                                  # failovers: each new prefill pinned new KV
        wait_until(lambda: pinned(p) == 0, 30, 0.05, "the prefiller's pinned KV freed by release legs")
        releaser = proxy.app.director.kv_release if proxy.app.director else None
        assert releaser is not None
        expected = len(prefills) - (r.status_code == 200)            # a 200's own KV was pulled by its decoder
        wait_until(lambda: releaser.released + releaser.failed >= expected, 10, 0.02, "release legs ended")
        assert (releaser.released, releaser.failed) == (expected, 0)
        releases = [x for x in d.received() if x["body"].get("max_tokens") == 1]
        assert len(releases) > releaser.released                   # some release legs were refused, then retried
        assert all(x["body"]["kv_transfer_params"]["do_remote_prefill"] for x in releases)
        proxy.wait_idle()
    finally:
        proxy.stop()


@pytest.fixture
def trio() -> Iterator[tuple[SimProcess, SimProcess, SimProcess]]:
    """A prefiller and two decoders."""
    with running(SimProcess("prefill", *SIM_ARGS), SimProcess("decode", *SIM_ARGS),
                 SimProcess("decode", *SIM_ARGS)) as (p, d0, d1):
        yield p, d0, d1


def stream_while_decoders_hang(proxy: ProxyThread, decoders: tuple[SimProcess, ...], hangs: int) -> tuple[
        httpx.Response, KVReleaser]:
    """Each of ``decoders`` hangs its next ``hangs`` requests; one streamed chat through ``proxy``: its response
    and the proxy's releaser."""
    for d in decoders:
        d.faults({"kind": "hang", "times": hangs})
    r = httpx.post(proxy.url + "/v1/chat/completions", timeout=30, json={
        "model": "sim-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
        "stream": True})
    releaser = proxy.app.director.kv_release if proxy.app.director else None
    assert releaser is not None
    return r, releaser


def test_a_release_leg_that_times_out_is_tried_again(trio: tuple[SimProcess, SimProcess, SimProcess]) -> None:
    """Both decoders hang once (a hung API server: the request is never handed to the engine).  The request fails
    over and is answered; the release leg of the first attempt's KV meets the other hang and times out — which
    frees nothing on the prefiller — so it is tried again and the KV is freed at once, not after 480 s."""
    p, d0, d1 = trio
    proxy = ProxyThread(prefill=[p.url], decode=[d0.url, d1.url], decode_first_byte_timeout_s=1.0,
                        kv_release_timeout_s=1.0).start()
    try:
        r, releaser = stream_while_decoders_hang(proxy, (d0, d1), 1)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        wait_until(lambda: pinned(p) == 0, 30, 0.05, "the prefiller's pinned KV freed by a retried release")
        wait_until(lambda: releaser.released >= 1, 10, 0.02, "release leg ended")
        releases = [x for d in (d0, d1) for x in d.received() if x["body"].get("max_tokens") == 1]
        assert len(releases) >= 2 and releaser.failed == 0      # the hung one, then the one that freed it
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_a_release_leg_that_times_out_twice_is_not_tried_again(
        trio: tuple[SimProcess, SimProcess, SimProcess]) -> None:
    """A leg that times out may have met a slow decoder, whose pull frees the KV anyway: it is tried once more (on
    the other decoder), and a second timeout ends it — never a full pull of KV that may be gone every 2 s for a
    minute, on decoders already too busy to answer."""
    p, d0, d1 = trio
    proxy = ProxyThread(prefill=[p.url], decode=[d0.url, d1.url], decode_first_byte_timeout_s=0.5,
                        kv_release_timeout_s=0.5, decode_attempts=1).start()
    try:
        r, releaser = stream_while_decoders_hang(proxy, (d0, d1), 20)
        assert r.status_code == 503, r.text           # decode_attempts spent: no decoder left, retry later
        wait_until(lambda: releaser.released + releaser.failed >= 1, 20, 0.02, "the release ended")
        releases = [(d.url, x) for d in (d0, d1) for x in d.received() if x["body"].get("max_tokens") == 1]
        assert len(releases) == 2 and len({url for url, _ in releases}) == 2, releases   # one more, elsewhere
        assert (releaser.released, releaser.failed) == (1, 0)
        proxy.wait_idle()
    finally:
        proxy.stop()
