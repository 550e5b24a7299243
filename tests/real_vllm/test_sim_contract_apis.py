"""Contract: ``pdproxy sim`` answers the APIs beyond chat/completions like real vLLM 0.32 did (fast; no engines).

Replays the captures of ``capture_apis.py`` against simulators configured like the engines that answered them:

- ``captures/apis/``: a prefiller and a decoder with ``--enable-scale-out`` and a LoRA adapter, no tool parser
  (Responses and Messages JSON/SSE, plain and as PD legs; count_tokens; render routes; ``/inference/v1/generate``;
  the sampling fields; their errors; constraint fields on a one-token prefill leg; routes a generate model lacks);
- ``captures/tools/``: a pair with ``--enable-auto-tool-choice --tool-call-parser hermes`` (forced tool calls);
- ``captures/pooling/``: an embedding model (``--runner pooling --convert embed``).

Compared: status and ``Content-Type``; error bodies byte for byte; JSON answers key by key with each leaf's JSON
type; the token counts the traffic determines (prompt tokens always; output tokens when the real answer was cut by
its limit and the request had no stop condition); SSE framing (``data:`` events ending with one ``[DONE]`` for the
OpenAI routes, ``event:``/``data:`` pairs without it for Responses and Messages) and the order of event kinds with
each non-delta event's shape; where each API puts ``kv_transfer_params``.

Where the tiny model's random weights decide the outcome (which text comes out, whether its forced tool call
parses, where a stop word falls) only what does not depend on them is compared; :data:`MODEL_DEPENDENT` names
those captures and why.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdproxy.tools import tinymodel
from tests.real_vllm.test_sim_contract import closed_port, shape
from tests.support import SimProcess

CAPTURES = Path(__file__).parent / "captures"
SIM_OUTPUT_TOKENS = 16
"""The simulator's default ``--output-tokens``: a chat-like answer without a lower limit ends there ("stop")."""
BASE_ARGS = ("--served-model-name", "tiny", "--max-model-len", "2048", "--block-size", "128")
CONFIGS: dict[str, tuple[str, ...]] = {
    "apis": (*BASE_ARGS, "--no-enable-auto-tool-choice", "--tool-call-parser", "none", "--enable-scale-out",
             "--lora-modules", "tiny-lora=/tmp/tiny-lora"),
    "tools": (*BASE_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
    "pooling": (*BASE_ARGS, "--runner", "pooling", "--convert", "embed", "--embedding-size", "256"),
}
MODEL_DEPENDENT = {
    "tools_messages_tool": "the tiny model's forced arguments were `true`, not an object: vLLM 400s on its own output",
    "tools_chat_required": "the tiny model's hermes text was cut by max_tokens and did not parse as a tool call",
    "tools_messages_any": "same: no tool call parsed from the tiny model's text",
    "tools_responses_required": "same",
    "tools_prefill1_required_decode": "same",
    "tools_prefill1_responses_required_decode": "same",
    "tools_chat_named_short": "max_tokens 5 cut the tiny model's forced call before its arguments",
    "tools_chat_auto": "the tiny model wrote text where the simulator makes the auto tool call",
    "derender_completion": "the derender routes are not modelled",
}
"""Captures whose body depends on the random model: only the status and content type are compared."""

pytestmark = pytest.mark.timeout(90)


def index(kind: str) -> list[str]:
    return [e["name"] for e in json.loads((CAPTURES / kind / "index.json").read_text())]


def load(kind: str, name: str) -> dict[str, Any]:
    return json.loads((CAPTURES / kind / f"{name}.json").read_text(encoding="utf-8"))


def kv_params_of(answer: dict[str, Any]) -> dict[str, Any] | None:
    """``kv_transfer_params`` of a JSON answer (top level) or of an SSE answer (any event, or its ``response``)."""
    if "json" in answer:
        body = answer["json"]
        return body.get("kv_transfer_params") if isinstance(body, dict) else None
    for line in answer.get("text", "").splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[len("data: "):])
            for holder in (event, event.get("response") or {}, event.get("message") or {}):
                if isinstance(holder, dict) and holder.get("kv_transfer_params"):
                    return dict(holder["kv_transfer_params"])
    return None


def send(client: httpx.Client, request: dict[str, Any], body: Any) -> dict[str, Any]:
    headers = {k: v for k, v in request["headers"].items() if k.lower() != "content-type"}
    try:
        resp = client.request(request["method"], request["url_path"], headers=headers,
                              json=body if body is not None else None)
        out: dict[str, Any] = {"status": resp.status_code,
                               "headers": {k.lower(): v for k, v in resp.headers.items()}}
        if resp.headers.get("content-type", "").startswith("application/json"):
            out["json"] = resp.json()
        else:
            out["text"] = resp.text
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:  # a stream the server cut short
        out = {"status": 200, "incomplete": True, "error": str(exc), "headers": {}}
    return out


def paired_prefill(name: str) -> str | None:
    if name == "pd_n2_decode":
        return "pd_n2_single_prefill"
    return name[:-len("_decode")] + "_prefill" if name.endswith("_decode") else None


@pytest.fixture(scope="module")
def replays(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    """Every capture directory replayed in order: ``{kind: {name: answer}}``."""
    tok = str(tinymodel.write_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer")))
    sims: dict[str, SimProcess] = {}
    try:
        out: dict[str, dict[str, Any]] = {}
        for kind, args in CONFIGS.items():
            prefill = sims[f"{kind}-p"] = SimProcess("both", *args, "--tokenizer", tok).start()
            decode = sims[f"{kind}-d"] = SimProcess("both", *args, "--tokenizer", tok).start()
            answers: dict[str, Any] = {}
            for name in index(kind):
                request = load(kind, name)["request"]
                body = request["body"]
                decoder_side = paired_prefill(name) is not None or name.startswith("decode_bad_remote")
                pair = paired_prefill(name)
                if pair is not None and pair in answers:
                    params = kv_params_of(answers[pair])
                    assert params is not None, f"{pair}: the sim returned no kv_transfer_params"
                    body = {**body, "kv_transfer_params": params}
                elif name.startswith("decode_bad_remote"):
                    params = kv_params_of(answers["pd_responses_prefill"]) or {}
                    body = {**body, "kv_transfer_params": {**params, "remote_port": closed_port()}}
                answers[name] = send((decode if decoder_side else prefill).client, request, body)
            out[kind] = answers
        yield out
    finally:
        for sim in sims.values():
            sim.stop()


CASES = [(kind, name) for kind in CONFIGS for name in index(kind)]


# ---------------------------------------------------------------------------------------------------- helpers
def openai_events(text: str) -> list[dict[str, Any]]:
    """The JSON events of an OpenAI-style stream; asserts ``data:`` framing and one final ``[DONE]``."""
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") and "\n" not in e for e in events), events[:3]
    payloads = [e[len("data: "):] for e in events]
    assert payloads.count("[DONE]") == 1
    return [json.loads(p) for p in payloads[:-1]]


def typed_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of a Responses/Messages stream; asserts ``event:``/``data:`` pairs, no ``[DONE]``."""
    assert "[DONE]" not in text
    out = []
    for block in text.split("\n\n"):
        if not block:
            continue
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block[:200]
        data = json.loads(lines[1][len("data: "):])
        assert data["type"] == lines[0][len("event: "):]
        out.append((lines[0][len("event: "):], data))
    return out


DELTAS = {"response.output_text.delta", "response.function_call_arguments.delta", "content_block_delta"}
VOLATILE_SHAPE = ("logprobs", "top_logprobs", "tool_calls", "content", "output", "item", "part", "delta",
                  "embedding", "data", "results", "token_ids", "text", "input")


ENDING = ("incomplete_details",)
"""Keys that say how an answer ended (null or an object): the model decides."""


def loose_shape(value: Any) -> Any:
    """:func:`shape` with the model-dependent parts (content, items, vectors) reduced to their JSON type."""
    if isinstance(value, dict):
        return {k: ("*" if k in ENDING else type(v).__name__ if k in VOLATILE_SHAPE and v is not None
                    else loose_shape(v)) for k, v in value.items()}
    if isinstance(value, list):
        return ["list"]
    return shape(value)


def kinds(answer_text: str) -> list[Any]:
    """Event kinds in order (deltas collapsed) with the loose shape of each non-delta event; an OpenAI stream's
    choices each get their own sequence (their interleaving depends on engine timing)."""
    out: list[Any] = []
    if answer_text.startswith("data: "):
        per_choice: dict[int, list[tuple[str, Any]]] = {}
        for event in openai_events(answer_text):
            if "error" in event:
                out.append(("error", shape(event)))
            elif not event.get("choices"):
                out.append(("usage", shape(event)))
            else:
                choice = event["choices"][0]
                seq = per_choice.setdefault(choice.get("index", 0), [])
                kind = "role" if (choice.get("delta") or {}).get("role") else (
                    "finish" if choice.get("finish_reason") else "delta")
                if not seq or kind != "delta" or seq[-1][0] != "delta":
                    seq.append((kind, loose_shape({k: v for k, v in event.items() if k != "system_fingerprint"})
                                if kind != "delta" else None))
        return [*sorted(per_choice.items()), *out]
    for name, data in typed_events(answer_text):
        if name in DELTAS:
            if not out or out[-1][0] != name:
                out.append((name, None))
        else:
            out.append((name, loose_shape(data)))
    return out


def finish_of(body: dict[str, Any]) -> str | None:
    if body.get("choices"):
        return body["choices"][0].get("finish_reason")
    if body.get("object") == "response":
        return "length" if body.get("status") == "incomplete" else "stop"
    if body.get("type") == "message":
        return "length" if body.get("stop_reason") == "max_tokens" else "stop"
    return None


def usage_numbers(body: dict[str, Any]) -> tuple[int | None, int | None]:
    """(prompt tokens, output tokens) in any API's usage shape."""
    usage = body.get("usage") or {}
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    if body.get("type") == "message" and prompt is not None:
        prompt += usage.get("cache_read_input_tokens") or 0
        prompt += usage.get("cache_creation_input_tokens") or 0
    return prompt, usage.get("completion_tokens", usage.get("output_tokens"))


# ---------------------------------------------------------------------------------------------------- tests
COMPARABLE = [(k, n) for k, n in CASES if n not in MODEL_DEPENDENT]


@pytest.mark.parametrize(("kind", "name"), COMPARABLE, ids=[f"{k}/{n}" for k, n in COMPARABLE])
def test_status_and_content_type_are_vllms(replays: dict[str, dict[str, Any]], kind: str, name: str) -> None:
    real, sim = load(kind, name)["response"], replays[kind][name]
    assert sim["status"] == real["status"], (sim.get("json") or sim.get("text", ""))
    if real.get("incomplete"):
        assert sim.get("incomplete"), "vLLM cut this stream short; the sim must too"
        return
    assert sim["headers"]["content-type"].split(";")[0] == real["headers"]["content-type"].split(";")[0]


ERRORS = [(k, n) for k, n in CASES if load(k, n)["response"]["status"] >= 400 and n not in MODEL_DEPENDENT]


@pytest.mark.parametrize(("kind", "name"), ERRORS, ids=[f"{k}/{n}" for k, n in ERRORS])
def test_error_bodies_are_vllms(replays: dict[str, dict[str, Any]], kind: str, name: str) -> None:
    real, sim = load(kind, name)["response"], replays[kind][name]
    assert sim.get("json") == real.get("json")


JSON_OK = [(k, n) for k, n in CASES if load(k, n)["response"]["status"] < 400 and "json" in load(k, n)["response"]
           and n not in MODEL_DEPENDENT]


@pytest.mark.parametrize(("kind", "name"), JSON_OK, ids=[f"{k}/{n}" for k, n in JSON_OK])
def test_json_answers_have_vllms_shape_and_counts(replays: dict[str, dict[str, Any]], kind: str, name: str) -> None:
    cap = load(kind, name)
    real, sim = cap["response"]["json"], replays[kind][name]["json"]
    assert loose_shape(sim) == loose_shape(real)
    if isinstance(real, dict) and "usage" in real and real["usage"]:
        (rp, ro), (sp, so) = usage_numbers(real), usage_numbers(sim)
        assert sp == rp, "prompt tokens"
        body = cap["request"]["body"] or {}
        free = not any(body.get(k) for k in ("stop", "stop_token_ids", "stop_sequences", "n", "response_format",
                                              "structured_outputs", "text", "tools"))
        limit = body.get("max_tokens", body.get("max_output_tokens")) or 0
        chat_like = cap["request"]["url_path"] not in ("/v1/completions", "/inference/v1/generate")
        if finish_of(real) == "length" and free and (limit <= SIM_OUTPUT_TOKENS or not chat_like):
            assert so == ro, "output tokens of an answer cut by its limit"
    rkv = real.get("kv_transfer_params") if isinstance(real, dict) else None
    skv = sim.get("kv_transfer_params") if isinstance(sim, dict) else None
    assert (rkv is None) == (skv is None), "kv_transfer_params where vLLM puts them"
    if rkv:
        assert skv["remote_num_tokens"] == rkv["remote_num_tokens"]
        def norm(rid: str) -> str:
            return re.sub(r"[0-9a-f]{8,}", "H", rid)

        assert norm(skv["remote_request_id"]) == norm(rkv["remote_request_id"])


STREAMS = [(k, n) for k, n in CASES if load(k, n)["response"]["status"] < 400 and "text" in load(k, n)["response"]
           and not load(k, n)["response"].get("incomplete") and n not in MODEL_DEPENDENT
           and load(k, n)["response"]["text"]]


@pytest.mark.parametrize(("kind", "name"), STREAMS, ids=[f"{k}/{n}" for k, n in STREAMS])
def test_sse_framing_and_event_kinds_are_vllms(replays: dict[str, dict[str, Any]], kind: str, name: str) -> None:
    real, sim = load(kind, name)["response"], replays[kind][name]
    if real["headers"]["content-type"].startswith("text/plain"):
        assert sim["text"] and sim["headers"]["content-type"].startswith("text/plain")
        return
    assert kinds(sim["text"]) == kinds(real["text"])
    assert (kv_params_of(sim) is None) == (kv_params_of(real) is None), "kv_transfer_params in the stream"


def test_captures_cover_every_new_route() -> None:
    paths = {load(k, n)["request"]["url_path"] for k, n in CASES}
    for path in ("/v1/responses", "/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions/render",
                 "/v1/completions/render", "/v1/messages/render", "/v1/responses/render", "/inference/v1/generate",
                 "/v1/embeddings", "/pooling", "/score", "/rerank", "/v1/rerank", "/v2/rerank"):
        assert path in paths
