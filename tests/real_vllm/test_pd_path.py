"""The ``openai`` client through pdproxy to real vLLM 0.32 engines (NixlConnector on loopback): chat and
completions, streaming and not, and proof that the PD path really happened:

- the prefiller returned ``kv_transfer_params`` (pdproxy's own view of the prefill answer);
- the decoder pulled the KV over NIXL: its ``vllm:nixl_xfer_time_seconds_count`` grew by one and
  ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` by the whole prompt, while
  ``source="local_compute"`` did not grow (it did not prefill the prompt itself);
- the prefiller computed the prompt and generated exactly one token (the capped prefill leg).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

from pdproxy.apis import kv_transfer
from tests.real_vllm.support import Engines, Prompts, metric, scrape
from tests.support import ProxyThread, wait_until

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(90)]
MAX_TOKENS = 12


def counters(url: str) -> dict[str, float]:
    text = scrape(url)
    return {
        "xfers": metric(text, "vllm:nixl_xfer_time_seconds_count"),
        "external": metric(text, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer"),
        "local": metric(text, "vllm:prompt_tokens_by_source_total", source="local_compute"),
        "cache_hit": metric(text, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"),
        "generated": metric(text, "vllm:generation_tokens_total"),
        "length": metric(text, "vllm:request_success_total", finished_reason="length"),
    }


def ask(client: openai.OpenAI, api: str, stream: bool, prompt: str) -> tuple[str, Any, str | None]:
    """One request; returns (text, usage, finish_reason)."""
    usage_opts: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    if api == "completions":
        reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, **usage_opts)
        if not stream:
            return reply.choices[0].text, reply.usage, reply.choices[0].finish_reason
        chunks = list(reply)
        texts = [c.choices[0].text for c in chunks if c.choices]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        return "".join(texts), chunks[-1].usage, finish
    messages = [{"role": "user", "content": prompt}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS, **usage_opts)
    if not stream:
        return reply.choices[0].message.content or "", reply.usage, reply.choices[0].finish_reason
    chunks = list(reply)
    assert chunks[0].choices[0].delta.role == "assistant"
    texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    return "".join(texts), chunks[-1].usage, finish


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_openai_client_through_pdproxy_takes_the_pd_path(
        engines: Engines, prompts: Prompts, make_proxy: Callable[..., ProxyThread], monkeypatch: pytest.MonkeyPatch,
        api: str, stream: bool) -> None:
    returned: list[dict[str, Any] | None] = []
    extract = kv_transfer.extract_params

    def spy(reply: dict[str, Any]) -> kv_transfer.KVHandle | None:
        params = extract(reply)
        returned.append(None if params is None else params.params())   # the handle's bytes, parsed to read
        return params

    monkeypatch.setattr(kv_transfer, "extract_params", spy)
    proxy = make_proxy(engines, tokenizer=str(engines.model_dir))
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompt = prompts.unique(40, seed=hash((api, stream)) & 0xFFFF)    # no prefix-cache hit on either engine
    n_prompt = prompts.count({"messages": [{"role": "user", "content": prompt}]} if api == "chat"
                             else {"prompt": prompt}, api)
    p0, d0 = counters(engines.prefill_url), counters(engines.decode_url)

    text, usage, finish = ask(client, api, stream, prompt)

    assert text and finish == "length"
    assert (usage.prompt_tokens, usage.completion_tokens) == (n_prompt, MAX_TOKENS)
    assert usage.prompt_tokens_details.cached_tokens == 0           # the prefiller's figure (no hit)
    assert len(returned) == 1 and returned[0] is not None           # the prefiller returned kv_transfer_params
    params = returned[0]
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == n_prompt
    assert {"remote_engine_id", "remote_block_ids", "remote_request_id", "remote_host", "remote_port"} <= set(params)

    def decoder_pulled() -> dict[str, float] | None:
        d = counters(engines.decode_url)
        return d if d["xfers"] > d0["xfers"] and d["generated"] - d0["generated"] >= MAX_TOKENS else None

    d1 = wait_until(decoder_pulled, 10, 0.1, "decoder metrics after the pull")
    p1 = counters(engines.prefill_url)
    assert d1["xfers"] - d0["xfers"] == 1                           # one NIXL transfer
    assert d1["external"] - d0["external"] == n_prompt              # the whole prompt came from the prefiller
    assert d1["local"] - d0["local"] == 0                           # the decoder did not prefill it
    assert d1["generated"] - d0["generated"] == MAX_TOKENS
    assert (p1["local"] + p1["cache_hit"]) - (p0["local"] + p0["cache_hit"]) == n_prompt
    assert (p1["generated"] - p0["generated"], p1["length"] - p0["length"]) == (1, 1)   # the capped prefill leg
