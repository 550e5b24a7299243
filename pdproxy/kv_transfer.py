"""The vLLM P→D contract — the only module that spells the ``kv_transfer_params`` wire fields.

Pull model (NixlConnector, vLLM-Ascend MooncakeConnector(V1)), reference §1.1–1.3:

1. prefill leg: the client body as a **new** dict with ``stream: false``, ``max_tokens: 1``,
   ``max_completion_tokens: 1`` only if the client set it, no ``stream_options``, ``min_tokens`` /
   ``min_completion_tokens`` capped at 1 (vLLM rejects ``min_tokens > max_tokens``; vLLM-Ascend forces 1 so a
   first-token EOS cannot end the request as stopped), and ``kv_transfer_params`` =
   ``{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
   "remote_block_ids": null, "remote_host": null, "remote_port": null}``
   (vLLM ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``; vLLM-Ascend
   ``examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py::build_prefill_request``);
2. the prefiller answers JSON with a top-level ``kv_transfer_params`` dict (vLLM
   ``entrypoints/openai/completion/serving.py``), opaque to us — vLLM 0.32 returns nested ``remote_block_ids``;
3. decode leg: the client's original body with ``kv_transfer_params`` replaced by that dict, verbatim.

Both legs carry the same ``X-Request-Id`` (reference §1.6).
"""

from __future__ import annotations

from typing import Any

import orjson

KVTransferParams = dict[str, Any]
"""Opaque connector handle produced by the prefiller and consumed by the decoder."""

KV_TRANSFER_PARAMS = "kv_transfer_params"

PREFILL_STUB: KVTransferParams = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# vLLM rejects these on a non-streaming request ("Stream options can only be defined when `stream=True`.").
_STREAM_ONLY = ("stream_options",)


def prefill_body(original: dict[str, Any]) -> dict[str, Any]:
    """Return a new dict: the prefill-leg body for ``original`` (a parsed client body).  Never mutates it."""
    body = dict(original)
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    for key in _STREAM_ONLY:
        body.pop(key, None)
    for key in ("min_tokens", "min_completion_tokens"):
        if key in body and body[key] is not None and body[key] > 1:
            body[key] = 1
    body[KV_TRANSFER_PARAMS] = dict(PREFILL_STUB)
    return body


def decode_body(original: dict[str, Any], params: KVTransferParams | None) -> dict[str, Any]:
    """Return a new dict: the decode-leg body, the client's body plus the prefiller's ``params`` verbatim.

    ``params=None`` (decode-side prefill allowed by the operator) drops any client-supplied
    ``kv_transfer_params`` so the decoder prefills locally.
    """
    body = dict(original)
    if params is None:
        body.pop(KV_TRANSFER_PARAMS, None)
    else:
        body[KV_TRANSFER_PARAMS] = params
    return body


def decode_body_bytes(raw: bytes, params: KVTransferParams | None) -> bytes:
    """The decode-leg body built from the client's raw JSON object bytes, which stay byte-for-byte intact.

    ``params`` is appended as the object's last member; JSON parsers used by vLLM (``json.loads`` under FastAPI)
    keep the last of duplicate keys, so it overrides any client-sent ``kv_transfer_params``.  Numbers, key order,
    and multi-MB base64 images are never re-encoded.  ``params=None`` (decode-side prefill) returns ``raw``
    without any client-sent ``kv_transfer_params``.
    Raises ``ValueError`` if ``raw`` is not a JSON object with at least one member.
    """
    if params is None:
        if KV_TRANSFER_PARAMS.encode() not in raw:
            return raw
        return orjson.dumps(decode_body(orjson.loads(raw), None))
    end = raw.rstrip().rfind(b"}")
    if end <= 0 or not raw.lstrip().startswith(b"{"):
        raise ValueError("request body is not a JSON object")
    head = raw[:end].rstrip()
    if head.endswith(b"{"):
        raise ValueError("request body is an empty JSON object")
    return head + b',"' + KV_TRANSFER_PARAMS.encode() + b'":' + orjson.dumps(params) + b"}"


def extract_params(prefill_response: dict[str, Any]) -> KVTransferParams | None:
    """The ``kv_transfer_params`` of a prefiller's JSON answer, or None when absent/null/not a dict.

    vLLM returns None when the request did not finish length-capped (e.g. first-token EOS with v0.11 NIXL or
    vLLM-Ascend Mooncake, reference §1.2), or when the engine has no KV connector.
    """
    params = prefill_response.get(KV_TRANSFER_PARAMS)
    return params if isinstance(params, dict) and params else None


def prefill_cached_tokens(prefill_response: dict[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of the prefiller's answer (its real prefix-cache hits).

    The decoder reports nearly the whole prompt as cached because it pulled it (vLLM ``v1/metrics/stats.py``
    counts local + external hits), so the client must see the prefiller's figure (reference §2.3).
    """
    usage = prefill_response.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return value if isinstance(value, int) else None
