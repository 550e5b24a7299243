"""The simulated PD KV connector: the ``kv_transfer_params`` a prefiller returns, and the decoder's pull.

Prefiller side: :func:`prefill_params` builds the dict returned at the top level of the prefill response.
Two shapes exist:

* ``nixl`` (default): vLLM 0.32's NixlConnector as observed (docs/pd-protocol.md §1; ``nixl/pull_scheduler.py::
  request_finished``). Nested ``remote_block_ids`` (one list per KV group), ``remote_engine_id
  "<uuid>_dp<k>"``, ``remote_request_id`` (the engine-internal id), ``remote_num_tokens``, ``tp_size``, ...
* ``mooncake``: vLLM-Ascend MooncakeConnector (main) ``request_finished``. Flat ``remote_block_ids`` plus
  ``remote_request_id``, ``remote_pcp_size``/``remote_dcp_size``/``remote_ptp_size``,
  ``remote_multi_nodes_meta_mapping``, ``num_prompt_blocks``, ``remote_block_size`` and ``last_token_id``.

``remote_host``/``remote_port`` name this simulator's HTTP listener. A decoder "pulls" with a real loopback
call, so a wrong host or port, or expired blocks, fail like a failed KV pull:

1. ``POST http://remote_host:remote_port/sim/kv/pull`` with the params. 200 means the blocks are pinned
   and now marked as being read. 404 means they are unknown or expired.
2. The decoder waits ``prompt_tokens / kv_transfer_tokens_per_s`` seconds (the transfer).
3. ``POST /sim/kv/release`` with ``{"remote_request_id", "remote_engine_id"}``: the prefiller frees the
   pin. A decoder request that ends before pulling sends the same release (docs/pd-protocol.md §6:
   the "done" notification without reading).
"""

from __future__ import annotations

import secrets
from typing import Any

import aiohttp

from pdproxy.sim.config import SimConfig

PULL_PATH = "/sim/kv/pull"
RELEASE_PATH = "/sim/kv/release"
_REQUIRED = ("remote_request_id", "remote_host", "remote_port")


def engine_id_for(base: str, dp_rank: int) -> str:
    """vLLM's per-rank engine id: ``"<uuid>_dp<k>"`` (``vllm/v1/engine/core.py``)."""
    return f"{base}_dp{dp_rank}"


def internal_request_id(response_id: str, api: str, prompt_index: int = 0) -> str:
    """The engine-internal id with vLLM's random suffix (``vllm/v1/engine/input_processor.py::assign_request_id``).

    completions: ``cmpl-<X-Request-Id>-<prompt index>-<8hex>``; chat and Messages:
    ``chatcmpl-<X-Request-Id>-<8hex>``; Responses: ``resp_<16hex>_0-<8hex>`` (sub-request 0);
    ``/inference/v1/generate``: ``generate-tokens-<X-Request-Id>-<8hex>``. With ``n > 1`` each child's id is
    :func:`child_request_id`.
    """
    suffix = secrets.token_hex(4)
    if api == "completions":
        rid = f"{response_id}-{prompt_index}-{suffix}"
    elif api == "responses":
        rid = f"{response_id}_0-{suffix}"
    else:
        rid = f"{response_id}-{suffix}"
    return rid


def child_request_id(parent: str, child: int, n: int) -> str:
    """Child ``child`` of an ``n``-sequence request: ``<k>_<parent id>`` (real vLLM 0.32 returned
    ``1_cmpl-…-0-…`` for ``n=2``); the parent id itself when ``n`` is 1."""
    return f"{child}_{parent}" if n > 1 else parent


def prefill_params(config: SimConfig, *, engine_id: str, request_id: str, host: str, port: int,
                   block_ids: list[int], num_tokens: int, last_token_id: int,
                   cached_tokens: int = 0) -> dict[str, Any]:
    """The ``kv_transfer_params`` a prefiller returns for a length-capped request whose blocks it pinned
    (``num_tokens``: prompt tokens; ``cached_tokens``: the prefiller's own prefix-cache hits)."""
    if config.kv_connector == "mooncake":
        return {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": list(block_ids),
            "remote_engine_id": engine_id, "remote_request_id": request_id, "remote_host": host,
            "remote_port": port, "remote_pcp_size": 1, "remote_dcp_size": 1, "remote_ptp_size": 1,
            "remote_multi_nodes_meta_mapping": {"0": {"host": host, "engine_id": engine_id, "handshake_port": port}},
            "num_prompt_blocks": len(block_ids), "remote_block_size": config.block_size,
            "last_token_id": last_token_id,
        }
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(block_ids)],
        "remote_engine_id": engine_id, "remote_request_id": request_id, "remote_host": host,
        "remote_port": port, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": None, "transfer_mode": "pull",
        "remote_prefill_cached_tokens": cached_tokens,
    }


def wants_remote_decode(params: Any) -> bool:
    """Whether a request's ``kv_transfer_params`` asks this engine to act as the prefiller."""
    return isinstance(params, dict) and bool(params.get("do_remote_decode"))


def remote_prefill_source(params: Any) -> dict[str, Any] | None:
    """The params of a decoder request whose KV lives on a prefiller, or None.

    None covers no params, ``do_remote_prefill`` false, and params lacking ``remote_request_id``,
    ``remote_host`` or ``remote_port``. vLLM-Ascend logs "Got invalid KVTransferParams" for the last case
    and prefills locally.
    """
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    if any(params.get(k) in (None, "") for k in _REQUIRED):
        return None
    return params


def _url(params: dict[str, Any], path: str) -> str:
    host = str(params["remote_host"])
    if host in ("localhost", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://{host}:{int(params['remote_port'])}{path}"


async def _post_ok(session: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float) -> bool:
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            return resp.status == 200
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
        return False


async def pull(session: aiohttp.ClientSession, params: dict[str, Any], timeout_s: float = 10.0) -> bool:
    """Start reading a prefiller's pinned KV. True when the prefiller holds it; False on 404, errors or
    unreachable hosts (the caller fails the request like ``kv_load_failure_policy="fail"``)."""
    return await _post_ok(session, _url(params, PULL_PATH), params, timeout_s)


async def release(session: aiohttp.ClientSession, params: dict[str, Any], timeout_s: float = 5.0) -> bool:
    """Tell the prefiller to free the pin (after a pull, or instead of one). True if it answered 200."""
    body = {"remote_request_id": params.get("remote_request_id"), "remote_engine_id": params.get("remote_engine_id")}
    return await _post_ok(session, _url(params, RELEASE_PATH), body, timeout_s)
