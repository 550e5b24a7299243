"""The other vLLM routes ``pdproxy sim`` serves: render (exact prompt ids), ``/inference/v1/generate``, LoRA
adapters in ``/v1/models``, the pooling routes of a pooling model, audio transcription, and FastAPI's 404 for
everything else. Real processes on loopback, the real openai client where users use it."""

from __future__ import annotations

import base64
import io
import struct
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.sim.helpers import sse_json
from tests.support import SimProcess, running

pytestmark = pytest.mark.timeout(60)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def sims() -> Iterator[dict[str, SimProcess]]:
    fleet = {"gen": SimProcess("both", "--lora-modules", "sql-lora=/adapters/sql", "--transcription"),
             "embed": SimProcess("both", "--runner", "pooling", "--embedding-size", "64"),
             "classify": SimProcess("both", "--runner", "pooling", "--convert", "classify"),
             "closed": SimProcess("both", "--no-enable-scale-out", "--tool-call-parser", "none")}
    with running(*fleet.values()):
        yield fleet


def test_render_routes_give_the_exact_prompt_ids(sims: dict[str, SimProcess]) -> None:
    url = sims["gen"].url
    chat = httpx.post(url + "/v1/chat/completions/render", json={"messages": MESSAGES, "max_tokens": 8}).json()
    tokenized = httpx.post(url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["token_ids"] == tokenized["tokens"] and chat["sampling_params"]["max_tokens"] == 8
    assert chat["request_id"].startswith("chatcmpl-") and chat["model"] == "sim-model"
    listed = httpx.post(url + "/v1/completions/render", json={"prompt": ["one two", "three"]}).json()
    assert [len(x["token_ids"]) for x in listed] == [2, 1] and listed[1]["request_id"].endswith("-1")
    messages = httpx.post(url + "/v1/messages/render", json={"model": "sim-model", "max_tokens": 4,
                                                             "messages": MESSAGES[1:]}).json()
    assert messages["token_ids"] == httpx.post(url + "/tokenize", json={"messages": MESSAGES[1:]}).json()["tokens"]
    resp = httpx.post(url + "/v1/responses/render", json={"input": "Hello there"}).json()
    assert resp["request_id"].startswith("resp_") and resp["token_ids"]
    bad = httpx.post(url + "/v1/chat/completions/render", json={"messages": MESSAGES, "model": "nope"})
    assert bad.status_code == 404 and bad.json()["error"]["type"] == "NotFoundError"


def test_generate_route_tokens_in_tokens_out(sims: dict[str, SimProcess]) -> None:
    url = sims["gen"].url
    body = {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 3}}
    out = httpx.post(url + "/inference/v1/generate", json=body, headers={"X-Request-Id": "g1"}).json()
    (choice,) = out["choices"]
    assert out["request_id"] == "generate-tokens-g1" and len(choice["token_ids"]) == 3
    assert choice["finish_reason"] == "length" and out["usage"]["prompt_tokens"] == 4
    events = sse_json(httpx.post(url + "/inference/v1/generate", json={**body, "stream": True}).text)
    assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 3
    text = httpx.post(url + "/inference/v1/generate", json={**body, "output_mode": "text"}).json()
    assert text["choices"][0]["text"]


def test_scale_out_routes_without_the_flag_are_vllms_403(sims: dict[str, SimProcess]) -> None:
    for path in ("/v1/chat/completions/render", "/inference/v1/generate"):
        resp = httpx.post(sims["closed"].url + path, json={"messages": MESSAGES})
        assert resp.status_code == 403 and resp.json()["error"]["type"] == "PermissionDeniedError"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    resp = httpx.post(sims["closed"].url + "/v1/chat/completions", json={"messages": MESSAGES, "tools": tools,
                                                                        "tool_choice": "required"})
    assert resp.status_code == 400 and resp.json()["error"]["message"] == (
        'tool_choice="required" requires --tool-call-parser to be set')


def test_lora_adapters_are_listed_and_served(sims: dict[str, SimProcess]) -> None:
    with openai.OpenAI(base_url=sims["gen"].url + "/v1", api_key="none", max_retries=0) as client:
        models = {m.id: m for m in client.models.list()}
        assert set(models) == {"sim-model", "sql-lora"}
        assert models["sql-lora"].parent == "sim-model" and models["sql-lora"].root == "/adapters/sql"  # type: ignore[attr-defined]
        assert models["sql-lora"].max_model_len is None  # type: ignore[attr-defined]
        resp = client.chat.completions.create(model="sql-lora", max_tokens=2,
                                              messages=[{"role": "user", "content": "hi"}])
        assert resp.model == "sql-lora"
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="other", prompt="x", max_tokens=2)
        assert missing.value.body == {"message": "The model `other` does not exist. Valid aliases: sim-model.",  # type: ignore[comparison-overlap]
                                      "type": "NotFoundError", "param": "model", "code": 404}


def test_unknown_routes_answer_fastapis_404(sims: dict[str, SimProcess]) -> None:
    for path in ("/v1/embeddings", "/nope", "/v1/rerank"):
        resp = httpx.post(sims["gen"].url + path, json={})
        assert (resp.status_code, resp.json()) == (404, {"detail": "Not Found"})
    resp = httpx.post(sims["embed"].url + "/v1/chat/completions", json={"messages": MESSAGES})
    assert (resp.status_code, resp.json()) == (404, {"detail": "Not Found"})


def test_embeddings_are_fixed_size_and_deterministic(sims: dict[str, SimProcess]) -> None:
    with openai.OpenAI(base_url=sims["embed"].url + "/v1", api_key="none", max_retries=0) as client:
        first = client.embeddings.create(model="sim-model", input=["Hello world", "other"], encoding_format="float")
        again = client.embeddings.create(model="sim-model", input="Hello world", encoding_format="float")
    vectors = [d.embedding for d in first.data]
    assert [len(v) for v in vectors] == [64, 64] and vectors[0] == again.data[0].embedding
    assert vectors[0] != vectors[1] and abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-6
    assert first.usage.prompt_tokens == 3 and again.usage.prompt_tokens == 2
    b64 = httpx.post(sims["embed"].url + "/v1/embeddings", json={"input": "Hello world",
                                                                 "encoding_format": "base64"}).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack("<64f", raw)) == pytest.approx(vectors[0], rel=1e-6)
    dims = httpx.post(sims["embed"].url + "/v1/embeddings", json={"input": "x", "dimensions": 8})
    assert dims.status_code == 400 and "Matryoshka" in dims.json()["error"]["message"]


def test_score_rerank_pooling_and_classify(sims: dict[str, SimProcess]) -> None:
    url = sims["embed"].url
    score = httpx.post(url + "/score", json={"text_1": "Hello", "text_2": ["Hello", "world"]}).json()
    assert [d["index"] for d in score["data"]] == [0, 1] and score["data"][0]["score"] == pytest.approx(1.0)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        rerank = httpx.post(url + path, json={"query": "Hello", "documents": ["world", "Hello", "there"],
                                              "top_n": 2}).json()
        assert rerank["results"][0]["index"] == 1 and len(rerank["results"]) == 2
    pooled = httpx.post(url + "/pooling", json={"input": "Hello"}).json()
    assert len(pooled["data"][0]["data"]) == 64
    classified = httpx.post(sims["classify"].url + "/classify", json={"input": ["a", "b"]}).json()
    assert [d["num_classes"] for d in classified["data"]] == [2, 2]
    assert all(sum(d["probs"]) == pytest.approx(1.0) for d in classified["data"])
    missing = httpx.post(url + "/v1/embeddings", json={"model": "other", "input": "x"})
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "The model `other` does not exist."


def test_transcription_multipart(sims: dict[str, SimProcess]) -> None:
    audio = io.BytesIO(b"RIFF" + bytes(64_000))
    with openai.OpenAI(base_url=sims["gen"].url + "/v1", api_key="none", max_retries=0) as client:
        result = client.audio.transcriptions.create(model="sim-model", file=("a.wav", audio))
    assert result.text
    raw = httpx.post(sims["gen"].url + "/v1/audio/transcriptions", files={"file": ("a.wav", bytes(32_000))},
                     data={"model": "sim-model"}).json()
    assert raw["usage"] == {"type": "duration", "seconds": 1}
    plain = httpx.post(sims["gen"].url + "/v1/audio/transcriptions", files={"file": ("a.wav", bytes(10))},
                       data={"response_format": "text"})
    assert plain.headers["content-type"].startswith("text/plain") and plain.text and "{" not in plain.text
