"""The real proxy path on fake engines: :class:`Rig` wires ``ProxyState.build(Settings(...))`` and
``ProxyState.director`` with a :class:`~tests.middle.fake_upstream.FakeUpstream` (upstream of the legs, the
releaser and admission) and :class:`~tests.middle.fake_upstream.FakeEngines` (the health monitor's probes), and
serves each request through :meth:`pdproxy.app.application.PDProxyApp.handle_completion` — the handler the server runs for a
completion, which cancels the director when the client disconnects and sends errors the way still open — on a
:class:`~tests.middle.fake_upstream.FakeClient`.

:meth:`Rig.close` ends the run and asserts the invariants every test shares: the pool idle (and every lease
released exactly once), never a negative load counter at any release, the prefill queue and its ledger idle, no
request in flight, every engine exchange over (each stream released or closed), every KV handle with exactly one
fate (pulled, rejected or released), nothing written to a client after it left, nothing unexpected seen by the
fake.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from pdproxy.apis.request import Api
from pdproxy.app.application import PDProxyApp
from pdproxy.app.state import ProxyState
from pdproxy.endpoints import Endpoint
from pdproxy.settings import Settings
from tests.middle.fake_upstream import MODEL, FakeClient, FakeUpstream

PREFILLERS = ["http://p0:9000", "http://p1:9000", "http://p2:9000"]
DECODERS = ["http://d0:9100", "http://d1:9100", "http://d2:9100"]


def chat_body(key: str, *, stream: bool = True, max_tokens: int = 8, **extra: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"tell me about {key} " * 8}],
                         "max_tokens": max_tokens, "stream": stream, **extra})


async def until(cond: Callable[[], object], what: str = "", rounds: int = 2000) -> None:
    """Let the loop run (``sleep(0)`` rounds, no clock) until ``cond()`` holds."""
    for _ in range(rounds):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not reached: {what or cond}")


async def settle(rounds: int = 30) -> None:
    """Let every runnable step run (no engine I/O is real, so this quiesces the loop)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class Sent:
    """One request being served: its client and the handler's task."""

    def __init__(self, key: str, client: FakeClient, task: asyncio.Task[None]) -> None:
        self.key = key
        self.client = client
        self.task = task

    async def done(self) -> FakeClient:
        await self.task
        return self.client


class Rig:
    """See the module docstring.  ``settings`` override the defaults (3 prefillers, 3 decoders, no backoff, no
    request log, prompts estimated: no ``/tokenize``)."""

    def __init__(self, *, prefill: list[str] | None = None, decode: list[str] | None = None, stepping: bool = False,
                 **settings: Any) -> None:
        options: dict[str, Any] = {"token_count": "estimate", "retry_backoff_s": 0.0, "request_log": False}
        options.update(settings)
        self.settings = Settings(prefill=PREFILLERS if prefill is None else prefill,
                                 decode=DECODERS if decode is None else decode, **options)
        self.state = state = ProxyState.build(self.settings)
        self.fake = FakeUpstream(stepping=stepping)
        state.upstream = state.admission.upstream = self.fake
        state.health.engines = self.fake.engines  # type: ignore[assignment]
        self.director = state.director()
        self.app = PDProxyApp(self.settings)
        self.app.state = state
        self.app.director = self.director
        self.sent: list[Sent] = []
        self.negative: list[str] = []
        state.pool.add_release_listener(self._check_loads)

    def endpoint(self, url: str) -> Endpoint:
        return next(e for e in self.state.pool.endpoints() if e.url == url)

    def _check_loads(self) -> None:
        for e in self.state.pool.endpoints():
            load = self.state.pool.load(e)
            if load.requests < 0 or load.tokens < 0:
                self.negative.append(f"{e.name}: {load}")

    # --- requests ------------------------------------------------------------------------------------------
    def send(self, key: str, *, stream: bool = True, body: bytes | None = None, api: Api = Api.CHAT,
             headers: Iterable[tuple[bytes, bytes]] = ()) -> Sent:
        """Start request ``key`` (its client's ``X-Request-Id``) with ``body`` (default: a chat of ``stream``)."""
        client = FakeClient(body if body is not None else chat_body(key, stream=stream),
                            [(b"content-type", b"application/json"), (b"x-request-id", key.encode()), *headers])
        client.send_timeout_s = self.state.settings.client_send_timeout_s
        task = asyncio.get_running_loop().create_task(self.app.handle_completion(api, client))  # type: ignore[arg-type]
        sent = Sent(key, client, task)
        self.sent.append(sent)
        return sent

    async def run(self, key: str, *, stream: bool = True) -> FakeClient:
        return await self.send(key, stream=stream).done()

    # --- the end -------------------------------------------------------------------------------------------
    async def __aenter__(self) -> Rig:
        return self

    async def __aexit__(self, exc_type: object, *_: object) -> None:
        await self.close(check=exc_type is None, abandon=exc_type is not None)

    async def close(self, *, check: bool = True, abandon: bool = False) -> None:
        """Wait for the requests, the background release legs and the probes; then :meth:`check` (see the
        module docstring) unless ``check`` is False.  ``abandon`` (a test already failed): cancel what is left
        instead of waiting for it."""
        try:
            if abandon:
                for task in [s.task for s in self.sent] + list(self.director.kv_release._tasks):
                    task.cancel()
            await asyncio.wait_for(asyncio.gather(*(s.task for s in self.sent), return_exceptions=abandon), 10)
            await self.director.aclose()            # release legs still running (bounded)
            await settle()
        finally:
            await self.state.health.stop()
            await self.fake.aclose()
            await self.state.passthrough.aclose()
            await self.state.engines.aclose()
        if check:
            self.check()

    def check(self) -> None:
        state, fake = self.state, self.fake
        assert not self.negative, self.negative
        assert state.pool.idle(), state.pool.totals()
        for e in state.pool.endpoints():
            load = state.pool.load(e)
            assert load.leased_total == load.released_total, (e.name, load)
        assert state.queue.depth == 0 and state.queue.idle(), "the prefill queue or its ledger holds something"
        assert state.in_flight == 0
        assert not fake.open_calls(), fake.open_calls()
        assert not fake.unsettled_handles(), (fake.unsettled_handles(), fake.calls)
        assert not fake.problems, fake.problems
        for s in self.sent:
            assert not s.client.after_gone, (s.key, s.client.after_gone)
        assert not self.director.kv_release._tasks
