"""Two models on separate pools and a LoRA adapter on one engine, through pdproxy to simulated engines: each request
reaches only engines that serve its model; ``/v1/models`` is the union with each model's longest
servable ``max_model_len``; an unknown model is vLLM's 404 before any engine is contacted; limits are per model; the
operator's pins narrow what an endpoint takes."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from pdproxy.endpoints import Role
from tests.support import ProxyThread, SimProcess, running, wait_until

pytestmark = pytest.mark.timeout(60)

FAST = ("--prefill-tokens-per-s", "0", "--decode-tokens-per-s", "0")
LORA = ("--lora-modules", "alpha-lora=/adapters/alpha-lora")


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, SimProcess]]:
    """alpha: a prefiller and two decoders (the prefiller and decoder ``da2`` also serve the ``alpha-lora``
    adapter); beta: a prefiller and a decoder, with a larger context."""
    fleet = {
        "pa": SimProcess("prefill", "--served-model-name", "alpha", "--max-model-len", "2048", *LORA, *FAST),
        "da1": SimProcess("decode", "--served-model-name", "alpha", "--max-model-len", "1024", *FAST),
        "da2": SimProcess("decode", "--served-model-name", "alpha", "--max-model-len", "1024", *LORA, *FAST),
        "pb": SimProcess("prefill", "--served-model-name", "beta", "--max-model-len", "4096", *FAST),
        "db": SimProcess("decode", "--served-model-name", "beta", "--max-model-len", "4096", *FAST),
    }
    with running(*fleet.values()):
        yield fleet


@pytest.fixture
def proxy(engines: dict[str, SimProcess]) -> Iterator[ProxyThread]:
    for s in engines.values():
        s.reset()
    p = ProxyThread(prefill=[engines["pa"].url, engines["pb"].url],
                    decode=[engines["da1"].url, engines["da2"].url, engines["db"].url]).start()
    try:
        yield p
        p.wait_idle()
    finally:
        p.stop()


def where(engines: dict[str, SimProcess]) -> dict[str, list[str]]:
    """Engine name → the models of the generation requests it received."""
    return {name: [r["body"]["model"] for r in s.received() if r["path"].startswith("/v1/")]
            for name, s in engines.items()}


def test_each_request_reaches_only_engines_that_serve_its_model(proxy: ProxyThread,
                                                                engines: dict[str, SimProcess]) -> None:
    c = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=20)
    for _ in range(3):
        for model in ("alpha", "beta", "alpha-lora"):
            resp = c.chat.completions.create(model=model, max_tokens=3,
                                             messages=[{"role": "user", "content": "Hello there"}])
            assert resp.model == model and resp.choices[0].message.content
        assert c.responses.create(model="beta", input="Hi", max_output_tokens=2).model == "beta"
    got = where(engines)
    assert sorted(set(got["pa"])) == ["alpha", "alpha-lora"] and got["pa"].count("alpha-lora") == 3
    assert set(got["da1"]) <= {"alpha"} and set(got["da2"]) <= {"alpha", "alpha-lora"}
    assert got["da2"].count("alpha-lora") == 3                     # the adapter only where it is loaded
    assert got["da1"].count("alpha") + got["da2"].count("alpha") == 3
    assert set(got["pb"]) == set(got["db"]) == {"beta"} and len(got["pb"]) == len(got["db"]) == 6


def test_an_unknown_model_is_a_404_before_any_engine_is_contacted(proxy: ProxyThread,
                                                                   engines: dict[str, SimProcess]) -> None:
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/completions", {"prompt": "x"}), ("/v1/responses", {"input": "x"}),
                       ("/v1/completions", {"prompt": ["x", "y"], "n": 2}), ("/tokenize", {"prompt": "x"})):
        r = httpx.post(proxy.url + path, json={**body, "model": "gamma"})
        assert r.status_code == 404, path
        assert r.json()["error"] == {"message": "The model `gamma` does not exist. Valid aliases: alpha, beta.",
                                     "type": "NotFoundError", "param": "model", "code": 404}
    assert not any(s.received() for s in engines.values())


def test_v1_models_is_the_union_with_each_models_servable_context(proxy: ProxyThread) -> None:
    cards = {c["id"]: c for c in httpx.get(proxy.url + "/v1/models").json()["data"]}
    assert set(cards) == {"alpha", "alpha-lora", "beta"}
    assert cards["alpha"]["max_model_len"] == 1024                 # the decoders', not the prefiller's 2048
    assert cards["beta"]["max_model_len"] == 4096
    assert cards["alpha-lora"]["parent"] == "alpha"


def test_limits_are_per_model(proxy: ProxyThread, engines: dict[str, SimProcess]) -> None:
    prompt = "word " * 1500                                        # over alpha's 1024, inside beta's 4096
    too_long = httpx.post(proxy.url + "/v1/completions", json={"model": "alpha", "prompt": prompt, "max_tokens": 2})
    assert too_long.status_code == 400 and "maximum context length is 1024 tokens" in too_long.text
    assert not [r for name in ("pa", "da1", "da2") for r in engines[name].received()]
    fits = httpx.post(proxy.url + "/v1/completions", json={"model": "beta", "prompt": prompt, "max_tokens": 2},
                      timeout=20)
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 2


def test_operator_pins_narrow_what_an_endpoint_takes(engines: dict[str, SimProcess]) -> None:
    """``da2`` pinned to ``alpha``: the adapter it loads is not sent there, and no other decoder has it."""
    for s in engines.values():
        s.reset()
    proxy = ProxyThread(prefill=[engines["pa"].url, engines["pb"].url], decode=[engines["db"].url],
                        endpoints=[{"url": engines["da1"].url, "role": Role.DECODE.value},
                                   {"url": engines["da2"].url, "role": Role.DECODE.value, "models": ["alpha"]}]
                        ).start()
    try:
        r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "alpha-lora", "max_tokens": 2,
                                                                 "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and "alpha-lora" in r.json()["error"]["message"]
        for _ in range(4):
            ok = httpx.post(proxy.url + "/v1/chat/completions", timeout=20,
                            json={"model": "alpha", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
            assert ok.status_code == 200
        assert len(where(engines)["da1"]) + len(where(engines)["da2"]) == 4
        proxy.wait_idle()
    finally:
        proxy.stop()


class EngineLog(logging.Handler):
    """The ``pdproxy.engines`` records of one test (its level lowered to INFO meanwhile)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self.logger = logging.getLogger("pdproxy.engines")

    def __enter__(self) -> EngineLog:
        self.level_before = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def events(self, name: str) -> list[logging.LogRecord]:
        return [r for r in self.records if getattr(r, "event", None) == name]


def listed(proxy: ProxyThread) -> set[str]:
    r = httpx.get(proxy.url + "/v1/models", timeout=10)
    assert r.status_code == 200, r.text
    return {c["id"] for c in r.json()["data"]}


def chat(proxy: ProxyThread, model: str) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/chat/completions", timeout=20,
                      json={"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})


def test_a_model_only_prefillers_serve_is_not_listed_and_said_once(engines: dict[str, SimProcess]) -> None:
    """beta's prefiller without its decoder (and alpha-lora, loaded on the prefiller and on no decoder here): no
    route serves them — every request needs a decoder of its model, a 404 — so ``/v1/models`` does not list them
    (it did: a client picking a model from the list got 404s), and the log says so once per model, however many
    refreshes; alpha, served by both, is listed and served."""
    for s in engines.values():
        s.reset()
    with EngineLog() as log:
        proxy = ProxyThread(prefill=[engines["pa"].url, engines["pb"].url], decode=[engines["da1"].url],
                            engine_refresh_interval_s=0.1).start()
        try:
            assert listed(proxy) == {"alpha"}
            for model in ("beta", "alpha-lora"):
                r = chat(proxy, model)
                assert r.status_code == 404 and "served by prefill engines but by no decode engine" in \
                    r.json()["error"]["message"], r.text
            assert chat(proxy, "alpha").status_code == 200
            wait_until(lambda: len(log.events("model_unservable")) >= 2, 10, what="the log")
            time.sleep(0.6)                                         # several refreshes more: nothing said again
            proxy.wait_idle()
        finally:
            proxy.stop()
    said = {r.model: r for r in log.events("model_unservable")}     # type: ignore[attr-defined]
    assert len(log.events("model_unservable")) == 2 and set(said) == {"beta", "alpha-lora"}
    assert all(r.levelno == logging.WARNING and r.role == "prefill" for r in said.values())  # type: ignore[attr-defined]
    assert not log.events("model_decoders_only")


def test_a_model_only_decoders_serve_is_listed_served_where_it_can_be_and_said_once(
        engines: dict[str, SimProcess]) -> None:
    """beta's decoder without its prefiller: listed — the routes without a PD leg serve it (a pooling or speech
    engine is configured as a decoder) — its /tokenize answered; a chat through the prefillers is the 404 naming
    the missing role; the log says so once (INFO)."""
    for s in engines.values():
        s.reset()
    with EngineLog() as log:
        proxy = ProxyThread(prefill=[engines["pa"].url], decode=[engines["da1"].url, engines["db"].url],
                            engine_refresh_interval_s=0.1).start()
        try:
            assert listed(proxy) == {"alpha", "beta"}                # alpha-lora: only on the prefiller
            tokenized = httpx.post(proxy.url + "/tokenize", json={"model": "beta", "prompt": "hi there"}, timeout=20)
            assert tokenized.status_code == 200 and tokenized.json()["count"] > 0
            r = chat(proxy, "beta")
            assert r.status_code == 404 and "served by decode engines but by no prefill engine" in \
                r.json()["error"]["message"], r.text
            wait_until(lambda: log.events("model_decoders_only"), 10, what="the log")
            time.sleep(0.6)
            proxy.wait_idle()
        finally:
            proxy.stop()
    (said,) = log.events("model_decoders_only")
    assert said.model == "beta" and said.levelno == logging.INFO        # type: ignore[attr-defined]
    assert [r.model for r in log.events("model_unservable")] == ["alpha-lora"]  # type: ignore[attr-defined]
