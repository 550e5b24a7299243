"""``Admission.admit`` in process (no engines answer): large prompts are counted off the event loop, a failed
``/tokenize`` falls back to the estimate, and the conditional-disaggregation decision."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from pdproxy.admission.count import LocalCounter
from pdproxy.apis.request import Api, ProxyRequest, parse_request
from pdproxy.app.state import ProxyState
from pdproxy.endpoints import Role
from pdproxy.engines.control import EngineInfo
from pdproxy.errors import PromptTooLong
from pdproxy.settings import load_settings
from pdproxy.timeline import RequestContext
from pdproxy.tokens import sim_prompt
from tests.support import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


@pytest.fixture
async def state(request: pytest.FixtureRequest) -> AsyncIterator[ProxyState]:
    """Proxy state for one prefiller and one decoder on ports where nothing listens (max_model_len 8192)."""
    overrides: dict[str, Any] = getattr(request, "param", {})
    st = ProxyState.build(load_settings(prefill=[f"http://127.0.0.1:{free_port()}"],
                                        decode=[f"http://127.0.0.1:{free_port()}"], connect_timeout_s=1,
                                        **overrides))
    for e in st.infos:
        st.infos[e] = EngineInfo(max_model_len=8192, kv_pool_tokens=65536)
    await st.upstream.start()
    async with st.admission:
        yield st
    await st.upstream.close()


def request(body: dict[str, Any]) -> tuple[ProxyRequest, RequestContext]:
    api = Api.CHAT if "messages" in body else Api.COMPLETIONS
    return parse_request(orjson.dumps(body), api), RequestContext("r", None, api.label)


@pytest.mark.parametrize("state", [{"tokenizer": "sim"}], indirect=True)
async def test_large_prompts_are_counted_in_a_worker_thread(state: ProxyState, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    threads: list[str] = []
    original = LocalCounter.count

    def spy(self: LocalCounter, *args: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(self, *args, **kw)

    monkeypatch.setattr(LocalCounter, "count", spy)
    req, ctx = request({"prompt": " ab." * 4500, "max_tokens": 100})   # 9000 tokens, 4500 words: count needed
    with pytest.raises(PromptTooLong):
        await state.admission.admit(req, ctx)
    req, ctx = request({"prompt": sim_prompt(2000, unique=True) + ",", "max_tokens": 100})
    await state.admission.admit(req, ctx)
    assert req.prompt_tokens == 2001 and ctx.disaggregated
    assert len(threads) == 2 and all(t.startswith("pdproxy-tokens") for t in threads)
    assert state.admission.stats.counted_total == {"local": 2}


async def test_failed_tokenize_falls_back_to_the_estimate(state: ProxyState) -> None:
    req, ctx = request({"messages": [{"role": "user", "content": sim_prompt(3000, unique=True)}]})
    await state.admission.admit(req, ctx)                             # nothing listens: the engine will decide
    stats = state.admission.stats
    assert stats.counted_total == {"estimate": 1} and stats.count_errors_total == 1
    assert req.prompt_tokens is not None and req.prompt_tokens >= 3000


@pytest.mark.parametrize("state", [{"tokenizer": "sim", "prefill_busy_tokens": 1000}], indirect=True)
async def test_short_prompts_skip_a_prefiller_busy_with_long_work(state: ProxyState) -> None:
    queue = state.admission.queue
    director = state.director()                                       # it asks the PD decision
    async with queue.slot(5000, 5001):                                # a long prefill in flight
        hello, ctx = request({"prompt": " hello", "max_tokens": 2})
        await director.admit(hello, ctx)
        assert not ctx.disaggregated
        medium, ctx2 = request({"prompt": sim_prompt(2000), "max_tokens": 2})
        await director.admit(medium, ctx2)
        assert ctx2.disaggregated                                     # above decode_only_busy_max_prompt_tokens
    hello, ctx = request({"prompt": " hello", "max_tokens": 2})
    await director.admit(hello, ctx)
    assert ctx.disaggregated                                          # the prefiller is free again
    assert state.admission.stats.decode_only_total == {"prefillers_busy": 1}
    assert queue.idle() and state.pool.available(Role.PREFILL)


async def test_large_responses_and_messages_views_are_built_in_a_worker_thread(state: ProxyState,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The chat a Responses or Messages request renders is built in Python item by item (300,000 items held the
    event loop 0.25 s): a long list of items, or a large body, is converted in the tokenizer threads; a short
    one inline.  ``messages_fields`` reads 50,000 plain messages without its per-message loop."""
    from pdproxy.apis import fields

    threads: dict[str, str] = {}
    original = ProxyRequest.count_view

    def spy(self: ProxyRequest) -> Any:
        if self._count_view is None:                                # the call that builds it
            threads[self.api.label] = threading.current_thread().name
        return original(self)

    def no_loop(messages: Any) -> None:
        raise AssertionError("plain messages went through the per-message loop")

    monkeypatch.setattr(ProxyRequest, "count_view", spy)
    monkeypatch.setattr(fields, "_message_fault", no_loop)
    big_input = [{"role": "user", "content": "hi"}] * 5_000
    tool_input = {"a": [1.5] * 20_000}                              # one message, a large tool input
    for api, body in ((Api.RESPONSES, {"model": "m", "input": big_input}),
                      (Api.MESSAGES, {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}] *
                                      50_000}),
                      (Api.MESSAGES, {"model": "m", "max_tokens": 4, "messages": [
                          {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                             "input": tool_input}]},
                          {"role": "user", "content": "go on"}]}),
                      (Api.RESPONSES, {"model": "m", "input": [{"role": "user", "content": "hi"}]})):
        req = parse_request(orjson.dumps(body), api)
        threads.clear()
        try:
            await state.admission.admit(req, RequestContext("r", None, api.label))
        except PromptTooLong:                                       # counted, after the view was built
            pass
        (name,) = threads.values()
        large = len(req.raw) > 100_000 or len(body.get("input", ())) > 100
        assert name.startswith("pdproxy-tokens") == large, (api, name)


class HeldTokenize:
    """A stand-in for ``Upstream.post_json`` whose ``/tokenize`` answers wait for ``release``: records how many are
    out at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.inflight = self.most = self.calls = 0

    async def __call__(self, endpoint: Any, path: str, body: bytes, headers: Any, **kw: Any) -> dict[str, Any]:
        assert path == "/tokenize"
        self.calls += 1
        self.inflight += 1
        self.most = max(self.most, self.inflight)
        try:
            await self.release.wait()
        finally:
            self.inflight -= 1
        return {"count": 3001, "tokens": list(range(3001))}


@pytest.mark.parametrize("state", [{"tokenize_max_inflight": 2, "tokenize_timeout_s": 0.3}], indirect=True)
async def test_tokenize_calls_in_flight_are_capped(state: ProxyState, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ten prompts the bounds cannot decide, at once: two ``/tokenize`` calls reach the engine, the other eight
    wait for a place, find none within ``tokenize_timeout_s`` and go on with the estimate (the engine judges);
    prefix keys' ``/tokenize`` does not wait at all while the places are taken."""
    held = HeldTokenize()
    monkeypatch.setattr(state.upstream, "post_json", held)
    pending = [request({"messages": [{"role": "user", "content": sim_prompt(3000, unique=True, seed=i)}]})
               for i in range(10)]
    tasks = [asyncio.create_task(state.admission.admit(req, ctx)) for req, ctx in pending]
    try:
        async with asyncio.timeout(10):
            while sum(1 for t in tasks if t.done()) < 8:
                await asyncio.wait([t for t in tasks if not t.done()], return_when=asyncio.FIRST_COMPLETED)
        assert held.calls == 2 and held.inflight == 2           # the other eight gave up waiting for a place
        assert state.admission.stats.count_errors_total == 8
        ids_req, ids_ctx = request({"prompt": "hello there"})
        assert await state.admission.prompt_token_ids(ids_req, ids_ctx, len) is None     # no wait: text keys
        assert held.calls == 2 and state.admission.stats.tokenize_skipped_total == 1
        waiter_req, waiter_ctx = request({"messages": [{"role": "user", "content": sim_prompt(3000, unique=True)}]})
        waiter = asyncio.create_task(state.admission.admit(waiter_req, waiter_ctx))
        slots = next(iter(state.admission._tokenize_slots.values()))
        async with asyncio.timeout(5):
            while not slots._waiters:                           # waiting for a place: then its client leaves
                await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        held.release.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert held.most == 2 and held.inflight == 0
        stats = state.admission.stats
        assert stats.counted_total == {"estimate": 8, "engine": 2}
        assert [req.prompt_tokens_exact for req, _ in pending].count(True) == 2
    finally:
        held.release.set()
        for t in tasks:
            t.cancel()
    assert await state.admission.prompt_token_ids(ids_req, ids_ctx, len) == 3001      # places free again
    assert [slots._value for slots in state.admission._tokenize_slots.values()] == [2]   # none leaked


async def test_a_prompt_far_over_the_limit_is_not_sent_to_an_engine_to_count(state: ProxyState,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Text no bound counts from below (a tool call's arguments: a chat template may drop them) makes a prompt
    undecidable; past ``engine_count_max_bytes_per_token`` (32) times the limit the engine is not asked to render
    it — vLLM's own over-length 400 at once (old code: a 20 MB ``tool_use`` input became a 70 MB ``/tokenize`` body
    that held a simulated prefiller ~40 s); below it the engine counts as before."""
    calls: list[int] = []

    async def tokenize(endpoint: Any, path: str, body: bytes, headers: Any, **kw: Any) -> dict[str, Any]:
        calls.append(len(body))
        return {"count": 9000}

    monkeypatch.setattr(state.upstream, "post_json", tokenize)

    def call_with(arguments: str) -> tuple[ProxyRequest, RequestContext]:
        return request({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "t", "type": "function",
                                                  "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "t", "content": "ok"}]})

    req, ctx = call_with("é" * 140_000)               # 280 KB: over 32 × 8,191 bytes
    with pytest.raises(PromptTooLong) as too_long:
        await state.admission.admit(req, ctx)
    assert calls == []
    assert "maximum context length is 8192 tokens" in too_long.value.message
    assert "at least 8193 input tokens" in too_long.value.message
    assert state.admission.stats.rejected_total == {"prefill:max_model_len": 1}
    req, ctx = call_with("é" * 100_000)               # 200 KB: the engine counts it
    with pytest.raises(PromptTooLong):
        await state.admission.admit(req, ctx)
    assert len(calls) == 1


@pytest.mark.parametrize("state", [{"max_tokens_overflow": "reject"}], indirect=True)
async def test_only_text_weighs_against_the_engine_count_ratio(state: ProxyState, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """What the ratio weighs is the text an engine would render to count — not the upper bound: a media part (no
    upper bound at all), tools too large to lay out (a loose bound of ~1.6 KB a member), a limit cut to a few
    tokens by ``max_tokens`` (the template's allowance alone), earlier turns' reasoning (templates drop it) are
    counted by the engine as before, not refused (old code: a false 400 for any image); a reject-mode refusal says
    what vLLM's reject mode says."""
    counts: list[int] = []

    async def tokenize(endpoint: Any, path: str, body: bytes, headers: Any, **kw: Any) -> dict[str, Any]:
        counts.append(len(body))
        return {"count": 300}

    monkeypatch.setattr(state.upstream, "post_json", tokenize)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 400_000}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "p": {"type": "array", "examples": [[] for _ in range(12_000)]}}}}}]      # 36 KB, a ~19 MB loose bound
    for body in ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}]},
                 {"messages": [{"role": "user", "content": "hi"}], "tools": tools},
                 {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7800},
                 {"messages": [{"role": "user", "content": "hi"},           # reasoning a template drops
                               {"role": "assistant", "content": "hello", "reasoning_content": "r" * 400_000},
                               {"role": "user", "content": "and?"}]}):
        req, ctx = request(body)
        await state.admission.admit(req, ctx)
        assert req.prompt_tokens == 300 and req.prompt_tokens_exact, body.keys()
    assert len(counts) == 4 and state.admission.stats.rejected_total == {}
    req, ctx = request({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"id": "t", "type": "function", "function": {"name": "f", "arguments": "x" * 300_000}}]}], "max_tokens": 8000})
    with pytest.raises(PromptTooLong) as too_long:
        await state.admission.admit(req, ctx)
    assert len(counts) == 4                         # 300 KB against a 191-token limit: the engine is not asked
    assert "you requested 8000 output tokens and your prompt contains at least 193 input" in too_long.value.message
    req, ctx = request({**req.body, "max_tokens": 9000})                     # no room at all: still a true bound
    with pytest.raises(PromptTooLong) as too_long:
        await state.admission.admit(req, ctx)
    assert "your prompt contains at least 1 input tokens, for a total of at least 9001" in too_long.value.message
    assert ctx.prompt_tokens == 1 and len(counts) == 4


async def test_a_tool_output_of_parts_counts_its_image_as_media(state: ProxyState,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A Responses ``function_call_output`` whose ``output`` is a list of parts (a tool returning a screenshot) is
    the tool message's content as vLLM builds it (``responses/utils.py``: ``content=output``): its image is a media
    part, not text — old code stringified the list, so 300 KB of base64 was prompt text, refused by the count
    ratio (and sent to ``/tokenize`` as text below it)."""
    sent: list[bytes] = []

    async def tokenize(endpoint: Any, path: str, body: bytes, headers: Any, **kw: Any) -> dict[str, Any]:
        sent.append(body)
        return {"count": 900}

    monkeypatch.setattr(state.upstream, "post_json", tokenize)
    shot = {"type": "input_image", "image_url": "data:image/png;base64," + "A" * 300_000}
    body = {"model": "m", "input": [
        {"role": "user", "content": "take a screenshot"},
        {"type": "function_call", "call_id": "c1", "name": "screenshot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "here"}, shot]}]}
    req = parse_request(orjson.dumps(body), Api.RESPONSES)
    ctx = RequestContext("r", None, Api.RESPONSES.label)
    await state.admission.admit(req, ctx)
    assert req.prompt_tokens == 900 and len(sent) == 1 and len(sent[0]) < 2_000     # counted, the image as a part
    tool = next(m for m in orjson.loads(sent[0])["messages"] if m["role"] == "tool")
    assert [p["type"] for p in tool["content"]] == ["text", "image_url"]


@pytest.mark.parametrize("state", [{"tokenizer": "sim"}], indirect=True)
async def test_a_prompt_list_sent_whole_is_admitted_without_copying_the_body_per_prompt(state: ProxyState) -> None:
    """A prompt list the decoder prefills (``prompt_logprobs``) is admitted prompt by prompt, each prompt's body
    only what counting reads: old code copied the client's whole body per prompt, so 1,024 prompts beside 200,000
    other keys (a 2.3 MB body) held the event loop ~3 s.  Measured as memory, not time: a copy of the 20,000
    keys here is ~1.3 MB, and the admission's peak stays well under one."""
    import tracemalloc

    prompts = ["hi"] * 1023 + [sim_prompt(3000, unique=True)]
    body: dict[str, Any] = {"prompt": prompts, "max_tokens": 4, "prompt_logprobs": 0}
    body.update((f"k{i}", 0) for i in range(20_000))
    req, ctx = request(body)
    tracemalloc.start()
    try:
        await state.admission.admit(req, ctx)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 600_000, peak
    assert req.prompt_tokens is not None and 3000 <= req.prompt_tokens <= 3010   # sized as its largest prompt
    assert state.admission.stats.admitted_total == 1
