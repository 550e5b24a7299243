"""``loadtest/ports.py``: the real engines' ports come from below the ephemeral range, free and distinct."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from loadtest.ports import RESERVED, engine_ports, ephemeral_low, window


def test_ports_are_free_distinct_and_never_ephemeral() -> None:
    ports = engine_ports(6)
    assert len(set(ports)) == 6
    assert all(20000 <= p < ephemeral_low() and p not in RESERVED for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))          # free now


def test_a_port_in_use_is_never_picked() -> None:
    (p,) = engine_ports(1, high=ephemeral_low() - 1)
    with socket.socket() as held:
        held.bind(("127.0.0.1", p))
        held.listen()
        for _ in range(20):                   # candidates: p (held) and p + 1
            assert engine_ports(1, low=p, high=p + 2) == [p + 1]


def test_unreadable_range_falls_back_to_the_linux_default(tmp_path: Path) -> None:
    assert ephemeral_low(tmp_path / "missing") == 32768
    with pytest.raises(RuntimeError, match="free ports"):
        engine_ports(10**6)


def test_an_operators_window_confines_every_pick(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PDPROXY_BENCH_PORTS=LOW-HIGH``: a shared machine's user keeps the benches, chaos and fault suites and tests
    inside the ports given to them (both ends included)."""
    low = ephemeral_low() - 40
    monkeypatch.setenv("PDPROXY_BENCH_PORTS", f"{low}-{low + 9}")
    picked = {p for _ in range(20) for p in engine_ports(3)}
    assert picked and all(low <= p <= low + 9 for p in picked)
    assert window("18300-18599") == (18300, 18600) and window("") == (20000, 65536)
    for bad in ("18300", "a-b", "18599-18300"):
        with pytest.raises(ValueError, match="PDPROXY_BENCH_PORTS"):
            window(bad)
