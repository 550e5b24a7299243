"""The pooling routes of a simulated pooling model (``--runner pooling``) and the audio route of a simulated
speech-to-text model (``--transcription``), with vLLM 0.32's shapes (``vllm/entrypoints/pooling/*/protocol.py``,
``vllm/entrypoints/speech_to_text/transcription/protocol.py``; captured from the tiny model run with ``--runner
pooling --convert embed`` in ``tests/real_vllm/captures/pooling/``).

vLLM registers these routes by the model's tasks (``vllm/entrypoints/pooling/factories.py``): a generate model
serves none of them (404 ``{"detail": "Not Found"}``), an embedding model (``--convert embed``) serves
``/v1/embeddings``, ``/pooling``, ``/score``, ``/v1/score``, ``/rerank``, ``/v1/rerank``, ``/v2/rerank``, a
classifier (``--convert classify``) ``/classify``, ``/pooling`` and the score/rerank routes. A pooling model serves
no generation route.

* Embeddings are fixed-size (``--embedding-size``, default 256 = the tiny model's hidden size), unit-length and
  deterministic: the same input always gets the same vector; ``encoding_format: "base64"`` gives little-endian
  float32 bytes; ``dimensions`` is refused as vLLM refuses it for a non-Matryoshka model.
* Scores are the cosine similarity of the two texts' embeddings (an embedding model's scoring); rerank sorts
  documents by it and keeps ``top_n``.
* Usage counts prompt tokens only (``completion_tokens: 0``); score and rerank count ``text_1``/``query`` once.
* ``/v1/audio/transcriptions`` (multipart ``file``, ``model``, ``language``, ``response_format``) answers
  ``{"text", "usage": {"type": "duration", "seconds"}}`` with ``seconds`` from the upload's size at 16 kHz
  16-bit mono, and ``text`` from the word list (``response_format: "text"`` → plain text).
"""

from __future__ import annotations

import base64
import math
import random
import secrets
import struct
import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web

from pdproxy.sim import validation as v
from pdproxy.sim.errors import SimHTTPError
from pdproxy.sim.outputs import WORDS
from pdproxy.tokens import HFTokenizer, Tokenizer

if TYPE_CHECKING:
    from pdproxy.sim.models import ModelRegistry

EMBED_ROUTES = ("/v1/embeddings", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
CLASSIFY_ROUTES = ("/classify", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
AUDIO_ROUTES = ("/v1/audio/transcriptions", "/v1/audio/translations")
_NO_INPUT = ("7 validation errors:\n" + "".join(
    f"  {{'type': 'missing', 'loc': 'body.{loc}', 'msg': 'Field required', 'input': '<dict of {{n}} items>'}}\n"
    for loc in ("input", "messages", "messages", "messages", "input", "messages", "input"))).rstrip()


def routes_for(convert: str) -> tuple[str, ...]:
    """The pooling routes a ``--convert`` task serves."""
    return CLASSIFY_ROUTES if convert == "classify" else EMBED_ROUTES


def embedding(token_ids: Sequence[int], size: int) -> list[float]:
    """A deterministic unit vector of ``size`` floats for a prompt."""
    rng = random.Random(zlib.crc32(struct.pack(f"<{len(token_ids)}q", *token_ids)) if token_ids else 0)
    values = [rng.gauss(0.0, 1.0) for _ in range(size)]
    norm = math.sqrt(sum(x * x for x in values)) or 1.0
    return [x / norm for x in values]


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity of two unit vectors."""
    return float(sum(x * y for x, y in zip(a, b, strict=False)))


def _usage(prompt: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0, "prompt_tokens_details": None,
            "completion_tokens_details": None}


def _ids(tokenizer: Tokenizer, item: Any) -> list[int]:
    if isinstance(item, list) and all(isinstance(t, int) for t in item):
        return list(item)
    text = str(item)
    return tokenizer.encode(text, add_special_tokens=True) if isinstance(tokenizer, HFTokenizer) else (
        tokenizer.encode(text))


def _inputs(body: dict[str, Any], key: str = "input") -> list[Any]:
    value = body.get(key)
    if isinstance(value, list) and value and not all(isinstance(t, int) for t in value):
        return value
    return [value]


class PoolingRoutes:
    """Handlers of the pooling routes (``tokenizer``, ``models``, vector ``size``, ``convert`` task)."""

    def __init__(self, tokenizer: Tokenizer, models: ModelRegistry, size: int, convert: str) -> None:
        self.tokenizer = tokenizer
        self.models = models
        self.size = size
        self.convert = convert

    def _model(self, body: dict[str, Any]) -> str:
        return self.models.resolve(body.get("model"), pooling=True)

    def answer(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The JSON answer of ``path`` for ``body``; raises :class:`SimHTTPError`."""
        if path == "/v1/embeddings":
            return self.embeddings(body)
        if path == "/pooling":
            return self.pooling(body)
        if path in ("/score", "/v1/score"):
            return self.score(body)
        if path == "/classify":
            return self.classify(body)
        return self.rerank(body)

    def _require_input(self, body: dict[str, Any]) -> None:
        if "input" not in body and "messages" not in body:
            raise SimHTTPError(400, _NO_INPUT.replace("{n}", str(len(body))), "Bad Request", "body.input")

    def embeddings(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/embeddings``."""
        self._require_input(body)
        model = self._model(body)
        if body.get("dimensions") is not None:
            raise SimHTTPError(400, f"Model '{model}' does not support Matryoshka embeddings; dimensions must be "
                                    f"unset (received dimensions={body['dimensions']}).")
        fmt = body.get("encoding_format", "float")
        data, prompt = [], 0
        for i, item in enumerate(_inputs(body)):
            ids = _ids(self.tokenizer, item)
            prompt += len(ids)
            vector: Any = embedding(ids, self.size)
            if fmt == "base64":
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"index": i, "object": "embedding", "embedding": vector})
        return {"id": f"embd-{secrets.token_hex(8)}", "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": _usage(prompt)}

    def pooling(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/pooling``: the pooled vector (or class probabilities) per input."""
        self._require_input(body)
        model = self._model(body)
        data, prompt = [], 0
        for i, item in enumerate(_inputs(body)):
            ids = _ids(self.tokenizer, item)
            prompt += len(ids)
            vector = self._probs(ids) if self.convert == "classify" else embedding(ids, self.size)
            data.append({"index": i, "object": "pooling", "data": vector})
        return {"id": f"pooling-{secrets.token_hex(8)}", "object": "list", "created": int(time.time()),
                "model": model, "data": data, "usage": _usage(prompt)}

    def _probs(self, ids: list[int]) -> list[float]:
        x = (embedding(ids, 2)[0] + 1.0) / 2.0
        return [1.0 - x, x]

    def classify(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/classify``: two classes, ``LABEL_0``/``LABEL_1``."""
        self._require_input(body)
        model = self._model(body)
        data, prompt = [], 0
        for i, item in enumerate(_inputs(body)):
            ids = _ids(self.tokenizer, item)
            prompt += len(ids)
            probs = self._probs(ids)
            data.append({"index": i, "label": f"LABEL_{int(probs[1] > probs[0])}", "probs": probs, "num_classes": 2})
        return {"id": f"classify-{secrets.token_hex(8)}", "object": "list", "created": int(time.time()),
                "model": model, "data": data, "usage": _usage(prompt)}

    def score(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/score``: ``text_1`` (or ``queries``) against each ``text_2`` (or ``documents``)."""
        first = body.get("text_1", body.get("queries"))
        second = body.get("text_2", body.get("documents"))
        if first is None:
            raise v.missing("text_1", body)
        if second is None:
            raise v.missing("text_2", body)
        model = self._model(body)
        query = _ids(self.tokenizer, first if not isinstance(first, list) else first[0])
        docs = second if isinstance(second, list) else [second]
        q = embedding(query, self.size)
        prompt = len(query)
        data = []
        for i, doc in enumerate(docs):
            ids = _ids(self.tokenizer, doc)
            prompt += len(ids)
            data.append({"index": i, "object": "score", "score": cosine(q, embedding(ids, self.size))})
        return {"id": f"score-{secrets.token_hex(8)}", "object": "list", "created": int(time.time()), "model": model,
                "data": data, "usage": _usage(prompt)}

    def rerank(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/rerank``, ``/v1/rerank``, ``/v2/rerank``: documents by relevance, ``top_n`` kept."""
        if body.get("query") is None:
            raise v.missing("query", body)
        if body.get("documents") is None:
            raise v.missing("documents", body)
        model = self._model(body)
        query = _ids(self.tokenizer, body["query"])
        q = embedding(query, self.size)
        prompt = len(query)
        results: list[dict[str, Any]] = []
        for i, doc in enumerate(body["documents"]):
            text = doc.get("text", "") if isinstance(doc, dict) else str(doc)
            ids = _ids(self.tokenizer, text)
            prompt += len(ids)
            results.append({"index": i, "document": {"text": text, "multi_modal": None},
                            "relevance_score": cosine(q, embedding(ids, self.size))})
        results.sort(key=lambda r: -float(r["relevance_score"]))
        top_n = v.get_int(body, "top_n") or len(results)
        return {"id": f"score-{secrets.token_hex(8)}", "model": model,
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt}, "results": results[:top_n]}


async def transcription(request: web.Request, models: ModelRegistry) -> web.Response:
    """``/v1/audio/transcriptions`` and ``/v1/audio/translations`` (multipart form)."""
    if not request.content_type.startswith("multipart/"):
        raise v.missing("file", {})
    form = await request.post()
    upload = form.get("file")
    if upload is None or not hasattr(upload, "file"):
        raise v.missing("file", dict(form))
    size = len(upload.file.read())
    models.resolve(form.get("model"))
    seconds = max(math.ceil(size / 32000), 1)
    words = max(seconds * 2, 1)
    text = "".join(WORDS[i % len(WORDS)] for i in range(words)).strip()
    if form.get("response_format") == "text":
        return web.Response(text=text, content_type="text/plain")
    return web.json_response({"text": text, "usage": {"type": "duration", "seconds": seconds}})
