"""Several models without sockets: served ids with the operator's pins, limits and the prefill queue per model,
the ``/v1/models`` union."""

from __future__ import annotations

import asyncio

import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineInfo
from pdproxy.engines.limits import Limits
from pdproxy.engines.models import ServedModels
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import BadRequest, ModelNotFound
from pdproxy.prefix.routing import PrefixRouter
from pdproxy.scheduling import PickRequest, Scheduler
from pdproxy.scheduling.queue import PrefillLedger, PrefillQueue

PA, PB = Endpoint("http://pa", Role.PREFILL), Endpoint("http://pb", Role.PREFILL)
DA, DB = Endpoint("http://da", Role.DECODE), Endpoint("http://db", Role.DECODE)


def card(mid: str, mml: int | None = None, parent: str | None = None) -> dict[str, object]:
    return {"id": mid, "object": "model", "max_model_len": mml, "parent": parent}


def two_models() -> dict[Endpoint, EngineInfo]:
    return {PA: EngineInfo(models=[card("a", 2048), card("a-lora", None, "a")], max_model_len=2048),
            DA: EngineInfo(models=[card("a", 1024)], max_model_len=1024),
            PB: EngineInfo(models=[card("b", 8192)], max_model_len=8192),
            DB: EngineInfo(models=[card("b", 8192)], max_model_len=8192)}


def test_served_ids_follow_the_listing_narrowed_by_pins() -> None:
    infos = two_models()
    served = ServedModels(infos, {(Role.PREFILL, "http://pa"): frozenset({"a"})})
    assert served.ids(PA) == {"a"}                               # pinned: the adapter is not taken there
    assert served.ids(DB) == {"b"} and served.serves(DB, "b") and not served.serves(DB, "a")
    assert served.serves(DA, None)                                # no model: any endpoint
    infos[DA] = EngineInfo()                                      # never refreshed: not ruled out
    assert served.serves(DA, "anything")
    pinned_unknown = ServedModels({DB: EngineInfo()}, {(Role.DECODE, "http://db"): frozenset({"b"})})
    assert pinned_unknown.ids(DB) == {"b"} and not pinned_unknown.serves(DB, "a")


def test_unknown_model_is_vllms_404_listing_base_models_only() -> None:
    served = ServedModels(two_models())
    served.require("a")
    with pytest.raises(ModelNotFound) as e:
        served.require("zzz")
    assert e.value.message == "The model `zzz` does not exist. Valid aliases: a, b."
    with pytest.raises(ModelNotFound):
        served.require("a-lora")                                  # only a prefiller lists it: no decoder serves it
    router = PrefixRouter.__new__(PrefixRouter)                   # its namespaces: only the listings are read
    router.infos = two_models()
    assert router.namespace("a-lora") == "a-lora" and router.namespace("a") == "" and router.namespace(None) == ""


def test_a_request_without_a_model_is_routed_as_the_one_served_else_refused() -> None:
    """A request that names no model (vLLM then runs its first served model) is routed as the one base model the
    endpoints serve, so its prefill and decode are on engines of one model; with several served it is a 400
    naming them — it once prefilled on one model's engine and decoded (with that KV handle) on another's."""
    one = {PA: two_models()[PA], DA: two_models()[DA]}
    assert ServedModels(one).route_model(None) == "a" and ServedModels(one).route_model("") == "a"
    emb = Endpoint("http://emb", Role.DECODE)                         # a pooling engine beside them: no prefiller
    assert ServedModels({**one, emb: EngineInfo(models=[card("emb")])}).route_model(None) == "a"
    assert ServedModels({DA: two_models()[DA]}).route_model(None) == "a"   # decode-only: the decoders' model
    assert ServedModels(one).route_model("a-lora") == "a-lora"          # a named model is kept as named
    assert ServedModels({PA: EngineInfo(), DA: EngineInfo()}).route_model(None) is None   # none known yet: any
    with pytest.raises(BadRequest) as e:
        ServedModels(two_models()).route_model(None)
    assert e.value.param == "model" and e.value.status_code == 400
    assert "serves several (a, b)" in e.value.message


def test_models_union_has_each_models_longest_servable_context() -> None:
    """Each model's ``max_model_len``: the largest among its prefillers and among its decoders, the smaller of the
    two — what admission lets through (a request needs one of each)."""
    cards = {c["id"]: c for c in ServedModels(two_models()).cards()}
    assert cards["a"]["max_model_len"] == 1024 and cards["b"]["max_model_len"] == 8192
    assert "a-lora" not in cards                              # only a prefiller loads it: no decoder serves it
    infos = two_models()
    infos[DA] = EngineInfo(models=[card("a", 1024), card("a-lora", None, "a")], max_model_len=1024)
    cards = {c["id"]: c for c in ServedModels(infos).cards()}
    assert cards["a-lora"]["parent"] == "a" and cards["a-lora"]["max_model_len"] is None
    assert ServedModels(two_models()).cards(max_model_len_override=512)[0]["max_model_len"] == 512
    capped = {c["id"]: c["max_model_len"] for c in ServedModels(infos).cards(max_model_len_override=4096)}
    assert capped == {"a": 1024, "b": 4096, "a-lora": None}   # a cap, never a raise: the engines refuse past theirs


def test_models_advertise_the_context_the_kv_pool_holds() -> None:
    """Seed 000: a decoder declaring 133,120 tokens with a KV pool of 4,584 is listed at 4,584, the context every
    longer prompt is refused at (it was listed at 133,120: clients sizing prompts from /v1/models got 400s)."""
    infos = two_models()
    infos[DB] = EngineInfo(models=[card("b", 133_120)], max_model_len=133_120, kv_pool_tokens=4584)
    infos[PB] = EngineInfo(models=[card("b", 133_120)], max_model_len=133_120, kv_pool_tokens=200_000)
    cards = {c["id"]: c for c in ServedModels(infos).cards()}
    assert cards["b"]["max_model_len"] == 4584 and cards["a"]["max_model_len"] == 1024
    infos[DB] = EngineInfo(models=[card("b", 133_120)], max_model_len=133_120, kv_pool_tokens=4584, block_size=4,
                           num_gpu_blocks=1146)       # its blocks known: one is vLLM's null block, never a request's
    assert {c["id"]: c for c in ServedModels(infos).cards()}["b"]["max_model_len"] == 4580


def test_a_rank_with_a_smaller_pool_does_not_shrink_the_advertised_context() -> None:
    """Decoder ranks of one model with unequal KV pools: ``/v1/models`` says what the larger ranks hold, the
    limit admission applies (a longer prompt goes to them) and the over-length 400 names (old code: the smallest
    rank's pool, so clients sizing prompts by it were cut short for nothing)."""
    small = Endpoint("http://db-small", Role.DECODE)
    infos = two_models()
    infos[DB] = EngineInfo(models=[card("b", 16_384)], max_model_len=16_384, kv_pool_tokens=100_000)
    infos[small] = EngineInfo(models=[card("b", 16_384)], max_model_len=16_384, kv_pool_tokens=4_800)
    infos[PB] = EngineInfo(models=[card("b", 16_384)], max_model_len=16_384, kv_pool_tokens=100_000)
    assert {c["id"]: c for c in ServedModels(infos).cards()}["b"]["max_model_len"] == 16_384
    infos[DB] = EngineInfo(models=[card("b", 16_384)], max_model_len=16_384, kv_pool_tokens=9_000)
    assert {c["id"]: c for c in ServedModels(infos).cards()}["b"]["max_model_len"] == 9_000   # the best decoder's
    infos[PB] = EngineInfo(models=[card("b", 8_000)], max_model_len=8_000)
    assert {c["id"]: c for c in ServedModels(infos).cards()}["b"]["max_model_len"] == 8_000   # now the prefiller's


def test_limits_are_per_model() -> None:
    infos = two_models()
    pool = EndpointPool(list(infos))
    limits = Limits(pool, infos, served=ServedModels(infos))
    assert limits.max_prompt_tokens(None, model="a") == 1023       # DA's 1024 - 1 output token
    assert limits.max_prompt_tokens(None, model="b") == 8191
    assert limits.max_prompt_tokens(None) == 8191                  # no model: the most permissive pair
    violation = limits.violation(1500, None, model="a")
    assert violation is not None and violation.limit == 1024 and violation.role is Role.DECODE
    assert limits.violation(1500, None, model="b") is None


@pytest.mark.anyio
@pytest.mark.timeout(10)
async def test_a_model_whose_prefillers_are_full_does_not_hold_up_another_models_queue() -> None:
    infos = two_models()
    pool = EndpointPool(list(infos))
    served = ServedModels(infos)
    limits = Limits(pool, infos, served=served)
    ledger = PrefillLedger(pool, limits, budget_tokens=1000, decoder_capacity=False)
    queue = PrefillQueue(ledger, Scheduler.standard(pool, ledger=ledger, infos=infos, limits=limits, served=served),
                         max_waiting=10, timeout_s=5, aging_tokens_per_s=0.0, busy_tokens=10_000)
    release = asyncio.Event()
    granted: list[str] = []

    async def take(model: str, tokens: int) -> None:
        async with queue.slot(tokens, tokens + 1, request=PickRequest(request_id=f"{model}{tokens}", model=model,
                                                                      prompt_tokens=tokens)) as slot:
            granted.append(f"{model}:{tokens}:{slot.endpoint.url}")
            await release.wait()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(take("a", 900))
        while not granted:
            await asyncio.sleep(0.005)
        tg.create_task(take("a", 700))                             # does not fit PA's budget: waits, first in line
        while queue.depth < 1:
            await asyncio.sleep(0.005)
        tg.create_task(take("b", 800))                             # behind it in order, but for another pool
        while len(granted) < 2:
            await asyncio.sleep(0.005)
        assert granted == ["a:900:http://pa", "b:800:http://pb"] and queue.depth == 1
        release.set()
    assert granted[-1] == "a:700:http://pa" and queue.idle()


def test_served_ids_follow_each_refresh_of_the_listing() -> None:
    """A refresh replaces the endpoint's list of cards; the ids follow every new list, even one CPython places
    at the address of a list read before (a cache keyed by ``id()`` answered the old model here)."""
    info = EngineInfo(models=[card("model-0")])
    served = ServedModels({DA: info})
    for k in range(0, 24, 2):
        info.models = [card(f"model-{k}")]
        assert served.ids(DA) == {f"model-{k}"} and served.serves(DA, f"model-{k}")
        info.models = [card(f"model-{k + 1}")]      # two refreshes, no lookup between: the list read last is
        info.models = [card(f"model-{k + 2}")]      # freed and its address can come back for the next one
        assert served.ids(DA) == {f"model-{k + 2}"} and not served.serves(DA, f"model-{k}")


def test_a_card_whose_max_model_len_is_a_boolean_declares_none() -> None:
    """An engine's ``"max_model_len": true`` is no limit to admission (``EngineClient.refresh``: its
    ``EngineInfo.max_model_len`` is None), so the ``max_model_len`` setting stands in for it there; ``/v1/models``
    advertised ``true`` (``min(True, 4096)`` is True), where admission applies 4096."""
    infos = {PA: EngineInfo(models=[card("a", True)]), DA: EngineInfo(models=[card("a", True)])}  # type: ignore[arg-type]
    pool = EndpointPool(list(infos))
    assert Limits(pool, infos, max_model_len_override=4096).of(DA).max_model_len == 4096
    assert ServedModels(infos).cards(max_model_len_override=4096)[0]["max_model_len"] == 4096
    assert ServedModels(infos).cards()[0]["max_model_len"] is None


@pytest.mark.parametrize("declared", [0, -1])
def test_a_card_whose_max_model_len_is_no_positive_count_declares_none(declared: int) -> None:
    """An engine's ``"max_model_len": 0`` (or less) is no limit to admission (``EngineClient.refresh``, f28d5f6:
    its ``EngineInfo.max_model_len`` is None), so the ``max_model_len`` setting stands in for it there;
    ``/v1/models`` advertised 0 (``min(0, 4096)``), a context no prompt fits, where admission applies 4096."""
    infos = {PA: EngineInfo(models=[card("a", declared)]), DA: EngineInfo(models=[card("a", declared)])}
    pool = EndpointPool(list(infos))
    assert Limits(pool, infos, max_model_len_override=4096).of(DA).max_model_len == 4096
    assert ServedModels(infos).cards(max_model_len_override=4096)[0]["max_model_len"] == 4096
    assert ServedModels(infos).cards()[0]["max_model_len"] is None


def test_models_listed_are_those_a_request_can_be_served_for() -> None:
    """Every request needs a decoder of its model: a model only prefillers serve is not listed (while there are
    decoders, and their lists are known), one only decoders serve is (its routes without a PD leg serve it)."""
    infos = {PA: two_models()[PA], DA: two_models()[DA], PB: two_models()[PB]}     # beta: no decoder
    served = ServedModels(infos)
    assert {c["id"] for c in served.cards()} == {"a"}                 # a-lora: on the prefiller only
    assert not served.servable("b") and not served.servable("a-lora") and served.servable("a")
    assert served.one_role() == {"a-lora": Role.PREFILL, "b": Role.PREFILL}
    with pytest.raises(ModelNotFound):
        served.require("b")                                           # as a request for it is refused
    infos[DB] = EngineInfo()                                          # a decoder not read yet may serve it
    assert served.servable("b") and {c["id"] for c in served.cards()} == {"a", "a-lora", "b"}
    assert served.one_role() == {}
    infos[DB] = EngineInfo(models=[card("emb", 512)])                 # a pooling model on a decoder: listed
    assert {c["id"] for c in served.cards()} == {"a", "emb"}
    assert served.one_role() == {"a-lora": Role.PREFILL, "b": Role.PREFILL, "emb": Role.DECODE}
    pinned = ServedModels(two_models(), {(Role.DECODE, "http://db"): frozenset({"a"})})   # db takes no beta
    assert "b" not in {c["id"] for c in pinned.cards()} and pinned.one_role()["b"] is Role.PREFILL
    only_prefillers = ServedModels({PA: two_models()[PA], PB: two_models()[PB]})          # no decoder at all
    assert {c["id"] for c in only_prefillers.cards()} == {"a", "a-lora", "b"} and only_prefillers.one_role() == {}
    only_decoders = ServedModels({DA: two_models()[DA]})                                  # decode-only deployment
    assert {c["id"] for c in only_decoders.cards()} == {"a"} and only_decoders.one_role() == {}
