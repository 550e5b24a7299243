"""glibc's malloc thresholds for a process that reads, parses and re-sends bodies of hundreds of KB per request.

A long agent prompt is a ~250 KB body, and the request path holds several buffers of its size at once (the bytes
read, the parsed prompt, the JSON parser's own work area, the rendering for prefix keys, the decode leg's bytes).
Python hands any buffer over 512 bytes to glibc's ``malloc``, whose default policy is dynamic (``malloc/malloc.c``,
``M_MMAP_THRESHOLD``): a block over 128 KiB is ``mmap``-ed until one is freed, which raises that threshold to the
block's size and the *trim* threshold to twice that.  Concurrent requests free several MB at the top of the heap
at a time, far over that trim threshold, so ``free`` gives the pages back to the kernel and the next request
faults them in again, zeroed.  Measured (``loadtest/RESULTS.md`` §4, "The heap kept"; ``tests/ops/test_heap.py``):
through ``pdproxy serve``, 8 concurrent 1 MB chat bodies, 130–330 page faults per request with glibc's policy,
~30 with this one; 16 concurrent ~64K-token prompts at full speed, 14–33 faults against 2–11 and ~0.07 ms of CPU
per request out of ~1.3 ms (~5 %).

:func:`tune_malloc` fixes both thresholds at start: ``free`` keeps up to ``malloc_trim_threshold_mib`` MiB at the
top of the heap (64 by default: a burst's worth of such requests — 32 was too few for 8 concurrent 1 MB bodies),
and blocks under half of it (at most glibc's own ceiling, 32 MiB) come from the heap, not ``mmap``.  The cost is
that much memory kept after a burst: the process's RSS falls back by that much less.  Process-wide and kept until
exit, so it is applied by the process's entry points (``pdproxy serve`` and each ``--workers`` process), not by
an app.

Left alone: a C library that is not glibc (musl, macOS), and an operator's own choice of these thresholds —
glibc's ``MALLOC_TRIM_THRESHOLD_``-style environment variables or their ``GLIBC_TUNABLES`` names, which
``mallopt`` would override.  A refusal by glibc is logged as a warning (:func:`apply_heap_policy`).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

M_TRIM_THRESHOLD: Final = -1
"""``mallopt``'s parameter numbers (glibc's ``malloc/malloc.h``)."""
M_MMAP_THRESHOLD: Final = -3
MMAP_THRESHOLD_MAX: Final = (4 << 20) * ctypes.sizeof(ctypes.c_long)
"""glibc's ceiling for its own dynamic mmap threshold (``DEFAULT_MMAP_THRESHOLD_MAX`` in ``malloc/malloc.c``: 32 MiB
on 64-bit); older glibc releases also refuse a larger ``M_MMAP_THRESHOLD``."""
INT_MAX: Final = (1 << 31) - 1
"""``mallopt`` takes an ``int``: a threshold over this (2,047 MiB and a bit) does not fit."""
OPERATOR_VARIABLES: Final = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                             "MALLOC_MMAP_MAX_")
"""glibc's environment variables that each turn its dynamic thresholds off (``do_set_trim_threshold`` and its
siblings in ``malloc/malloc.c`` set ``no_dyn_threshold``): set, even empty, they are the operator's policy."""
OPERATOR_TUNABLES: Final = ("glibc.malloc.trim_threshold", "glibc.malloc.mmap_threshold", "glibc.malloc.top_pad",
                            "glibc.malloc.mmap_max")
"""The same as ``GLIBC_TUNABLES`` names (``name=value`` pairs apart by ``:``)."""

log = logging.getLogger("pdproxy.heap")

Mallopt = Callable[[int, int], int]
"""``mallopt(param, value)``: 1 on success, 0 on error."""


@dataclass(frozen=True, slots=True)
class HeapOutcome:
    """What :func:`tune_malloc` did: ``applied``, else ``why`` not (one line); ``refused``: glibc refused a value
    (the policy not applied, or — the trim threshold refused after the mmap threshold was taken — half applied)."""

    applied: bool
    why: str = ""
    refused: bool = False


def _glibc_mallopt() -> Mallopt | None:
    """This process's ``mallopt`` when its C library is glibc, else None."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (ValueError, OSError):               # no such name outside glibc
        return None
    try:
        fn = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def tune_malloc(trim_threshold_mib: int, *, environ: Mapping[str, str] | None = None,
                mallopt: Mallopt | None = None) -> HeapOutcome:
    """Fix glibc's mmap threshold at half of ``trim_threshold_mib`` MiB (at most :data:`MMAP_THRESHOLD_MAX`), then
    its trim threshold at ``trim_threshold_mib`` MiB.  Not applied when ``trim_threshold_mib`` is 0, when
    ``environ`` (default ``os.environ``) holds an operator's ``MALLOC_*_`` variable or ``GLIBC_TUNABLES`` name
    (:data:`OPERATOR_VARIABLES`, :data:`OPERATOR_TUNABLES`), when the C library is not glibc, and when a value
    does not fit ``mallopt``'s ``int`` or ``mallopt`` refuses it.  The mmap threshold goes first: setting either
    turns glibc's dynamic thresholds off, and a fixed trim threshold alone would leave every block over 128 KiB
    ``mmap``-ed.  ``mallopt``: injected by tests (default: glibc's, through ``ctypes``)."""
    if trim_threshold_mib <= 0:
        return HeapOutcome(False, "malloc_trim_threshold_mib is 0: glibc's dynamic thresholds kept")
    env = os.environ if environ is None else environ
    chosen = [name for name in OPERATOR_VARIABLES if name in env]
    tunables = {pair.partition("=")[0] for pair in env.get("GLIBC_TUNABLES", "").split(":")}
    chosen += [name for name in OPERATOR_TUNABLES if name in tunables]
    if chosen:
        return HeapOutcome(False, f"{', '.join(chosen)} set: the operator's malloc policy kept")
    trim = trim_threshold_mib << 20
    if trim > INT_MAX:
        return HeapOutcome(False, f"malloc_trim_threshold_mib {trim_threshold_mib} does not fit mallopt's int",
                           refused=True)
    fn = mallopt if mallopt is not None else _glibc_mallopt()
    if fn is None:
        return HeapOutcome(False, "not glibc: its malloc left alone")
    mmap = min(trim // 2, MMAP_THRESHOLD_MAX)
    if not fn(M_MMAP_THRESHOLD, mmap):
        return HeapOutcome(False, f"mallopt refused M_MMAP_THRESHOLD {mmap}: glibc's dynamic thresholds kept",
                           refused=True)
    if not fn(M_TRIM_THRESHOLD, trim):
        return HeapOutcome(False, f"mallopt refused M_TRIM_THRESHOLD {trim} (M_MMAP_THRESHOLD {mmap} taken)",
                           refused=True)
    return HeapOutcome(True)


def apply_heap_policy(trim_threshold_mib: int) -> HeapOutcome:
    """:func:`tune_malloc` at a process's start: a refusal is logged as a warning, a choice to leave malloc alone
    at debug level."""
    outcome = tune_malloc(trim_threshold_mib)
    if outcome.refused:
        log.warning("heap: %s", outcome.why)
    elif not outcome.applied:
        log.debug("heap: %s", outcome.why)
    return outcome
