"""Start-up and shutdown on one exit stack (pdproxy/app/state.py, the lifespan in pdproxy/app/application.py): a
component whose start raises leaves nothing running — the ones started before it are stopped, newest first."""

from __future__ import annotations

from typing import Any

import pytest

from pdproxy.app.application import create_app
from pdproxy.app.state import ProxyState
from pdproxy.settings import load_settings
from tests.support import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


def _settings() -> Any:
    # nothing listens on these ports: health's first probe round fails fast, which start-up tolerates
    return load_settings(prefill=[f"http://127.0.0.1:{free_port()}"], decode=[f"http://127.0.0.1:{free_port()}"],
                         connect_timeout_s=1, health_timeout_s=1)


def _record(state: ProxyState, monkeypatch: pytest.MonkeyPatch, fail: str | None) -> list[str]:
    """Record each component's start and stop in order; the start named ``fail`` raises instead."""
    calls: list[str] = []

    def wrap(name: str, obj: object, method: str, *, starts: bool) -> None:
        original = getattr(obj, method)

        async def recorded(*args: object) -> object:
            calls.append(f"{'start' if starts else 'stop'} {name}")
            if starts and name == fail:
                raise RuntimeError(f"{name} failed to start")
            return await original(*args)

        monkeypatch.setattr(obj, method, recorded)

    wrap("upstream", state.upstream, "start", starts=True)
    wrap("upstream", state.upstream, "close", starts=False)
    wrap("admission", state.admission, "start", starts=True)
    wrap("admission", state.admission, "aclose", starts=False)
    wrap("health", state.health, "start", starts=True)
    wrap("health", state.health, "stop", starts=False)
    wrap("passthrough", state.passthrough, "aclose", starts=False)
    wrap("engines", state.engines, "aclose", starts=False)
    return calls


async def test_a_failed_start_stops_the_earlier_components_in_reverse(monkeypatch: pytest.MonkeyPatch) -> None:
    state = ProxyState.build(_settings())
    calls = _record(state, monkeypatch, fail="health")
    with pytest.raises(RuntimeError, match="health failed to start"):
        await state.start()
    assert calls == ["start upstream", "start admission", "start health",
                     "stop health", "stop admission", "stop upstream", "stop passthrough", "stop engines"]
    with pytest.raises(RuntimeError, match="not awaited"):   # the upstream pool is closed, not left open
        state.upstream.pool  # noqa: B018
    assert state.admission._executor is None                 # the token-count threads are stopped
    await state.stop()                                       # nothing left to stop: a no-op
    assert calls[-1] == "stop engines"


async def test_stop_runs_the_start_in_reverse(monkeypatch: pytest.MonkeyPatch) -> None:
    state = ProxyState.build(_settings())
    calls = _record(state, monkeypatch, fail=None)
    async with state:
        assert calls == ["start upstream", "start admission", "start health"]
    assert calls[3:] == ["stop health", "stop admission", "stop upstream", "stop passthrough", "stop engines"]


async def test_the_lifespan_leaves_no_state_when_start_up_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = create_app(_settings())
    closed: list[str] = []

    async def refuse(self: Any) -> None:
        raise RuntimeError("admission failed to start")

    original_close = ProxyState.stop

    async def stop(self: ProxyState) -> None:
        closed.append("state")
        await original_close(self)

    monkeypatch.setattr("pdproxy.admission.admission.Admission.start", refuse)
    monkeypatch.setattr(ProxyState, "stop", stop)
    lifespan = proxy.control.router.lifespan_context
    with pytest.raises(RuntimeError, match="admission failed to start"):
        async with lifespan(proxy.control):
            pass
    assert proxy.state is None and proxy.director is None
    assert closed == []             # the state never entered: its own start unwound what it had started


async def test_the_lifespan_stops_everything_on_the_way_out() -> None:
    proxy = create_app(_settings())
    async with proxy.control.router.lifespan_context(proxy.control):
        assert proxy.state is not None and proxy.director is not None
        state = proxy.state
    assert proxy.state is None and state.shutting_down
    with pytest.raises(RuntimeError, match="not awaited"):
        state.upstream.pool  # noqa: B018
