"""Garbage collection for a latency-bound proxy: full collections on a timer, not when the live set grows.

CPython's cycle collector runs a *full* collection whenever the objects promoted to the oldest generation grow
by 25 % of those already there.  A stream keeps ~170 tracked container objects alive for its whole life
(parsers' bound callbacks, coroutine frames, context managers, the relay's splice), so a ramp to 1,000
concurrent streams triggers a full collection at every 25 % step, each one stopping the event loop for ~1 µs per
live object: measured on this machine kind during a 1,000-stream ramp, pauses of 15, 137, 238 and 210 ms at
49k, 122k, 208k and 70k objects — every request arriving meanwhile got that much added TTFT (p99 +230 ms).

The proxy's own stream objects are freed by reference counting (the relay, server and transport break their
reference cycles when a stream ends: ``pdproxy/pd/relay.py``, ``pdproxy/http/server.py``, ``pdproxy/http/client.py``), so
what only a full collection can free grows slowly.  :class:`GcPolicy` therefore, while the app serves:

1. collects once and freezes everything allocated at start-up (``gc.freeze()``: the app, FastAPI, pydantic,
   the tokenizer — ~50k objects never scanned again);
2. keeps young collections (they scan only the objects allocated since the last one), less often (4.);
3. turns the automatic full collection off (its threshold set out of reach) and runs one every
   ``interval_s`` seconds instead (``gc_full_interval_s``; 0 keeps CPython's policy);
4. raises the young generation's threshold from CPython's 700 to ``young_threshold`` (``gc_young_threshold``;
   0 keeps CPython's thresholds): a request allocates tracked objects (dicts, lists, frames' closures) that
   reference counting frees within milliseconds, and a young collection scans each one still alive — at 700 one
   runs every few requests and finds most of the in-flight requests' objects alive, ~6 % of the proxy's CPU at
   100 concurrent short requests; at 10,000, one every few hundred requests, most have died first (~1 %).  The
   middle generation is then collected after every two young collections (its threshold 1, CPython's 10: young,
   young, middle), so a middle collection scans at most three young collections' worth of objects: pauses of at
   most ~5 ms (young) and ~15 ms (middle) measured in a ramp to 1,000 streams, against ~2 and ~7 ms at CPython's
   thresholds, and ~80 ms with only the young threshold raised (``loadtest/RESULTS.md`` §4, "Young
   collections").  The saving needs the threshold above the objects the in-flight requests hold (~100 of them at
   a time here); far more concurrent requests make a young collection find most of its objects alive again.

Restored by :meth:`GcPolicy.stop`.  Not thread-safe; one per process (the app's lifespan owns it).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time

log = logging.getLogger("pdproxy.gc")

_NEVER = 1 << 30
"""A third threshold no count reaches: gen-1 collections before the automatic full one."""
_MIDDLE = 1
"""The second threshold with a raised young one: a middle collection comes once more than this many young ones
have run since the last (1: young, young, middle).  CPython 3.11-3.13 and 3.15's generational collector; 3.14's
incremental one has no middle generation, and its second threshold is left alone."""


class GcPolicy:
    """See the module docstring.  ``interval_s``: seconds between full collections (≤ 0: leave CPython's full
    collections alone); ``young_threshold``: the young generation's threshold (allocations of tracked objects
    less deallocations; ≤ 0: CPython's).  ``full_collections``: how many it ran; ``last_pause_s``: the duration
    of the last one."""

    def __init__(self, interval_s: float, young_threshold: int = 0) -> None:
        self.interval_s = interval_s
        self.young_threshold = young_threshold
        self.full_collections = 0
        self.last_pause_s = 0.0
        self._saved: tuple[int, int, int] | None = None
        self._applied: tuple[int, int, int] | None = None
        self._froze = False
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Apply the policy (call inside the running loop, after start-up)."""
        if self._saved is not None or (self.interval_s <= 0 and self.young_threshold <= 0):
            return
        self._saved = gc.get_threshold()
        young, middle, oldest = self._saved
        if self.young_threshold > 0:
            young = self.young_threshold
            if sys.version_info[:2] != (3, 14):     # 3.14's incremental collector reads it as the old one's scan rate
                middle = _MIDDLE
        if self.interval_s > 0:
            gc.collect()
            gc.freeze()
            self._froze = True
            oldest = _NEVER
            self._loop = asyncio.get_running_loop()
            self._timer = self._loop.call_later(self.interval_s, self._full)
        gc.set_threshold(young, middle, oldest)
        self._applied = gc.get_threshold()

    def _full(self) -> None:
        started = time.perf_counter()
        found = gc.collect()
        self.last_pause_s = time.perf_counter() - started
        self.full_collections += 1
        if self.last_pause_s > 0.05:
            log.info("full garbage collection: %.0f ms, %d objects freed", self.last_pause_s * 1000, found)
        if self._loop is not None and self._saved is not None:
            self._timer = self._loop.call_later(self.interval_s, self._full)

    def stop(self) -> None:
        """Restore the thresholds found at :meth:`start` — unless they have changed since, i.e. another policy
        started after this one is still applied or has restored what it found (two apps of the same settings in one
        process, as tests run them, stopping in either order leave the thresholds as they were before both) — and
        unfreeze (a no-op if not started)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._saved is not None:
            if gc.get_threshold() == self._applied:
                gc.set_threshold(*self._saved)
            self._saved = self._applied = None
            if self._froze:
                self._froze = False
                gc.unfreeze()
