"""``/v1/responses`` (real ``openai`` client) and ``/v1/messages`` (real ``anthropic`` client) through pdproxy to
real vLLM 0.32 engines (NixlConnector on loopback), JSON and streamed, with proof that the PD path happened: the
prefiller returned ``kv_transfer_params`` for its one-token leg and the decoder pulled the whole prompt over NIXL
(``vllm:nixl_xfer_time_seconds_count`` + 1, ``prompt_tokens_by_source{external_kv_transfer}`` = the prompt,
``local_compute`` unchanged) — the checks of ``test_pd_path.py``, on the standard engines (no new start)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from pdproxy.apis import kv_transfer
from tests.real_vllm.support import Engines, Prompts
from tests.real_vllm.test_pd_path import counters
from tests.support import ProxyThread, wait_until

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(120)]
MAX_TOKENS = 8


def spy_params(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any] | None]:
    """The ``kv_transfer_params`` every prefill answer carried, as pdproxy read them."""
    returned: list[dict[str, Any] | None] = []
    extract = kv_transfer.extract_params

    def spy(reply: dict[str, Any]) -> kv_transfer.KVHandle | None:
        params = extract(reply)
        returned.append(None if params is None else params.params())   # the handle's bytes, parsed to read
        return params

    monkeypatch.setattr(kv_transfer, "extract_params", spy)
    return returned


def assert_pulled(engines: Engines, before: tuple[dict[str, float], dict[str, float]], n_prompt: int) -> None:
    p0, d0 = before

    def decoder_pulled() -> dict[str, float] | None:
        d = counters(engines.decode_url)
        return d if d["xfers"] > d0["xfers"] and d["generated"] - d0["generated"] >= MAX_TOKENS else None

    d1 = wait_until(decoder_pulled, 10, 0.1, "decoder metrics after the pull")
    p1 = counters(engines.prefill_url)
    assert d1["xfers"] - d0["xfers"] == 1                           # one NIXL transfer
    assert d1["external"] - d0["external"] == n_prompt              # the whole prompt came from the prefiller
    assert d1["local"] - d0["local"] == 0                           # the decoder did not prefill it
    assert d1["generated"] - d0["generated"] == MAX_TOKENS
    assert p1["generated"] - p0["generated"] == 1                   # the one-token prefill leg


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_responses_through_pdproxy_take_the_pd_path(engines: Engines, prompts: Prompts,
                                                    make_proxy: Callable[..., ProxyThread],
                                                    monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    returned = spy_params(monkeypatch)
    proxy = make_proxy(engines, tokenizer=str(engines.model_dir))
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = prompts.unique(40, seed=0x5E5 + stream)
    before = counters(engines.prefill_url), counters(engines.decode_url)
    kwargs = {"model": engines.served_model, "input": prompt, "max_output_tokens": MAX_TOKENS, "temperature": 0}
    if stream:
        got = list(client.responses.create(**kwargs, stream=True))
        kinds = [e.type for e in got]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert [e.sequence_number for e in got] == list(range(len(got)))
        resp = got[-1].response
    else:
        resp = client.responses.create(**kwargs)
    assert resp.output_text and resp.usage is not None and resp.usage.output_tokens == MAX_TOKENS
    assert resp.usage.input_tokens_details.cached_tokens == 0       # the prefiller's figure: no hit
    assert len(returned) == 1 and returned[0] is not None and returned[0]["do_remote_prefill"] is True
    assert returned[0]["remote_num_tokens"] == resp.usage.input_tokens
    assert resp.id.startswith("resp_") and returned[0]["remote_request_id"].startswith(resp.id + "_0-")
    assert_pulled(engines, before, resp.usage.input_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_messages_through_pdproxy_take_the_pd_path(engines: Engines, prompts: Prompts,
                                                   make_proxy: Callable[..., ProxyThread],
                                                   monkeypatch: pytest.MonkeyPatch, stream: bool) -> None:
    returned = spy_params(monkeypatch)
    proxy = make_proxy(engines, tokenizer=str(engines.model_dir))
    client = anthropic.Anthropic(base_url=proxy.url, api_key="unused", max_retries=0, timeout=60)
    body = {"model": engines.served_model, "system": "Be brief.",
            "messages": [{"role": "user", "content": prompts.unique(40, seed=0x3E5 + stream)}]}
    n_prompt = int(httpx.post(engines.decode_url + "/v1/messages/count_tokens", json=body).json()["input_tokens"])
    before = counters(engines.prefill_url), counters(engines.decode_url)
    if stream:
        with client.messages.stream(**body, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}) as s:
            kinds = [e.type for e in s]
            message = s.get_final_message()
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    else:
        message = client.messages.create(**body, max_tokens=MAX_TOKENS, extra_body={"temperature": 0})
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == MAX_TOKENS
    assert message.usage.cache_read_input_tokens == 0
    assert message.usage.input_tokens == n_prompt
    assert len(returned) == 1 and returned[0] is not None and returned[0]["remote_num_tokens"] == n_prompt
    assert_pulled(engines, before, n_prompt)
