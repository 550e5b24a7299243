"""Deployment files without a Docker engine or cluster: config examples load; the compose file and the Kubernetes
manifests parse and are consistent (every command parses with pdproxy's own argument parsers, every URL names a
service and port that exist); the Docker image's ENTRYPOINT + CMD and its HEALTHCHECK command are run here, outside
Docker, against the simulated fleet."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from pdproxy.cli import add_serve_arguments, settings_from_args
from pdproxy.endpoints import Role
from pdproxy.settings import Settings, load_settings
from pdproxy.sim import cli as sim_cli
from tests.conftest import Fleet
from tests.support import free_port, wait_until

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config"


# --- config/ -------------------------------------------------------------------------------------------------------
def test_config_examples_load() -> None:
    demo = load_settings(str(CONFIG / "demo.yaml"))
    assert [(e.role, e.url) for e in demo.all_endpoints()] == [
        (Role.PREFILL, "http://127.0.0.1:8100"), (Role.DECODE, "http://127.0.0.1:8200"),
        (Role.DECODE, "http://127.0.0.1:8201")]
    seed = load_settings(str(CONFIG / "seed002-2p-2x4d.yaml"))
    eps = seed.all_endpoints()
    assert [e.url for e in eps if e.role is Role.PREFILL] == ["http://p0:9100", "http://p1:9100"]
    assert [e.url for e in eps if e.role is Role.DECODE] == [
        f"http://{h}:{p}" for h in ("d0", "d1") for p in (9100, 9101, 9102, 9103)]
    single = load_settings(str(CONFIG / "single-node-1p1d.yaml"))
    assert [e.role for e in single.all_endpoints()] == [Role.PREFILL, Role.DECODE]
    assert load_settings(str(CONFIG / "docker.yaml")).request_log_path == "-"


def test_reference_lists_every_setting_with_its_default() -> None:
    text = (CONFIG / "reference.yaml").read_text()
    keys = re.findall(r"^(\w+):", text, flags=re.MULTILINE)
    twice = sorted({k for k in keys if keys.count(k) > 1})
    assert not twice, f"config/reference.yaml lists these settings more than once (YAML keeps the last): {twice}"
    data = yaml.safe_load(text)
    missing = sorted(set(Settings.model_fields) - set(data))
    assert not missing, f"document these settings in config/reference.yaml: {missing}"
    assert not set(data) - set(Settings.model_fields)
    defaults = Settings.model_construct()
    for name, value in data.items():
        assert value == getattr(defaults, name), f"config/reference.yaml: {name}: {value!r} is not the default"


def test_bad_config_values_are_clear_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("endpoints: [{url: http://d0:9100, role: mixer}]\n")
    with pytest.raises(ValueError, match="role"):
        load_settings(str(bad))
    bad.write_text("decode: [http://d0:9100, http://d0:9100/]\n")
    with pytest.raises(ValueError, match="duplicate"):
        load_settings(str(bad))
    bad.write_text("prefill: ['ftp://p0']\n")
    with pytest.raises(ValueError, match="scheme"):
        load_settings(str(bad))


# --- docker/compose.yaml ---------------------------------------------------------------------------------------------
def _serve_settings(command: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """What ``pdproxy <command>`` would run with, given the container's environment (config dir mapped)."""
    assert command[0] == "serve"
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([a.replace("/etc/pdproxy/", f"{CONFIG}/") for a in command[1:]])
    for key in [k for k in os.environ if k.startswith("PDPROXY_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return settings_from_args(args)


def _sim_args(command: list[str]) -> argparse.Namespace:
    assert command[0] == "sim"
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    return parser.parse_args(command[1:])


def test_compose_file_is_consistent(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    services: dict[str, Any] = compose["services"]
    assert set(services) == {"prefill", "decode-0", "decode-1", "proxy"}
    sims = {name: _sim_args(svc["command"]) for name, svc in services.items() if name != "proxy"}
    assert [a.role for a in sims.values()] == ["prefill", "decode", "decode"]
    for name, args in sims.items():
        assert args.host == "0.0.0.0", name
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD" and f":{args.port}/health" in test[-1], name
    for svc in services.values():
        assert svc["build"]["dockerfile"] == "docker/Dockerfile" and (ROOT / "docker" / "Dockerfile").exists()
        assert (ROOT / "docker" / svc["build"]["context"]).resolve() == ROOT
    proxy = services["proxy"]
    settings = _serve_settings(proxy["command"], proxy["environment"], monkeypatch)
    for e in settings.all_endpoints():
        host, port = urlsplit(e.url).hostname, urlsplit(e.url).port
        assert host in sims, f"{e.url}: no service {host}"
        assert port == sims[host].port and sims[host].role == e.role.value, e.url
    assert {urlsplit(e.url).hostname for e in settings.all_endpoints()} == set(sims)
    assert proxy["depends_on"] == {n: {"condition": "service_healthy"} for n in sims}
    assert proxy["ports"] == [f"{settings.port}:{settings.port}"]
    assert settings.host == "0.0.0.0"
    grace = float(proxy["stop_grace_period"].rstrip("s"))
    assert grace > settings.shutdown_grace_s


def test_compose_config_with_docker_client() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` plugin on this machine (the structural checks above still ran)")
    done = subprocess.run([docker, "compose", "-f", str(ROOT / "docker" / "compose.yaml"), "config", "--quiet"],
                          capture_output=True, timeout=20)
    assert done.returncode == 0, done.stderr.decode()


# --- deploy/k8s ------------------------------------------------------------------------------------------------------
def _k8s() -> dict[str, dict[str, Any]]:
    docs = {}
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def test_kubernetes_manifests_are_consistent(tmp_path: Path) -> None:
    docs = _k8s()
    assert set(docs) == {"ConfigMap", "Deployment", "Service"}
    dep, svc, cm = docs["Deployment"], docs["Service"], docs["ConfigMap"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["replicas"] >= 2
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert svc["spec"]["ports"][0]["targetPort"] in ports
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert container["livenessProbe"]["httpGet"]["path"] == "/version"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    volumes = {v["name"]: v for v in pod["volumes"]}
    config_mount = next(m for m in container["volumeMounts"] if volumes[m["name"]].get("configMap"))
    assert volumes[config_mount["name"]]["configMap"]["name"] == cm["metadata"]["name"]
    (key,) = cm["data"]
    config_arg = container["args"][container["args"].index("--config") + 1]
    assert config_arg == f"{config_mount['mountPath']}/{key}"
    path = tmp_path / key
    path.write_text(cm["data"][key])
    settings = load_settings(str(path))
    eps = settings.all_endpoints()
    assert (sum(e.role is Role.PREFILL for e in eps), sum(e.role is Role.DECODE for e in eps)) == (2, 8)
    assert settings.port in ports.values()
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] > settings.shutdown_grace_s + pre_stop
    assert "/dev/shm" in {m["mountPath"] for m in container["volumeMounts"]}  # --workers board + metrics


# --- docker/Dockerfile -----------------------------------------------------------------------------------------------
def _dockerfile() -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in (ROOT / "docker" / "Dockerfile").read_text().splitlines():
        if line.strip().startswith("#") and not buf:
            continue
        buf += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\") and buf:
            word, _, rest = buf.partition(" ")
            out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def _image_commands() -> tuple[list[str], list[str]]:
    """The final stage's ENTRYPOINT + CMD and HEALTHCHECK command, in exec form."""
    steps = _dockerfile()
    final = steps[max(i for i, (w, _) in enumerate(steps) if w == "FROM"):]
    kinds = {w: rest for w, rest in final}
    assert "slim" in kinds["FROM"]
    user = kinds["USER"].split(":")[0]
    assert user not in ("root", "0") and user
    entry, cmd = json.loads(kinds["ENTRYPOINT"]), json.loads(kinds["CMD"])
    health = kinds["HEALTHCHECK"]
    check = json.loads(health[health.index("CMD") + 3:].strip())
    assert sum(w == "FROM" for w, _ in steps) == 2  # build stage + runtime stage
    return entry + cmd, check


def test_the_image_is_built_with_the_compiled_parts() -> None:
    """The wheel is built where setup.py and a C compiler are (pdproxy's optional C files: without them pip builds a
    pure wheel and the image runs their slower Python twins), and the runtime stage installs that wheel only."""
    steps = _dockerfile()
    last = max(i for i, (w, _) in enumerate(steps) if w == "FROM")
    build, final = steps[:last], steps[last:]
    assert any(w == "RUN" and "gcc" in rest and "libc6-dev" in rest for w, rest in build)
    copied = " ".join(rest for w, rest in build if w == "COPY")
    assert "setup.py" in copied and "pyproject.toml" in copied
    assert "setup.py" in re.findall(r"^!(\S+)$", (ROOT / "docker" / "Dockerfile.dockerignore").read_text(), re.M)
    assert not any(w == "RUN" and "gcc" in rest for w, rest in final)
    compiled = re.findall(r'Extension\("([\w.]+)", \["([\w/]+\.c)"\]', (ROOT / "setup.py").read_text())
    assert {m for m, _ in compiled} == {"pdproxy.pd._record", "pdproxy.pd._splice", "pdproxy.http._chunked",
                                        "pdproxy.apis._jsonscan", "pdproxy.prefix._textkeys"}
    assert all((ROOT / c).exists() for _, c in compiled)


def test_image_entrypoint_and_healthcheck_outside_docker(sims: Fleet, tmp_path: Path) -> None:
    command, check = _image_commands()
    assert command[0] == "pdproxy" and check[0] == "python"
    exe = Path(sys.executable).parent / "pdproxy"
    argv = [str(exe)] + [a.replace("/etc/pdproxy/", f"{CONFIG}/") for a in command[1:]]
    health = [sys.executable] + check[1:]
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDPROXY_")}
    env.update(PDPROXY_PORT=str(port), PDPROXY_HOST="127.0.0.1", PDPROXY_HEALTH_INTERVAL_S="0.3",
               PDPROXY_PREFILL=sims.prefillers[0].url, PDPROXY_DECODE=",".join(d.url for d in sims.decoders))

    def healthcheck() -> int:
        return subprocess.run(health, env=env, capture_output=True, timeout=10).returncode

    assert healthcheck() != 0  # nothing listening yet: unhealthy
    out = tmp_path / "stdout.log"
    with open(out, "wb") as sink:
        proc = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: healthcheck() == 0, 20, 0.2, f"HEALTHCHECK passing ({out.read_text()[-800:]})")
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=10,
                       json={"model": "sim-model", "prompt": "docker", "max_tokens": 2})
        assert r.status_code == 200
        # config/docker.yaml sends request lines to stdout: the container log
        line = wait_until(lambda: next((x for x in out.read_text().splitlines() if x.startswith('{"event"')), None),
                          5, 0.05, "request line on stdout")
        assert json.loads(line)["outcome"] == "ok"
        proc.send_signal(signal.SIGTERM)  # docker stop
        assert proc.wait(timeout=15) == 0
        assert healthcheck() != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
