"""Contract: ``pdproxy sim`` answers like real vLLM 0.32 did, exchange for exchange (fast; no real engines).

Every capture in ``captures/`` (recorded by ``capture.py`` from real vLLM 0.32 engines serving the tiny model) is
replayed, in the recorded order, against two simulator processes configured like those engines (served name
``tiny``, ``max_model_len`` 2048, block size 128, the same tokenizer directory, no auto tool choice): the
prefiller-side exchanges go to one, the decoder-side ones to the other, with the simulator's own
``kv_transfer_params``. Then each answer is compared with the real one:

- status, ``Content-Type``, and the JSON *shape* (every key, recursively, with the JSON type of each value);
- error bodies byte for byte (message, type, param, code), including the failed-KV-pull 500 and its SSE form;
- SSE framing: ``data: <json>\\n\\n`` events, compact JSON (the error event alone has ``json.dumps`` spacing),
  event kinds in order (chat role chunk, content, finishing chunk, usage chunk), ``data: [DONE]`` last once;
- numbers that do not depend on the model's random weights: token counts, ids, clamped ``max_tokens``;
- ``/metrics``: every vLLM family the simulator exposes exists in vLLM with the same TYPE, HELP and label keys,
  the families pdproxy reads are all there, and the counters that depend only on the traffic (prompt tokens by
  source, NIXL transfers, finished reasons, HTTP requests per handler) have vLLM's values after the same traffic.

If a capture is re-recorded, only numbers that the traffic determines are compared, so the test keeps holding.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdproxy.tools import tinymodel
from tests.real_vllm.support import metric
from tests.support import SimProcess

CAPTURES = Path(__file__).parent / "captures"
INDEX = [entry["name"] for entry in json.loads((CAPTURES / "index.json").read_text())]
SIM_ARGS = ("--served-model-name", "tiny", "--max-model-len", "2048", "--block-size", "128",
            "--no-enable-auto-tool-choice")

pytestmark = pytest.mark.timeout(60)


def load(name: str) -> dict[str, Any]:
    return json.loads((CAPTURES / f"{name}.json").read_text(encoding="utf-8"))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exchange(client: httpx.Client, request: dict[str, Any], body: Any = None) -> dict[str, Any]:
    """Replay one captured request (``body`` replaces the recorded one); the answer in the capture format."""
    headers = {k: v for k, v in request["headers"].items() if k.lower() != "content-type"}
    payload = request["body"] if body is None else body
    resp = client.request(request["method"], request["url_path"], headers=headers,
                          json=payload if payload is not None else None)
    out: dict[str, Any] = {"status": resp.status_code, "headers": {k.lower(): v for k, v in resp.headers.items()}}
    if resp.headers.get("content-type", "").startswith("application/json"):
        out["json"] = resp.json()
    else:
        out["text"] = resp.text
    return out


@pytest.fixture(scope="module")
def replay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Every capture replayed against a simulated prefiller and decoder: ``{name: answer, "metrics_<role>": text}``."""
    tok = tinymodel.write_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))
    sims = {role: SimProcess("both", *SIM_ARGS, "--tokenizer", str(tok)) for role in ("prefill", "decode")}
    try:
        for sim in sims.values():
            sim.start()
        out: dict[str, Any] = {}
        params: dict[str, Any] = {}
        for name in INDEX:
            cap = load(name)
            request = cap["request"]
            decoder_side = name.endswith("_decode") or name.startswith("decode_bad_remote")
            body = request["body"]
            if name.endswith("_decode"):
                body = {**body, "kv_transfer_params": params[name[:-len("_decode")]]}
            elif name.startswith("decode_bad_remote"):
                body = {**body, "kv_transfer_params": {**body["kv_transfer_params"], "remote_port": closed_port()}}
            sim = sims["decode" if decoder_side else "prefill"]
            out[name] = exchange(sim.client, request, body)
            if name.startswith("pd_") and name.endswith("_prefill"):
                params[name[:-len("_prefill")]] = out[name]["json"]["kv_transfer_params"]
        for role, sim in sims.items():
            out[f"metrics_{role}"] = sim.client.get("/metrics").text
        yield out
    finally:
        for sim in sims.values():
            sim.stop()


# ---------------------------------------------------------------------------------------------------- helpers
def shape(value: Any, leaves: bool = True) -> Any:
    """Keys recursively, with each leaf's JSON type (``leaves``) or ``"*"``; lists by their items' shapes."""
    if isinstance(value, dict):
        return {k: shape(v, leaves) for k, v in value.items()}
    if isinstance(value, list):
        shapes: list[Any] = []
        for item in value:
            s = shape(item, leaves)
            if s not in shapes:
                shapes.append(s)
        return shapes
    if not leaves:
        return "*"
    return "null" if value is None else type(value).__name__


def json_events(text: str) -> list[str]:
    """The ``data:`` payloads of an SSE body; asserts vLLM's framing and exactly one final ``[DONE]``."""
    assert text.endswith("data: [DONE]\n\n"), text[-120:]
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events
    payloads = [e[len("data: "):] for e in events]
    assert payloads.count("[DONE]") == 1
    return payloads[:-1]


def event_kind(event: dict[str, Any]) -> str:
    if "error" in event:
        return "error"
    if not event["choices"]:
        return "usage"
    choice = event["choices"][0]
    if choice.get("delta", {}).get("role"):
        return "role"
    return "finish" if choice["finish_reason"] is not None else "content"


def stream_signature(text: str) -> tuple[list[tuple[str, Any]], dict[str, Any]]:
    """(kinds in order with the typed shape of each non-content event, the key shape of content events)."""
    kinds: list[tuple[str, Any]] = []
    content: dict[str, Any] = {}
    for payload in json_events(text):
        event = json.loads(payload)
        kind = event_kind(event)
        spacing = json.dumps(event) if kind == "error" else json.dumps(event, separators=(",", ":"),
                                                                      ensure_ascii=False)
        assert payload == spacing, f"{kind} event not written as vLLM writes it: {payload[:200]}"
        if kind == "content":
            content = shape(event, leaves=False)
        else:
            kinds.append((kind, shape(event)))
    return kinds, content


def without_volatile(body: dict[str, Any]) -> dict[str, Any]:
    """Drop what depends on the model's random weights or the clock (text, created, ids checked separately)."""
    body = json.loads(json.dumps(body))
    body.pop("created", None)
    for choice in body.get("choices", []):
        choice.pop("text", None)
        (choice.get("message") or {}).pop("content", None)
    return body


# ---------------------------------------------------------------------------------------------------- tests
ERRORS = [n for n in INDEX if n.startswith(("error_", "decode_bad_remote")) or load(n)["response"]["status"] >= 400]


@pytest.mark.parametrize("name", ERRORS)
def test_error_bodies_are_vllms(replay: dict[str, Any], name: str) -> None:
    real, sim = load(name)["response"], replay[name]
    assert sim["status"] == real["status"]
    assert sim["headers"]["content-type"] == real["headers"]["content-type"]
    assert sim.get("json") == real.get("json") and sim.get("text") == real.get("text")


JSON_OK = [n for n in INDEX if n not in ERRORS and "json" in load(n)["response"]]


@pytest.mark.parametrize("name", JSON_OK)
def test_json_answers_have_vllms_shape(replay: dict[str, Any], name: str) -> None:
    real, sim = load(name)["response"], replay[name]
    assert (sim["status"], sim["headers"]["content-type"]) == (real["status"], real["headers"]["content-type"])
    assert shape(sim["json"]) == shape(real["json"])
    rj, sj = real["json"], sim["json"]
    if "usage" in rj:
        assert sj["usage"] == rj["usage"]                # token counts, clamped max_tokens, prefix-cache hits
        assert re.fullmatch(r"vllm-0\.32\.0-[0-9a-f]{8}", sj["system_fingerprint"])
        rid = load(name)["request"]["headers"].get("X-Request-Id")
        prefix = "chatcmpl-" if rj["object"].startswith("chat") else "cmpl-"
        assert sj["id"] == rj["id"] if rid else re.fullmatch(prefix + "[0-9a-f]{16}", sj["id"])
        drop = ("kv_transfer_params", "id", "system_fingerprint")
        assert {k: v for k, v in without_volatile(sj).items() if k not in drop} == {
            k: v for k, v in without_volatile(rj).items() if k not in drop}
    if rj.get("kv_transfer_params"):
        rp, sp = rj["kv_transfer_params"], sj["kv_transfer_params"]
        assert sp["remote_num_tokens"] == rp["remote_num_tokens"] == rj["usage"]["prompt_tokens"]
        assert [len(g) for g in sp["remote_block_ids"]] == [len(g) for g in rp["remote_block_ids"]]
        internal = re.escape(rj["id"]) + ("-0" if rj["object"] == "text_completion" else "") + "-[0-9a-f]{8}"
        assert re.fullmatch(internal, sp["remote_request_id"]) and re.fullmatch(internal, rp["remote_request_id"])
    if name.startswith("tokenize"):
        assert sj == rj                                  # same tokenizer, chat template, BOS


STREAMS = [n for n in INDEX if n not in ERRORS and "text" in load(n)["response"] and load(n)["response"]["text"]]


@pytest.mark.parametrize("name", STREAMS)
def test_sse_framing_and_events_are_vllms(replay: dict[str, Any], name: str) -> None:
    real, sim = load(name)["response"], replay[name]
    assert (sim["status"], sim["headers"]["content-type"]) == (real["status"], real["headers"]["content-type"])
    real_kinds, real_content = stream_signature(real["text"])
    sim_kinds, sim_content = stream_signature(sim["text"])
    assert sim_kinds == real_kinds
    if real_content:
        assert sim_content == real_content
    last = [json.loads(p) for p in json_events(sim["text"])]
    assert [("system_fingerprint" in e) for e in last] == [False] * (len(last) - 1) + [True]
    real_usage = [json.loads(p) for p in json_events(real["text"])][-1].get("usage")
    assert last[-1].get("usage") == real_usage


def test_health_and_empty_bodies(replay: dict[str, Any]) -> None:
    real, sim = load("health_prefill")["response"], replay["health_prefill"]
    assert (sim["status"], sim.get("text")) == (real["status"], real["text"]) == (200, "")


# ---------------------------------------------------------------------------------------------------- metrics
def families(text: str) -> dict[str, dict[str, Any]]:
    """``{family: {"type", "help", "labels": {sample name: label-key set}, "samples": {series: value}}}``."""
    out: dict[str, dict[str, Any]] = {}
    current = ""
    for line in text.splitlines():
        if line.startswith("# HELP "):
            current, _, help_text = line[len("# HELP "):].partition(" ")
            out.setdefault(current, {"labels": {}, "samples": {}})["help"] = help_text
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE "):].partition(" ")
            out.setdefault(name, {"labels": {}, "samples": {}})["type"] = kind
        elif line:
            series, _, value = line.rpartition(" ")
            sample = series.partition("{")[0]
            keys = frozenset(re.findall(r'(\w+)="', series.partition("{")[2]))
            out[current]["labels"][sample] = keys
            out[current]["samples"][series] = float(value)
    return out


# Families pdproxy (engines.py, doctor, health) and the real-vLLM tests read.
REQUIRED = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_waiting_by_reason",
    "vllm:kv_cache_usage_perc", "vllm:cache_config_info", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total", "vllm:prompt_tokens_by_source_total",
    "vllm:prompt_tokens_cached_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:nixl_xfer_time_seconds", "vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_kv_expired_reqs_total",
    "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "http_requests_total",
)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_metric_families_are_vllms(replay: dict[str, Any], role: str) -> None:
    real = families((CAPTURES / f"metrics_{role}.txt").read_text())
    sim = families(replay[f"metrics_{role}"])
    for name, fam in sim.items():
        if name.startswith("sim_"):
            continue
        assert name in real, f"{name} is not a vLLM 0.32 metric"
        assert (fam["type"], fam["help"]) == (real[name]["type"], real[name]["help"]), name
        for sample, keys in fam["labels"].items():
            real_keys = real[name]["labels"].get(sample)
            assert real_keys is not None, f"{sample}: vLLM has no such sample"
            if name == "vllm:cache_config_info":
                assert keys <= real_keys
            else:
                assert keys == real_keys, sample
    assert [n for n in REQUIRED if n not in sim] == []


TRAFFIC_COUNTERS = [
    ("decode", "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    ("decode", "vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    ("decode", "vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
    ("decode", "vllm:prompt_tokens_total", {}),
    ("decode", "vllm:prompt_tokens_cached_total", {}),
    ("decode", "vllm:generation_tokens_total", {}),
    ("decode", "vllm:nixl_xfer_time_seconds_count", {}),
    ("decode", "vllm:nixl_num_failed_transfers_total", {}),
    ("decode", "vllm:prefix_cache_queries_total", {}),
    ("decode", "vllm:external_prefix_cache_hits_total", {}),
    ("prefill", "vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    ("prefill", "vllm:prompt_tokens_by_source_total", {"source": "local_cache_hit"}),
    ("prefill", "vllm:prompt_tokens_total", {}),
    ("prefill", "vllm:prefix_cache_hits_total", {}),
    ("prefill", "vllm:generation_tokens_total", {}),
    ("prefill", "vllm:nixl_xfer_time_seconds_count", {}),
    *[(role, "vllm:request_success_total", {"finished_reason": r})
      for role in ("prefill", "decode") for r in ("stop", "length", "abort", "error")],
    *[(role, "http_requests_total", {"handler": h, "status": s}) for role in ("prefill", "decode")
      for h in ("/v1/completions", "/v1/chat/completions") for s in ("2xx", "4xx", "5xx")],
]


@pytest.mark.parametrize(("role", "name", "labels"), TRAFFIC_COUNTERS,
                         ids=[f"{r}-{n}-{'-'.join(v.values())}" for r, n, v in TRAFFIC_COUNTERS])
def test_traffic_counters_match_vllm_after_the_same_traffic(replay: dict[str, Any], role: str, name: str,
                                                            labels: dict[str, str]) -> None:
    real = metric((CAPTURES / f"metrics_{role}.txt").read_text(), name, **labels)
    assert metric(replay[f"metrics_{role}"], name, **labels) == real
