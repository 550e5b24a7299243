"""Freeing a prefiller's pinned KV blocks that no decoder is going to read.

After the prefill leg the prefiller holds the prompt's KV blocks ("delay free") until a decoder pulls them or the
connector's timeout expires — 480 s for vLLM-Ascend Mooncake (``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``), 120–480 s
for NIXL (reference §1.4).  vLLM has no public abort endpoint (``/abort_requests`` only under
``VLLM_SERVER_DEV_MODE``, reference §1.5).  What frees the blocks with every connector is a decoder that receives
the ``kv_transfer_params`` and then ends: when a ``do_remote_prefill`` request finishes (or is aborted, or
rejected) on the decoder, the connector notifies the prefiller, which frees the blocks (vLLM v0.26
``nixl/pull_scheduler.py::request_finished``, vLLM-Ascend ``mooncake_connector.py::request_finished``).

So when a request leaves between its prefill and its decoder's first event — the client disconnected in the
P→D gap, the decode leg failed before its first byte, the deadline passed — :meth:`KVReleaser.release` sends, in
the background, a *release leg*: the decode body with ``max_tokens: 1`` and the prefiller's params, to a healthy
decoder, bounded by ``timeout_s`` (the connection is closed on expiry, which aborts it on the decoder, which
again notifies the prefiller).  If the KV was already pulled or freed, the decoder's pull fails and nothing
else happens.  Tasks are owned by the releaser and awaited (bounded) by :meth:`aclose` at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import orjson

from pdproxy import kv_transfer
from pdproxy.endpoints import Endpoint, Role
from pdproxy.errors import ProxyError

if TYPE_CHECKING:
    from pdproxy.protocol import ProxyRequest
    from pdproxy.state import ProxyState

log = logging.getLogger("pdproxy.kv_release")


def release_body(original: dict[str, object], params: kv_transfer.KVTransferParams) -> bytes:
    """The release leg's body: the prefill overrides (``stream: false``, ``max_tokens: 1``, no stream options,
    ``min_tokens`` ≤ 1) with the prefiller's ``params`` as the decoder's ``kv_transfer_params``."""
    return orjson.dumps(kv_transfer.decode_body(kv_transfer.prefill_body(original), params))


class KVReleaser:
    """Runs release legs in the background (see module docstring).  ``released``/``failed`` count legs."""

    def __init__(self, state: ProxyState, *, timeout_s: float = 5.0) -> None:
        self.state = state
        self.timeout_s = timeout_s
        self.released = 0
        self.failed = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def release(self, req: ProxyRequest, request_id: str, authorization: str | None,
                params: kv_transfer.KVTransferParams | None, *, avoid: Sequence[Endpoint] = ()) -> None:
        """Start a release leg for ``params`` (no-op for None: nothing is pinned).  ``avoid``: decoders that just
        failed, used only when no other decoder is available."""
        if params is None:
            return
        task = asyncio.get_running_loop().create_task(self._run(req, request_id, authorization, params, avoid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _pick(self, avoid: Sequence[Endpoint]) -> Endpoint | None:
        st = self.state
        for exclude in (avoid, ()):
            try:
                endpoint = st.scheduler.choose(Role.DECODE, exclude=exclude, fits=st.health.admits())
            except ProxyError:
                continue
            st.health.on_pick(endpoint)
            return endpoint
        return None

    async def _run(self, req: ProxyRequest, request_id: str, authorization: str | None,
                   params: kv_transfer.KVTransferParams, avoid: Sequence[Endpoint]) -> None:
        st = self.state
        endpoint = self._pick(avoid)
        if endpoint is None:
            self.failed += 1
            log.warning("no decoder to release the prefiller's KV of request %s; it stays pinned until the "
                        "connector's timeout", request_id)
            return
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id, **endpoint.extra_headers()}
        auth = st.engine_authorization(authorization)
        if auth:
            headers["Authorization"] = auth
        with st.pool.lease(endpoint, req.prompt_tokens or 0):
            try:
                await st.upstream.post_json(endpoint, req.api.value, release_body(req.body, params), headers,
                                            timeout_s=self.timeout_s)
            except ProxyError as exc:  # an error answer still means the decoder saw the params and ended
                log.info("release leg for request %s on %s: %s", request_id, endpoint.name, exc.message)
            finally:
                st.health.record_neutral(endpoint)
        self.released += 1

    async def aclose(self) -> None:
        """Wait (at most ``timeout_s``) for running release legs, then cancel what is left."""
        tasks = list(self._tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=self.timeout_s)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
