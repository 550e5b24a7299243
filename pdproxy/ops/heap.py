"""glibc's malloc thresholds for a process that reads, parses and re-sends bodies of hundreds of KB per request.

A long agent prompt is a ~250 KB body, and the request path holds several buffers of its size at once (the bytes
read, the parsed prompt, the JSON parser's own work area, the rendering for prefix keys, the decode leg's bytes).
Python hands any buffer over 512 bytes to glibc's ``malloc``, whose default policy (``mallopt(3)``) is dynamic: a
block over 128 KiB is ``mmap``-ed until one is freed, which raises that threshold to the block's size and the
*trim* threshold to twice that.  Concurrent requests free several MB at the top of the heap at a time, far over
that trim threshold, so ``free`` gives the pages back to the kernel and the next request faults them in again,
zeroed.  Measured through ``pdproxy serve`` (``tests/ops/test_heap.py``; ``loadtest/RESULTS.md`` §4, "The heap
kept"): 8 concurrent 1 MB chat bodies, 180–330 page faults per request with glibc's policy, ~30 with this one;
16 concurrent ~64K-token prompts at full speed, ~30 faults and ~0.15 ms of CPU per request out of ~1.35 ms.

:func:`tune_malloc` fixes both thresholds at start: ``free`` keeps up to ``malloc_trim_threshold_mib`` MiB at the
top of the heap (64 by default: a burst's worth of such requests — 32 was too few for 8 concurrent 1 MB bodies),
and blocks under half of it (at most glibc's own ceiling, 32 MiB) come from the heap, not ``mmap``.  The cost is
that much memory kept after a burst: the process's RSS falls back by that much less.  Process-wide and kept until
exit, so it is applied by the process's entry points (``pdproxy serve`` and each ``--workers`` process), not by
an app.

Left alone: a C library that is not glibc (musl, macOS), and an operator's own choice of these thresholds —
glibc's ``MALLOC_TRIM_THRESHOLD_``-style environment variables or their ``GLIBC_TUNABLES`` names, which
``mallopt`` would override.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Mapping
from typing import Final

M_TRIM_THRESHOLD: Final = -1
"""``mallopt``'s parameter numbers (glibc's ``malloc.h``)."""
M_MMAP_THRESHOLD: Final = -3
MMAP_THRESHOLD_MAX: Final = 32 << 20
"""glibc's largest ``M_MMAP_THRESHOLD`` on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``): larger values are refused."""
OPERATOR_VARIABLES: Final = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                             "MALLOC_MMAP_MAX_")
"""glibc's environment variables for what :func:`tune_malloc` sets: when one is set, the operator has chosen."""
OPERATOR_TUNABLES: Final = ("glibc.malloc.trim_threshold", "glibc.malloc.mmap_threshold", "glibc.malloc.top_pad",
                            "glibc.malloc.mmap_max")
"""The same as ``GLIBC_TUNABLES`` names (``name=value`` pairs apart by ``:``)."""

log = logging.getLogger("pdproxy.heap")

Mallopt = Callable[[int, int], int]
"""``mallopt(param, value)``: 1 on success, 0 on error."""


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
                mallopt: Mallopt | None = None) -> str | None:
    """Fix glibc's trim threshold at ``trim_threshold_mib`` MiB and its mmap threshold at half of it (at most
    :data:`MMAP_THRESHOLD_MAX`).  Returns None when applied, else why not (one line): ``trim_threshold_mib`` 0,
    an operator's ``MALLOC_*_`` / ``GLIBC_TUNABLES`` choice in ``environ`` (default ``os.environ``), no glibc, or
    ``mallopt`` refusing a value (``trim_threshold_mib`` over 1,023 does not fit its ``int``).  ``mallopt``: injected by tests (default: glibc's, through ``ctypes``)."""
    if trim_threshold_mib <= 0:
        return "malloc_trim_threshold_mib is 0: glibc's dynamic thresholds kept"
    env = os.environ if environ is None else environ
    chosen = [name for name in OPERATOR_VARIABLES if env.get(name)]
    tunables = {pair.partition("=")[0] for pair in env.get("GLIBC_TUNABLES", "").split(":")}
    chosen += [name for name in OPERATOR_TUNABLES if name in tunables]
    if chosen:
        return f"{', '.join(chosen)} set: the operator's malloc policy kept"
    fn = mallopt if mallopt is not None else _glibc_mallopt()
    if fn is None:
        return "not glibc: its malloc left alone"
    trim = trim_threshold_mib << 20
    if not fn(M_TRIM_THRESHOLD, trim) or not fn(M_MMAP_THRESHOLD, min(trim // 2, MMAP_THRESHOLD_MAX)):
        return "mallopt refused the thresholds"
    return None


def apply_heap_policy(trim_threshold_mib: int) -> None:
    """:func:`tune_malloc` at a process's start; why it was left alone, if it was, is logged at debug level."""
    why = tune_malloc(trim_threshold_mib)
    if why is not None:
        log.debug("heap: %s", why)
