"""A release leg that no decoder could take is tried again (pdproxy/pd/kv_release.py): the prefiller's KV that a
failed request left pinned is freed once a decoder answers, not after the connector's timeout."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

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
    """The only decoder closes its first five connections unanswered: the request fails over to new prefills and
    ends in a 502, and the release legs of the KV each prefill pinned meet the same refusals (then the decoder's
    open breaker).  They are tried again until the decoder answers: nothing stays pinned, every lease is back."""
    p, d = pair
    proxy = ProxyThread(prefill=[p.url], decode=[d.url]).start()
    try:
        d.faults({"kind": "refuse", "times": 5})
        r = httpx.post(proxy.url + "/v1/chat/completions", timeout=30, json={
            "model": "sim-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4})
        assert r.status_code == 502 and r.json()["error"]["code"] == 502
        prefills = [x for x in p.received() if x["path"] == "/v1/chat/completions"]
        assert len(prefills) >= 2                                  # failovers: each new prefill pinned new KV
        wait_until(lambda: pinned(p) == 0, 30, 0.05, "the prefiller's pinned KV freed by release legs")
        releases = [x for x in d.received() if x["body"].get("max_tokens") == 1]
        assert len(releases) > len(prefills)                       # some release legs were tried again
        assert all(x["body"]["kv_transfer_params"]["do_remote_prefill"] for x in releases)
        releaser = proxy.app.director.kv_release if proxy.app.director else None
        assert releaser is not None and releaser.released == len(prefills) and releaser.failed == 0
        proxy.wait_idle()
    finally:
        proxy.stop()
