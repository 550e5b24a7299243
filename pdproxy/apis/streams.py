"""The decoder's answer on ``/v1/responses`` and ``/v1/messages``: how each stream opens and ends, its usage,
its errors — what the relay needs to relay it honestly (chat and completions are :mod:`pdproxy.apis.chat`'s).

Facts (vLLM 0.32, ``docs/apis-through-pd.md``; captures ``tests/real_vllm/captures/apis/``):

- **Responses** (``openai/responses/serving.py::responses_stream_generator``, ``api_router.py``): events are
  ``event: <type>\\ndata: <json>\\n\\n`` with a ``sequence_number`` from 0.  ``response.created`` and
  ``response.in_progress`` are yielded *before* the engine request runs, so on a decoder they say nothing about
  the KV pull: they are :attr:`~ResponsesStream.opening` events, held back until a later event arrives (a decoder
  that fails after them is then still replaced — the client saw nothing).  ``response.completed`` is the last
  event and carries the whole response, its usage (``usage.input_tokens_details.cached_tokens``,
  ``usage.output_tokens``) included; there is no ``data: [DONE]``.  vLLM has no working error event (its
  ``GenerationError`` event fails validation and the connection is cut), so a failure pdproxy reports mid-stream
  is the Responses API's own ``error`` event ``{"type": "error", "code", "message", "param",
  "sequence_number"}`` (``code``: a string, the HTTP status as the other routes' ``error.code``: ``"502"``), and
  the stream ends there.
- **Messages** (``anthropic/serving.py::message_stream_converter``): ``event: <name>\\ndata: <json>\\n\\n``;
  ``message_start`` (usage ``{input_tokens: <whole prompt>, output_tokens: 0}``) then ``content_block_*``, then
  ``message_delta`` with the final usage (``input_tokens`` net of ``cache_read_input_tokens`` and
  ``cache_creation_input_tokens``, ``_build_anthropic_usage``), then ``message_stop``; no ``data: [DONE]``.  A
  failed KV pull on a decoder gives ``message_start`` then ``event: error`` ``{"type": "error", "error":
  {"type", "message"}}``, so ``message_start`` is held back too.  pdproxy's own mid-stream errors take that shape.

Usage patching: the client sees the *prefiller's* cached-token figure (the decoder's is 0 on NIXL,
docs/apis-through-pd.md, or the whole prompt on some connectors).  Messages keeps the total: the tokens moved into
``cache_read_input_tokens`` come out of ``input_tokens``.

Each stream class is a transform of the relay's splice (:mod:`pdproxy.pd.relay`: ``trigger`` bytes — the splice calls
``feed`` only for blocks holding them — ``feed(block, prev) -> bytes``, ``recomputed`` always False), with the
stream's ``done_event`` (the bytes that end it: the splice ends the client's response on them; Responses' last
event has no fixed bytes, so its marker never matches and the end is its :meth:`ended` event, seen by ``feed``,
which marks the ``responder`` done), ``opening`` (events held back until a later one arrives), :meth:`ended`,
:meth:`first_error` (the first real event is an error: an HTTP error instead of a 200 stream) and
:meth:`error_event` (a failure after the first byte, in this API's shape, ending the stream).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol

import orjson

from pdproxy.apis.request import Api
from pdproxy.errors import ProxyError, UpstreamHTTPError, dumps_or_none, error_body, error_status, error_type_for
from pdproxy.http import sse
from pdproxy.timeline import RequestContext


class Ends(Protocol):
    """The client side of a response as a stream class sees it (:class:`pdproxy.pd.responder.Responder`)."""

    done_sent: bool


_SEQ_RE = re.compile(rb'"sequence_number"\s*:\s*(\d{1,15})(?!\d)')
_OUTPUT_TOKENS_RE = re.compile(rb'"output_tokens"\s*:\s*(\d{1,15})(?!\d)')
"""An engine's figures read in place: at most 15 digits (a float holds them exactly; a longer one is no count
and is not read: ``int()`` of thousands of digits raises, a metric of such a figure overflows)."""
ERROR_EVENT = b"event: error"


def holds_event(block: bytes, line: bytes) -> bool:
    """Whether ``block`` (whole SSE events) holds an event whose field line starts with ``line`` (e.g. ``event:
    message_stop``): at the block's start or after a newline — never inside a ``data:`` line, whose JSON holds no raw
    newline, so a model's text that spells an event's name does not count."""
    return block.startswith(line) or block.find(b"\n" + line) >= 0


def event_name(event: bytes) -> bytes:
    """The ``event:`` field of one SSE event (``b""`` when it has none)."""
    if event.startswith(b"event:"):
        end = event.find(b"\n")
        name = event[6:end if end >= 0 else len(event)]
        if name.find(b"\r") < 0:
            return name.strip()
    for line in sse.normalize(event).split(b"\n"):
        if line.startswith(b"event:"):
            return line[6:].strip()
    return b""


def named_event(name: bytes, payload: dict[str, Any]) -> bytes:
    """One SSE event with an ``event:`` line, framed as vLLM frames it."""
    return b"event: " + name + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def output_tokens_in(data: bytes) -> int | None:
    """The last ``output_tokens`` figure in a JSON document or block of events (Responses and Messages usage)."""
    found = _OUTPUT_TOKENS_RE.findall(data)
    return int(found[-1]) if found else None


def anthropic_error(err: ProxyError) -> dict[str, Any]:
    """An error pdproxy raises on ``/v1/messages``, in vLLM's Anthropic envelope
    (``anthropic/api_router.py::translate_error_response``: ``{"type": "error", "error": {"type": <vLLM's error
    type>, "message"}}``)."""
    return anthropic_envelope(err.error_type, err.client_message())


def anthropic_envelope(kind: str, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type": kind, "message": message}}``: the one shape of an error on Messages."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_json(api: Api, err: ProxyError) -> bytes:
    """The JSON body of an error answered on ``api`` before the response started: the Anthropic envelope on
    Messages, vLLM's OpenAI envelope elsewhere.  An engine's own error body passes through, except that on Messages
    one in the OpenAI envelope (vLLM answers its request validation errors so on every route,
    ``vllm/entrypoints/serve/exception_handling/handlers/validation.py``) is put in the Anthropic envelope with its
    ``type`` and ``message``, as vLLM's own Messages route does for the errors it raises
    (``vllm/entrypoints/anthropic/api_router.py::translate_error_response``)."""
    if api is not Api.MESSAGES:
        return err.body_bytes()
    if not isinstance(err, UpstreamHTTPError):
        return orjson.dumps(anthropic_error(err))
    body = err.body_bytes()
    try:
        inner = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return body
    if not isinstance(inner, dict) or not isinstance(inner.get("message"), str):
        return body
    kind = inner.get("type")
    return orjson.dumps(anthropic_envelope(kind if isinstance(kind, str) else error_type_for(err.status_code),
                                           inner["message"]))


def refusal_json(api: Api, status: int, message: str) -> bytes:
    """The JSON body of a refusal pdproxy's HTTP server answers itself (``status`` 400/408/413/431/500, before
    any handler read the request) on ``api``: :func:`anthropic_envelope` on Messages, vLLM's OpenAI envelope
    elsewhere, with ``message`` as given and the ``type`` of ``status``."""
    if api is Api.MESSAGES:
        return orjson.dumps(anthropic_envelope(error_type_for(status), message))
    return orjson.dumps(error_body(status, message))


def _first_error(block: bytes) -> UpstreamHTTPError | None:
    """An ``event: error`` among the first real events, as an HTTP error with the engine's data as its body."""
    if block.find(ERROR_EVENT) < 0:
        return None
    for event in sse.split_events(block):
        if event_name(event) == b"error":
            data = sse.event_data(event) or b""
            code: object = None
            try:
                obj = orjson.loads(data)
                err = obj.get("error") if isinstance(obj, dict) else None
                code = (err or {}).get("code") if isinstance(err, dict) else obj.get("code")
            except (orjson.JSONDecodeError, AttributeError):
                pass
            return UpstreamHTTPError(error_status(code), data)
    return None


def _patch_events(block: bytes, names: tuple[bytes, ...], patch: Any) -> bytes:
    """``block`` with ``patch(obj)`` applied to the data of its events named one of ``names`` (re-framed when
    ``patch`` returns True); other events stay byte for byte."""
    out: list[bytes] = []
    for event in sse.split_events(block):
        if event_name(event) in names:
            data = sse.event_data(event)
            try:
                obj = orjson.loads(data) if data is not None else None
            except orjson.JSONDecodeError:
                obj = None
            if isinstance(obj, dict) and patch(obj):
                written = dumps_or_none(obj)    # None: nested past what orjson writes, the event relayed as it
                if written is not None:         # came, unpatched (as patch_json does)
                    event = b"event: " + event_name(event) + b"\ndata: " + written + b"\n\n"
        out.append(event)
    return b"".join(out)


def patch_responses_usage(usage: Any, cached_tokens: int | None) -> bool:
    """Set ``input_tokens_details.cached_tokens`` of a Responses usage object; True when changed."""
    if not isinstance(usage, dict) or cached_tokens is None:
        return False
    details = usage.get("input_tokens_details")
    if not isinstance(details, dict):
        details = usage["input_tokens_details"] = {}
    details["cached_tokens"] = cached_tokens
    return True


def patch_messages_usage(usage: Any, cached_tokens: int | None) -> bool:
    """Set ``cache_read_input_tokens`` of an Anthropic usage object (a final one: with ``output_tokens``) and move
    the difference out of ``input_tokens`` so the prompt's total stays; True when changed."""
    if not isinstance(usage, dict) or cached_tokens is None:
        return False
    before = usage.get("cache_read_input_tokens")
    before = before if isinstance(before, int) else 0
    usage["cache_read_input_tokens"] = cached_tokens
    usage.setdefault("cache_creation_input_tokens", 0)
    if isinstance(usage.get("input_tokens"), int):
        usage["input_tokens"] = max(0, usage["input_tokens"] + before - cached_tokens)
    return True


def patch_json(api: Api, data: bytes, cached_tokens: int | None) -> bytes:
    """A non-streamed Responses or Messages answer with the prefiller's cached tokens in its usage."""
    if cached_tokens is None or data.find(b'"usage"') < 0:
        return data
    try:
        obj = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    if not isinstance(obj, dict):
        return data
    patch = patch_messages_usage if api is Api.MESSAGES else patch_responses_usage
    if not patch(obj.get("usage"), cached_tokens):
        return data
    return dumps_or_none(obj) or data       # nested past what orjson writes: relayed as it came


class _EventStream:
    """What the Responses and Messages streams share: the end of the stream (``terminal`` markers) and the usage
    event's patch.  Subclasses set ``ctx``, ``cached`` (the prefiller's cached tokens, or None), ``responder``."""

    __slots__ = ()
    terminal: tuple[bytes, ...]
    ctx: RequestContext
    cached: int | None
    responder: Ends | None

    def ended(self, block: bytes) -> bool:
        """True when ``block`` holds an event that ends the stream (one of ``terminal``, :func:`holds_event`)."""
        return any(holds_event(block, t) for t in self.terminal)

    def ending(self, block: bytes, prev: bytes) -> bytes:
        """The stream's last block, as is (:class:`pdproxy.apis.transform.Transform`)."""
        return block

    def _note_end(self, block: bytes) -> None:
        """Mark the response done at the stream's last event; an engine error event is the request's outcome."""
        if self.responder is not None and self.ended(block):
            self.responder.done_sent = True
            if holds_event(block, ERROR_EVENT):
                self.ctx.outcome = "upstream_error"

    def _usage(self, block: bytes, events: tuple[bytes, ...],
               patch: Callable[[dict[str, Any], int], Any]) -> bytes:
        """``block`` (holding one of the usage ``events``): its output tokens noted on ``ctx``, its usage patched
        with the prefiller's cached tokens by ``patch(event object, cached)``."""
        tokens = output_tokens_in(block)
        if tokens is not None:
            self.ctx.completion_tokens = tokens
        cached = self.cached
        if cached is None:
            return block
        return _patch_events(block, events, lambda obj: patch(obj, cached))


class ResponsesStream(_EventStream):
    """A Responses SSE stream (module docstring).  ``ctx`` gets ``completion_tokens``; ``cached_tokens``: the
    prefiller's figure for the usage in ``response.completed`` (None: leave it)."""

    __slots__ = ("cached", "ctx", "responder", "sequence")
    opening = (b"response.created", b"response.in_progress")
    terminal = (b"event: response.completed", b"event: response.incomplete", b"event: response.failed",
                ERROR_EVENT)
    done_event = b"event: response.completed"   # a marker only: a block never ends with it (see module docstring)
    end_name = "response.completed"
    trigger = b""                       # every block: the last sequence number is kept for an error event
    recomputed = False

    def __init__(self, ctx: RequestContext, cached_tokens: int | None) -> None:
        self.ctx = ctx
        self.cached = cached_tokens
        self.sequence = -1
        self.responder: Ends | None = None

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        """``block`` with ``response.completed``'s usage patched; the sequence number and output tokens noted, the
        response marked done at the stream's last event."""
        at = block.rfind(b'"sequence_number"')
        if at >= 0:
            found = _SEQ_RE.match(block, at)
            if found:
                self.sequence = int(found.group(1))
        self._note_end(block)
        if block.find(b"event: response.completed") < 0 and block.find(b"event: response.incomplete") < 0:
            return block
        return self._usage(block, (b"response.completed", b"response.incomplete"),
                           lambda obj, cached: patch_responses_usage((obj.get("response") or {}).get("usage"), cached))

    @staticmethod
    def first_error(block: bytes) -> UpstreamHTTPError | None:
        """The first real events are an error event: an HTTP error (status from its ``code`` when it has one)."""
        return _first_error(block)

    def error_event(self, err: ProxyError) -> bytes:
        """The Responses API's ``error`` event for a failure after the first byte (it ends the stream).  ``code`` is
        a string there (OpenAI's ``ResponseErrorEvent``): the error's own string code, else its HTTP status as every
        other route's ``error.code`` carries it (``"502"``)."""
        self.sequence += 1
        code = err.code if isinstance(err.code, str) else str(err.status_code)
        return named_event(b"error", {"type": "error", "code": code, "message": err.client_message(),
                                      "param": err.param, "sequence_number": self.sequence})


class MessagesStream(_EventStream):
    """An Anthropic Messages SSE stream (module docstring).  ``ctx`` gets ``completion_tokens``;
    ``cached_tokens``: the prefiller's figure for the final usage in ``message_delta`` (None: leave it)."""

    __slots__ = ("cached", "ctx", "responder")
    opening = (b"message_start",)
    terminal = (b"event: message_stop", ERROR_EVENT)
    done_event = b'event: message_stop\ndata: {"type":"message_stop"}\n\n'   # vLLM's last event, byte for byte
    end_name = "message_stop"
    trigger = b"event: "                # every block: the usage, the end and an engine's error event
    recomputed = False

    def __init__(self, ctx: RequestContext, cached_tokens: int | None) -> None:
        self.ctx = ctx
        self.cached = cached_tokens
        self.responder: Ends | None = None

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        """``block`` with ``message_delta``'s usage patched; output tokens noted; the response marked done at
        ``message_stop`` or at the engine's own error event (after which vLLM sends nothing)."""
        self._note_end(block)
        if block.find(b"event: message_delta") < 0:
            return block
        return self._usage(block, (b"message_delta",), lambda obj, cached: patch_messages_usage(obj.get("usage"), cached))

    @staticmethod
    def first_error(block: bytes) -> UpstreamHTTPError | None:
        """The first real event is ``event: error`` (a failed KV pull): an HTTP 500 with the engine's Anthropic
        error body."""
        return _first_error(block)

    def error_event(self, err: ProxyError) -> bytes:
        """An Anthropic ``error`` event for a failure after the first byte (the stream ends there)."""
        return named_event(b"error", anthropic_error(err))


ApiStream = ResponsesStream | MessagesStream


def stream_for(api: Api, ctx: RequestContext, cached_tokens: int | None) -> ApiStream | None:
    """The stream handling of ``api`` (None for chat and completions: the relay's own)."""
    if api is Api.RESPONSES:
        return ResponsesStream(ctx, cached_tokens)
    if api is Api.MESSAGES:
        return MessagesStream(ctx, cached_tokens)
    return None


def only_opening(block: bytes, opening: tuple[bytes, ...]) -> bool:
    """True when every event of ``block`` is one of the ``opening`` events (named by their ``event:`` field)."""
    return all(event_name(e) in opening for e in sse.split_events(block) if e.strip())
