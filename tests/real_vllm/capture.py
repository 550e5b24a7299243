"""Capture what real vLLM engines return, for the simulator's contract test (not a test itself).

Run against the engines started by ``scripts/real-vllm.sh start``::

    eval "$(scripts/real-vllm.sh env)" && python tests/real_vllm/capture.py [OUT_DIR]

Stdlib only (any Python >= 3.10). Writes one JSON file per exchange into ``OUT_DIR`` (default
``tests/real_vllm/captures/``): ``{"name", "request": {method, url_path, headers, body}, "response": {status,
headers, json | text}, "elapsed_s"}``. Streaming bodies are kept byte-exact in ``response.text`` (SSE framing).
``metrics_prefill.txt`` / ``metrics_decode.txt`` hold the raw ``/metrics`` pages after the PD exchanges.
``index.json`` lists every capture with its status and elapsed seconds. Token-exact prompts are built as
``" the" * (n - 1)``: with the tiny tokenizer (pdproxy.tools.tinymodel) that is ``n`` prompt tokens including BOS,
checked with ``/tokenize``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

PREFILL = os.environ.get("REAL_VLLM_PREFILL_URL", "http://127.0.0.1:8100")
DECODE = os.environ.get("REAL_VLLM_DECODE_URL", "http://127.0.0.1:8200")
MODEL = os.environ.get("REAL_VLLM_SERVED_MODEL", "tiny")
MAX_MODEL_LEN = int(os.environ.get("REAL_VLLM_MAX_MODEL_LEN", "2048"))
# The prefill stub every PD proxy sends (vLLM's toy_proxy_server.py; docs/pd-protocol.md §1).
PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
PROMPT = "The prefiller reads the whole prompt and computes the key/value cache for every prompt token."
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi there"}]
TOOL_CHAT = {
    "messages": [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
}


def exchange(
    base: str, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> dict[str, Any]:
    """One HTTP exchange; returns the capture dict (never raises on HTTP error statuses)."""
    hdrs = {"Content-Type": "application/json", **(headers or {})} if body is not None else dict(headers or {})
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method, headers=hdrs)
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, rhdrs, raw = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        status, rhdrs, raw = err.code, dict(err.headers), err.read()
    elapsed = time.monotonic() - t0
    lower = {k.lower(): v for k, v in rhdrs.items() if k.lower() != "date"}
    out: dict[str, Any] = {"status": status, "headers": lower}
    text = raw.decode("utf-8", errors="replace")
    if lower.get("content-type", "").startswith("application/json"):
        out["json"] = json.loads(text)
    else:
        out["text"] = text
    return {
        "request": {"method": method, "url_path": path, "headers": hdrs, "body": body},
        "response": out,
        "elapsed_s": round(elapsed, 4),
    }


class Recorder:
    """Writes captures into ``out_dir`` and keeps the index."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.index: list[dict[str, Any]] = []
        out_dir.mkdir(parents=True, exist_ok=True)

    def save(self, name: str, cap: dict[str, Any]) -> dict[str, Any]:
        cap = {"name": name, **cap}
        (self.out_dir / f"{name}.json").write_text(json.dumps(cap, indent=2, ensure_ascii=False) + "\n")
        self.index.append({"name": name, "status": cap["response"]["status"], "elapsed_s": cap["elapsed_s"]})
        print(f"{name:40s} {cap['response']['status']}  {cap['elapsed_s'] * 1000:8.1f} ms")
        return cap

    def finish(self) -> None:
        (self.out_dir / "index.json").write_text(json.dumps(self.index, indent=2) + "\n")


def pd_pair(rec: Recorder, api: str, body: dict[str, Any], request_id: str, name: str) -> dict[str, Any]:
    """Prefill on P (stub kv_transfer_params, max_tokens 1, non-stream), then the client body + P's params on D.

    Returns P's ``kv_transfer_params``.
    """
    path = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    prefill_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV}
    prefill_body.pop("stream_options", None)
    p = rec.save(f"{name}_prefill", exchange(PREFILL, "POST", path, prefill_body, {"X-Request-Id": request_id}))
    params = p["response"]["json"]["kv_transfer_params"]
    rec.save(
        f"{name}_decode",
        exchange(DECODE, "POST", path, {**body, "kv_transfer_params": params}, {"X-Request-Id": request_id}),
    )
    return params


def exact_prompt(n: int) -> str:
    """A completions prompt of exactly ``n`` tokens (BOS included), verified with P's ``/tokenize``."""
    text = " the" * (n - 1)
    got = exchange(PREFILL, "POST", "/tokenize", {"model": MODEL, "prompt": text})["response"]["json"]["count"]
    if got != n:
        raise SystemExit(f"exact_prompt({n}) tokenized to {got}; the tiny tokenizer changed?")
    return text


def main() -> int:
    """Run every capture; returns a process exit code."""
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "captures"
    rec = Recorder(out)
    rec.save("health_prefill", exchange(PREFILL, "GET", "/health"))
    rec.save("version", exchange(PREFILL, "GET", "/version"))
    rec.save("models", exchange(PREFILL, "GET", "/v1/models"))
    rec.save("tokenize_completion", exchange(PREFILL, "POST", "/tokenize", {"model": MODEL, "prompt": PROMPT}))
    rec.save("tokenize_chat", exchange(PREFILL, "POST", "/tokenize", {"model": MODEL, "messages": MESSAGES}))
    rec.save("tokenize_chat_tools", exchange(PREFILL, "POST", "/tokenize", {"model": MODEL, **TOOL_CHAT}))

    cmpl = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8}
    usage = {"stream": True, "stream_options": {"include_usage": True}}
    pd_pair(rec, "completions", {**cmpl, **usage}, "cap-cmpl-stream", "pd_completion_stream")
    params = pd_pair(rec, "completions", cmpl, "cap-cmpl", "pd_completion")
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
    pd_pair(rec, "chat", {**chat, **usage}, "cap-chat-stream", "pd_chat_stream")
    pd_pair(rec, "chat", chat, "cap-chat", "pd_chat")
    pd_pair(rec, "chat", {**chat, "stream": True}, "cap-chat-stream-nousage", "pd_chat_stream_no_usage")

    # D given kv_transfer_params it cannot pull from (no such remote engine): kv_load_failure_policy="fail".
    bogus = {**params, "remote_engine_id": "no-such-engine", "remote_port": 5999}
    for name, extra in (("decode_bad_remote", {}), ("decode_bad_remote_stream", usage)):
        rec.save(
            name,
            exchange(
                DECODE,
                "POST",
                "/v1/completions",
                {**cmpl, **extra, "kv_transfer_params": bogus},
                {"X-Request-Id": f"cap-{name}"},
            ),
        )

    # max_model_len boundary (completions): vLLM clamps max_tokens to max_model_len - prompt_tokens.
    for n, max_tokens in (
        (MAX_MODEL_LEN - 1, 16),
        (MAX_MODEL_LEN, 1),
        (MAX_MODEL_LEN + 1, 1),
        (MAX_MODEL_LEN - 48, 100),
        (MAX_MODEL_LEN + 952, 1),
    ):
        body = {"model": MODEL, "prompt": exact_prompt(n), "max_tokens": max_tokens}
        rec.save(f"length_prompt{n}_max{max_tokens}", exchange(PREFILL, "POST", "/v1/completions", body))
    body = {"model": MODEL, "prompt": exact_prompt(MAX_MODEL_LEN + 1), "max_tokens": 1, "stream": True}
    rec.save(f"length_prompt{MAX_MODEL_LEN + 1}_stream", exchange(PREFILL, "POST", "/v1/completions", body))
    body = {"model": MODEL, "messages": [{"role": "user", "content": exact_prompt(MAX_MODEL_LEN)}], "max_tokens": 1}
    rec.save("length_chat_over", exchange(PREFILL, "POST", "/v1/chat/completions", body))

    errors = {
        "error_stream_options_without_stream": {**cmpl, "stream": False, "stream_options": {"include_usage": True}},
        "error_unknown_model": {**cmpl, "model": "no-such-model"},
        "error_min_tokens_over_max": {**cmpl, "max_tokens": 1, "min_tokens": 3},
        "error_bad_json_type": {**cmpl, "max_tokens": "eight"},
    }
    for name, body in errors.items():
        rec.save(name, exchange(PREFILL, "POST", "/v1/completions", body))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    rec.save("error_chat_tools_auto", exchange(PREFILL, "POST", "/v1/chat/completions", {**chat, "tools": tools}))
    rec.save(
        "chat_tools_none",
        exchange(PREFILL, "POST", "/v1/chat/completions", {**chat, "tools": tools, "tool_choice": "none"}),
    )

    for role, base in (("prefill", PREFILL), ("decode", DECODE)):
        cap = exchange(base, "GET", "/metrics")
        (out / f"metrics_{role}.txt").write_text(cap["response"]["text"])
        print(f"metrics_{role}.txt {cap['response']['status']}  {cap['elapsed_s'] * 1000:8.1f} ms")
    rec.finish()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
