"""vLLM 0.32's own verdict on a request body, without an engine: run by the real-vLLM venv's interpreter.

Reads JSON lines ``{"api": "chat"|"completions", "body": {...}}`` on stdin and writes one JSON line per request:
``{"status": int, "json": {...}}``.  Each body goes through a FastAPI app with vLLM's exception handlers
(``vllm/entrypoints/serve/exception_handling/register.py``) and a route taking vLLM's request model
(``ChatCompletionRequest`` / ``CompletionRequest``), as ``vllm serve`` does, then through the checks the serving
layer runs before any tokenization or engine work: the output-token bound against ``max_model_len``
(``build_tok_params``), the effective ``max_tokens`` (``serve/utils/api_utils.py::get_max_tokens``, for a
prompt of ``PROMPT_TOKENS`` tokens) and ``to_sampling_params`` (``SamplingParams._verify_args``).  A 200 answer
reports what vLLM understood: ``stream``, the requested output tokens, ``min_tokens``, ``n``, the usage options
whether the request needs the prompt's logits (``prompt_logprobs`` after ``echo``) and whether it is an echo
without generation (``echo`` with ``max_tokens`` 0, which vLLM runs with ``max_tokens`` 1).

Prompt and chat-message checks that need the tokenizer or the chat template are not run here: pdproxy passes
those fields unchanged to the prefiller, whose own 400 reaches the client.  :class:`Oracle` runs this script
from pdproxy's own interpreter; used by ``tests/real_vllm/test_request_rules.py`` and
``tests/real_vllm/capture_request_rules.py``.
"""

# no "from __future__ import annotations": FastAPI reads the route annotations at runtime
import json
import logging
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any

MAX_MODEL_LEN = 2048
PROMPT_TOKENS = 16


def build_app() -> Any:
    from fastapi import FastAPI, Request
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    app = FastAPI()
    init_exception_handler(app)
    app.state.args = Namespace(log_error_stack=False)
    model_config = Namespace(max_model_len=MAX_MODEL_LEN)

    def verdict(request: Any, requested: int | None) -> dict[str, Any]:
        request.build_tok_params(model_config)
        max_tokens = get_max_tokens(MAX_MODEL_LEN, requested, PROMPT_TOKENS, {},
                                    truncate_prompt_tokens=request.truncate_prompt_tokens)
        if request.use_beam_search:
            params: Any = request.to_beam_search_params(max_tokens, {})
            prompt_logprobs = None
        else:
            params = request.to_sampling_params(max_tokens, {})
            prompt_logprobs = params.prompt_logprobs
        options = request.stream_options
        return {"ok": True, "stream": bool(request.stream), "requested_max_tokens": requested,
                "min_tokens": getattr(params, "min_tokens", None), "n": request.n,
                "include_usage": bool(options and options.include_usage),
                "continuous_usage": bool(options and options.continuous_usage_stats),
                "prompt_logits": prompt_logprobs is not None, "beam_search": bool(request.use_beam_search),
                # completion/protocol.py::to_sampling_params: echo without generation runs with max_tokens 1
                "echo_only": bool(getattr(request, "echo", False) and request.max_tokens == 0
                                  and not request.use_beam_search)}

    @app.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest, raw_request: Request) -> dict[str, Any]:
        requested = (request.max_completion_tokens if request.max_completion_tokens is not None
                     else request.max_tokens)
        return verdict(request, requested)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw_request: Request) -> dict[str, Any]:
        return verdict(request, request.max_tokens)

    return app


class Oracle:
    """This script running under the real-vLLM venv's interpreter (``$REAL_VLLM_HOME/venv``); ``judge`` asks it."""

    def __init__(self, home: str | None = None) -> None:
        root = Path(home or os.environ.get("REAL_VLLM_HOME") or Path(__file__).resolve().parents[2] / ".real-vllm")
        python = root / "venv" / "bin" / "python"
        if not python.exists():
            raise RuntimeError(f"no real-vLLM venv at {root} (scripts/real-vllm.sh setup)")
        self.proc = subprocess.Popen([str(python), __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if not ready.startswith('{"ready"'):
            raise RuntimeError(f"vLLM oracle did not start: {ready!r}")

    def judge(self, api: str, raw: bytes) -> tuple[int, dict[str, Any]]:
        """vLLM's ``(status, json)`` for ``raw`` posted to the ``api`` ("chat" / "completions") route."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"api": api, "raw": raw.decode()}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self.proc.stdout.readline())
        return int(answer["status"]), answer["json"]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.kill()          # nothing to flush: vLLM's interpreter teardown alone takes seconds
        self.proc.wait()


def main() -> None:
    logging.disable(logging.WARNING)
    from fastapi.testclient import TestClient

    client = TestClient(build_app(), raise_server_exceptions=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        case = json.loads(line)
        path = "/v1/chat/completions" if case["api"] == "chat" else "/v1/completions"
        raw = case["raw"].encode() if "raw" in case else json.dumps(case["body"]).encode()
        resp = client.post(path, content=raw, headers={"content-type": "application/json"})
        try:
            body = resp.json()
        except ValueError:
            body = {"raw": resp.text}
        print(json.dumps({"status": resp.status_code, "json": body}), flush=True)


if __name__ == "__main__":
    main()
