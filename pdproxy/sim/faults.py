"""Fault injection: counted, deterministic fault specs per listener (``POST /sim/faults``, ``--fault``).

A spec is a JSON object::

    {"kind": K, "on_request": k, "times": n, "path": "/v1/chat/completions", "probability": p, ...params}

* ``on_request``: the fault fires on the k-th matching request counted from when it was added (1-based),
  then on the next ``times - 1`` matching requests (``times`` defaults to 1). Without ``on_request`` it
  fires on every matching request, ``times`` times if given, else forever.
* ``probability``: fire at random with that probability, from a ``random.Random(seed)``. Without it, faults
  are deterministic.
* ``path``: only requests whose path starts with it match. The default is the generation routes
  (:data:`DEFAULT_PATHS`). The ``/sim/`` control paths never match.

Kinds and their params: ``refuse`` (close the connection, no response), ``hang`` (never answer),
``status`` (``status``, ``body``, ``retry_after``), ``headers_then_stall`` (200 SSE headers, then nothing),
``reset_after_events`` (``events``: send k SSE events, then reset the TCP connection),
``close_without_done`` (``events``: k events, then end the body cleanly without ``data: [DONE]``),
``error_after_events`` (``events``: k events, then vLLM's in-band error event and the terminator, in the k-th
event's write),
``stall_after_events`` (``events``: k events, then silence with the connection open; ``events: 0``: the engine
runs the request — a decoder pulls its KV — but no event is ever written; these four also cut a non-streaming
answer once the engine finished it: half the body then a reset / a clean close / silence, or vLLM's 500,
``pdproxy/sim/completion.py``),
``slow`` (``factor``: stretch TTFT and every inter-event gap; ``min_gap_s`` floors the stretched gap),
``slice`` (``mode``: ``byte`` | ``crlf`` | ``data`` | ``utf8``), ``recomputed`` (``tokens``: end after k
tokens with ``finish_reason "stop"``, ``stop_reason "recomputed"``), ``no_kv_params`` (the prefiller finishes
on a first-token EOS and returns no ``kv_transfer_params``), ``hold_answer`` (``delay_s``: a non-streaming answer
is sent that long after the engine finished the request — a prefiller's KV is pinned meanwhile — like an API server
slow to send a finished answer), ``slow_health`` (``delay_s``: ``/health`` answers that late; give it
``"path": "/health"``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

KINDS = frozenset({"refuse", "hang", "status", "headers_then_stall", "reset_after_events", "close_without_done",
                   "slow", "slice", "recomputed", "no_kv_params", "hold_answer", "slow_health",
                   "error_after_events", "stall_after_events"})
SLICE_MODES = frozenset({"byte", "crlf", "data", "utf8"})
DEFAULT_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/inference/v1/generate")
_META = ("kind", "on_request", "times", "path", "probability")


@dataclass(slots=True)
class Fault:
    """One pending fault with its own counters (``seen`` matching requests, ``fired`` times)."""

    kind: str
    params: dict[str, Any]
    on_request: int | None = None
    times: int | None = None
    path: str | None = None
    probability: float | None = None
    seen: int = 0
    fired: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def matches(self, path: str) -> bool:
        """Whether a request to ``path`` counts for this fault."""
        if path.startswith("/sim/"):
            return False
        return path.startswith(self.path) if self.path else path in DEFAULT_PATHS

    def consider(self) -> bool:
        """Count one matching request; True when the fault fires on it."""
        self.seen += 1
        if self.exhausted:
            return False
        if self.on_request is not None:
            fire = self.seen >= self.on_request
        elif self.probability is not None:
            fire = self.rng.random() < self.probability
        else:
            fire = True
        if fire:
            self.fired += 1
        return fire

    @property
    def exhausted(self) -> bool:
        """True when the fault has fired ``times`` times."""
        return self.times is not None and self.fired >= self.times

    def spec(self) -> dict[str, Any]:
        """The spec as JSON, with ``seen`` and ``fired`` counters."""
        out: dict[str, Any] = {"kind": self.kind, **self.params, "seen": self.seen, "fired": self.fired}
        for key in ("on_request", "times", "path", "probability"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


def parse_fault(spec: Any, seed: int = 0) -> Fault:
    """Validate one spec. Raises ``ValueError`` for an unknown kind, a bad count or a bad slice mode."""
    if not isinstance(spec, dict):
        raise ValueError("a fault spec must be a JSON object")
    kind = spec.get("kind")
    if kind not in KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; expected one of {sorted(KINDS)}")
    on_request = spec.get("on_request")
    times = spec.get("times")
    for name, value in (("on_request", on_request), ("times", times)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be a positive integer")
    if on_request is not None and times is None:
        times = 1
    if kind == "slice" and spec.get("mode", "byte") not in SLICE_MODES:
        raise ValueError(f"slice mode must be one of {sorted(SLICE_MODES)}")
    probability = spec.get("probability")
    params = {k: v for k, v in spec.items() if k not in _META}
    return Fault(kind=kind, params=params, on_request=on_request, times=times, path=spec.get("path"),
                 probability=float(probability) if probability is not None else None,
                 rng=random.Random(f"{seed}:{len(str(spec))}:{kind}"))


class FaultBook:
    """The pending faults of one listener, in the order they were added."""

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._faults: list[Fault] = []

    def add(self, specs: Any) -> list[Fault]:
        """Add one spec or a list of specs (all validated first). Raises ``ValueError``."""
        items = specs if isinstance(specs, list) else [specs]
        parsed = [parse_fault(s, self._seed + i) for i, s in enumerate(items)]
        self._faults.extend(parsed)
        return parsed

    def match(self, path: str) -> Fault | None:
        """The fault that fires on this request, if any. Every matching fault counts the request."""
        chosen: Fault | None = None
        for fault in self._faults:
            if fault.matches(path) and fault.consider() and chosen is None:
                chosen = fault
        self._faults = [f for f in self._faults if not f.exhausted]
        return chosen

    def pending(self) -> list[dict[str, Any]]:
        """The specs still pending (``GET /sim/faults``)."""
        return [f.spec() for f in self._faults]

    def clear(self) -> None:
        """Drop every pending fault."""
        self._faults.clear()


def slice_event(event: bytes, mode: str) -> list[bytes]:
    """Split one SSE event into the writes of a ``slice`` fault (see the module docstring)."""
    if mode == "byte":
        return [event[i:i + 1] for i in range(len(event))]
    if mode == "crlf":
        body = event[:-2] if event.endswith(b"\n\n") else event
        return [body + b"\r", b"\n\r", b"\n"]
    if mode == "data":
        return [event[:2], event[2:]]
    if mode == "utf8":
        for i, byte in enumerate(event):
            if byte >= 0xC0:
                return [event[:i + 1], event[i + 1:]]
        return [event]
    return [event]
