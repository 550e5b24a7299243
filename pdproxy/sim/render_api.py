"""vLLM 0.32's scale-out routes: the render routes and ``POST /inference/v1/generate``
(``vllm/entrypoints/scale_out/render/api_router.py``, ``scale_out/token_in_token_out/{api_router,protocol}.py``;
shapes as captured in ``tests/real_vllm/captures/apis/``).

vLLM serves them only with ``--enable-scale-out`` (``scale_out/factories.py``); without it every one answers 403
``PermissionDeniedError`` "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable
them." The simulator serves them unless ``--no-enable-scale-out``.

* ``/v1/chat/completions/render``, ``/v1/messages/render``, ``/v1/responses/render`` take their API's request and
  answer one ``GenerateRequest``: ``{"request_id", "token_ids": <the exact prompt ids, chat template applied>,
  "sampling_params": {...}, "model", ..., "kv_transfer_params"}``; ``/v1/completions/render`` answers a list, one
  per prompt (``request_id`` ``cmpl-<16 hex>-<i>``). The requests are validated as the generation routes
  validate them (same 400/404).
* ``/inference/v1/generate`` (tokens in, tokens out): ``{"token_ids": [...], "sampling_params": {...},
  "model"?, "stream"?, "output_mode": "tokens" | "text", "kv_transfer_params"?}`` → ``{"request_id":
  "generate-tokens-<X-Request-Id>", "model", "created", "usage", ..., "kv_transfer_params", "output_mode",
  "choices": [{"index", "finish_reason", "stop_reason", "token_ids", ..., "weight_versions", ["text"],
  "logprobs"}]}``; streamed as ``data:`` chunks of new ``token_ids`` and ``data: [DONE]``. It accepts
  ``kv_transfer_params`` like the other generation routes (a PD prefill leg is ``sampling_params.max_tokens: 1``).
"""

from __future__ import annotations

import secrets
import time
from typing import TYPE_CHECKING, Any

import orjson

from pdproxy.sim import validation as v
from pdproxy.sim.errors import SimHTTPError, error_body
from pdproxy.sim.generation import Seq, Usage
from pdproxy.sim.protocol import ParsedRequest, check_length, decode_body

if TYPE_CHECKING:
    from pdproxy.sim.config import SimConfig
    from pdproxy.sim.models import ModelRegistry

DONE = b"data: [DONE]\n\n"
SCALE_OUT_DISABLED = SimHTTPError(403, "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out "
                                       "to enable them.", "PermissionDeniedError")


def sampling_params_dump(parsed: ParsedRequest, extra_args: bool = False) -> dict[str, Any]:
    """The ``sampling_params`` object a render route returns (vLLM's non-default fields)."""
    spec, body = parsed.sampling, parsed.body
    out: dict[str, Any] = {"presence_penalty": float(v.get_float(body, "presence_penalty") or 0.0),
                           "frequency_penalty": float(v.get_float(body, "frequency_penalty") or 0.0),
                           "repetition_penalty": float(v.get_float(body, "repetition_penalty") or 1.0),
                           "temperature": spec.temperature, "top_p": float(v.get_float(body, "top_p") or 1.0),
                           "min_p": float(v.get_float(body, "min_p") or 0.0)}
    if spec.n != 1:
        out["n"] = spec.n
    if spec.seed is not None:
        out["seed"] = spec.seed
    out["stop"] = list(spec.rules.stop)
    out["stop_token_ids"] = list(spec.rules.stop_token_ids)
    if spec.rules.ignore_eos:
        out["ignore_eos"] = True
    out["max_tokens"] = parsed.max_tokens
    if spec.rules.min_tokens:
        out["min_tokens"] = spec.rules.min_tokens
    if spec.logprobs is not None:
        out["logprobs"] = spec.logprobs
    out["output_kind"] = 2
    out["skip_clone"] = True
    if extra_args:
        out["extra_args"] = {}
    out["bad_words"] = []
    out["skip_reading_prefix_cache"] = False
    return out


def render_one(parsed: ParsedRequest, request_id: str, token_ids: list[int], extra_args: bool = False,
               ) -> dict[str, Any]:
    """One ``GenerateRequest`` as the render routes return it."""
    return {"request_id": request_id, "token_ids": token_ids, "token_offsets": None, "features": None,
            "content_parts": None, "sampling_params": sampling_params_dump(parsed, extra_args),
            "model": parsed.model, "reasoning_ended": None, "reasoning_parser_kwargs": None,
            "return_token_ids": None, "output_mode": "tokens", "stream": parsed.stream, "stream_options": None,
            "cache_salt": None, "priority": 0, "kv_transfer_params": parsed.kv_transfer_params,
            "ec_transfer_params": None}


def render_answer(parsed: ParsedRequest) -> Any:
    """The body of a render route for an already validated request (a list for completions)."""
    if parsed.api == "completions":
        base = secrets.token_hex(8)
        return [render_one(parsed, f"cmpl-{base}-{i}", ids) for i, ids in enumerate(parsed.prompts)]
    if parsed.api == "responses":
        return render_one(parsed, parsed.response_id, parsed.prompt_token_ids, extra_args=True)
    rid = parsed.response_id if parsed.body.get("request_id") or parsed.api == "messages" else (
        f"chatcmpl-{secrets.token_hex(8)}")
    return render_one(parsed, rid, parsed.prompt_token_ids)


def parse_generate(raw: Any, headers: Any, config: SimConfig, models: ModelRegistry) -> ParsedRequest:
    """Validate an ``/inference/v1/generate`` request; raises :class:`SimHTTPError`."""
    body = decode_body(raw)
    ids = body.get("token_ids")
    if ids is None:
        raise v.missing("token_ids", body)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise v.pydantic_error("list_type", "token_ids", "Input should be a valid list", ids)
    if not ids:
        raise v.pydantic_error("too_short", "token_ids", "List should have at least 1 item after validation, not 0",
                               ids, {"field_type": "List", "min_length": 1, "actual_length": 0})
    if any(t < 0 for t in ids):
        raise v.pydantic_error("value_error", "token_ids", "Value error, token_ids must not contain negative values",
                               ids, {"error": ValueError("token_ids must not contain negative values")})
    if "sampling_params" not in body:
        raise v.missing("sampling_params", body)
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise v.pydantic_error("dataclass_type", "sampling_params", "Input should be a dictionary or an instance of "
                               "SamplingParams", params)
    stream = v.get_bool(body, "stream")
    v.check_stream_options(body)
    fields = v.read_sampling(params, "completions")
    model = models.resolve(body.get("model"))
    max_tokens = v.get_int(params, "max_tokens")
    limit = check_length(len(ids), 16 if max_tokens is None else max_tokens, config.max_model_len,
                         clamp=config.max_tokens_overflow == "clamp")
    spec = fields.verify(limit)
    base = str(headers.get("X-Request-Id") or body.get("request_id") or secrets.token_hex(8))
    raw_options = body.get("stream_options")
    options: dict[str, Any] = raw_options if isinstance(raw_options, dict) else {}
    output_mode = body.get("output_mode", "tokens")
    if output_mode not in ("tokens", "text"):
        raise v.pydantic_error("literal_error", "output_mode", "Input should be 'tokens' or 'text'", output_mode,
                               {"expected": "'tokens' or 'text'"})
    return ParsedRequest(
        api="generate", body=body, base_id=base, response_id=f"generate-tokens-{base}", stream=stream,
        include_usage=bool(options.get("include_usage")), continuous_usage=False, prompt_token_ids=list(ids),
        max_tokens=limit, min_tokens=spec.rules.min_tokens, kv_transfer_params=body.get("kv_transfer_params"),
        tools=None, tool_choice=None, sampling=spec, model=model, return_token_ids=output_mode == "text")


class GenerateWriter:
    """The JSON body and SSE chunks of one ``/inference/v1/generate`` request."""

    done = DONE
    continuous_usage = False

    def __init__(self, req: ParsedRequest) -> None:
        self.req = req
        self.include_usage = req.include_usage
        self.text = req.body.get("output_mode") == "text"
        self.created = int(time.time())

    @staticmethod
    def usage(figures: Usage) -> dict[str, Any]:
        """Completions-style usage (``created_cache_tokens`` null)."""
        return {"prompt_tokens": figures.prompt, "total_tokens": figures.total,
                "completion_tokens": figures.completion,
                "prompt_tokens_details": {"cached_tokens": max(figures.cached, 0), "created_cache_tokens": None,
                                          "multimodal_tokens": None}, "completion_tokens_details": None}

    def _choice(self, seq: Seq, start: int, end: int, finish: str | None, reason: Any, final: bool
                ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": seq.index, "finish_reason": finish, "stop_reason": reason,
                                  "token_ids": seq.plan.token_ids(start, end), "routed_experts": None,
                                  "sampling_mask": None,
                                  "weight_versions": [{"version": "default", "start": 0, "end": end}] if final
                                  else None}
        if self.text:
            choice["text"] = seq.plan.text(start, end)
        choice["logprobs"] = None
        return choice

    def head(self) -> list[bytes]:
        """Nothing."""
        return []

    @staticmethod
    def opening(seq: Seq) -> list[bytes]:
        """Nothing."""
        seq.started = True
        return []

    def output(self, seq: Seq, start: int, end: int, finish: str | None, stop_reason: Any,
               usage: Usage | None, last: bool) -> list[bytes]:
        """One chunk with the new token ids."""
        seq.started = True
        chunk = {"request_id": self.req.response_id, "usage": None, "output_mode": "text" if self.text else "tokens",
                 "choices": [self._choice(seq, start, end, finish, stop_reason, finish is not None)]}
        return [b"data: " + orjson.dumps(chunk) + b"\n\n"]

    def tail(self, seqs: list[Seq], usage: Usage, kv_params: dict[str, Any] | None) -> list[bytes]:
        """The usage chunk with ``stream_options.include_usage``."""
        if not self.include_usage:
            return []
        chunk = {"request_id": self.req.response_id, "usage": self.usage(usage),
                 "output_mode": "text" if self.text else "tokens", "choices": []}
        return [b"data: " + orjson.dumps(chunk) + b"\n\n"]

    def failure(self) -> list[bytes]:
        """The OpenAI-style mid-stream error chunk."""
        from pdproxy.sim.responses import ResponseWriter

        return [ResponseWriter.error_event("Internal server error", "InternalServerError", 500)]

    @staticmethod
    def failure_body() -> tuple[int, bytes]:
        """The 500 of a non-streaming request whose KV pull failed."""
        return 500, error_body("Internal server error", "InternalServerError", 500)

    def body(self, seqs: list[Seq], usage: Usage, kv_params: dict[str, Any] | None) -> bytes:
        """The ``GenerateResponse`` body."""
        return orjson.dumps({
            "request_id": self.req.response_id, "model": self.req.model, "created": self.created,
            "usage": self.usage(usage), "prompt_logprobs": None, "prompt_token_id_logprobs": None,
            "prompt_token_ids": None, "mm_placeholders": None, "metrics": None, "kv_transfer_params": kv_params,
            "ec_transfer_params": None, "output_mode": "text" if self.text else "tokens",
            "choices": [self._choice(s, 0, s.sent, s.finish, s.reason, True) for s in seqs]})
