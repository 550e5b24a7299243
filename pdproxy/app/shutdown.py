"""Graceful shutdown: the first SIGTERM (or SIGINT) drains, then the process exits.

uvicorn alone closes its listening socket at once on SIGTERM (new clients get a refused connection, not an
answer) and cuts in-flight requests after ``timeout_graceful_shutdown``.  :class:`DrainingServer` instead:

0. with ``delay_s`` (setting ``shutdown_delay_s``) > 0: ``GET /health`` answers 503 at once (``proxy.unready``)
   while new requests are still served for ``delay_s`` seconds, so that a load balancer's health check
   (Envoy, a Kubernetes readiness probe) stops sending before the replica starts refusing;
1. marks the proxy ``shutting_down``: new completion requests get **503 + ``Retry-After``** (``ShuttingDown``)
   and ``GET /health`` answers 503, so load balancers and Kubernetes readiness probes take the replica out;
2. keeps serving the requests already in flight — streams run to their ``data: [DONE]`` — for at most
   ``grace_s`` seconds (setting ``shutdown_grace_s``);
3. then lets uvicorn shut down (close listeners, the app lifespan stops probes and waits for KV release legs)
   and exits with status 0.  A second signal during the drain exits at once (uvicorn's force exit).

It logs (logger ``pdproxy.shutdown``) the drain's start (``shutdown_started``: requests in flight, the grace
period) and the end (``shutdown_done``: how long it took, requests still in flight when the grace ran out), and
calls ``on_started`` with the bound socket addresses once it listens (``pdproxy serve`` logs its banner there).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

import uvicorn

log = logging.getLogger("pdproxy.shutdown")


class DrainState(Protocol):
    """What the drain reads and writes of the proxy's state (``pdproxy/app/state.py``'s ``ProxyState``):
    ``in_flight`` requests, and ``shutting_down`` (set: new requests get 503 + Retry-After)."""

    in_flight: int
    shutting_down: bool


class Drainable(Protocol):
    """What the drain reads and writes of the app (:class:`pdproxy.app.application.PDProxyApp`): its ``state``
    (None outside the lifespan) and ``unready`` (set: ``GET /health`` answers 503 while requests are still
    served)."""

    unready: bool

    @property
    def state(self) -> DrainState | None: ...


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` with the drain above.  ``proxy``: the :class:`pdproxy.app.application.PDProxyApp` being served;
    ``grace_s``: seconds in-flight requests get after the signal; ``poll_s``: how often in-flight is checked."""

    def __init__(self, config: uvicorn.Config, proxy: Drainable, *, grace_s: float, delay_s: float = 0.0,
                 poll_s: float = 0.05, on_started: Callable[[list[tuple[Any, ...]]], None] | None = None,
                 handshake_timeout_s: float = 30.0) -> None:
        super().__init__(config)
        self.handshake_timeout_s = handshake_timeout_s
        self.proxy = proxy
        self.grace_s = grace_s
        self.delay_s = delay_s
        self.poll_s = poll_s
        self.on_started = on_started
        self.draining = False
        self._drain_started: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        """Run uvicorn's server on ``sockets``, remembering the running loop for the signal handler; log the end
        of a drain once uvicorn has stopped."""
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)
        if self._drain_started is not None:
            took = time.monotonic() - self._drain_started
            log.info("pdproxy: shutdown complete in %.1f s", took,
                     extra={"event": "shutdown_done", "seconds": round(took, 3), "forced": self.force_exit})

    async def startup(self, sockets: Any = None) -> None:
        """uvicorn's start-up (lifespan, listeners), then ``on_started`` with the bound addresses.  With TLS the
        listeners bound a handshake by ``handshake_timeout_s`` (the setting ``request_headers_timeout_s``: a
        handshake is the start of the request's head; asyncio's default is 60 s, and a connection still in its
        handshake is not yet counted against ``max_client_connections``); uvicorn has no option for it, so its
        ``loop.create_server`` call gets it for the start-up's duration."""
        loop = asyncio.get_running_loop()
        if self.config.ssl is not None:
            loop.create_server = functools.partial(  # type: ignore[method-assign]
                loop.create_server, ssl_handshake_timeout=self.handshake_timeout_s)
        try:
            await super().startup(sockets=sockets)
        finally:
            vars(loop).pop("create_server", None)
        if self.on_started is not None and self.started:
            addresses = [sock.getsockname() for server in getattr(self, "servers", []) for sock in server.sockets]
            self.on_started(addresses)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Signal handler (uvicorn's hook).  The first SIGTERM / SIGINT starts the drain (up to ``grace_s``
        seconds); a second signal, or any other signal, makes uvicorn exit now (forced if already draining)."""
        if self.draining or self._loop is None or sig not in (signal.SIGTERM, signal.SIGINT):
            if self.draining:
                state = self.proxy.state
                log.warning("pdproxy: %s again: cutting %d request(s) in flight now", signal.Signals(sig).name,
                            state.in_flight if state is not None else 0,
                            extra={"event": "shutdown_forced", "signal": signal.Signals(sig).name})
            self.force_exit = self.draining
            self.should_exit = True
            return
        self.draining = True
        self._drain_started = time.monotonic()
        state = self.proxy.state
        in_flight = state.in_flight if state is not None else 0
        extra = {"event": "shutdown_started", "signal": signal.Signals(sig).name, "in_flight": in_flight,
                 "grace_s": self.grace_s, "delay_s": self.delay_s}
        if self.delay_s > 0:
            log.info("pdproxy: %s: /health answers 503 now; new requests are still served for %.1f s "
                     "(shutdown_delay_s) so that load balancers stop sending first, then the drain (up to %g s)",
                     signal.Signals(sig).name, self.delay_s, self.grace_s, extra=extra)
        elif in_flight:
            log.warning("pdproxy: %s: draining: waiting up to %g s for %d request(s) in flight; a second signal "
                        "(Ctrl-C again) cuts them now", signal.Signals(sig).name, self.grace_s, in_flight, extra=extra)
        else:
            log.info("pdproxy: %s: shutting down (nothing in flight)", signal.Signals(sig).name, extra=extra)
        if self.delay_s <= 0:
            self.begin_drain()
        else:
            self.proxy.unready = True
        self._loop.call_soon_threadsafe(self._start_drain_task)

    def begin_drain(self) -> None:
        """Refuse new work from now on (503 + Retry-After; /health 503)."""
        state = self.proxy.state
        if state is not None:
            state.shutting_down = True

    def _start_drain_task(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self.drain())

    async def drain(self) -> None:
        """After ``delay_s`` refuse new work, wait until nothing is in flight or ``grace_s`` passed, then ask
        uvicorn to exit."""
        loop = asyncio.get_running_loop()
        if self.delay_s > 0:
            await asyncio.sleep(self.delay_s)
            self.begin_drain()
        deadline = loop.time() + self.grace_s
        while loop.time() < deadline:
            state = self.proxy.state
            if state is None or state.in_flight == 0:
                break
            await asyncio.sleep(self.poll_s)
        else:
            state = self.proxy.state
            left = state.in_flight if state is not None else 0
            if left:
                log.warning("pdproxy: shutdown_grace_s (%g s) is over: cutting %d request(s) still in flight",
                            self.grace_s, left, extra={"event": "shutdown_grace_over", "in_flight": left})
                for task in list(getattr(self.server_state, "tasks", ())):   # now, each ending its response
                    task.cancel("shutdown_grace_s is over")                   # (not uvicorn's ERROR a second later)
        self.should_exit = True


class CancelledLifespanFilter(logging.Filter):
    """Drops the traceback uvicorn logs when a forced exit (a second Ctrl-C during a stream) cancels the ASGI
    lifespan task: Starlette reports the ``CancelledError`` as a failed lifespan shutdown, which it is not — the
    operator asked to cut the open streams, and :meth:`DrainingServer.handle_exit` already said so in one line.
    Installed on ``uvicorn.error`` by ``pdproxy serve`` and by each worker of ``--workers N``."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith("Traceback") and text.rstrip().endswith("CancelledError"))
