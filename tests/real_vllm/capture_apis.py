"""Capture real vLLM 0.32 answers for the APIs beyond completions/chat (not a test itself).

Records Responses (``/v1/responses``) and Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``)
JSON and SSE answers, each as a PD prefill leg (the ``kv_transfer_params`` stub, one output token) and as the
decode leg with the returned params; the render routes and ``/inference/v1/generate``; LoRA adapters in
``/v1/models``; the sampling parameters the simulator honours (stop strings and token ids, logprobs,
``response_format``, ``n``, ``min_tokens``, ``ignore_eos``, ``tool_choice``) and their error bodies; what the
constraint fields do on a one-token prefill leg; routes a generate model does not serve.

Engines: a prefiller and a decoder started by ``scripts/real-vllm.sh start`` with extra arguments::

    REAL_VLLM_PREFILL_ARGS="--enable-scale-out --enable-lora --lora-modules tiny-lora=DIR --max-lora-rank 8"
    REAL_VLLM_DECODE_ARGS="(the same)"

(``write_lora_adapter`` below writes DIR: a rank-8 adapter of zeros). Run as ``capture.py`` is run::

    eval "$(scripts/real-vllm.sh env)" && python tests/real_vllm/capture_apis.py [OUT_DIR]

``OUT_DIR`` defaults to ``tests/real_vllm/captures/apis/`` (its own ``index.json``, replayed in order by
``tests/real_vllm/test_sim_contract.py``). With ``--pooling`` it instead records the pooling routes of an engine
started with ``--runner pooling --convert embed`` (into ``captures/pooling/``), and with ``--tools`` the forced tool
calls of a pair started with ``--enable-auto-tool-choice --tool-call-parser hermes`` (into ``captures/tools/``).
Stdlib only.
"""

from __future__ import annotations

import http.client
import json
import struct
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from capture import DECODE, MESSAGES, MODEL, PREFILL, PREFILL_KV, PROMPT, Recorder

LORA = "tiny-lora"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ANTHROPIC_MESSAGES = [{"role": "user", "content": "Hi there"}]


def exchange(base: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
             timeout: float = 60.0) -> dict[str, Any]:
    """One HTTP exchange in ``capture.py``'s format; a body the server cuts short (an incomplete chunked
    stream) is kept as read, with ``"incomplete": true``."""
    hdrs = {"Content-Type": "application/json", **(headers or {})} if body is not None else dict(headers or {})
    url = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)
    t0 = time.monotonic()
    conn.request(method, path, body=json.dumps(body).encode() if body is not None else None, headers=hdrs)
    resp = conn.getresponse()
    chunks: list[bytes] = []
    incomplete = False
    try:
        while chunk := resp.read1(65536):
            chunks.append(chunk)
    except http.client.IncompleteRead as exc:
        chunks.append(exc.partial)
        incomplete = True
    conn.close()
    elapsed = time.monotonic() - t0
    lower = {k.lower(): v for k, v in resp.getheaders() if k.lower() != "date"}
    out: dict[str, Any] = {"status": resp.status, "headers": lower}
    text = b"".join(chunks).decode("utf-8", errors="replace")
    if lower.get("content-type", "").startswith("application/json") and not incomplete:
        out["json"] = json.loads(text)
    else:
        out["text"] = text
    if incomplete:
        out["incomplete"] = True
    return {"request": {"method": method, "url_path": path, "headers": hdrs, "body": body}, "response": out,
            "elapsed_s": round(elapsed, 4)}


def write_lora_adapter(out: Path, rank: int = 8) -> Path:
    """A PEFT LoRA adapter of zeros for the tiny model (q_proj, v_proj of 2 layers), stdlib only."""
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, list[int]] = {}
    for layer in range(2):
        for proj, width in (("q_proj", 256), ("v_proj", 128)):
            base = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{base}.lora_A.weight"] = [rank, 256]
            tensors[f"{base}.lora_B.weight"] = [width, rank]
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in tensors.items():
        size = shape[0] * shape[1] * 2  # bf16
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (out / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"],
        "task_type": "CAUSAL_LM", "bias": "none", "lora_dropout": 0.0, "fan_in_fan_out": False,
        "modules_to_save": None, "inference_mode": True}))
    return out


def pd(rec: Recorder, path: str, body: dict[str, Any], limit: dict[str, Any], rid: str, name: str,
       prefill_stream: bool = False) -> dict[str, Any] | None:
    """A prefill leg (``limit`` = the API's one-token output limit, stream off unless ``prefill_stream``), then
    the client ``body`` with the returned ``kv_transfer_params`` on the decoder. Returns the params."""
    prefill_body = {**body, **limit, "stream": prefill_stream, "kv_transfer_params": PREFILL_KV}
    p = rec.save(f"{name}_prefill", exchange(PREFILL, "POST", path, prefill_body, {"X-Request-Id": rid}))
    params = find_kv_params(p["response"])
    if params is None:
        return None
    rec.save(f"{name}_decode", exchange(DECODE, "POST", path, {**body, "kv_transfer_params": params},
                                        {"X-Request-Id": rid}))
    return params


def find_kv_params(response: dict[str, Any]) -> dict[str, Any] | None:
    """``kv_transfer_params`` of a JSON answer (top level) or of any SSE event (top level or in ``response``)."""
    if "json" in response:
        body = response["json"]
        return body.get("kv_transfer_params") if isinstance(body, dict) else None
    for line in response.get("text", "").splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: "):])
        for holder in (event, event.get("response") or {}, event.get("message") or {}):
            if isinstance(holder, dict) and holder.get("kv_transfer_params"):
                return holder["kv_transfer_params"]
    return None


def generation(rec: Recorder) -> None:
    """Responses and Messages, plain and through PD; count_tokens; their error bodies."""
    one = {"max_output_tokens": 1}
    resp = {"model": MODEL, "input": "Hi there", "max_output_tokens": 8, "temperature": 0}
    rec.save("responses_json", exchange(PREFILL, "POST", "/v1/responses", resp))
    rec.save("responses_stream", exchange(PREFILL, "POST", "/v1/responses", {**resp, "stream": True}))
    params = pd(rec, "/v1/responses", resp, one, "cap-resp", "pd_responses") or {}
    pd(rec, "/v1/responses", {**resp, "stream": True}, one, "cap-resp-stream", "pd_responses_stream")
    pd(rec, "/v1/responses", {**resp, "stream": True}, one, "cap-resp-pstream", "pd_responses_streamed_prefill",
       prefill_stream=True)
    # The body's request_id names the response (X-Request-Id does not): both legs can carry the proxy's id.
    pd(rec, "/v1/responses", {**resp, "request_id": "resp_cap-named"}, one, "cap-resp-named", "pd_responses_named")
    resp_tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    rec.save("responses_tool_required_no_parser", exchange(PREFILL, "POST", "/v1/responses", {
        **resp, "tools": resp_tools, "tool_choice": "required"}))
    items = {"model": MODEL, "instructions": "You are a helpful assistant.", "max_output_tokens": 8,
             "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]}]}
    rec.save("responses_items", exchange(PREFILL, "POST", "/v1/responses", items))

    msgs = {"model": MODEL, "max_tokens": 8, "messages": ANTHROPIC_MESSAGES, "temperature": 0}
    rec.save("messages_json", exchange(PREFILL, "POST", "/v1/messages", msgs))
    rec.save("messages_stream", exchange(PREFILL, "POST", "/v1/messages", {**msgs, "stream": True}))
    pd(rec, "/v1/messages", msgs, {"max_tokens": 1}, "cap-msg", "pd_messages")
    pd(rec, "/v1/messages", {**msgs, "stream": True}, {"max_tokens": 1}, "cap-msg-stream", "pd_messages_stream")
    rec.save("pd_messages_streamed_prefill_prefill", exchange(
        PREFILL, "POST", "/v1/messages", {**msgs, "max_tokens": 1, "stream": True, "kv_transfer_params": PREFILL_KV},
        {"X-Request-Id": "cap-msg-pstream"}))
    system = {**msgs, "system": "You are a helpful assistant.", "stop_sequences": ["zzzz"]}
    rec.save("messages_system", exchange(PREFILL, "POST", "/v1/messages", system))

    # The decoder given kv_transfer_params it cannot pull from (kv_load_failure_policy="fail"), JSON and SSE.
    bogus = {**params, "remote_engine_id": "no-such-engine", "remote_port": 5999}
    for api, path, body in (("responses", "/v1/responses", resp), ("messages", "/v1/messages", msgs)):
        for suffix, extra in (("", {}), ("_stream", {"stream": True})):
            name = f"decode_bad_remote_{api}{suffix}"
            rec.save(name, exchange(DECODE, "POST", path, {**body, **extra, "kv_transfer_params": bogus},
                                    {"X-Request-Id": f"cap-{name}"}))

    count = {"model": MODEL, "messages": ANTHROPIC_MESSAGES}
    rec.save("count_tokens", exchange(PREFILL, "POST", "/v1/messages/count_tokens", count))
    rec.save("count_tokens_system", exchange(PREFILL, "POST", "/v1/messages/count_tokens",
                                             {**count, "system": "You are a helpful assistant."}))
    rec.save("tokenize_chat_same_as_count", exchange(PREFILL, "POST", "/tokenize", {
        "model": MODEL, "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                     *ANTHROPIC_MESSAGES]}))

    errors = {
        "error_messages_no_max_tokens": ("/v1/messages", {"model": MODEL, "messages": ANTHROPIC_MESSAGES}),
        "error_messages_max_tokens_zero": ("/v1/messages", {**msgs, "max_tokens": 0}),
        "error_messages_unknown_model": ("/v1/messages", {**msgs, "model": "no-such-model"}),
        "error_messages_bad_role": ("/v1/messages", {**msgs, "messages": [{"role": "wizard", "content": "hi"}]}),
        "error_messages_temperature": ("/v1/messages", {**msgs, "temperature": -1}),
        "error_messages_stream_unknown_model": ("/v1/messages", {**msgs, "model": "no-such-model", "stream": True}),
        "error_count_tokens_unknown_model": ("/v1/messages/count_tokens", {**count, "model": "no-such-model"}),
        "error_responses_no_input": ("/v1/responses", {"model": MODEL}),
        "error_responses_unknown_model": ("/v1/responses", {**resp, "model": "no-such-model"}),
        "error_responses_temperature": ("/v1/responses", {**resp, "temperature": -1}),
        "error_responses_max_output_tokens_zero": ("/v1/responses", {**resp, "max_output_tokens": 0}),
        "error_responses_previous_id": ("/v1/responses", {**resp, "previous_response_id": "resp_nope"}),
        "error_responses_stream_unknown_model": ("/v1/responses", {**resp, "model": "no-such-model",
                                                                  "stream": True}),
    }
    for name, (path, body) in errors.items():
        rec.save(name, exchange(PREFILL, "POST", path, body))


def render(rec: Recorder) -> None:
    """Render routes (exact token ids with the chat template), /inference/v1/generate, derender."""
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
    rec.save("render_chat", exchange(PREFILL, "POST", "/v1/chat/completions/render", chat))
    rec.save("render_chat_tools", exchange(PREFILL, "POST", "/v1/chat/completions/render",
                                           {**chat, "tools": TOOLS, "tool_choice": "none"}))
    rec.save("render_completion", exchange(PREFILL, "POST", "/v1/completions/render",
                                           {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}))
    rec.save("render_completion_list", exchange(PREFILL, "POST", "/v1/completions/render",
                                                {"model": MODEL, "prompt": ["Hello", "world"], "max_tokens": 4}))
    rec.save("render_messages", exchange(PREFILL, "POST", "/v1/messages/render",
                                         {"model": MODEL, "max_tokens": 8, "messages": ANTHROPIC_MESSAGES}))
    rec.save("render_responses", exchange(PREFILL, "POST", "/v1/responses/render",
                                          {"model": MODEL, "input": "Hi there", "max_output_tokens": 8}))
    rec.save("error_render_unknown_model", exchange(PREFILL, "POST", "/v1/chat/completions/render",
                                                    {**chat, "model": "no-such-model"}))
    ids = exchange(PREFILL, "POST", "/tokenize", {"model": MODEL, "prompt": PROMPT})["response"]["json"]["tokens"]
    gen = {"model": MODEL, "token_ids": ids, "sampling_params": {"max_tokens": 4, "temperature": 0}}
    rec.save("generate_tokens", exchange(PREFILL, "POST", "/inference/v1/generate", gen))
    rec.save("generate_tokens_stream", exchange(PREFILL, "POST", "/inference/v1/generate",
                                                {**gen, "stream": True}))
    rec.save("generate_tokens_text", exchange(PREFILL, "POST", "/inference/v1/generate",
                                              {**gen, "output_mode": "text"}))
    pd(rec, "/inference/v1/generate", gen, {"sampling_params": {"max_tokens": 1, "temperature": 0}},
       "cap-gen", "pd_generate")
    rec.save("derender_completion", exchange(PREFILL, "POST", "/v1/completions/derender",
                                             {"model": MODEL, "token_ids": ids[:6]}))
    for path in ("/v1/embeddings", "/pooling", "/classify", "/score", "/rerank", "/v1/rerank", "/v2/rerank",
                 "/v1/nonexistent"):
        name = "not_served" + path.replace("/", "_")
        rec.save(name, exchange(PREFILL, "POST", path, {"model": MODEL, "input": "hello"}))
    rec.save("not_served_audio_transcriptions", exchange(PREFILL, "POST", "/v1/audio/transcriptions", None))


def sampling(rec: Recorder) -> None:
    """What vLLM does with the parameters the simulator honours (temperature 0: deterministic answers)."""
    cmpl = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    base = rec.save("params_completion_base", exchange(PREFILL, "POST", "/v1/completions",
                                                       {**cmpl, "return_token_ids": True}))
    choice = base["response"]["json"]["choices"][0]
    text, token_ids = choice["text"], choice["token_ids"]
    stop = text[len(text) // 2: len(text) // 2 + 3] or "the"
    rec.save("params_completion_stop", exchange(PREFILL, "POST", "/v1/completions", {**cmpl, "stop": [stop]}))
    rec.save("params_completion_stop_stream", exchange(PREFILL, "POST", "/v1/completions", {
        **cmpl, "stop": stop, "stream": True}))
    rec.save("params_completion_stop_included", exchange(PREFILL, "POST", "/v1/completions", {
        **cmpl, "stop": [stop], "include_stop_str_in_output": True}))
    rec.save("params_completion_stop_token_ids", exchange(PREFILL, "POST", "/v1/completions", {
        **cmpl, "stop_token_ids": [token_ids[4]], "return_token_ids": True}))
    rec.save("params_completion_logprobs", exchange(PREFILL, "POST", "/v1/completions",
                                                    {**cmpl, "max_tokens": 3, "logprobs": 2}))
    rec.save("params_completion_logprobs_stream", exchange(PREFILL, "POST", "/v1/completions", {
        **cmpl, "max_tokens": 3, "logprobs": 2, "stream": True}))
    rec.save("params_completion_n2", exchange(PREFILL, "POST", "/v1/completions", {
        **cmpl, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 1}))
    rec.save("params_completion_n2_stream", exchange(PREFILL, "POST", "/v1/completions", {
        **cmpl, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 1, "stream": True,
        "stream_options": {"include_usage": True}}))
    rec.save("params_completion_prompt_list", exchange(PREFILL, "POST", "/v1/completions", {
        **cmpl, "max_tokens": 3, "prompt": ["Hello", "The prefiller"]}))
    rec.save("params_completion_prompt_ids", exchange(PREFILL, "POST", "/v1/completions", {
        **cmpl, "max_tokens": 3, "prompt": [[0, 11, 12], [0, 13, 14]]}))
    # Fan-out through one P/D pair does not work: what the prefiller returns for n=2 or two prompts, and what a
    # decoder given one prefill's params does with n=2.
    rec.save("pd_n2_prefill", exchange(PREFILL, "POST", "/v1/completions", {
        **cmpl, "max_tokens": 1, "n": 2, "temperature": 1.0, "kv_transfer_params": PREFILL_KV}))
    rec.save("pd_prompt_list_prefill", exchange(PREFILL, "POST", "/v1/completions", {
        **cmpl, "max_tokens": 1, "prompt": ["Hello", "The prefiller"], "kv_transfer_params": PREFILL_KV}))
    single = rec.save("pd_n2_single_prefill", exchange(PREFILL, "POST", "/v1/completions", {
        **cmpl, "max_tokens": 1, "kv_transfer_params": PREFILL_KV}))
    kv = single["response"]["json"].get("kv_transfer_params")
    if kv:
        rec.save("pd_n2_decode", exchange(DECODE, "POST", "/v1/completions", {
            **cmpl, "max_tokens": 3, "n": 2, "temperature": 1.0, "kv_transfer_params": kv}))
    rec.save("params_completion_min_tokens", exchange(PREFILL, "POST", "/v1/completions", {
        **cmpl, "max_tokens": 8, "min_tokens": 6, "stop": [stop]}))
    rec.save("params_completion_ignore_eos", exchange(PREFILL, "POST", "/v1/completions",
                                                      {**cmpl, "max_tokens": 8, "ignore_eos": True}))

    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    rec.save("params_chat_logprobs", exchange(PREFILL, "POST", "/v1/chat/completions",
                                              {**chat, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}))
    rec.save("params_chat_logprobs_stream", exchange(PREFILL, "POST", "/v1/chat/completions", {
        **chat, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "stream": True}))
    rec.save("params_chat_n2", exchange(PREFILL, "POST", "/v1/chat/completions", {
        **chat, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 1}))
    rec.save("params_chat_n2_stream", exchange(PREFILL, "POST", "/v1/chat/completions", {
        **chat, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 1, "stream": True,
        "stream_options": {"include_usage": True}}))
    rec.save("params_chat_json_object", exchange(PREFILL, "POST", "/v1/chat/completions", {
        **chat, "max_tokens": 40, "response_format": {"type": "json_object"}}))
    rec.save("params_chat_json_schema", exchange(PREFILL, "POST", "/v1/chat/completions", {
        **chat, "max_tokens": 60, "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "person", "schema": SCHEMA}}}))
    rec.save("params_chat_tool_required", exchange(PREFILL, "POST", "/v1/chat/completions", {
        **chat, "max_tokens": 60, "tools": TOOLS, "tool_choice": "required"}))
    rec.save("params_chat_tool_named", exchange(PREFILL, "POST", "/v1/chat/completions", {
        **chat, "max_tokens": 60, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    rec.save("params_chat_tool_named_stream", exchange(PREFILL, "POST", "/v1/chat/completions", {
        **chat, "max_tokens": 60, "tools": TOOLS, "stream": True,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    rec.save("params_responses_logprobs", exchange(PREFILL, "POST", "/v1/responses", {
        "model": MODEL, "input": "Hi there", "max_output_tokens": 3, "temperature": 0, "top_logprobs": 2,
        "include": ["message.output_text.logprobs"]}))
    rec.save("params_responses_json_schema", exchange(PREFILL, "POST", "/v1/responses", {
        "model": MODEL, "input": "Hi there", "max_output_tokens": 60, "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}}}))
    rec.save("params_messages_tool_any", exchange(PREFILL, "POST", "/v1/messages", {
        "model": MODEL, "max_tokens": 60, "messages": ANTHROPIC_MESSAGES, "temperature": 0,
        "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        "tool_choice": {"type": "tool", "name": "get_weather"}}))

    bad = {
        "error_chat_temperature_negative": {**chat, "temperature": -1},
        "error_chat_temperature_high": {**chat, "temperature": 2.5},
        "error_chat_top_p_zero": {**chat, "top_p": 0},
        "error_chat_bad_role": {**chat, "messages": [{"role": "wizard", "content": "hi"}]},
        "error_chat_n_zero": {**chat, "n": 0},
        "error_chat_n_greedy": {**chat, "n": 2},
        "error_chat_logprobs_too_many": {**chat, "logprobs": True, "top_logprobs": 21},
        "error_chat_top_logprobs_without_logprobs": {**chat, "top_logprobs": 2},
        "error_chat_empty_stop": {**chat, "stop": [""]},
        "error_chat_json_schema_missing": {**chat, "response_format": {"type": "json_schema"}},
        "error_chat_tool_required_no_tools": {**chat, "tool_choice": "required"},
        "error_chat_tool_named_unknown": {**chat, "tools": TOOLS,
                                          "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "error_chat_presence_penalty": {**chat, "presence_penalty": 3},
        "error_chat_min_tokens_negative": {**chat, "min_tokens": -1},
        "error_chat_messages_missing": {"model": MODEL},
        "error_chat_stop_token_ids_str": {**chat, "stop_token_ids": ["x"]},
    }
    for name, body in bad.items():
        rec.save(name, exchange(PREFILL, "POST", "/v1/chat/completions", body))
    bad_cmpl = {
        "error_completion_logprobs_too_many": {**cmpl, "logprobs": 21},
        "error_completion_temperature_negative": {**cmpl, "temperature": -0.5},
        "error_completion_prompt_missing": {"model": MODEL},
        "error_completion_echo_logprobs": {**cmpl, "echo": True, "logprobs": 1},
    }
    for name, body in bad_cmpl.items():
        rec.save(name, exchange(PREFILL, "POST", "/v1/completions", body))


def one_token_prefill(rec: Recorder) -> None:
    """Constraint fields on a one-token prefill leg, then the decode leg with the returned params."""
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "temperature": 0}
    one = {"max_tokens": 1}
    cases = {
        "prefill1_tool_required": {**chat, "tools": TOOLS, "tool_choice": "required"},
        "prefill1_tool_named": {**chat, "tools": TOOLS,
                                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        "prefill1_json_schema": {**chat, "response_format": {"type": "json_schema",
                                                             "json_schema": {"name": "person", "schema": SCHEMA}}},
        "prefill1_json_object": {**chat, "response_format": {"type": "json_object"}},
        "prefill1_structured_outputs": {**chat, "structured_outputs": {"json": SCHEMA}},
        "prefill1_min_tokens": {**chat, "min_tokens": 5},
    }
    for name, body in cases.items():
        pd(rec, "/v1/chat/completions", body, one, f"cap-{name}", name)
    pd(rec, "/v1/chat/completions", {**cases["prefill1_min_tokens"], "min_tokens": 1}, one, "cap-p1-min1",
       "prefill1_min_tokens_clamped")
    pd(rec, "/v1/responses", {"model": MODEL, "input": "Hi there", "max_output_tokens": 60, "temperature": 0,
                              "text": {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA}}},
       {"max_output_tokens": 1}, "cap-p1-resp-json", "prefill1_responses_json_schema")


def lora(rec: Recorder) -> None:
    """LoRA adapters: ``/v1/models`` with their ``parent``; a request for the adapter; through PD."""
    rec.save("models_lora", exchange(PREFILL, "GET", "/v1/models"))
    body = {"model": LORA, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    rec.save("lora_completion", exchange(PREFILL, "POST", "/v1/completions", body))
    rec.save("lora_chat", exchange(PREFILL, "POST", "/v1/chat/completions", {
        "model": LORA, "messages": MESSAGES, "max_tokens": 4}))
    pd(rec, "/v1/completions", body, {"max_tokens": 1}, "cap-lora", "pd_lora_completion")
    rec.save("error_lora_unknown_model", exchange(PREFILL, "POST", "/v1/completions", {**body, "model": "nope"}))


def tools(rec: Recorder) -> None:
    """An engine pair started with ``--enable-auto-tool-choice --tool-call-parser hermes``: forced tool calls
    (``required``, named) in each API, plainly and as a one-token prefill leg."""
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, "temperature": 0, "tools": TOOLS}
    named = {"type": "function", "function": {"name": "get_weather"}}
    rec.save("tools_chat_required", exchange(PREFILL, "POST", "/v1/chat/completions",
                                             {**chat, "tool_choice": "required"}))
    rec.save("tools_chat_required_stream", exchange(PREFILL, "POST", "/v1/chat/completions",
                                                    {**chat, "tool_choice": "required", "stream": True}))
    rec.save("tools_chat_named", exchange(PREFILL, "POST", "/v1/chat/completions", {**chat, "tool_choice": named}))
    rec.save("tools_chat_named_stream", exchange(PREFILL, "POST", "/v1/chat/completions",
                                                 {**chat, "tool_choice": named, "stream": True}))
    rec.save("tools_chat_auto", exchange(PREFILL, "POST", "/v1/chat/completions", {**chat, "max_tokens": 8}))
    rec.save("tools_chat_named_short", exchange(PREFILL, "POST", "/v1/chat/completions",
                                                {**chat, "tool_choice": named, "max_tokens": 5}))
    pd(rec, "/v1/chat/completions", {**chat, "tool_choice": "required"}, {"max_tokens": 1}, "cap-t-req",
       "tools_prefill1_required")
    pd(rec, "/v1/chat/completions", {**chat, "tool_choice": named}, {"max_tokens": 1}, "cap-t-named",
       "tools_prefill1_named")
    anthropic_tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
    msgs = {"model": MODEL, "max_tokens": 60, "messages": ANTHROPIC_MESSAGES, "temperature": 0,
            "tools": anthropic_tools}
    rec.save("tools_messages_tool", exchange(PREFILL, "POST", "/v1/messages", {
        **msgs, "tool_choice": {"type": "tool", "name": "get_weather"}}))
    rec.save("tools_messages_tool_stream", exchange(PREFILL, "POST", "/v1/messages", {
        **msgs, "tool_choice": {"type": "tool", "name": "get_weather"}, "stream": True}))
    rec.save("tools_messages_any", exchange(PREFILL, "POST", "/v1/messages", {**msgs, "tool_choice": {"type": "any"}}))
    resp_tools = [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]
    resp = {"model": MODEL, "input": "Hi there", "max_output_tokens": 60, "temperature": 0, "tools": resp_tools}
    rec.save("tools_responses_required", exchange(PREFILL, "POST", "/v1/responses",
                                                  {**resp, "tool_choice": "required"}))
    rec.save("tools_responses_named", exchange(PREFILL, "POST", "/v1/responses", {
        **resp, "tool_choice": {"type": "function", "name": "get_weather"}}))
    rec.save("tools_responses_named_stream", exchange(PREFILL, "POST", "/v1/responses", {
        **resp, "tool_choice": {"type": "function", "name": "get_weather"}, "stream": True}))
    pd(rec, "/v1/responses", {**resp, "tool_choice": "required"}, {"max_output_tokens": 1}, "cap-t-resp",
       "tools_prefill1_responses_required")


def pooling(rec: Recorder) -> None:
    """An engine started with ``--runner pooling --convert embed``: the pooling routes it serves and those it
    does not."""
    rec.save("pooling_models", exchange(PREFILL, "GET", "/v1/models"))
    rec.save("embeddings", exchange(PREFILL, "POST", "/v1/embeddings", {"model": MODEL, "input": "Hello world"}))
    rec.save("embeddings_list", exchange(PREFILL, "POST", "/v1/embeddings",
                                         {"model": MODEL, "input": ["Hello", "world"]}))
    rec.save("embeddings_base64", exchange(PREFILL, "POST", "/v1/embeddings",
                                           {"model": MODEL, "input": "Hello", "encoding_format": "base64"}))
    rec.save("embeddings_dimensions", exchange(PREFILL, "POST", "/v1/embeddings",
                                               {"model": MODEL, "input": "Hello", "dimensions": 8}))
    rec.save("pooling", exchange(PREFILL, "POST", "/pooling", {"model": MODEL, "input": "Hello world"}))
    rec.save("score", exchange(PREFILL, "POST", "/score", {"model": MODEL, "text_1": "Hello", "text_2": "world"}))
    rec.save("v1_score", exchange(PREFILL, "POST", "/v1/score", {
        "model": MODEL, "text_1": "Hello", "text_2": ["world", "there"]}))
    rerank = {"model": MODEL, "query": "Hello", "documents": ["world", "there", "Hello again"], "top_n": 2}
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        rec.save("rerank" + path.replace("/", "_"), exchange(PREFILL, "POST", path, rerank))
    rec.save("classify_not_served", exchange(PREFILL, "POST", "/classify", {"model": MODEL, "input": "Hello"}))
    rec.save("pooling_completions_not_served", exchange(PREFILL, "POST", "/v1/completions",
                                                        {"model": MODEL, "prompt": "Hello"}))
    rec.save("error_embeddings_unknown_model", exchange(PREFILL, "POST", "/v1/embeddings",
                                                        {"model": "no-such-model", "input": "Hello"}))
    rec.save("error_embeddings_no_input", exchange(PREFILL, "POST", "/v1/embeddings", {"model": MODEL}))


def main() -> int:
    """Run the captures of one engine set (``--pooling``, ``--tools``, default the API pair); returns an exit code."""
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    kind = "pooling" if "--pooling" in sys.argv else "tools" if "--tools" in sys.argv else "apis"
    rec = Recorder(Path(args[0]) if args else Path(__file__).parent / "captures" / kind)
    sections = {"pooling": (pooling,), "tools": (tools,),
                "apis": (generation, render, sampling, one_token_prefill, lora)}[kind]
    for section in sections:
        try:
            section(rec)
        except Exception as exc:  # keep what was recorded; say what failed
            print(f"section {section.__name__} failed: {exc!r}", file=sys.stderr)
    rec.finish()
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "write-lora":
        print(write_lora_adapter(Path(sys.argv[2])))
        raise SystemExit(0)
    raise SystemExit(main())
