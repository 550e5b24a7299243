"""Response bodies and SSE events of the OpenAI chat and completions routes, shaped like vLLM's (reference
captures in ``tests/real_vllm/captures/``, kept by ``tests/real_vllm/test_sim_contract.py``).

* Completion chunk: ``{"id","object":"text_completion","created","model","choices":[{"index","text",
  "logprobs","finish_reason","stop_reason","prompt_token_ids":null,"token_ids":null}]}``.
* Chat: each choice's first chunk ``delta {"role":"assistant","content":""}`` (sent with its first output), then
  ``delta.content`` (or ``delta.tool_calls``) chunks; the chunk carrying a choice's last token has
  ``finish_reason`` and ``stop_reason``. With ``n > 1`` the choices' chunks interleave, one choice per chunk,
  in the order their tokens came.
* Usage chunk (only with ``stream_options.include_usage``): ``choices: []`` plus ``usage``; then
  ``data: [DONE]``. Usage counts every prompt once and sums every choice's output.

Compact JSON events; chat's role chunk carries top-level ``prompt_token_ids``/``prompt_text`` (null); every chat
choice chunk has ``token_ids: null``; the last JSON event of a stream carries ``system_fingerprint``
(``"vllm-<version>-<8 hex>"``); usage in a stream drops null details (``{"cached_tokens": 0}``, chat adds
``"created_cache_tokens"``) while a JSON body keeps them and adds ``completion_tokens_details: null``; JSON bodies
carry ``routed_experts``, ``ec_transfer_params`` and ``metrics`` as null. The mid-stream error event alone is
written by ``json.dumps`` (``{"error": {"message": ...}}``, with spaces).

Logprobs (``logprobs`` / ``top_logprobs``): chat ``{"content": [{"token","logprob","bytes","top_logprobs":
[{"token","logprob","bytes"}]}]}``; completions ``{"text_offset","token_logprobs","tokens","top_logprobs":
[{token: logprob}]}`` (the sampled token is always among the top entries).

Echo without generation (completions with ``echo`` and ``max_tokens: 0``, run with ``max_tokens`` 1): each
choice's text is its prompt alone (``""`` with ``return_token_ids``, as vLLM's), in one chunk when streamed, with
the finish reason and usage of the one token the engine ran (``vllm/entrypoints/openai/completion/serving.py``);
``logprobs`` is null (the prompt's logprobs vLLM would report are not simulated).

Echo with generation (completions with ``echo`` and ``max_tokens`` > 0): each choice's text is its prompt followed
by the generated text (``output_text = prompt_text + output.text``); streamed, the prompt goes with the choice's
first output chunk (``delta_text = prompt_text + output.text``), and ``""`` stands for the prompt with
``return_token_ids``, as in vLLM; usage counts the generated tokens only. ``logprobs`` covers the generated tokens
alone, their ``text_offset`` counted from the start of the echoed text (vLLM also lists the prompt's tokens first,
with a null logprob for the first one: not simulated).

Tool calls: ``tool_choice`` auto (the simulator's ``--enable-auto-tool-choice``) calls the first tool,
``"required"`` the first tool, a named choice that tool; ``arguments`` is JSON built from the tool's parameter
schema, streamed in 4-character pieces. ``finish_reason`` is ``"tool_calls"`` for auto and required, ``"stop"``
for a named choice (``vllm/entrypoints/openai/chat_completion/serving.py``); required and named answers have
``content: ""`` and stream ``{"content": null, "tool_calls": [...]}`` deltas, the name first, then the
arguments, then a finishing chunk with an empty delta.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

import orjson

from pdproxy.sim.generation import Seq, Usage
from pdproxy.sim.protocol import ParsedRequest

DONE = b"data: [DONE]\n\n"


class ResponseWriter:
    """Builds the bytes of one chat/completions request's answer (SSE events or the JSON body).

    ``fingerprint`` is the ``system_fingerprint`` value (``"vllm-<version>-<8 hex>"``); ``model`` is the name
    the request asked for (a LoRA adapter's name is echoed).
    """

    done = DONE

    def __init__(self, req: ParsedRequest, model: str, created: int, fingerprint: str | None = None) -> None:
        self.req = req
        self.model = model
        self.created = created
        self.fingerprint = fingerprint
        self.include_usage = req.include_usage
        self.continuous_usage = req.continuous_usage
        self.chat = req.api == "chat"
        self.tool_name = req.tool_name
        self.tool_mode = req.tool_mode
        self._lp = req.sampling.logprobs is not None and not req.echo_only
        self._tool_ids: dict[int, str] = {}
        self._text_at: dict[int, tuple[int, int]] = {}   # choice index → (token i, len(text(0, i))): logprobs' offset
        self._head = {"id": req.response_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                      "created": created, "model": model}

    def tool_id(self, index: int) -> str:
        """The tool call id of choice ``index`` (``chatcmpl-tool-<16 hex>``, stable within the request)."""
        tid = self._tool_ids.get(index)
        if tid is None:
            tid = self._tool_ids[index] = f"chatcmpl-tool-{secrets.token_hex(8)}"
        return tid

    def public_finish_reason(self, finish_reason: str | None) -> str | None:
        """``stop`` becomes ``tool_calls`` for an auto or required tool call."""
        if finish_reason == "stop" and self.tool_mode in ("auto", "required"):
            return "tool_calls"
        return finish_reason

    def usage(self, figures: Usage, stream: bool = False) -> dict[str, Any]:
        """OpenAI/vLLM usage with ``prompt_tokens_details`` (JSON-body form, or the stream form without null
        details when ``stream``). ``created_cache_tokens`` is reported by chat only."""
        details: dict[str, Any] = {"cached_tokens": max(figures.cached, 0),
                                   "created_cache_tokens": figures.created if self.chat else None,
                                   "multimodal_tokens": None}
        usage: dict[str, Any] = {"prompt_tokens": figures.prompt, "total_tokens": figures.total,
                                 "completion_tokens": figures.completion}
        if stream:
            usage["prompt_tokens_details"] = {k: v for k, v in details.items() if v is not None}
        else:
            usage["prompt_tokens_details"] = details
            usage["completion_tokens_details"] = None
        return usage

    # ---- logprobs -----------------------------------------------------------------------------------------
    def _logprobs(self, seq: Seq, start: int, end: int) -> dict[str, Any] | None:
        top = self.req.sampling.logprobs
        if top is None or end <= start:
            return None
        plan = seq.plan
        if self.chat:
            content = []
            for i in range(start, end):
                token, lp, alts = plan.logprobs(i, max(top, 1))
                content.append({"token": token, "logprob": lp, "bytes": list(token.encode()),
                                "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                                 for t, v in alts[:top]]})
            return {"content": content}
        at, length = self._text_at.get(seq.index, (0, 0))   # from the last event's start: O(event), not O(stream)
        if at > start:
            at, length = 0, 0
        offset = length + len(plan.text(at, start))
        self._text_at[seq.index] = (start, offset)
        if self.req.echo_texts is not None:   # after the echoed prompt (vLLM's offsets count its tokens first)
            offset += len(self.req.echo_texts[seq.prompt_index])
        offsets, token_lps, tokens, tops = [], [], [], []
        for i in range(start, end):
            token, lp, alts = plan.logprobs(i, max(top, 1))
            offsets.append(offset)
            offset += len(token)
            token_lps.append(lp)
            tokens.append(token)
            tops.append(dict(alts))
        return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}

    # ---- streaming ----------------------------------------------------------------------------------------
    def head(self) -> list[bytes]:
        """Nothing: chat's role chunk goes with a choice's first output."""
        return []

    def opening(self, seq: Seq) -> list[bytes]:
        """Chat's role chunk of choice ``seq.index`` (vLLM sends it with the choice's first output)."""
        seq.started = True
        if not self.chat:
            return []
        return [self._event({**self._head, "choices": [{
            "index": seq.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}], "prompt_token_ids": self._stream_prompt_ids(seq, 0), "prompt_text": None})]

    def output(self, seq: Seq, start: int, end: int, finish: str | None, stop_reason: Any,
               usage: Usage | None, last: bool) -> list[bytes]:
        """The chunk(s) for tokens ``[start, end)`` of ``seq`` (preceded by :meth:`opening` the first time)."""
        events: list[bytes] = [] if seq.started else self.opening(seq)
        tool_mode = self.tool_mode
        public = finish if tool_mode is None else self.public_finish_reason(finish)
        usage_obj = self.usage(usage, stream=True) if usage is not None else None
        text = seq.plan.text(start, end) if self.req.echo_texts is None else self._echo_text(seq, start, end)
        logprobs = self._logprobs(seq, start, end) if self._lp else None
        if self.chat and tool_mode in ("required", "named"):
            return events + self._forced_tool_chunks(seq, start, end, text, public, stop_reason, usage_obj, last)
        if self.chat:
            if tool_mode == "auto":
                call: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
                if start == 0:
                    call = {"id": self.tool_id(seq.index), "type": "function", "index": 0,
                            "function": {"name": self.tool_name, "arguments": text}}
                delta: dict[str, Any] = {"tool_calls": [call]} if end > start or start == 0 else {}
            else:
                delta = {"content": text} if end > start else {}
            choice: dict[str, Any] = {"index": seq.index, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": public}
            if public is not None:
                choice["stop_reason"] = stop_reason
            choice["token_ids"] = self._stream_ids(seq, start, end)
        else:
            choice = {"index": seq.index, "text": text, "logprobs": logprobs, "finish_reason": public,
                      "stop_reason": stop_reason, "prompt_token_ids": self._stream_prompt_ids(seq, start),
                      "token_ids": self._stream_ids(seq, start, end)}
        chunk: dict[str, Any] = {**self._head, "choices": [choice]}
        if usage_obj is not None:
            chunk["usage"] = usage_obj
        if last:
            chunk["system_fingerprint"] = self.fingerprint
        events.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
        return events

    def _echo_text(self, seq: Seq, start: int, end: int) -> str:
        """The text of an echo completion's output tokens ``[start, end)``: the prompt first, once (``""`` with
        ``return_token_ids``, as vLLM's ``prompt_text``), then the generated text; echo-only: the prompt alone
        (vLLM: ``output_text = prompt_text``), nothing after it."""
        req = self.req
        echoed = start == 0 and req.echo_texts is not None and not req.return_token_ids
        prompt = req.echo_texts[seq.prompt_index] if echoed and req.echo_texts is not None else ""
        return prompt if req.echo_only else prompt + seq.plan.text(start, end)

    def _stream_ids(self, seq: Seq, start: int, end: int) -> list[int] | None:
        """A streamed choice's ``token_ids`` (output tokens ``[start, end)``) with ``return_token_ids``, else None
        (``vllm/entrypoints/openai/chat_completion/serving.py``, ``completion/serving.py``)."""
        return seq.plan.token_ids(start, end) if self.req.return_token_ids else None

    def _stream_prompt_ids(self, seq: Seq, start: int) -> list[int] | None:
        """The prompt's ids, sent once per choice (chat: top level of the role chunk; completions: the choice's
        first chunk) with ``return_token_ids``, else None."""
        return list(seq.ereq.prompt_token_ids) if self.req.return_token_ids and start == 0 else None

    def _forced_tool_chunks(self, seq: Seq, start: int, end: int, text: str, finish: str | None, stop_reason: Any,
                            usage: dict[str, Any] | None, last: bool) -> list[bytes]:
        events: list[bytes] = []
        lp = self._logprobs(seq, start, end)
        if start == 0 and end > 0:
            events.append(self._chunk({"index": seq.index, "delta": {"content": None, "tool_calls": [{
                "id": self.tool_id(seq.index), "type": "function", "index": 0,
                "function": {"name": self.tool_name}}]}, "logprobs": None, "finish_reason": None,
                "token_ids": None}, None, False))
        if text:
            events.append(self._chunk({"index": seq.index, "delta": {"content": None, "tool_calls": [{
                "index": 0, "function": {"arguments": text}}]}, "logprobs": lp, "finish_reason": None,
                "token_ids": None}, usage if finish is None else None, False))
        if finish is not None:
            events.append(self._chunk({"index": seq.index, "delta": {}, "logprobs": None, "finish_reason": finish,
                                       "stop_reason": stop_reason, "token_ids": None}, usage, last))
        return events

    def _chunk(self, choice: dict[str, Any], usage: dict[str, Any] | None, last: bool) -> bytes:
        chunk: dict[str, Any] = {**self._head, "choices": [choice]}
        if usage is not None:
            chunk["usage"] = usage
        if last:
            chunk["system_fingerprint"] = self.fingerprint
        return self._event(chunk)

    def tail(self, seqs: list[Seq], usage: Usage, kv_params: dict[str, Any] | None) -> list[bytes]:
        """The final ``choices: []`` usage chunk (with ``stream_options.include_usage``; it carries
        ``system_fingerprint``). vLLM never puts ``kv_transfer_params`` in a chat/completions stream."""
        if not self.include_usage:
            return []
        return [self._event({**self._head, "choices": [], "usage": self.usage(usage, stream=True),
                             "system_fingerprint": self.fingerprint})]

    def failure(self) -> list[bytes]:
        """vLLM's mid-stream error chunk for a failed KV load (``data: [DONE]`` follows)."""
        return [self.error_event("Internal server error", "InternalServerError", 500)]

    @staticmethod
    def failure_body() -> tuple[int, bytes]:
        """The 500 of a non-streaming request whose KV pull failed."""
        from pdproxy.sim.errors import error_body

        return 500, error_body("Internal server error", "InternalServerError", 500)

    @staticmethod
    def error_event(message: str, error_type: str, code: int) -> bytes:
        """A mid-stream error chunk ``data: {"error": {...}}`` (vLLM sends ``data: [DONE]`` after it). vLLM writes
        this one with ``json.dumps``, so it has spaces after ``:`` and ``,`` unlike the other events."""
        body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    @staticmethod
    def _event(obj: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    # ---- non-streaming --------------------------------------------------------------------------------------
    def body(self, seqs: list[Seq], usage: Usage, kv_params: dict[str, Any] | None) -> bytes:
        """The full JSON response, with vLLM's top-level ``kv_transfer_params`` (null unless pinned)."""
        choices = [self._json_choice(seq) for seq in seqs]
        usage_obj = self.usage(usage)
        if self.chat:
            body: dict[str, Any] = {
                "id": self.req.response_id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices, "service_tier": None,
                "system_fingerprint": self.fingerprint, "usage": usage_obj, "prompt_logprobs": None,
                "prompt_token_ids": None, "prompt_text": None, "kv_transfer_params": kv_params,
                "ec_transfer_params": None, "metrics": None}
        else:
            body = {
                "id": self.req.response_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "service_tier": None,
                "system_fingerprint": self.fingerprint, "usage": usage_obj, "kv_transfer_params": kv_params,
                "ec_transfer_params": None, "metrics": None}
        return orjson.dumps(body)

    def _json_choice(self, seq: Seq) -> dict[str, Any]:
        n = seq.sent
        finish = self.public_finish_reason(seq.finish)
        text = seq.plan.text(0, n) if self.req.echo_texts is None else self._echo_text(seq, 0, n)
        logprobs = self._logprobs(seq, 0, n) if self._lp else None
        stop_reason = seq.reason
        token_ids = seq.plan.token_ids(0, n) if self.req.return_token_ids else None
        if not self.chat:
            return {"index": seq.index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                    "stop_reason": stop_reason, "token_ids": token_ids, "prompt_logprobs": None,
                    "prompt_token_ids": None, "routed_experts": None}
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None, "annotations": None,
                                   "audio": None, "function_call": None}
        if self.tool_mode is not None:
            message["content"] = None if self.tool_mode == "auto" else ""
            message["tool_calls"] = [{"id": self.tool_id(seq.index), "type": "function",
                                      "function": {"name": self.tool_name, "arguments": text}}]
        message["reasoning"] = None
        return {"index": seq.index, "message": message, "logprobs": logprobs, "finish_reason": finish,
                "stop_reason": stop_reason, "token_ids": token_ids, "routed_experts": None}
