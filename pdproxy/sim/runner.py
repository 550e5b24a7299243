"""The asyncio engine-core task of one DP rank: runs :class:`EngineCore` steps in real (loop) time.

Each iteration: expire pins, ``schedule(now)``, start KV pulls, sleep until the step's deadline (or
``sleep(0)`` in zero-cost mode, so HTTP handlers always get the loop between steps), then
``complete(plan, now)`` and wake the listeners of the touched requests. An idle or blocked engine waits for a
wake-up (new request, abort, pull done, pin released) or for the next pin expiry. It does not spin.

Steps are paced on a timeline: while the engine runs back to back, a step starts at the previous step's
deadline, not when the loop got round to it. The engine's own CPU time and the HTTP handlers' writes then
overlap the modelled step time, and the configured rates hold on average (a real engine core runs in its own
process, beside the API server).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import aiohttp

from pdproxy.sim import connector
from pdproxy.sim.config import SimConfig
from pdproxy.sim.scheduler import EngineCore, EngineRequest


class RankEngine:
    """One rank: an :class:`EngineCore` plus its loop task. Use as ``async with RankEngine(...)``.

    ``session`` is called for the aiohttp client session used to pull KV from prefillers.
    """

    def __init__(self, config: SimConfig, dp_rank: int, engine_id: str,
                 session: Callable[[], aiohttp.ClientSession]) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.engine_id = engine_id
        self.core = EngineCore(config, dp_rank)
        self.port = 0
        self.active_streams = 0
        self._session = session
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._side_tasks: set[asyncio.Task[Any]] = set()
        self._pull_state: dict[str, str] = {}
        self._last_deadline: float | None = None

    async def __aenter__(self) -> RankEngine:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"sim-engine-dp{self.dp_rank}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        tasks = [t for t in (self._task, *self._side_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # ---- API used by the HTTP layer -----------------------------------------------------------------------
    def submit(self, request: EngineRequest) -> None:
        """Queue ``request``; its ``listener`` is called whenever it gets tokens or finishes."""
        if request.remote_prefill is not None:
            self._pull_state[request.request_id] = "none"
        self.core.add_request(request)
        self._wake.set()

    def abort(self, request: EngineRequest) -> None:
        """Abort (client disconnect): free blocks now, and tell the prefiller if the KV was never pulled."""
        if self.core.abort(request, self._now()):
            if request.remote_prefill is not None and self._pull_state.get(request.request_id) == "none":
                self.spawn(connector.release(self._session(), request.remote_prefill))
            self._wake.set()
        self._pull_state.pop(request.request_id, None)

    def release_pin(self, remote_request_id: str) -> bool:
        """Free a pin (decoder's done-notification). True if it existed."""
        found = self.core.release_pin(remote_request_id) is not None
        if found:
            self._wake.set()
        return found

    def clear_pins(self) -> int:
        """Free every pinned request's blocks (``POST /sim/reset``); returns how many pins were dropped.

        The expiry timer goes with them: the idle loop is woken and recomputes its timeout from the (now
        empty) pins. A decoder still reading one of them gets ``released: false`` on its done-notification.
        """
        dropped = self.core.clear_pins()
        if dropped:
            self._wake.set()
        return dropped

    def start_pull(self, remote_request_id: str) -> bool:
        """Mark a pin as being read (it cannot expire meanwhile). False when unknown or expired."""
        self.core.expire_pins(self._now())
        pin = self.core.pins.get(remote_request_id)
        if pin is None:
            return False
        pin.pulling = True
        return True

    def spawn(self, coro: Any) -> None:
        """Run ``coro`` as a tracked side task (cancelled when the rank stops)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)

    def reset(self) -> None:
        """Forget prefix-cache hashes (``POST /sim/reset``)."""
        self.core.pool.reset_prefix_cache()

    # ---- loop -------------------------------------------------------------------------------------------
    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    async def _idle(self, now: float) -> None:
        expiry = self.core.next_pin_expiry()
        timeout = None if expiry is None else max(expiry - now, 0.0) + 0.001
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    async def _run(self) -> None:
        core = self.core
        while True:
            self._wake.clear()
            now = self._now()
            if core.pins:
                core.expire_pins(now)
            if not core.has_work():
                self._last_deadline = None
                await self._idle(now)
                continue
            start = now
            last = self._last_deadline
            if last is not None and 0.0 <= now - last < 0.05:
                start = last  # back-to-back steps: keep the timeline
            plan = core.schedule(now)
            for req in plan.pulls:
                self._pull_state[req.request_id] = "pulling"
                self.spawn(self._pull(req))
            if plan.empty:
                self._last_deadline = None
                await self._idle(now)
                continue
            deadline = start + plan.duration_s
            await asyncio.sleep(max(deadline - self._now(), 0.0))
            self._last_deadline = deadline
            for req in core.complete(plan, self._now()):
                if req.finished:
                    self._pull_state.pop(req.request_id, None)
                if req.listener is not None:
                    req.listener(req)

    async def _pull(self, req: EngineRequest) -> None:
        params = req.remote_prefill
        assert params is not None
        session = self._session()
        started = self._now()
        ok = await connector.pull(session, params)
        if ok:
            rate = self.config.kv_transfer_tokens_per_s
            if rate > 0 and not req.finished:
                await asyncio.sleep(req.num_prompt_tokens / rate)
            await connector.release(session, params)
        self._pull_state[req.request_id] = "done"
        if req.finished:
            return
        now = self._now()
        self.core.finish_remote_kv(req, ok, now, xfer_s=now - started)
        self._wake.set()
        if not ok and req.listener is not None:
            req.listener(req)
