"""One way to stop a request's work when its client leaves, used by both routes.

The completion routes (``pdproxy/app/application.py``, pdproxy's own server: the connection calls
``Exchange.on_disconnect``) and the passthrough routes (raw ASGI: ``receive()`` returns ``http.disconnect``) both
run the request's work in the handler's own task and must cancel it when the client goes away before the
response ended — closing the engine connections, which makes vLLM abort the request — then *uncancel* the task
so the handler can still record the request.  :func:`cancel_on_disconnect` is that dance, once; a
:data:`Watch` adapts each route's disconnect signal (:func:`exchange_disconnect`, :func:`asgi_disconnect`).
Starlette's ``StreamingResponse.listen_for_disconnect`` is the same idea for ASGI (a task waiting on
``receive()`` that cancels the response's work).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

Watch = Callable[[Callable[[], None]], Callable[[], None]]
"""``watch(on_gone) -> stop``: call ``on_gone()`` (at most once) when the client disconnects, until ``stop()``."""


class Disconnectable(Protocol):
    """A connection that says when its client left: ``on_disconnect`` is called once (``pdproxy/http/server.py``'s
    ``Exchange``)."""

    on_disconnect: Callable[[], None] | None


def exchange_disconnect(ex: Disconnectable) -> Watch:
    """The :data:`Watch` of one of pdproxy's own server exchanges (its ``on_disconnect`` hook)."""

    def watch(on_gone: Callable[[], None]) -> Callable[[], None]:
        ex.on_disconnect = on_gone

        def stop() -> None:
            ex.on_disconnect = None

        return stop

    return watch


def asgi_disconnect(receive: Callable[[], Awaitable[dict[str, Any]]]) -> Watch:
    """The :data:`Watch` of an ASGI request whose body was read whole: the next ``receive()`` only returns when
    the client disconnects (``http.disconnect``)."""

    def watch(on_gone: Callable[[], None]) -> Callable[[], None]:
        message = asyncio.ensure_future(receive())

        def done(_: asyncio.Future[dict[str, Any]]) -> None:
            on_gone()

        message.add_done_callback(done)

        def stop() -> None:
            message.remove_done_callback(done)        # first: cancelling it must not read as a disconnect
            message.cancel()

        return stop

    return watch


async def cancel_on_disconnect(work: Awaitable[None], disconnected: Watch, ended: Callable[[], bool]) -> bool:
    """Run ``work`` in the current task, cancelling it when ``disconnected`` fires before the response ``ended()``
    (after its last byte a disconnect is only the client closing a finished exchange).

    Returns True when the client left that way: whatever ``work`` raised on its way out (its ``CancelledError``,
    or an error it made of it) is dropped — nobody is left to answer — and the task's cancellation is taken back
    (``uncancel``), so the caller goes on to record the request.  Returns False when ``work`` finished first; its
    exceptions propagate, and so does a ``CancelledError`` from anyone else (also when both happened).
    """
    task = asyncio.current_task()
    assert task is not None, "cancel_on_disconnect runs inside a task"
    gone = False

    def on_gone() -> None:
        nonlocal gone
        if not gone and not ended():
            gone = True
            task.cancel()

    stop = disconnected(on_gone)
    try:
        await work
    except asyncio.CancelledError:
        if not gone or task.cancelling() > 1:          # (also) cancelled from outside: the server is stopping
            raise
    except Exception:
        if not gone:
            raise
    finally:
        stop()
        if gone and task.cancelling():
            task.uncancel()
    return gone
