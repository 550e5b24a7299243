"""How the prefix lookup's token count sizes a request (``PrefixRouter.hints``, pdproxy/prefix/routing.py): an
exact count from token keys always replaces admission's; a text estimate (bytes × the engine's learnt tokens per
byte) never replaces an exact count, stays within admission's bounds when admission bounded the prompt, and
replaces admission's own estimate when admission could only estimate — and the legs pdproxy builds from a request
(recompute, continuation) carry its exactness and bounds, so the same rules hold for them."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from pdproxy.apis.request import Api, ProxyRequest, parse_request
from pdproxy.prefix.routing import KeyKind, PrefixLookup, PrefixRouter
from pdproxy.timeline import RequestContext

pytestmark = pytest.mark.timeout(10)


def request(tokens: int, *, lower: int = 0, upper: int | None = None, exact: bool = False,
            estimated: bool = False) -> ProxyRequest:
    req = parse_request(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}), Api.CHAT)
    req.prompt_tokens, req.prompt_tokens_lower, req.prompt_tokens_upper = tokens, lower, upper
    req.prompt_tokens_exact, req.prompt_tokens_estimated = exact, estimated
    return req


def sized(req: ProxyRequest, count: int, kind: KeyKind = "text") -> int | None:
    """``req.prompt_tokens`` after :meth:`PrefixRouter.hints` with a lookup whose count is ``count``."""
    router = PrefixRouter.__new__(PrefixRouter)        # only ``hints`` runs: its lookup is given

    async def lookup(_req: ProxyRequest, _ctx: RequestContext) -> PrefixLookup:
        return PrefixLookup({}, kind, token_count=count)

    router.lookup = lookup  # type: ignore[method-assign]
    ctx = RequestContext(request_id="r", client_request_id=None, api_label="chat")
    asyncio.run(router.hints(req, ctx))
    assert ctx.prompt_tokens in (None, req.prompt_tokens)
    return req.prompt_tokens


def test_an_exact_count_is_never_replaced_by_a_text_estimate() -> None:
    assert sized(request(5, lower=5, upper=5, exact=True), 12_000) == 5


def test_a_text_estimate_stays_within_admissions_bounds() -> None:
    assert sized(request(300, lower=100, upper=500), 12_000) == 500
    assert sized(request(300, lower=100, upper=500), 50) == 100
    assert sized(request(300, lower=100, upper=500), 420) == 420


def test_a_text_estimate_replaces_admissions_own_estimate() -> None:
    """Admission could not count (``token_count: estimate``, or ``/tokenize`` failed): its "upper bound" is its
    bytes/4 guess, and the engine-calibrated estimate (40K tokens of CJK) is the better one."""
    assert sized(request(30_000, upper=30_000, estimated=True), 40_000) == 40_000


def test_token_keys_count_exactly_and_always_replace() -> None:
    assert sized(request(300, lower=100, upper=500, exact=True), 9_000, kind="tokens") == 9_000


def test_legs_built_from_a_request_keep_its_exactness_and_bounds() -> None:
    parent = request(5, lower=5, upper=5, exact=True)
    leg = request(0)
    leg.size_from(parent, 20)                           # a recompute / text continuation leg: 20 tokens more
    assert (leg.prompt_tokens, leg.prompt_tokens_lower, leg.prompt_tokens_upper) == (25, 25, 25)
    assert sized(leg, 12_000) == 25                     # was: 12,000, over the pool of a prompt that fits
    bounded = request(0)
    bounded.size_from(request(300, lower=100, upper=500), 20)
    assert sized(bounded, 12_000) == 520
    ids = request(0)
    ids.size_exactly(77)                                # a token-id continuation
    assert sized(ids, 12_000) == 77 and ids.prompt_tokens_exact
