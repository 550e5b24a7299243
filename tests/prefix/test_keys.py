"""In process: the token ids prefix routing hashes are the engine's (local tokenizer, chat template, block cache);
text rendering keeps a conversation's prefix; the tie-break key skips what every prefiller holds; decoders that
hold the prompt are preferred only among equally loaded ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pdproxy.admission.count import IdsCache, LocalCounter
from pdproxy.endpoints import Role, expand
from pdproxy.engines.pool import EndpointPool
from pdproxy.prefix.index import block_keys, text_keys
from pdproxy.prefix.routing import PrefixLookup, PrefixRouter, render_bytes, render_parts
from pdproxy.scheduling import PickRequest, PrefixHints, Scheduler
from pdproxy.tokens import load_tokenizer, prompt_token_ids, sim_prompt
from pdproxy.tools.tinymodel import write_tokenizer

pytestmark = pytest.mark.timeout(60)

TOOLS = [{"type": "function", "function": {"name": "grep", "parameters": {"type": "object"}}}]


def bodies() -> list[tuple[dict[str, Any], str]]:
    system = "You are an agent working in a repository. " * 40
    return [
        ({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Find the bug."}],
          "tools": TOOLS}, "chat"),
        ({"messages": [{"role": "system", "content": system}, {"role": "user", "content": "Find the bug."},
                       {"role": "assistant", "content": "",
                        "tool_calls": [{"id": "c1", "type": "function",
                                        "function": {"name": "grep", "arguments": "{\"q\": \"bug\"}"}}]},
                       {"role": "tool", "tool_call_id": "c1", "content": "main.py:3: bug " * 50}],
          "tools": TOOLS}, "chat"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                                    {"type": "image_url", "image_url": {"url": "x"}}]}]}, "chat"),
        ({"prompt": "Hello world. " * 300}, "completions"),
        ({"prompt": [5, 6, 7, 8]}, "completions"),
    ]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.mark.parametrize("source", ["sim", "hf"])
def test_token_ids_are_the_engines_and_the_block_cache_keeps_them(source: str, hf_dir: Path) -> None:
    src = "sim" if source == "sim" else str(hf_dir)
    counter = LocalCounter(src)
    tok = load_tokenizer(None if source == "sim" else src)
    for body, api in bodies():
        expected = prompt_token_ids(tok, body, api)   # what pdproxy sim (and vLLM) build for the prompt
        assert counter.token_ids(body, api == "chat") == expected
        hits = counter.ids_cache.hits
        assert counter.token_ids(body, api == "chat") == expected      # again: from the cache
        assert counter.ids_cache.hits > hits or len(str(body)) < 300
    huge = {"messages": [{"role": "user", "content": sim_prompt(60_000, unique=True, seed=3)}]}
    assert counter.token_ids(huge, True) == prompt_token_ids(tok, huge, "chat")   # split at word boundaries


def test_the_ids_cache_is_bounded_in_tokens() -> None:
    cache = IdsCache(max_tokens=1000)
    for i in range(10):
        cache.put(bytes([i]), list(range(200)))
    assert cache.size <= 1000 and cache.get(bytes([9])) is not None and cache.get(bytes([0])) is None
    cache.put(b"big", list(range(300)))                  # over a quarter of the bound: not kept
    assert cache.get(b"big") is None


def test_text_rendering_keeps_a_conversations_prefix() -> None:
    turn1 = bodies()[0][0]
    turn2 = bodies()[1][0]
    a, b = render_bytes(turn1, True), render_bytes(turn2, True)
    assert b.startswith(a[:-len(b"Find the bug.")])
    # turn 1's last chunk ends at its text's end; turn 2 ends a chunk at that message mark unless it lies less than
    # half a step (and one chunk) into a chunk: the keys turn 2 shares with turn 1 cover all of turn 1 but less
    # than max(chunk_chars, 1/16 of it)
    for last in ("Find the bug.", "Find it. " * 30, "Find it. " * 60, "x" * 1000, "y" * 20_000):
        one = {**turn1, "messages": [*turn1["messages"][:-1], {"role": "user", "content": last}]}
        two = {**turn2, "messages": [*one["messages"], *turn2["messages"][2:]]}
        a, b = render_bytes(one, True), render_bytes(two, True)
        assert b.startswith(a) and b[len(a):len(a) + 1] == b"\x1e"
        ka, kb = text_keys(a, chunk_chars=64), text_keys(b, chunk_chars=64)
        shared = next(i for i, (x, y) in enumerate(zip(ka.keys, kb.keys, strict=False)) if x != y) \
            if kb.keys[:len(ka.keys)] != ka.keys else len(ka.keys)
        assert len(a) - max(64, len(a) // 16) < kb.ends[shared - 1] <= len(a) and len(kb.keys) >= len(ka.keys)
        assert ka.ends[-1] == len(a)                                   # the last chunk ends at the text's end
    assert render_bytes({"prompt": ["one prompt"]}, False) == b"one prompt"
    assert render_bytes({"prompt": [1, 2]}, False) == b""


P = expand(["http://p0:1", "http://p1:1", "http://p2:1"], Role.PREFILL)
D = expand(["http://d0:1", "http://d1:1"], Role.DECODE)


def test_the_tie_break_key_is_the_first_block_not_every_prefiller_holds() -> None:
    ids = list(range(1000, 1000 + 16 * 10))
    keys = block_keys(ids, 16)
    lookup = PrefixLookup({16: keys}, "tokens", block_sizes={e.name: 16 for e in P})
    targets = [(e, True, True) for e in P]

    def key(cached: dict[Any, int]) -> bytes | None:
        return PrefixRouter._routing_key(lookup, targets, cached)

    first = keys.keys[0].to_bytes(8, "big", signed=True)
    assert key({}) == first                                         # nobody holds anything: the first block
    assert key({P[0]: 64}) == first                                 # not everyone: still the first
    assert key(dict.fromkeys(P, 64)) == keys.keys[4].to_bytes(8, "big", signed=True)   # past a shared prompt
    assert key(dict.fromkeys(P, 10_000)) == keys.keys[-1].to_bytes(8, "big", signed=True)


def test_a_decoder_holding_the_prompt_wins_only_among_equally_loaded() -> None:
    pool = EndpointPool(P + D)
    sched = Scheduler.standard(pool)
    hints = PrefixHints(cached_tokens={D[1]: 4000})
    req = PickRequest("r", prompt_tokens=5000, hints=hints)
    assert {sched.pick(Role.DECODE, PickRequest(f"r{i}", prompt_tokens=5000, hints=hints))
            for i in range(10)} == {D[1]}                              # pulls 1,000 instead of 5,000
    with pool.lease(D[1], 100):                                       # one more request in its batch: tier 0
        assert sched.pick(Role.DECODE, req) == D[0]


def test_prompts_in_flight_count_as_cached_where_they_run() -> None:
    from pdproxy.prefix.routing import InflightPrefixes

    flying = InflightPrefixes()
    system = list(range(16 * 8))
    a = block_keys(system + [1] * 40, 16)
    b = block_keys(system + [2] * 40, 16)
    flying.add("p0", a)
    assert flying.match(b, "p0") == 16 * 8 and flying.match(b, "p1") == 0
    assert flying.match(block_keys(system + [1] * 40, 32), "p0") == 0      # another block size: other keys
    flying.remove("p0", a)                                       # the attempt failed: gone
    assert flying.match(b, "p0") == 0 and len(flying) == 0
    now = [100.0]
    settling = InflightPrefixes(settle_s=5.0, clock=lambda: now[0])
    settling.add("p0", a)
    settling.remove("p0", a, answered=True)                    # answered: until its KV events are surely read
    now[0] += 4.0
    assert settling.match(b, "p0") == 16 * 8
    now[0] += 2.0
    assert settling.match(b, "p0") == 0 and len(settling) == 0 and not settling._held


def test_queues_closer_than_the_resolution_tie_and_in_flight_requests_decide() -> None:
    from pdproxy.engines.limits import Limits
    from pdproxy.scheduling.queue import PrefillLedger

    pool = EndpointPool(P + D)
    ledger = PrefillLedger(pool, Limits(pool, {}), budget_tokens=0)
    sched = Scheduler.standard(pool, ledger=ledger, prefill_resolution_tokens=256)
    everywhere = PrefixHints(cached_tokens=dict.fromkeys(P, 1500))
    req = PickRequest("r", prompt_tokens=1575, hints=everywhere)
    slot = ledger.hold(P[0], 1575, 0, compute_tokens=75)             # P0 answers a small prefill...
    with pool.lease(P[1], 1575), pool.lease(P[1], 1575):            # ...P1 has two requests in flight
        assert [sc[0] for sc in sched.score(Role.PREFILL, req, P)] == [75.0, 75.0, 75.0]   # 75 queued rounds to 0
        assert sched.pick(Role.PREFILL, req) in (P[0], P[2])          # tier 1: fewer requests in flight
        slot.release()
        held = ledger.hold(P[2], 5000, 0, compute_tokens=300)        # a queue one step longer counts
        assert sched.pick(Role.PREFILL, req) == P[0]
        held.release()
    hints = PrefixHints(cached_tokens={P[2]: 1510})                  # a prefix hit counts to the token
    assert sched.pick(Role.PREFILL, PickRequest("r", prompt_tokens=1575, hints=hints)) == P[2]


def test_text_keys_of_a_rendered_chat_are_pinned() -> None:
    # replicas and versions key a prompt alike (the picker's tie-break key, the approximate index across a
    # restart): the keys of one chat — tools, a list content with a mark inside, tool calls, a role that is not
    # a string, non-ASCII text — as the rendering first keyed them (a text, formatted then encoded)
    body = {"tools": [{"type": "function", "function": {"name": "grep", "description": "search files é"}}],
            "messages": [{"role": "system", "content": "You are a coding agent. " * 6},
                         {"role": "user", "content": [{"type": "text", "text": "Fix ☃ in\x1emain.py"},
                                                      {"type": "image_url"}]},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "grep", "arguments": '{"q": "☃"}'}}]},
                         {"role": None, "content": 17}, {"role": "tool", "content": "main.py:3: x = '☃'"}]}
    keys = text_keys(render_bytes(body, True), chunk_chars=16, namespace="m")
    assert keys.num_chars == 395 and keys.ends == [16, 32, 48, 64, 80, 96, 112, 128, 144, 162, 182, 204, 229, 255,
                                                    286, 321, 361, 395]
    assert keys.keys == [
        8256292637354454668, 16019773111651134166, 4299414531826878635, 3489712071052954578, 16019478842703787130,
        1824734322904574074, 4488672694323462285, 7143787276218162239, 15335403299361016369, 5305698952034529564,
        2518824593386082122, 5056739300937358290, 12578474548483258503, 10961350380700196707, 4526384372057410479,
        6473355559937028508, 3814072231123602999, 14589595235104345335]
    assert keys == text_keys(render_bytes(body, True).decode(), chunk_chars=16, namespace="m")    # text or bytes
    assert keys == text_keys(render_parts(body, True), chunk_chars=16, namespace="m")   # or its parts, unjoined


@pytest.mark.parametrize("mode", ["auto", "approximate", "precise"])
def test_an_answered_prompt_settles_only_where_kv_events_will_tell_of_it(mode: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the answered prompt's keys go into the approximate index (modes auto / approximate, text keys or an
    engine without live events), its in-flight credit ends with the prefill — the record predicts the prompt from
    then on; where nothing predicts it (precise, no live publisher) there is nothing to credit; it settles only
    for token keys on an engine whose KV events will tell of it."""
    import asyncio

    from pdproxy.apis.request import Api, parse_request
    from pdproxy.app.state import ProxyState
    from pdproxy.prefix.index import BlockKeys
    from pdproxy.settings import Settings
    from pdproxy.timeline import RequestContext, new_request_id

    async def run() -> None:
        state = ProxyState.build(Settings(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:10"],
                                          prefix_routing=mode))
        _engines_known(state)
        prefiller = state.pool.endpoints(Role.PREFILL)[0]
        router = state.prefix
        await state.admission.start()
        try:
            raw = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "%s"}]}' % (
                b"all work and no play " * 400)

            async def routed() -> tuple[Any, RequestContext]:
                req = parse_request(raw, Api.CHAT)
                ctx = RequestContext(request_id=new_request_id(None), client_request_id=None, api_label="chat")
                await state.admission.admit(req, ctx)
                await router.hints(req, ctx)
                return req, ctx

            first, ctx = await routed()
            with router.prefilling(first, ctx, prefiller):
                assert len(router.inflight) == 1
            second, _ = await routed()
            assert len(router.inflight) == 0 and not router.inflight._held      # no settling
            predictions = second.prefix_lookup.predictions
            if mode == "precise":          # no live publisher: no prediction that a settling credit could raise
                assert prefiller.name not in predictions
            else:                          # recorded: the record predicts the prompt
                assert predictions[prefiller.name].cached_tokens > 0
            tokens = BlockKeys([1, 2, 3], 16, 64)
            assert not router._settles(prefiller, tokens)     # token keys (a tokenizer) but no live publisher
            monkeypatch.setattr(state.prefix_cache, "is_precise", lambda name: True)
            assert router._settles(prefiller, tokens)                            # token keys on a live publisher
            assert not router._settles(prefiller, first.prefix_lookup.keys_for(prefiller.name))   # text keys
        finally:
            await state.admission.aclose()

    asyncio.run(run())


def test_the_ids_cache_bound_holds_its_memory_for_blocks_of_few_tokens() -> None:
    """Each block is charged its entry's bookkeeping beside its ids, and its ids are kept as bytes the garbage
    collector does not track: a client's blocks of 4 tokens each (256 spaces can be that few) once held ~30 times
    the memory the bound said, as two tracked objects each, and a full cache lengthened every full collection's
    pause (0.64 s at the 4M default)."""
    import gc
    import tracemalloc

    bound = 200_000                                      # "tokens": ~800 KB
    tracemalloc.start()
    try:
        cache = IdsCache(max_tokens=bound)
        for i in range(50_000):
            cache.put(i.to_bytes(16, "little"), [i, i + 1, i + 2, i + 3])
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cache.size <= bound and len(cache._data) <= bound // 80
    assert held < 4 * bound * 1.5, held
    key = (49_999).to_bytes(16, "little")
    assert list(cache.ids(key) or []) == [49_999, 50_000, 50_001, 50_002]
    gc.collect()
    assert not any(gc.is_tracked(entry) for entry in cache._data.values())   # nothing a collection walks


@pytest.mark.parametrize("source", ["sim", "hf"])
@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": 1}},
    {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"tools": 1}},
    {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"add_generation_prompt": True}},
    {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "x"},
    {"messages": [5]}, {"messages": None}, {"messages": [{"role": "user", "content": "hi"}], "tools": 5}])
def test_a_chat_the_template_cannot_render_is_a_value_error_for_every_caller(source: str, hf_dir: Path,
                                                                            body: dict[str, Any]) -> None:
    """Counting and prefix keys treat a ``ValueError`` as "the engine judges it" (its own 400, or the estimate);
    any other error of the template escaped as pdproxy's 500 with a traceback — a ``chat_template_kwargs`` naming
    one of the template's own arguments (``TypeError``: got multiple values), a message that is no object."""
    counter = LocalCounter("sim" if source == "sim" else str(hf_dir))
    for call in (lambda: counter.count(body, True), lambda: counter.token_ids(body, True)):
        try:
            call()
        except ValueError:
            pass                                     # (the sim template ignores some of them: rendered, fine)


def test_a_prefill_answered_after_its_prefiller_was_removed_records_nothing() -> None:
    """A forced remove (admin API) drops what prefix routing knew of the endpoint (4ff6e50); a prefill in flight
    there that is answered afterwards recorded its prompt in the approximate index all the same — the removed
    engine's location, its ``pdproxy_prefix_index_approx_entries`` series and a prediction an engine added later at
    the same address inherited came back."""
    import asyncio

    from pdproxy.apis.request import Api, parse_request
    from pdproxy.app.state import ProxyState
    from pdproxy.settings import Settings
    from pdproxy.timeline import RequestContext, new_request_id

    async def run() -> None:
        state = ProxyState.build(Settings(prefill=["http://127.0.0.1:9", "http://127.0.0.1:11"],
                                          decode=["http://127.0.0.1:10"], prefix_routing="approximate"))
        _engines_known(state)
        prefiller = state.pool.endpoints(Role.PREFILL)[0]
        await state.admission.start()
        try:
            raw = b'{"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "%s"}]}' % (
                b"all work and no play " * 400)
            req = parse_request(raw, Api.CHAT)
            ctx = RequestContext(request_id=new_request_id(None), client_request_id=None, api_label="chat")
            await state.admission.admit(req, ctx)
            await state.prefix.hints(req, ctx)
            with state.prefix.prefilling(req, ctx, prefiller):
                state.health.remove(prefiller)                   # forced while the prefill runs
                assert prefiller.name not in state.prefix_cache.approx.endpoints()
            assert prefiller.name not in state.prefix_cache.approx.endpoints()
        finally:
            await state.admission.aclose()

    asyncio.run(run())


def _engines_known(state: Any) -> None:
    """Every endpoint of ``state`` (a ``ProxyState``) refreshed as a 100,000-token engine serving model ``m``
    (block size 16, 10,000 blocks), as its first refresh would leave it."""
    for e in state.pool.endpoints():
        info = state.infos[e]
        info.models = [{"id": "m", "object": "model", "max_model_len": 100_000}]
        info.max_model_len, info.block_size, info.num_gpu_blocks = 100_000, 16, 10_000
        info.kv_pool_tokens, info.reachable = 160_000, True
        state.prefix_cache.update_engine(e, info)
