"""Ports for processes that bind them later (engines, proxies, receivers of the benches and the tests), picked below
the kernel's ephemeral range.

The real-vLLM stage picks the engines' ports once and starts three engine configurations on them over several
minutes.  A port picked by binding port 0 comes from the ephemeral range (``/proc/sys/net/ipv4/
ip_local_port_range``, 32768–60999 by default), the range every outgoing connection and port-0 listener draws
from — and each starting vLLM worker opens a few dozen port-0 listeners of its own (UCX, gloo, ZMQ).  One run
lost the decoder's NIXL side channel that way: the prefiller's worker, starting beside it, held the port, and
the decoder's ``nixl_handshake_listener`` thread died on ``Address already in use``, so it could never pull.
Ports below the ephemeral range are never handed out by the kernel, so a port free when picked stays free.

``python -m loadtest.ports N`` prints N such ports (scripts/test-all.sh exports them for the real-vLLM stage).

``PDPROXY_BENCH_PORTS=LOW-HIGH`` (e.g. ``18300-18599``) confines every port picked here — the benches', the chaos
and fault suites', the tests' — to ``[LOW, HIGH]`` (still below the ephemeral range), for a machine whose other
users own the rest.
"""

from __future__ import annotations

import os
import random
import socket
import sys
from pathlib import Path

RESERVED = frozenset({5557, 5558, 5600, 5601, 8000, 8100, 8200})
"""Ports the README's commands use (the demo, ``scripts/real-vllm.sh`` defaults, vLLM's KV events default)."""


def ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """The lowest port the kernel hands out for port 0 / outgoing connections (32768 when unreadable)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


WINDOW_ENV = "PDPROXY_BENCH_PORTS"


def window(value: str | None = None) -> tuple[int, int]:
    """``[low, high)`` of :data:`WINDOW_ENV` (``LOW-HIGH``, inclusive; read from the environment when ``value`` is
    None), or ``(20000, 65536)`` when unset.  Raises ``ValueError`` for a malformed value."""
    text = os.environ.get(WINDOW_ENV) if value is None else value
    if not text:
        return 20000, 65536
    low, sep, high = text.partition("-")
    if not sep or not low.strip().isdigit() or not high.strip().isdigit() or int(low) > int(high):
        raise ValueError(f"{WINDOW_ENV}={text!r}: expected LOW-HIGH, e.g. 18300-18599")
    return int(low), int(high) + 1


def engine_ports(n: int, low: int | None = None, high: int | None = None) -> list[int]:
    """``n`` distinct ports in ``[low, high)`` (default: :data:`WINDOW_ENV`'s window, else from 20000; never at or
    above :func:`ephemeral_low`) that are free now, in random order (concurrent stages rarely pick the same).
    Raises ``RuntimeError`` when too few are free."""
    if low is None or high is None:
        w_low, w_high = window()
        low = w_low if low is None else low
        high = w_high if high is None else high
    candidates = [p for p in range(low, min(high or 65536, ephemeral_low())) if p not in RESERVED]
    random.shuffle(candidates)
    picked = [p for p in candidates[: n * 50] if _free(p)][:n]
    if len(picked) < n:
        raise RuntimeError(f"only {len(picked)} free ports in {low}–{high - 1} below the ephemeral range, {n} "
                           "needed")
    return picked


_HANDED_OUT: set[int] = set()
"""Ports :func:`free_port` gave out in this process (each once)."""


def free_port() -> int:
    """A port free now for a process that binds it later: below the ephemeral range, where no outgoing connection
    or port-0 listener can take it meanwhile, and never handed out twice in this process (a restarted engine keeps
    its port: pass it explicitly)."""
    while True:
        port = engine_ports(1)[0]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


if __name__ == "__main__":
    print(*engine_ports(int(sys.argv[1]) if len(sys.argv) > 1 else 6))
