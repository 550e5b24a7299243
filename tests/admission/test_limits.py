"""Engine limits and the over-length 400 (no sockets): P and D rules, the threshold M, vLLM's wording."""

from __future__ import annotations

import pytest

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineInfo
from pdproxy.engines.limits import Limits
from pdproxy.engines.pool import EndpointPool
from pdproxy.scheduling import PickRequest
from pdproxy.scheduling.filters import FitsLimits

pytestmark = pytest.mark.timeout(10)

P = Endpoint("http://p", Role.PREFILL)
P2 = Endpoint("http://p2", Role.PREFILL)
D = Endpoint("http://d", Role.DECODE)


def limits(p: EngineInfo, d: EngineInfo, p2: EngineInfo | None = None, override: int | None = None,
           clamp: bool = True) -> Limits:
    infos = {P: p, D: d} | ({P2: p2} if p2 else {})
    return Limits(EndpointPool(list(infos)), infos, max_model_len_override=override, clamp=clamp)


def info(mml: int | None, blocks: int | None = None, block_size: int = 16) -> EngineInfo:
    pool = blocks * block_size if blocks else None
    return EngineInfo(max_model_len=mml, kv_pool_tokens=pool, num_gpu_blocks=blocks, block_size=block_size)


def test_clamp_mode_needs_room_for_one_output_token_whatever_max_tokens() -> None:
    lim = limits(info(1000), info(1000))                                 # vLLM 0.32 clamps max_tokens
    assert lim.max_prompt_tokens(None) == lim.max_prompt_tokens(100) == 999
    assert lim.violation(999, 100) is None
    v = lim.violation(1000, None)
    assert v is not None and v.role is Role.PREFILL
    err = v.error(1000, exact=True)                                      # vLLM 0.32's body, word for word
    assert err.body()["error"] == {"message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                                   "type": "BadRequestError", "param": "max_tokens", "code": 400}
    assert v.ambiguous(1000, exact=False) and not v.ambiguous(1000, exact=True)   # a bound of L may be L + 1
    over = lim.violation(1001, None)
    assert over is not None and not over.ambiguous(1001, exact=False)


def test_reject_mode_counts_output_on_the_decoder_only() -> None:
    lim = limits(info(1000), info(1000), clamp=False)
    assert lim.max_prompt_tokens(None) == 999                            # every leg generates at least 1 token
    assert lim.max_prompt_tokens(100) == 900
    assert lim.violation(999, None) is None
    v = lim.violation(901, 100)
    assert v is not None and v.role is Role.DECODE and v.limit_kind == "max_model_len" and v.output_tokens == 100


def test_kv_pool_smaller_than_max_model_len_is_the_limit_and_is_named() -> None:
    lim = limits(info(133120, 1146, 4), info(133120, 1146, 4))          # docs/field-reports.md: 1146 × 4 = 4584 tokens
    assert lim.max_prompt_tokens(None) == 4579       # 1145 blocks (vLLM's null block is never given); + 1 token
    v = lim.violation(10_000, None)
    assert v is not None and v.role is Role.PREFILL and v.limit_kind == "kv_pool" and v.limit == 4580
    err = v.error(10_000, exact=True)
    body = err.body()["error"]
    assert err.status_code == 400 and body["type"] == "BadRequestError" and body["code"] == 400
    assert body["param"] == "input_tokens"
    msg = body["message"]
    assert "maximum context length" in msg and "133120" in msg and "4580" in msg and "10000" in msg
    assert "KV cache pool" in msg and "1146 blocks × 4 tokens less vLLM's null block" in msg
    assert lim.violation(4579, None) is None and lim.violation(4580, None) is not None   # the engine's own bound


VLLM_OVER_2048 = ("This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 "
                  "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
                  "of the input prompt. (parameter=input_tokens, value=2049)")
"""vLLM 0.32's body for any prompt over 2,048 tokens (``tests/real_vllm/captures/length_prompt3000_max1.json``)."""


@pytest.mark.parametrize("clamp", [True, False])
@pytest.mark.parametrize(("tokens", "exact"), [(2049, True), (3000, True), (5000, False)])
def test_over_max_model_len_is_vllms_body_whatever_the_count(clamp: bool, tokens: int, exact: bool) -> None:
    lim = limits(info(2048), info(2048), clamp=clamp)
    err = lim.violation(tokens, None).error(tokens, exact=exact)  # type: ignore[union-attr]
    assert err.body()["error"] == {"message": VLLM_OVER_2048, "type": "BadRequestError", "param": "input_tokens",
                                   "code": 400}
    assert err.prompt_tokens == tokens                                   # pdproxy's own count stays in its logs


def test_reject_mode_keeps_the_requested_output_wording() -> None:
    lim = limits(info(2048), info(2048), clamp=False)
    msg = lim.violation(2000, 100).error(2000, exact=True).message    # type: ignore[union-attr]
    assert msg == ("This model's maximum context length is 2048 tokens. However, you requested 100 output tokens "
                   "and your prompt contains 2000 input tokens, for a total of 2100 tokens. Please reduce the length "
                   "of the input prompt or the number of requested output tokens. "
                   "(parameter=input_tokens, value=2000)")


def test_most_permissive_endpoint_decides_and_routing_filters_the_rest() -> None:
    lim = limits(info(1000), info(4000), p2=info(3000))
    assert lim.max_prompt_tokens(None) == 2999
    assert FitsLimits(lim, Role.PREFILL)(PickRequest(prompt_tokens=2000), [P, P2]) == [P2]
    assert lim.violation(3000, None).endpoint == P2.name  # type: ignore[union-attr]


def test_unknown_limits_impose_nothing_and_override_wins() -> None:
    assert limits(info(None), info(None)).max_prompt_tokens(10) is None
    assert limits(info(None), info(5000)).max_prompt_tokens(None) == 4999
    assert limits(info(100_000), info(100_000), override=512).max_prompt_tokens(None) == 511


def test_the_setting_caps_an_engines_max_model_len_and_never_raises_it(caplog: pytest.LogCaptureFixture) -> None:
    """``max_model_len: 100000`` in front of 4,096-token engines: the engines' 4,096 stays (once logged per
    engine); old code admitted 100,000-token prompts, each refused by the prefiller after a round trip instead of
    pdproxy's fast 400.  An engine that declares nothing gets the setting."""
    caplog.set_level("WARNING", logger="pdproxy.limits")
    lim = limits(info(4096), info(4096), override=100_000)
    assert lim.max_prompt_tokens(None) == 4095
    assert lim.of(P).max_model_len == lim.of(D).max_model_len == 4096
    assert lim.max_prompt_tokens(None) == 4095
    assert sorted(r.getMessage() for r in caplog.records) == [
        "max_model_len 100000 is over engine http://d's own (4096): that engine's limit stays",
        "max_model_len 100000 is over engine http://p's own (4096): that engine's limit stays"]
    assert limits(info(None), info(None), override=100_000).max_prompt_tokens(None) == 99_999
