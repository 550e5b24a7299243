"""What a pick is about (pdproxy/scheduling/request.py): admission's result and the prefix lookup are typed fields
of the request, and a fan-out sibling's prefiller comes in as an argument — no string-keyed bag in between."""

from __future__ import annotations

import dataclasses

import orjson

from pdproxy.apis.request import Api, ProxyRequest, parse_request
from pdproxy.endpoints import Endpoint, Role
from pdproxy.scheduling import PickRequest, PrefixHints


def test_pick_request_of_reads_admissions_typed_result_and_takes_affinity() -> None:
    req = parse_request(orjson.dumps({"model": "m", "prompt": "hello", "max_tokens": 7}), Api.COMPLETIONS)
    req.prompt_tokens, req.prompt_tokens_upper = 40, 48
    sibling = Endpoint("http://p1:8100", Role.PREFILL)
    hints = PrefixHints(routing_key=b"k")
    pick = PickRequest.of(req, "r-1", hints, affinity=sibling)
    assert (pick.request_id, pick.model, pick.prompt_tokens, pick.prompt_tokens_upper, pick.limit_tokens) == (
        "r-1", "m", 40, 48, 48)
    assert (pick.max_output_tokens, pick.hints, pick.affinity) == (7, hints, sibling)
    assert PickRequest.of(req, "r-2").affinity is None


def test_the_request_carries_no_string_keyed_bag() -> None:
    names = {f.name for f in dataclasses.fields(ProxyRequest)}
    assert "extra" not in names
    assert {"prompt_tokens", "prompt_tokens_upper", "prompt_tokens_estimated", "prefix_lookup"} <= names
