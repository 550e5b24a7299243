"""The benchmarks' floor of a Python PD relay (loadtest/bare_relay.py): it must do the two legs a PD proxy does —
a one-token prefill carrying ``do_remote_decode``, a decode leg carrying the prefiller's ``kv_transfer_params`` —
and relay the whole stream, or its figures price less than any PD relay must do."""

from __future__ import annotations

import asyncio
import sys

import httpx
import pytest

from loadtest import fleet

pytestmark = pytest.mark.timeout(60)


def test_the_bare_relay_runs_both_legs_and_relays_the_whole_stream() -> None:
    from loadtest.loadgen import run_batch

    with fleet.fake_engine("bare-prefiller", None) as p, fleet.fake_engine("bare-decoder", None) as d:
        relay = fleet.Child("bare-relay", [sys.executable, "-m", "loadtest.bare_relay", "--port",
                                           str(port := fleet.free_port()), "--prefill", p.url,   # type: ignore[attr-defined]
                                           "--decode", d.url],                                  # type: ignore[attr-defined]
                            cpus=None, health_url=f"http://127.0.0.1:{port}/health")
        with relay:
            url = f"http://127.0.0.1:{port}"
            r = httpx.post(url + "/v1/chat/completions", timeout=10, json={
                "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "stream": True})
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            assert r.text.count('"content":" tok"') == 5              # every token relayed
            spec = {"mode": "proxy", "target": url, "prefill": p.url, "decode": d.url,   # type: ignore[attr-defined]
                    "max_tokens": 16, "arrival": {"kind": "closed_n", "concurrency": 8, "n": 200},
                    "api": "completions"}
            window = asyncio.run(run_batch(spec))["windows"][0]
            pstats, dstats = fleet.engine_stats(p.url), fleet.engine_stats(d.url)  # type: ignore[attr-defined]
    assert window["errors"] == 0 and window["requests"] == 200
    assert pstats["kv_prefills"] == 201 and pstats["stream_events"] == 0      # every prefill leg one-token, no stream
    assert dstats["kv_decodes"] == 201 and dstats["requests"] == 201          # every decode leg had the handle
    assert window["events"] >= 200 * 16
