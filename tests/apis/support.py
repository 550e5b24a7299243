"""Helpers for the API tests: the legs each engine received, SSE parsing, pinned-KV and stream counters."""

from __future__ import annotations

from typing import Any

import orjson

from tests.conftest import Fleet
from tests.support import SimProcess, wait_until


def legs(sims: list[SimProcess], path: str) -> list[dict[str, Any]]:
    """Every request to ``path`` the engines received (in arrival order per engine)."""
    return [r for s in sims for r in s.received() if r["path"] == path]


def events(text: str) -> list[tuple[str | None, Any]]:
    """``(event name, parsed data)`` of each SSE event of a body (``[DONE]`` kept as the string)."""
    out: list[tuple[str | None, Any]] = []
    for raw in text.replace("\r\n", "\n").split("\n\n"):
        if not raw.strip():
            continue
        name = None
        data: list[str] = []
        for line in raw.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip())
        payload = "\n".join(data)
        out.append((name, payload if payload == "[DONE]" else orjson.loads(payload)))
    return out


def pinned(sim: SimProcess) -> int:
    """KV blocks the engine still pins for a decoder (``/sim/state``)."""
    state = sim.state()
    ranks = state.get("ranks") or [state]
    return sum(int(r.get("pinned_blocks") or 0) for r in ranks)


def active_streams(sim: SimProcess) -> int:
    """Streams the engine is still writing (``/sim/state``)."""
    state = sim.state()
    ranks = state.get("ranks") or [state]
    return sum(int(r.get("active_streams") or 0) for r in ranks)


def wait_engines_idle(sims: Fleet, timeout_s: float = 10.0) -> None:
    """Every engine of the fleet has released its pinned KV and closed its streams."""
    wait_until(lambda: all(pinned(s) == 0 and active_streams(s) == 0 for s in sims.all), timeout_s,
               what="engines idle (pinned blocks and streams back to 0): "
                    f"{[(s.url, pinned(s), active_streams(s)) for s in sims.all]}")
