"""JSON limits on every route that reads a client body: a body nested deeper than ``max_json_depth`` gets vLLM's
400 ``json_invalid`` at once — on the generation routes, the passthrough, ``/debug/prefix`` and the admin API —
and nothing reaches an engine; a malformed body's byte offset never becomes a metric label; the generation
routes (PD, decode-only, fan-out) never hand an engine a client's ``kv_transfer_params``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Fleet
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(60)

ADMIN = {"authorization": "Bearer admin-secret"}
HOSTILE = {"remote_host": "203.0.113.9", "remote_port": 7777, "remote_engine_id": "evil", "remote_block_ids": [1],
           "do_remote_prefill": True}


def nested(depth: int) -> bytes:
    """A small chat body whose ``x`` member nests ``depth`` arrays (the body itself: ``depth + 1`` levels)."""
    return (b'{"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "x": '
            + b"[" * depth + b"]" * depth + b"}")


def many(n: int) -> bytes:
    """A small chat body whose ``x`` member holds ``n`` empty objects (~2n items: a ``{`` and a ``,`` each)."""
    return (b'{"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "x": ['
            + b",".join([b"{}"] * n) + b"]}")


def assert_json_invalid(r: httpx.Response, anthropic: bool = False, limit: str = "max_json_depth") -> None:
    """vLLM's 400 for a body it cannot decode (the Anthropic envelope on ``/v1/messages``), naming ``limit``."""
    assert r.status_code == 400, r.text
    body = r.json()
    error = body["error"]
    assert "json_invalid" in error["message"] and limit in error["message"], error
    assert body["type"] == "error" if anthropic else error["param"] == "body"


@pytest.fixture(scope="module")
def proxy(fleet: Fleet) -> Iterator[ProxyThread]:
    p = ProxyThread(prefill=[s.url for s in fleet.prefillers], decode=[s.url for s in fleet.decoders],
                    api_keys=["sk-client"], admin_key="admin-secret").start()
    try:
        yield p
    finally:
        p.stop()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                                  "/tokenize", "/v1/embeddings", "/inference/v1/generate", "/debug/prefix",
                                  "/admin/endpoints"])
def test_deep_bodies_get_vllms_400_on_every_route(proxy: ProxyThread, sims: Fleet, path: str) -> None:
    """256–1,024 levels used to end in a 500 "TypeError" (orjson writes at most 254), more in a RecursionError
    that held the connection: now one 400 in vLLM's words, and no engine hears of it."""
    headers = {**(ADMIN if path.startswith(("/debug", "/admin")) else {"authorization": "Bearer sk-client"}),
               "content-type": "application/json"}
    for depth in (300, 1100, 5000):
        r = httpx.post(proxy.url + path, content=nested(depth), headers=headers, timeout=10)
        assert_json_invalid(r, anthropic=path == "/v1/messages")
    assert not any(s.received() for s in sims.all)
    proxy.wait_idle()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                                  "/tokenize", "/v1/embeddings", "/inference/v1/generate", "/debug/prefix",
                                  "/admin/endpoints"])
def test_bodies_of_too_many_items_get_vllms_400_on_every_route(proxy: ProxyThread, sims: Fleet, path: str) -> None:
    """1.1M empty objects (3.3 MB, ~2.2M items) would cost ~90 MB and ~0.3 s of event loop parsed (a 60 MB body of
    them 1.7 GB and 4.6 s): refused before the parse, and no engine hears of it."""
    headers = {**(ADMIN if path.startswith(("/debug", "/admin")) else {"authorization": "Bearer sk-client"}),
               "content-type": "application/json"}
    r = httpx.post(proxy.url + path, content=many(1_100_000), headers=headers, timeout=30)
    assert_json_invalid(r, anthropic=path == "/v1/messages", limit="max_json_items")
    assert not any(s.received() for s in sims.all)
    proxy.wait_idle()


def test_the_limits_are_settings_and_what_fits_is_served(sims: Fleet) -> None:
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                        max_json_depth=40, max_json_items=10_000).start()
    json_type = {"content-type": "application/json"}
    try:
        ok = httpx.post(proxy.url + "/v1/chat/completions", content=nested(39), headers=json_type, timeout=10)
        assert ok.status_code == 200, ok.text                                                   # 40 levels
        assert_json_invalid(httpx.post(proxy.url + "/v1/chat/completions", content=nested(40), headers=json_type,
                                       timeout=10))
        ok = httpx.post(proxy.url + "/v1/chat/completions", content=many(4_500), headers=json_type, timeout=10)
        assert ok.status_code == 200, ok.text                                                   # ~9,000 items
        assert_json_invalid(httpx.post(proxy.url + "/v1/chat/completions", content=many(5_500), headers=json_type,
                                       timeout=10), limit="max_json_items")
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_malformed_bodies_add_no_metric_series(sims: Fleet) -> None:
    """A JSON syntax error's 400 names its position (``body.N``, as vLLM's); the rejection label is ``body``."""
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders]).start()
    try:
        for n in range(3):
            r = httpx.post(proxy.url + "/v1/chat/completions", content=b'{"model": ' + b" " * n + b"nope}",
                           headers={"content-type": "application/json"}, timeout=10)
            assert r.status_code == 400 and r.json()["error"]["param"] == f"body.{10 + n}", r.text
        metrics = httpx.get(proxy.url + "/metrics", timeout=10).text
        lines = [line for line in metrics.splitlines() if line.startswith("pdproxy_rejections_total{")]
        assert lines == ['pdproxy_rejections_total{detail="body",reason="bad_request"} 3.0'], lines
    finally:
        proxy.stop()


@pytest.mark.parametrize("extra", [{}, {"prompt_logprobs": 1}, {"n": 2}],
                         ids=["prefill-then-decode", "decoder-prefills", "fan-out"])
def test_generation_routes_never_forward_a_clients_handle(sims: Fleet, extra: dict[str, object]) -> None:
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders]).start()
    try:
        body = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                "kv_transfer_params": HOSTILE, "ec_transfer_params": HOSTILE, **extra}
        r = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        legs = [rec["body"] for s in sims.all for rec in s.completions_received()]
        assert legs and not any("ec_transfer_params" in leg for leg in legs)
        assert all((leg.get("kv_transfer_params") or {}).get("remote_host") != "203.0.113.9" for leg in legs)
        refused = httpx.post(proxy.url + "/v1/chat/completions", timeout=30, json={
            **body, "kv_transfer_params": None, "ec_transfer_params": None, "vllm_xargs": {"kv_transfer_params": "x"}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "vllm_xargs", refused.text
        proxy.wait_idle()
    finally:
        proxy.stop()


@pytest.mark.parametrize("prompt", [[[1, 2], 5], [5, [1, 2]], [None, 1], [[1, [2]]]])
def test_a_malformed_id_prompt_with_a_local_tokenizer_is_the_engines_400_not_a_500(sims: Fleet,
                                                                                    prompt: list[object]) -> None:
    """A completions prompt list that is no list of token ids goes to the prefiller to judge (vLLM's 400); with a
    local tokenizer, prefix routing asks for its token ids first — old code: ``int([1, 2])``'s ``TypeError``
    escaped as pdproxy's 500 with a 38-line ERROR traceback in the log, for every such 70-byte request."""
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                        tokenizer="sim", prefix_routing="approximate").start()
    try:
        r = httpx.post(proxy.url + "/v1/completions", timeout=10,
                       json={"model": "sim-model", "max_tokens": 1, "prompt": prompt})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "BadRequestError"
        judged = [c for s in sims.prefillers for c in s.completions_received()]
        assert len(judged) == 1 and judged[0]["body"]["prompt"] == prompt      # the engine's own verdict
        assert not [c for s in sims.decoders for c in s.completions_received()]
        proxy.wait_idle()
    finally:
        proxy.stop()


def test_a_chat_the_local_template_cannot_render_is_vllms_400_not_a_500(sims: Fleet, tmp_path: Path) -> None:
    """A ``chat_template_kwargs`` naming one of the template's own arguments (``messages``, ``tools``) makes the chat
    template raise (``TypeError``: multiple values), which vLLM answers 400 "Chat template rejected the request"
    (``renderers/hf.py::safe_apply_chat_template``).  pdproxy's local template failing so is the engine's to judge,
    as any template refusal: a prompt too short to need counting goes on without prefix keys (the simulated engine,
    ignoring the kwargs, answers 200), one that needs counting gets that 400 before any engine is asked — old code:
    a 500 and a traceback either way.  ``/debug/prefix`` refuses a body of the wrong shape with its 400."""
    from pdproxy.tools.tinymodel import write_tokenizer

    tokenizer = write_tokenizer(tmp_path / "tokenizer")
    proxy = ProxyThread(prefill=[s.url for s in sims.prefillers], decode=[s.url for s in sims.decoders],
                        tokenizer=str(tokenizer), prefix_routing="approximate", debug_routes="open").start()
    try:
        for kwargs in ({"messages": 1}, {"tools": 1}):
            short = {"model": "sim-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
                     "chat_template_kwargs": kwargs}
            r = httpx.post(proxy.url + "/v1/chat/completions", timeout=10, json=short)
            assert r.status_code == 200, r.text                     # the engine judged it
            long = {**short, "messages": [{"role": "user", "content": "hello " * 1500}]}
            r = httpx.post(proxy.url + "/v1/chat/completions", timeout=10, json=long)
            assert r.status_code == 400, r.text                     # counted: the template's refusal, as vLLM's
            error = r.json()["error"]
            assert error["type"] == "BadRequestError" and "chat template" in error["message"]
        assert len([c for s in sims.prefillers for c in s.completions_received()]) == 2   # the short ones only
        # the request's own add_generation_prompt wins over the kwargs' (vLLM's build_chat_params): rendered, counted
        r = httpx.post(proxy.url + "/v1/chat/completions", timeout=10, json={
            "model": "sim-model", "messages": [{"role": "user", "content": "hello " * 1500}], "max_tokens": 2,
            "chat_template_kwargs": {"add_generation_prompt": False}})
        assert r.status_code == 200, r.text
        r = httpx.post(proxy.url + "/debug/prefix", timeout=10,
                       json={"model": "sim-model", "messages": None, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "body.messages", r.text   # vLLM's shape
        proxy.wait_idle()
    finally:
        proxy.stop()
