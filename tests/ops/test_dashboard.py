"""The Grafana dashboard (``deploy/grafana/pdproxy.json``) against what pdproxy really exports: every query is valid
PromQL (once Grafana's variables are substituted) and names only metrics a running proxy with traffic exposes on
``/metrics``, and every pdproxy metric family is shown somewhere."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Fleet
from tests.support import ProxyThread

pytestmark = pytest.mark.timeout(60)

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdproxy.json"
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$instance": ".*"}
ONLY_WITH_WORKERS = {"pdproxy_worker_inflight_requests"}  # exported by --workers N only; not on the dashboard


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """``(panel title, PromQL)`` for every target, and the templating variables' queries."""
    out = [(p["title"], t["expr"]) for p in panels(dashboard["panels"]) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            text = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            assert text.startswith("label_values(") and text.endswith(")"), text
            metric = text[len("label_values("):-1].split(",")[0].strip()
            out.append((f"variable {var['name']}", metric))
    return out


def metric_names(expr: str) -> set[str]:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    ast = promql_parser.parse(expr)  # raises ValueError on invalid PromQL
    names: set[str] = set()
    promql_parser.walk(ast, lambda node: names.add(node.name) if isinstance(node, promql_parser.VectorSelector)
                       else None)
    return names


def exported(text: str) -> tuple[set[str], set[str]]:
    """``(sample names a query can use, family names)`` of one scrape (families without samples count too:
    prometheus-client declares them before their first label set is used)."""
    samples, families = set(), set()
    for fam in text_string_to_metric_families(text):
        families.add(fam.name)
        if fam.type == "counter":
            samples |= {fam.name + "_total", fam.name + "_created"}
        elif fam.type == "histogram":
            samples |= {fam.name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            samples.add(fam.name)
        samples |= {s.name for s in fam.samples}
    return samples, families


def family_of(sample: str, families: set[str]) -> str:
    for suffix in ("_bucket", "_sum", "_count", "_total", ""):
        if sample.endswith(suffix) and sample[:len(sample) - len(suffix)] in families:
            return sample[:len(sample) - len(suffix)]
    return sample


def test_every_query_names_an_exported_metric(proxy: ProxyThread, sims: Fleet) -> None:
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0, timeout=20)
    list(client.chat.completions.create(model="sim-model", stream=True, max_tokens=6,
                                        messages=[{"role": "user", "content": "dashboard traffic"}]))
    client.completions.create(model="sim-model", prompt="more traffic", max_tokens=3)
    assert httpx.post(proxy.url + "/v1/chat/completions", json={"model": "sim-model"}).status_code == 400
    proxy.wait_idle()
    text = httpx.get(proxy.url + "/metrics").text
    samples, families = exported(text)
    assert {"pdproxy_requests_total", "pdproxy_time_to_first_token_seconds_bucket",
            "pdproxy_engine_kv_pool_tokens"} <= samples  # the scrape is the real thing, with traffic in it

    dashboard = json.loads(DASHBOARD.read_text())
    used: dict[str, list[str]] = {}
    for title, expr in queries(dashboard):
        names = metric_names(expr)
        assert names, f"{title}: no metric in {expr}"
        for name in names:
            used.setdefault(name, []).append(title)
    unknown = {name: titles for name, titles in used.items() if name not in samples}
    assert not unknown, f"queries name metrics pdproxy does not export: {unknown}"
    shown = {family_of(name, families) for name in used}
    ours = {f for f in families if f.startswith("pdproxy_") and not f.endswith("_created")}
    assert not (ours - shown - ONLY_WITH_WORKERS), f"metric families on no panel: {sorted(ours - shown)}"


def test_dashboard_layout_imports_cleanly() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] == "pdproxy" and dashboard["schemaVersion"] >= 36
    var_names = [v["name"] for v in dashboard["templating"]["list"]]
    assert var_names == ["datasource", "instance"]
    items = list(panels(dashboard["panels"]))
    assert len({p["id"] for p in items}) == len(items)
    for p in items:
        g = p["gridPos"]
        assert p["title"] and g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" and t["refId"] for t in p["targets"]), p["title"]
    rows = [p["title"] for p in items if p["type"] == "row"]
    assert rows == ["Traffic", "Client-visible latency", "Phase split (where the time goes)",
                    "Admission and prefill queue", "Endpoints (pdproxy's view)",
                    "Engines (their own gauges, re-exported)", "Prefix cache (routing and KV events)",
                    "Retries, failovers, release legs and tokens"]
