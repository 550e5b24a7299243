"""One disconnect helper for both routes (pdproxy/app/disconnect.py), tested the way Starlette tests
``StreamingResponse.listen_for_disconnect``: fake ``receive``/``send`` (ASGI, the passthrough routes) and a fake
exchange whose connection reports the disconnect (pdproxy's own server, the completion routes)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from pdproxy.app.application import create_app
from pdproxy.app.disconnect import asgi_disconnect, cancel_on_disconnect, exchange_disconnect
from pdproxy.errors import UpstreamUnavailable
from pdproxy.settings import load_settings
from pdproxy.timeline import RequestContext

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(10)]


def _proxy() -> Any:
    return create_app(load_settings(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"]))


class _Work:
    """A request's work: sends a first piece, then waits (for ever, or until ``finish`` is set) and notes how it
    ended."""

    def __init__(self) -> None:
        self.sent_first = asyncio.Event()
        self.finish = asyncio.Event()
        self.ended: list[str] = []

    async def run(self, send: Any | None = None) -> None:
        if send is not None:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"part", "more_body": True})
        self.sent_first.set()
        try:
            await self.finish.wait()
        except asyncio.CancelledError:
            self.ended.append("cancelled")      # the engine connection would be closed here
            raise
        if send is not None:
            await send({"type": "http.response.body", "body": b""})
        self.ended.append("done")


# --- the passthrough route: raw ASGI, fake receive and send -------------------------------------------------

async def _passthrough(work: _Work, disconnect_when: asyncio.Event) -> tuple[list[str], list[dict[str, Any]], Any]:
    proxy = _proxy()
    state = SimpleNamespace(shutting_down=False, in_flight=0,
                            passthrough=SimpleNamespace(serve=lambda path, body, headers, ctx, send: work.run(send)))
    proxy.state = state
    outcomes: list[str] = []
    proxy._finished = lambda ctx, req: outcomes.append(ctx.outcome)
    messages = [{"type": "http.request", "body": b'{"model": "m", "prompt": "x"}', "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await disconnect_when.wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/tokenize", "headers": [(b"content-type", b"application/json")]}
    await asyncio.wait_for(proxy.handle_passthrough("/tokenize", "tokenize", scope, receive, send), 5)
    assert state.in_flight == 0
    return outcomes, sent, asyncio.current_task()


async def test_passthrough_work_stops_when_receive_says_disconnect() -> None:
    work = _Work()
    outcomes, sent, task = await _passthrough(work, work.sent_first)
    assert work.ended == ["cancelled"]
    assert outcomes == ["client_disconnected"]
    assert [m.get("more_body") for m in sent if m["type"] == "http.response.body"] == [True]  # never finished
    assert task.cancelling() == 0                                  # the handler's task is not left cancelled


async def test_passthrough_disconnect_after_the_last_byte_cancels_nothing() -> None:
    work = _Work()
    gone = asyncio.Event()

    async def finish_then_leave() -> None:
        await work.sent_first.wait()
        work.finish.set()
        while "done" not in work.ended:
            await asyncio.sleep(0)
        gone.set()

    leaver = asyncio.create_task(finish_then_leave())
    outcomes, sent, _ = await _passthrough(work, gone)
    await leaver
    assert work.ended == ["done"] and outcomes == ["ok"]
    assert sent[-1] == {"type": "http.response.body", "body": b""}


# --- the completion route: pdproxy's server reports the disconnect on the exchange ---------------------------

class _Out:
    """The client side as the completion route sees it (``Responder``): flags and what was sent."""

    def __init__(self) -> None:
        self.started = self.ended = False
        self.errors: list[Exception] = []

    def error_nowait(self, err: Exception) -> None:
        self.errors.append(err)
        self.ended = True

    def end_nowait(self) -> None:
        self.ended = True


async def _completion(serve: Any, leave: bool) -> tuple[RequestContext, _Out, Any]:
    proxy = _proxy()
    ex = SimpleNamespace(on_disconnect=None)
    ctx = RequestContext("r", None, "chat")
    out = _Out()
    director = SimpleNamespace(serve=serve)
    handler = asyncio.create_task(proxy._serve_until_disconnect(director, None, ctx, out, ex))
    while ex.on_disconnect is None:
        await asyncio.sleep(0)
    if leave:
        out.started = True
        ex.on_disconnect()                     # the connection saw the client go (pdproxy/http/server.py)
    await asyncio.wait_for(handler, 5)
    assert ex.on_disconnect is None            # the hook is not left on the exchange
    return ctx, out, handler


async def test_completion_work_stops_when_the_exchange_reports_a_disconnect() -> None:
    work = _Work()
    ctx, out, handler = await _completion(lambda req, ctx, out: work.run(), leave=True)
    assert work.ended == ["cancelled"]
    assert ctx.outcome == "client_disconnected" and out.errors == []   # nobody is left to answer
    assert handler.cancelling() == 0 and not handler.cancelled()


async def test_completion_error_after_a_disconnect_is_not_sent() -> None:
    async def serve(req: Any, ctx: Any, out: Any) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise UpstreamUnavailable("decoder gone") from None       # work that turns its cancel into an error
    ctx, out, _ = await _completion(serve, leave=True)
    assert ctx.outcome == "client_disconnected" and out.errors == []


async def test_completion_error_without_a_disconnect_is_answered() -> None:
    async def serve(req: Any, ctx: Any, out: Any) -> None:
        await asyncio.sleep(0)
        raise UpstreamUnavailable("decoder refused")
    ctx, out, _ = await _completion(serve, leave=False)
    assert ctx.outcome == "upstream_error" and [type(e) for e in out.errors] == [UpstreamUnavailable]


# --- the helper itself ----------------------------------------------------------------------------------------

async def test_a_cancel_from_outside_still_propagates_after_a_disconnect() -> None:
    hook = SimpleNamespace(on_disconnect=None)
    work = _Work()

    async def handler() -> bool:
        return await cancel_on_disconnect(work.run(), exchange_disconnect(hook), lambda: False)

    task = asyncio.create_task(handler())
    await work.sent_first.wait()
    hook.on_disconnect()                        # the client left …
    task.cancel()                               # … and the server is stopping
    with pytest.raises(asyncio.CancelledError):
        await task
    assert work.ended == ["cancelled"]


async def test_asgi_watch_stops_without_reading_a_disconnect() -> None:
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.disconnect"}

    work = _Work()
    work.finish.set()
    assert await cancel_on_disconnect(work.run(), asgi_disconnect(receive), lambda: False) is False
    for _ in range(5):                          # the cancelled receive() settles without calling on_gone
        await asyncio.sleep(0)
    assert work.ended == ["done"] and asyncio.current_task().cancelling() == 0
