"""Freeing a prefiller's pinned KV blocks that no decoder is going to read.

After the prefill leg the prefiller holds the prompt's KV blocks ("delay free") until a decoder pulls them or the
connector's lease expires — 480 s for vLLM-Ascend Mooncake (``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT``, vllm/envs.py),
NIXL's ``kv_lease_duration`` for vLLM 0.32 (``docs/pd-protocol.md``).  vLLM has no public abort endpoint
(``/abort_requests`` exists only under ``VLLM_SERVER_DEV_MODE``).  What frees the blocks with every connector is a
decoder that receives the ``kv_transfer_params`` and then ends: when a ``do_remote_prefill`` request finishes, is
aborted or is rejected on the decoder, the connector notifies the prefiller, which frees the blocks (vLLM
``nixl/pull_scheduler.py::request_finished``, ``generate/base/serving.py::_with_kv_transfer_rejection_cleanup``;
vLLM-Ascend ``mooncake_connector.py::request_finished``).

A decoder that sent its first event has the KV, and one that answered an error status for the handle has freed
it; the director sends a *release leg* (:meth:`KVReleaser.release`) only otherwise — the client left in the P→D
gap or before the decoder answered, the deadline passed there, or the decoder was refused, reset, timed out or
stalled (it may be gone).  The leg is the decode body with ``max_tokens: 1`` and the prefiller's params, to a
healthy decoder, in the background, bounded by ``timeout_s`` (the connection is closed on expiry).  If the KV was
already pulled or freed, the decoder's pull fails — the expected outcome, logged at DEBUG.  A leg that finds no
decoder it may use (every one refused or behind an open breaker: the decoders that just failed the request are
often the only ones) or whose decoder closed the connection without an answer byte is tried again after a
jittered backoff (0.1 s doubling to 2 s) for up to ``retry_s`` seconds (``kv_release_retry_s``): a decoder back in
service then frees the KV, which otherwise stays pinned until the connector's timeout.  An answer of any kind, even
a malformed one (a 204, a status line that is no HTTP, an upgrade), says the decoder read the request: it ends the
tries and the prefiller's lease at once.  A leg that got no
answer within ``timeout_s`` is tried once more, on another decoder: a hung API server never hands it to its engine
(and closing the wait frees nothing), a slow decoder's pull frees the KV anyway.  Another try of a KV already freed
is only a failed pull.  Tasks are owned by the releaser and awaited (bounded) by
:meth:`aclose` at shutdown.

A client that leaves while the prefill leg is in flight does not drop the prefiller's answer unread
(:meth:`KVReleaser.drain`): the engine may have finished the prefill and pinned the KV already, the answer on its
way, and closing the connection then aborts nothing.  The answer is awaited for at most ``prefill_cancel_grace_s``;
when it comes with ``kv_transfer_params`` a release leg follows, when it does not come in time the connection is
closed, which makes vLLM abort the still-running request and free its blocks.

While a release leg (or such a drain) runs, the prefiller keeps a pool lease for the prompt's tokens, so pdproxy's
own accounting (``kv_held_tokens`` in ``/debug/load``, the prefill queue's KV-pool check) counts the KV the engine
still holds until the leg ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine, Sequence
from contextlib import ExitStack
from typing import Any

from pdproxy.apis import kv_transfer
from pdproxy.apis.request import ProxyRequest
from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import ProxyError, UpstreamTimeout, UpstreamUnavailable
from pdproxy.http.engine_headers import EngineHeaders
from pdproxy.http.upstream import Upstream
from pdproxy.pd.backoff import Backoff
from pdproxy.scheduling import PickRequest, Scheduler

log = logging.getLogger("pdproxy.kv_release")


class KVReleaser:
    """Runs release legs in the background (see module docstring).  ``released``/``failed`` count legs;
    ``drained``/``abandoned`` count prefill answers awaited after the client left (answered with a KV handle /
    not answered within the grace, connection closed).

    ``scheduler`` picks the decoder (its decode profile: healthy, breaker, model…), ``pool`` holds a lease on it
    for the leg (no breaker trial: a leg's outcome is no verdict on the decoder), ``upstream`` sends it with
    ``headers``;
    ``timeout_s`` bounds each leg, ``retry_s`` the tries of one release (seconds; module docstring)."""

    def __init__(self, *, scheduler: Scheduler, pool: EndpointPool, upstream: Upstream,
                 headers: EngineHeaders, timeout_s: float = 5.0, retry_s: float = 60.0) -> None:
        self.scheduler = scheduler
        self.pool = pool
        self.upstream = upstream
        self.headers = headers
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.backoff = Backoff(0.1, 2.0)
        self.released = 0
        self.failed = 0
        self.drained = 0
        self.abandoned = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def release(self, req: ProxyRequest, request_id: str, authorization: str | None,
                params: kv_transfer.KVHandle | None, *, avoid: Sequence[Endpoint] = (),
                prefiller: Endpoint | None = None) -> None:
        """Start a release leg for ``params`` (no-op for None: nothing is pinned).  ``avoid``: decoders that just
        failed, used only when no other decoder is available.  ``prefiller``: the engine holding the KV, which
        keeps a pool lease of the prompt's tokens until the leg ended (taken here, before the caller's own
        lease is given back)."""
        if params is None:
            return
        held = self._hold(prefiller, req)
        self._spawn(self._held(held, self._run(req, request_id, authorization, params, avoid)))

    def drain(self, answer: asyncio.Future[dict[str, Any]], req: ProxyRequest, request_id: str,
              authorization: str | None, *, prefiller: Endpoint, grace_s: float,
              answered: Callable[[], None] | None = None) -> None:
        """The request left while ``answer`` (the prefill leg's ``post_json``, still running) was awaited: wait for
        it at most ``grace_s`` seconds, then release the KV it reports pinned; past the grace ``answer`` is
        cancelled (its connection closed: vLLM aborts the request).  The prefiller keeps a pool lease meanwhile.
        ``answered`` is called once the prefill is no longer in flight on the engine (answered, failed or aborted):
        the prefill slot's budget is held until then (:meth:`PrefillSlot.hand_off_prefill
        <pdproxy.scheduling.queue.PrefillSlot.hand_off_prefill>`)."""
        if grace_s <= 0 and not answer.done():
            answer.cancel()
            if answered is not None:
                answered()
            return
        held = self._hold(prefiller, req)
        if answered is not None:
            held.callback(answered)
        self._spawn(self._held(held, self._drain(answer, req, request_id, authorization, grace_s, answered)))

    def _hold(self, prefiller: Endpoint | None, req: ProxyRequest) -> ExitStack:
        held = ExitStack()
        if prefiller is not None:
            held.enter_context(self.pool.lease(prefiller, req.prompt_tokens or 0))
        return held

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _held(held: ExitStack, work: Coroutine[Any, Any, None]) -> None:
        with held:
            await work

    async def _drain(self, answer: asyncio.Future[dict[str, Any]], req: ProxyRequest, request_id: str,
                     authorization: str | None, grace_s: float, answered: Callable[[], None] | None = None) -> None:
        try:
            async with asyncio.timeout(grace_s):
                reply = await answer                 # cancelled on expiry: the connection is closed
        except TimeoutError:
            if answered is not None:
                answered()
            self.abandoned += 1
            log.debug("prefill of request %s not answered %.2f s after the client left: aborted", request_id,
                      grace_s)
            return
        except ProxyError:                           # the prefill failed: the engine pinned nothing
            if answered is not None:
                answered()
            return
        if answered is not None:                     # answered: no longer in flight (its KV is held by the lease)
            answered()
        params = kv_transfer.extract_params(reply)
        if params is None:                           # finished on the prefiller (no handle): nothing pinned
            return
        self.drained += 1
        await self._run(req, request_id, authorization, params, ())

    def _pick(self, request: PickRequest, avoid: Sequence[Endpoint]) -> Endpoint | None:
        """A decoder for a release leg, one of ``avoid`` only when no other will do; no breaker trial is taken (a
        release leg says nothing of the decoder's health, and a half-open decoder's one trial is for a request)."""
        for exclude in (avoid, ()):
            endpoint = self.scheduler.try_pick(Role.DECODE, request, exclude, trial=False)
            if endpoint is not None:
                return endpoint
        return None

    async def _run(self, req: ProxyRequest, request_id: str, authorization: str | None,
                   params: kv_transfer.KVHandle, avoid: Sequence[Endpoint]) -> None:
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + self.retry_s
        body = kv_transfer.release_body(req.body, params, req.api)
        attempt = 0
        timed_out = False
        while True:
            endpoint = self._pick(PickRequest(request_id=request_id, model=req.model), avoid)
            reached = None if endpoint is None else await self._leg(endpoint, req, request_id, authorization, body)
            if reached is True or (reached is None and timed_out and endpoint is not None):
                self.released += 1      # answered — or a second leg timed out too: slow decoders, not hung ones
                return
            timed_out = timed_out or (reached is None and endpoint is not None)
            if endpoint is not None:
                avoid = (endpoint,)
            attempt += 1
            delay = self.backoff.delay_s(attempt)
            if loop.time() + delay > give_up_at:
                self.failed += 1
                log.warning("no decoder took the release of the prefiller's KV of request %s (%d tries); it stays "
                            "pinned until the connector's timeout", request_id, attempt)
                return
            await asyncio.sleep(delay)

    async def _leg(self, endpoint: Endpoint, req: ProxyRequest, request_id: str, authorization: str | None,
                   body: bytes) -> bool | None:
        """One release leg to ``endpoint``: True when the decoder answered — anything, even a malformed answer
        (:attr:`UpstreamUnavailable.answered <pdproxy.errors.UpstreamUnavailable>`: it read the request); False when
        it never reached the decoder's engine (the connection was refused, closed or reset before any answer byte):
        worth another try; None
        when nothing answered within ``timeout_s`` — a hung API server, which never hands the request on (the
        close that ends the wait frees nothing on the prefiller), or a slow decoder whose pull frees the KV: one
        more try, on another decoder (:meth:`_run`), tells them apart at the cost of at most one pull of KV that
        may be gone (it fails, or reads stale blocks for a one-token answer nobody reads)."""
        headers = self.headers.leg(endpoint, request_id, authorization)
        with self.pool.lease(endpoint, req.prompt_tokens or 0):
            try:
                await self.upstream.post_json(endpoint, req.api.value, body, headers, timeout_s=self.timeout_s)
            except UpstreamTimeout as exc:
                log.debug("release leg for request %s on %s: %s", request_id, endpoint.name, exc.message)
                return None
            except UpstreamUnavailable as exc:
                if not exc.answered:
                    log.debug("release leg for request %s on %s not answered: %s", request_id, endpoint.name,
                              exc.message)
                    return False
                # a malformed answer (a 204, bytes that are no HTTP, an upgrade) is an answer all the same: the
                # decoder read the request, and another try would only meet the same answer for a minute
                log.debug("release leg for request %s on %s: %s", request_id, endpoint.name, exc.message)
            except ProxyError as exc:  # an error answer still means the decoder saw the params and ended: when the
                # KV is already gone (pulled, or freed by a decoder that ended), the pull fails, as expected
                log.debug("release leg for request %s on %s: %s", request_id, endpoint.name, exc.message)
        return True

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
