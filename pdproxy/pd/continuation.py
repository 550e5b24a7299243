"""Stream continuation: a chat / text completions stream whose decoder is lost after the first byte continues,
token-exact, on another P→D pair; the client sees one stream (docs/stream-continuation.md).

**Record (hot path).**  An eligible stream's decode leg asks the decoder for ``return_token_ids`` (vLLM 0.32:
``prompt_token_ids`` in the first chunk — top level for chat, in the choice for completions — and ``token_ids``
in every choice chunk; ``vllm/entrypoints/openai/chat_completion/serving.py``, ``completion/serving.py``).
Unless the client asked for the ids itself, :class:`RecordIds` rewrites every ``"token_ids":[…]`` /
``"prompt_token_ids":[…]`` array to ``null`` — the client gets vLLM's plain shape byte for byte (vLLM sets the
field to None, and serializes with ``exclude_unset``, so a plain stream carries ``"token_ids":null``) — and keeps
what a continuation needs: the first block whole (head, prompt ids), then, for the blocks of token chunks, only
their ids, appended to one ``bytearray`` (about 6 bytes a token instead of the ~250-byte event), and the last
``_TAIL`` reads in a ring (a reference each, no copy; of a read over 4 KiB only its last events:
:func:`pdproxy.pd.record.py_last_events`).  One call into compiled code per block does both
(:mod:`pdproxy.pd.record`, ``pdproxy/pd/_record.c``), and nothing else runs for a block whose last event is a token
chunk (see :class:`RecordIds`: vLLM's usage chunk, in-band error event and ``[DONE]`` come only after the last
token chunk, so such a block holds none of them and their searches are skipped).  Any other block takes the general
path: a search for vLLM's in-band error event (``data: {"error": …}``, e.g. a failed KV load), which ends the
client's part of this leg, the block kept whole, the ids rewritten, the stream's own transform.

**On loss.**  The relay raises :class:`StreamLost` instead of sending its error event (a reset, an end of body
without ``data: [DONE]``, the relay's silence limit, vLLM's in-band error event).  Only then is the transcript
parsed (:meth:`Resume.read_transcript`): the prompt's ids, every delivered id, the first chunk's
``id``/``created``/``model``, whether a tool call or reasoning was streamed, and (from the ring) the trailing ids
whose token events carried no text — vLLM held back the text of a token that ends inside a UTF-8 character, so
they were not delivered as text — and, when the last event with text carried several ids, an engine's
``/detokenize`` says whether its last ids were held back too (:func:`held_in_text`).  :meth:`Resume.next_leg`
builds the continuation — ``/v1/completions`` with the token-id ``prompt`` = prompt ids + delivered ids less that
held-back run (the new decoder generates it again and sends the character whole), ``max_tokens`` and
``min_tokens`` lowered by the ids kept, the client's sampling fields — which the director runs through the usual
prefill and decode legs, the lost decoder excluded (and its breaker told).

**Re-frame.**  :class:`Reframe` turns the continuation's completions chunks into the client's API shape with the
first chunk's ``id``/``created``/``model``: no second role chunk (chat), ``prompt_token_ids`` dropped, the usage
chunk (only if the client asked for one) with the original ``prompt_tokens`` and every delivered token as
``completion_tokens``.  The re-prefill of the delivered tokens is never in usage.

A client that leaves cancels the director's task: a stream is continued only while its client is connected.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from pdproxy.apis import fields, recompute
from pdproxy.apis import streams as api_streams
from pdproxy.apis.request import Api, ProxyRequest, parse_request
from pdproxy.apis.transform import Transform
from pdproxy.endpoints import Endpoint
from pdproxy.errors import ProxyError
from pdproxy.http import sse
from pdproxy.pd.record import RecordBase, last_events, null_ids
from pdproxy.pd.responder import Responder
from pdproxy.timeline import RequestContext

log = logging.getLogger("pdproxy.continuation")

_ERROR_EVENT = b'data: {"error"'
_CHAR_TOKENS = 3   # tokens that can end inside one character: a UTF-8 character is at most 4 bytes
_CUT_WINDOW = 16   # trailing ids detokenized to see the cut (a character spans at most 4 of them)
_TAIL = 8     # reads kept for the held-back tail (RecordIds.tail; ≤ 4 KiB each): a run of empty-text events is short
_UNSAFE = (b'"reasoning',)   # a chat delta a continuation would mis-parse (docs/stream-continuation.md; a stream
# that may carry a tool call is not continued at all: _tools_callable)
# request fields that make a continuation unfaithful or unparseable (docs/stream-continuation.md lists why)
_INELIGIBLE = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "guided_decoding_backend", "stop", "echo", "logprobs", "top_logprobs",
               "prompt_logprobs", "best_of", "use_beam_search", "suffix", "prompt_embeds")
_INELIGIBLE_RESPONSES = ("previous_response_id", "conversation", "prompt", "background", "top_logprobs",
                         "include", "reasoning")
_INELIGIBLE_MESSAGES = ("stop_sequences", "thinking", "output_format")
_INELIGIBLE_SET = frozenset((*_INELIGIBLE, "tools"))   # a body with none of these (the common case): one set test
# sampling fields copied onto the continuation's completions body
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens",
             "spaces_between_special_tokens", "logit_bias", "cache_salt", "priority", "user", "bad_words",
             "allowed_token_ids")
# not truncate_prompt_tokens: the prompt ids a decoder sends are the prompt it ran, already truncated; truncated
# again with the delivered ids after them, a continuation would keep the last k of those and lose the prompt


class LossCause(enum.StrEnum):
    """How a continuable stream's decoder was lost (the ``cause`` label of ``pdproxy_continuations_total``)."""

    RESET = "reset"               # the connection failed mid-stream (reset, decoder process killed)
    NO_END = "no_end"             # end of body without the API's end marker
    ERROR_EVENT = "error_event"   # vLLM's in-band error event (e.g. a failed KV load)
    STALL = "stall"               # silence far above the leg's own inter-token time
    DRAIN = "drain"               # an operator's drain with ``migrate``


_MAX_TOKEN_ID = (1 << 63) - 1


def token_ids(values: list[Any]) -> list[int] | None:
    """``values`` when each is a token id as vLLM writes one (an integer, no boolean, 0 ≤ id < 2**63), else None:
    a decoder's ``"a"``, null, 1.5 or a 31-digit id is no prompt a continuation can be built of (it raised out of
    the loss's handling: the client's error event said "internal error in pdproxy"; 1.5 was cut to 1)."""
    return values if all(type(v) is int and 0 <= v <= _MAX_TOKEN_ID for v in values) else None


def _index(value: Any) -> int:
    """An ``output_index`` / ``content_index`` / ``index`` / ``sequence_number`` of a Responses / Messages event
    (absent or null: 0).
    Raises ``ValueError`` for one vLLM never sends (a string, a float, a negative or 64-bit-overflowing number: the
    continuation's events could not be written with it), which :meth:`Resume.read_transcript` reads as
    ``unreadable``."""
    if value is None:
        return 0
    if type(value) is int and 0 <= value <= _MAX_TOKEN_ID:
        return value
    raise ValueError(f"not an index: {value!r}")


class Refusal(enum.StrEnum):
    """Why a started stream whose decoder was lost was not continued (the ``reason`` label of
    ``pdproxy_continuations_refused_total``); the client gets the typed error event."""

    INELIGIBLE = "ineligible"           # the request's shape (n > 1, structured output, stop strings …: eligible())
    IN_FLIGHT = "tool_or_reasoning"     # a tool call or reasoning block was streamed
    CLOSING = "closing"                 # lost while closing a Responses / Messages text
    NO_TOKEN_IDS = "no_token_ids"       # the decoder sent no prompt token ids (or ids that are none)
    UNREADABLE = "unreadable"           # an event of a shape vLLM never sends: what was delivered is not known
    MAX = "max_continuations"           # ``stream_continuation_max`` spent
    TIMEOUT = "timeout"                 # no continuation event within ``stream_continuation_timeout_s``
    FAILED = "failed"                   # the continuation's own prefill / decode legs failed


class ContinuationObserver(Protocol):
    """Where continuations are counted (``pdproxy.ops.metrics.ContinuationMetrics``; ``api``: the client's API
    label)."""

    def continued(self, cause: LossCause, api: str) -> None:
        """A lost stream went on: its continuation's first event reached the client, or nothing was left to
        generate and the stream was ended whole (one per loss)."""

    def refused(self, reason: Refusal, api: str) -> None:
        """A started stream lost its decoder and was not continued."""

    def reprefilled(self, api: str, tokens: int) -> None:
        """A continuation leg's prompt (the original prompt + the delivered tokens), prefilled again; never in
        the client's usage."""

    def gap(self, api: str, seconds: float) -> None:
        """The client-visible gap of one continuation: the last write before the loss to the continuation's
        first event (or to the stream's end when nothing was left to generate)."""


class NoObserver:
    """Counts nothing (a director without metrics)."""

    def continued(self, cause: LossCause, api: str) -> None:
        """Nothing."""

    def refused(self, reason: Refusal, api: str) -> None:
        """Nothing."""

    def reprefilled(self, api: str, tokens: int) -> None:
        """Nothing."""

    def gap(self, api: str, seconds: float) -> None:
        """Nothing."""


class StreamLost(Exception):
    """The decoder of a started, continuable stream was lost (internal: raised by the relay instead of its error
    event; the director continues the stream or sends ``error``, the typed error the client would have had).
    ``planned``: an operator's drain moved the stream (the decoder's breaker is not told); ``cause``: how it was
    lost; ``last_write``: monotonic time of the last write to the client before the loss (None: unknown)."""

    def __init__(self, error: ProxyError, planned: bool = False, cause: LossCause = LossCause.RESET,
                 last_write: float | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.planned = planned
        self.cause = LossCause.DRAIN if planned else cause
        self.last_write = last_write


class Movable(Protocol):
    """A live stream's decode leg as a drain and the stall sweep see it (:class:`pdproxy.pd.relay.StreamRelay`)."""

    @property
    def movable(self) -> bool:
        """Whether :meth:`move` would move it now: past its first event and not ended."""

    def move(self) -> bool:
        """End the leg as lost (planned) so the stream continues on another decoder; False when not movable."""

    def check_lost(self, now: float) -> None:
        """End the leg as lost if its decoder has been silent too long by monotonic time ``now``."""


class LiveStreams:
    """The continuable streams each decoder is relaying now, by endpoint name: what a drain with ``migrate``
    moves (``POST /admin/endpoints/drain``, pdproxy/app/admin.py), and what the stall sweep checks: while any leg
    is tracked, one timer every ``check_interval_s`` seconds (``stream_continuation_stall_min_s / 4``) asks each
    whether its decoder is silent too long (:meth:`sweep`) — a lost decoder is seen at most that much after its
    limit, at a cost per stream and sweep of one method call, instead of a timer per stream re-armed every few
    seconds (≈ 2 % of the CPU of 1,000 paced streams, loadtest/RESULTS.md).  Per process (``--workers N``: each
    worker its own streams); ``observer``: where this process's continuations are counted."""

    def __init__(self, check_interval_s: float = 0.5) -> None:
        self._by_decoder: dict[str, set[Movable]] = {}
        self.check_interval_s = check_interval_s
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_loop: asyncio.AbstractEventLoop | None = None
        self.observer: ContinuationObserver = NoObserver()
        """Where continuations are counted (the app sets its metrics, pdproxy/app/application.py)."""

    @contextmanager
    def track(self, decoder: str, leg: Movable) -> Iterator[None]:
        """Register ``leg`` (a stream's decode leg on ``decoder``) while the block runs; the sweep runs on the
        running event loop while any leg is registered."""
        legs = self._by_decoder.setdefault(decoder, set())
        legs.add(leg)
        loop = asyncio.get_running_loop()
        if self._sweep is None or self._sweep_loop is not loop:     # a new loop (tests): the old timer is gone
            self._sweep_loop = loop
            self._sweep = loop.call_later(self.check_interval_s, self.sweep)
        try:
            yield
        finally:
            legs.discard(leg)
            if not legs:
                self._by_decoder.pop(decoder, None)

    @property
    def sweeping(self) -> bool:
        """Whether the next sweep is armed (while a leg is tracked, and once more after the last one left)."""
        return self._sweep is not None

    def sweep(self) -> None:
        """Ask every tracked leg whether its decoder is lost (:meth:`Movable.check_lost`), then again in
        ``check_interval_s`` seconds while any leg is tracked."""
        self._sweep = None
        now = time.monotonic()
        for legs in list(self._by_decoder.values()):
            for leg in list(legs):
                try:
                    leg.check_lost(now)
                except Exception:     # one leg's failure must not stop the others' checks, now or later
                    log.exception("stall check of a continuable stream failed")
        if self._by_decoder and self._sweep_loop is not None:
            self._sweep = self._sweep_loop.call_later(self.check_interval_s, self.sweep)

    def migrate(self, decoder: str) -> int:
        """Move every live stream of ``decoder`` to other decoders; returns how many move (a stream still waiting
        for its first event there finishes there)."""
        return sum(1 for leg in list(self._by_decoder.get(decoder, ())) if leg.move())

    def count(self, decoder: str, *, movable: bool = False) -> int:
        """Live continuable streams on ``decoder`` (``movable``: only those a drain would move now)."""
        legs = self._by_decoder.get(decoder, ())
        return sum(1 for leg in legs if leg.movable) if movable else len(legs)


def eligible(req: ProxyRequest, enabled: bool) -> bool:
    """Whether a stream of ``req`` is continued should its decoder be lost: chat or text completions, streamed,
    one sequence, no structured output, tools the model may call, stop strings, echo, logprobs or beam search,
    and ``continuous_usage`` off; ``enabled`` is the ``stream_continuation`` setting."""
    if not enabled or not req.stream or req.sequences != 1:
        return False
    if req.decoder_prefills or req.engine_judges or req.continuous_usage:
        return False
    if req.api is not Api.RESPONSES and req.api is not Api.MESSAGES and _INELIGIBLE_SET.isdisjoint(req.body):
        return True                             # chat / completions with none of the fields: one set test
    return ineligible_reason(req) is None


def ineligible_reason(req: ProxyRequest) -> str | None:
    """Why a stream of ``req`` is not :func:`eligible` with ``stream_continuation`` on, in a few words for the
    client's error event (``"2 sequences"``, ``"logprobs"``, ``"text.format"`` …), or None when it is eligible.
    Off the hot path: called once a stream is lost (``pdproxy/pd/relay.py``, ``pdproxy/pd/decode.py``)."""
    if not req.stream:
        return "not streamed"
    if req.sequences != 1:
        return f"{req.sequences} sequences"
    if req.decoder_prefills:
        return "prefilled by its decoder"
    if req.engine_judges:
        return "the engine judges its fields"
    if req.continuous_usage:
        return "continuous_usage_stats"
    body = req.body
    if _tools_callable(body):
        return "tools"
    if req.api is Api.RESPONSES:
        fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
        found = next((k for k in _INELIGIBLE_RESPONSES if _present(body.get(k))), None)
        if found is None and not (fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text")):
            found = "text.format"
        return found
    if req.api is Api.MESSAGES:
        config = body.get("output_config")
        if isinstance(config, dict) and _present(config.get("format")):
            return "output_config.format"    # vLLM 0.32's structured output on Messages: response_format
        return next((k for k in _INELIGIBLE_MESSAGES if _present(body.get(k))), None)
    return next((k for k in _INELIGIBLE if _present(body.get(k))), None)


def _tools_callable(body: dict[str, Any]) -> bool:
    """Whether the model may call a tool: ``tools`` set and ``tool_choice`` not "none" (``{"type": "none"}`` on
    Messages).  Such a stream is not continued: chat and completions go on as text completions, which parse no tool
    call (its markup would reach the client as text), and a required or named tool constrains the output as
    structured output does, which no continuation carries (docs/stream-continuation.md)."""
    if not _present(body.get("tools")):
        return False
    choice = body.get("tool_choice")
    return choice != "none" and not (isinstance(choice, dict) and choice.get("type") == "none")


def _present(value: Any) -> bool:
    """Whether a request field is set: not absent, null, false, an empty list or an empty string (0 is set)."""
    return value is not None and value is not False and value != [] and value != ""


def ask_token_ids(body: bytes) -> bytes:
    """Decode-leg body bytes with ``return_token_ids: true`` appended as the object's last member (vLLM keeps the
    last duplicate key)."""
    end = body.rstrip().rfind(b"}")
    return body[:end].rstrip() + b',"return_token_ids":true}'


@dataclass
class EventState:
    """What a Responses / Messages client has been sent (read from its events on loss, then kept by
    :class:`Reframe`): the opening object (``response`` of ``response.created`` / ``message`` of
    ``message_start``), the text item's ids and indices, the last ``sequence_number``, the prompt's
    ``input_tokens`` (Messages), and ``closing``: an event that closes the text was already sent."""

    opening: dict[str, Any] = field(default_factory=dict)
    item_id: str = ""
    output_index: int = 0
    content_index: int = 0
    sequence: int = -1
    input_tokens: int | None = None
    closing: bool = False


@dataclass
class Resume:
    """The state of one continuable client stream across its legs.

    ``req``: the client's request; ``keep_ids``: the client asked for ``return_token_ids`` (ids not stripped);
    ``blocks``: the first leg's record (:class:`RecordIds`), unparsed: relayed blocks kept whole (they start with
    an SSE field name; ``bytes``) and, for the blocks of plain token chunks between them, only their ids, in one
    ``bytearray`` (``b"5,6,7"``; :class:`pdproxy.pd.record.PyRecordBase`);
    ``tail``: the last few reads (:class:`RecordIds`; of a read over 4 KiB its last events only:
    :func:`pdproxy.pd.record.py_last_events`; read on loss for a finish reason and ``held``);
    ``prompt_ids`` / ``generated``: token ids read from them on loss (and from every continuation chunk);
    ``held``: how many of the last ``generated`` ids came in token events of empty text — vLLM's detokenizer holds
    back the text of a token that ends inside a UTF-8 character (or decodes to nothing, e.g. a skipped special
    token) and sends it with the token that completes it, so these ids were not delivered as text and the
    continuation regenerates them (:meth:`next_leg`); ``texted``: how many ids the last token event with text
    carried (vLLM sends what accumulated since its last write, so its last ids may be held back too:
    :func:`held_in_text`); ``replay``: regenerated ids the client already got
    (``return_token_ids``), not shown again; ``delivered``: tokens sent before the ids are known (a
    Responses / Messages first leg: one per text delta event); ``text``: the text sent (Responses / Messages);
    ``head``: the first chunk's ``id``/``created``/``model``; ``events``: Responses / Messages state;
    ``lost``: decoders lost so far; ``legs``: decode legs run (1 = the original); ``finish``: a finish reason
    was delivered (``finish_reason``: a continuation's); ``unsafe``: a tool call or reasoning was streamed (a continuation would mis-parse it);
    ``bad_ids``: the decoder's ``token_ids`` / ``prompt_token_ids`` held something no token id is (no prompt of ids can be built);
    ``unreadable``: an event of the first leg had a shape vLLM never sends (``"item": "x"``): what was delivered is not known;
    ``cached_tokens``: the original prefill's prefix-cache hits for usage; ``observer``: where continuations are
    counted; ``last_write``: monotonic time of the client's last write before the current loss (the gap's start);
    ``waiting``: the time budget of the continuation in flight (``stream_continuation_timeout_s``), met at its
    first event; ``deadline``: the event loop's time by which the current loss's continuation must send its first
    event (its detection + ``stream_continuation_timeout_s``); ``usage_sent``: the first leg's usage chunk reached
    the client (the decoder was lost between it and ``[DONE]``: the end then adds only ``[DONE]``); ``cause``: the
    current loss's, counted as continued (``pdproxy_continuations_total``) once the stream goes on
    (:meth:`resumed`)."""

    req: ProxyRequest
    keep_ids: bool
    blocks: list[bytes | bytearray] = field(default_factory=list)
    tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=_TAIL))
    held: int = 0
    texted: int = 0
    replay: int = 0
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    delivered: int = 0
    text: list[str] = field(default_factory=list)
    head: dict[str, Any] = field(default_factory=dict)
    events: EventState = field(default_factory=EventState)
    lost: list[Endpoint] = field(default_factory=list)
    legs: int = 1
    finish: bool = False
    finish_reason: str | None = None
    unsafe: bool = False
    bad_ids: bool = False
    unreadable: bool = False
    cached_tokens: int | None = None
    observer: ContinuationObserver = field(default_factory=NoObserver)
    last_write: float | None = None
    waiting: asyncio.Timeout | None = None
    deadline: float | None = None
    usage_sent: bool = False
    cause: LossCause | None = None

    @classmethod
    def of(cls, req: ProxyRequest, enabled: bool) -> Resume | None:
        """The state for ``req`` when it is :func:`eligible`, else None."""
        if not eligible(req, enabled):
            return None
        return cls(req, keep_ids=req.body.get("return_token_ids") is True)

    @property
    def openai(self) -> bool:
        """The client speaks chat or text completions (token ids in its own stream)."""
        return self.req.api in (Api.CHAT, Api.COMPLETIONS)

    @property
    def tokens(self) -> int:
        """Completion tokens delivered so far."""
        return self.delivered + len(self.generated)

    # --- the rare path: read what was delivered ---------------------------------------------------------------
    def read_transcript(self) -> None:
        """Parse the first leg's record (``blocks``, in order: ids of token-chunk blocks and whole blocks) into the
        state above; ``tail`` (the last reads' last events; their ids are in the record) adds whether a finish reason was
        delivered and ``held``: the trailing ids whose token events carried no text (a run longer than the tail's
        reads is counted from the tail's start)."""
        blocks, self.blocks = self.blocks, []
        for block in blocks:
            if isinstance(block, bytearray):      # token blocks' ids (RecordIds): "5,6,7"
                try:
                    ids = token_ids([int(i) for i in block.split(b",") if i.strip()])
                except ValueError:                # "a", null, 1.5: the decoder's, as it wrote them
                    ids = None
                if ids is None:
                    self.bad_ids = True
                else:
                    self.generated.extend(ids)
                continue
            for event in sse.split_events(block):
                obj = recompute.parse_event(event)
                if obj is None:
                    continue
                try:
                    if self.openai:
                        self.observe(obj)
                    else:
                        self.observe_event(api_streams.event_name(event).decode(), obj)
                except (AttributeError, TypeError, ValueError):   # a shape vLLM never sends ("item": "x")
                    self.unreadable = True
        tail = b"".join(self.tail)                # empty on a later loss: Reframe kept ``held`` then
        self.tail.clear()
        if tail:
            self.held = self.texted = 0
        for event in sse.split_events(tail):
            obj = recompute.parse_event(event)
            choices = obj.get("choices") if obj is not None else None
            for c in choices if isinstance(choices, list) else ():
                if not isinstance(c, dict):
                    continue
                if c.get("finish_reason") is not None:
                    self.finish = True
                ids = c.get("token_ids")
                if c.get("finish_reason") is not None or _has_text(c):
                    self.held = 0
                    self.texted = len(ids) if isinstance(ids, list) else 0
                elif isinstance(ids, list):
                    self.held += len(ids)

    def observe(self, obj: dict[str, Any]) -> None:
        """Account one chat / completions chunk (the first leg, or a continuation leg)."""
        if not self.head and "id" in obj:
            self.head = {k: obj[k] for k in ("id", "created", "model") if k in obj}
        ids = obj.get("prompt_token_ids")
        choices = obj.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if choice is not None and ids is None:
            ids = choice.get("prompt_token_ids")
        if self.prompt_ids is None and isinstance(ids, list):
            self.prompt_ids = token_ids(ids)
            self.bad_ids = self.bad_ids or self.prompt_ids is None
        if choice is None:
            if isinstance(obj.get("usage"), dict):
                self.usage_sent = True      # the usage chunk (``choices: []``): vLLM's last before [DONE]
            return
        out = choice.get("token_ids")
        if isinstance(out, list):
            checked = token_ids(out)
            if checked is None:
                self.bad_ids = True
            else:
                self.generated.extend(checked)
        delta = choice.get("delta")
        if isinstance(delta, dict) and (delta.get("tool_calls") or delta.get("reasoning")
                                        or delta.get("reasoning_content")):
            self.unsafe = True
        if choice.get("finish_reason") is not None:
            self.finish = True

    def observe_event(self, name: str, obj: dict[str, Any]) -> None:
        """Account one Responses / Messages event of the first leg."""
        st = self.events
        if obj.get("sequence_number") is not None:
            st.sequence = max(st.sequence, _index(obj["sequence_number"]))
        if name in ("response.created", "message_start"):
            opening = obj.get("response") if name == "response.created" else obj.get("message")
            st.opening = dict(opening) if isinstance(opening, dict) else {}
            usage = st.opening.get("usage")
            if name == "message_start" and isinstance(usage, dict) and isinstance(usage.get("input_tokens"), int):
                st.input_tokens = usage["input_tokens"]
        elif name == "response.output_item.added":
            item = obj.get("item") or {}
            if item.get("type") != "message":
                self.unsafe = True
            st.item_id = str(item.get("id") or "")
            st.output_index = _index(obj.get("output_index"))
        elif name == "response.content_part.added":
            st.content_index = _index(obj.get("content_index"))
        elif name == "content_block_start":
            if (obj.get("content_block") or {}).get("type") != "text":
                self.unsafe = True
            st.content_index = _index(obj.get("index"))
        elif name == "response.output_text.delta":
            self.text.append(str(obj.get("delta") or ""))
            self.delivered += 1
        elif name == "content_block_delta":
            delta = obj.get("delta") or {}
            if delta.get("type") != "text_delta":
                self.unsafe = True
            self.text.append(str(delta.get("text") or ""))
            self.delivered += 1
        elif name in ("response.output_text.done", "content_block_stop", "message_delta"):
            st.closing = True
        elif name not in ("response.in_progress", "response.content_part.added", "ping"):
            self.unsafe = True      # function calls, reasoning, anything this module does not re-frame

    def refusal(self, max_legs: int) -> tuple[Refusal, str] | None:
        """Why this stream cannot be continued, as ``(reason, message)`` (None: it can)."""
        if self.unsafe:
            return Refusal.IN_FLIGHT, "a tool call or reasoning block was in flight"
        if self.bad_ids:
            return Refusal.NO_TOKEN_IDS, "the decoder sent token ids that are not token ids"
        if self.unreadable:
            return Refusal.UNREADABLE, "the decoder sent events pdproxy could not read"
        if self.events.closing and not self.openai:
            return Refusal.CLOSING, "it was lost while closing the response"
        if self.openai and self.prompt_ids is None:
            return Refusal.NO_TOKEN_IDS, "the decoder sent no prompt token ids"
        if self.legs > max_legs:
            return Refusal.MAX, f"it was already continued {max_legs} times"
        return None

    def resumed(self, api: str) -> None:
        """The continuation's first event is in (or the stream is being ended here): its time budget is met, the
        loss is counted as continued, and the client-visible gap since the last write before the loss is counted
        (once per loss)."""
        if self.cause is not None:
            self.observer.continued(self.cause, api)
            self.cause = None
        waiting, self.waiting = self.waiting, None
        if waiting is not None and not waiting.expired():
            waiting.reschedule(None)
        if self.last_write is not None:
            self.observer.gap(api, max(0.0, time.monotonic() - self.last_write))
            self.last_write = None

    def next_leg(self, context_len: int | None = None) -> ProxyRequest | None:
        """The continuation request, or None when nothing is left to generate (the budget is spent or a finish
        reason was delivered: the stream only needs its end).  With the prompt's ids known it is
        ``/v1/completions`` with the token-id ``prompt`` = prompt ids + delivered ids, and — when the client set
        no output limit — ``max_tokens`` the room ``context_len`` (the decoders' ``max_model_len``, tokens; None:
        unknown) leaves after that prompt, as the client's chat would have had: vLLM reads a completion's absent
        or null ``max_tokens`` as 16 (``CompletionRequest.normalize_null_max_tokens``,
        ``vllm/entrypoints/openai/completion/protocol.py``); for a Responses / Messages
        first leg (vLLM sends no ids there) it is ``/v1/chat/completions`` on the chat the request renders
        (:mod:`pdproxy.apis.fields`) with the delivered text as the final assistant message
        (``continue_final_message``), asking ``return_token_ids`` so that later legs are token-exact."""
        body = self.req.body
        if self.held and not self.finish:      # ids whose text was held back: regenerated, not in the prompt
            held = min(self.held, len(self.generated))
            del self.generated[len(self.generated) - held:]
            self.replay += held if self.keep_ids else 0
            self.held = 0
        sent = self.tokens
        limit = self.req.max_output_tokens
        if self.finish:
            return None
        if limit is not None and limit - sent < 1:
            self.finish_reason = "length"      # the client's limit met: the stream ends as vLLM's would
            return None
        room = None                            # a completion's room left in the context, without a client limit
        if self.prompt_ids is not None and limit is None and context_len is not None:
            room = context_len - len(self.prompt_ids) - len(self.generated)
            if room < 1:                       # the context is full: the original would have ended there
                self.finish_reason = "length"
                return None
        cont: dict[str, Any] = {k: body[k] for k in _SAMPLING if k in body}
        cont.update({"model": body.get("model") or self.head.get("model"),
                     "max_tokens": None if limit is None else limit - sent, "stream": True,
                     "stream_options": {"include_usage": True}, "return_token_ids": True})
        for key in ("min_tokens", "min_completion_tokens"):
            if isinstance(body.get(key), int):
                cont["min_tokens"] = max(0, body[key] - sent)
        self.legs += 1
        if self.prompt_ids is not None:
            cont["prompt"] = self.prompt_ids + self.generated
            if room is not None:
                cont["max_tokens"] = room
            leg = parse_request(orjson.dumps(cont), Api.COMPLETIONS, max_items=None)   # pdproxy's own body
            leg.size_exactly(len(cont["prompt"]))
            return leg
        chat = fields.responses_chat(body) if self.req.api is Api.RESPONSES else fields.messages_chat(body)
        messages = [*chat["messages"], {"role": "assistant", "content": "".join(self.text)}]
        cont.update({"messages": messages, "continue_final_message": True, "add_generation_prompt": False})
        if chat.get("tools"):             # rendered into the prompt as the original's were; never called (an
            cont["tools"], cont["tool_choice"] = chat["tools"], "none"   # eligible stream's tools are not callable)
        leg = parse_request(orjson.dumps(cont), Api.CHAT, max_items=None)
        leg.size_from(self.req, sent)
        return leg

    def prompt_tokens(self) -> int:
        """The client's original prompt tokens."""
        if self.events.input_tokens is not None:
            return self.events.input_tokens
        if self.openai and self.prompt_ids is not None:
            return len(self.prompt_ids)
        return self.req.prompt_tokens or 0

    def usage(self) -> dict[str, Any]:
        """The client's chat / completions usage: the original prompt, every delivered token (the re-prefill never
        counts)."""
        prompt = self.prompt_tokens()
        usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + self.tokens,
                                 "completion_tokens": self.tokens}
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage

    def ending(self, include_usage: bool) -> bytes:
        """The end of a chat / completions stream whose last content was delivered before the loss: the finish
        chunk (``finish_reason: "length"``) when :meth:`next_leg` found the limit met and none was delivered, usage
        (if asked and not already sent) and ``[DONE]``."""
        tail = b""
        kind = "chat.completion.chunk" if self.req.api is Api.CHAT else "text_completion"
        if not self.finish and self.finish_reason is not None:
            choice: dict[str, Any] = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": self.finish_reason}
                                      if self.req.api is Api.CHAT else
                                      {"index": 0, "text": "", "logprobs": None, "finish_reason": self.finish_reason})
            tail = sse.data_event(orjson.dumps({**self.head, "object": kind, "choices": [choice]}))
            self.finish = True
        if include_usage and not self.usage_sent:
            tail += sse.data_event(orjson.dumps({**self.head, "object": kind, "choices": [], "usage": self.usage()}))
        return tail + sse.DONE_EVENT


def _has_text(choice: dict[str, Any]) -> bool:
    """Whether a chat / completions choice chunk delivered text (``text``; ``delta``'s ``content``, a reasoning or
    a tool-call delta)."""
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content") or delta.get("reasoning")
                                            or delta.get("reasoning_content") or delta.get("tool_calls"))


Detokenize = Callable[[list[int]], Awaitable[str | None]]
"""The text of token ids from an engine (``POST /detokenize``); None when no engine answered."""


async def held_in_text(resume: Resume, detokenize: Detokenize) -> None:
    """Count into ``resume.held`` the last ids of the last token event with text whose own text vLLM held back.

    vLLM's API server sends what accumulated since its last write, so one event can carry several tokens, and the
    last of them can end inside a UTF-8 character: the event's text stops before that character, and a
    continuation primed after those ids would not start at the cut (vLLM's ``DecodeStream`` then returned the
    prompt's whole text; docs/stream-continuation.md, "A cut inside a character").  vLLM holds text back exactly
    while the decoded text ends with U+FFFD (``tokenizers``' ``DecodeStream.step``, the fallback's
    ``detokenize_incrementally``; ``vllm/v1/engine/detokenizer.py``), so the engine's text of the ids up to the
    cut (the last ``_CUT_WINDOW`` of them), then of one, two, three ids fewer, says how many: the first text that
    does not end with U+FFFD.  Asked on loss only, and only for a token-id continuation (``prompt_ids`` known) whose
    last event with text carried more than one id (with one id, that id's text was sent) and that has no finish.
    ``detokenize`` returning None, or every text ending with U+FFFD, counts nothing: the continuation starts at the
    cut, as without this check.  At most ``_CHAR_TOKENS + 1`` calls; usually one."""
    candidates = min(resume.texted - 1, _CHAR_TOKENS)
    resume.texted = 0
    end = len(resume.generated) - resume.held
    if resume.finish or resume.prompt_ids is None or candidates < 1 or end < 1:
        return
    window = resume.generated[max(0, end - _CUT_WINDOW):end]
    for k in range(min(candidates, len(window)) + 1):
        text = await detokenize(window[:len(window) - k])
        if text is None:
            return
        if not text.endswith("\ufffd"):
            resume.held += k
            return


class RecordIds(RecordBase):
    """The first leg's transform (every block): record the block for :meth:`Resume.read_transcript`, strip the ids
    unless the client asked for them (chat / completions), then run ``then`` (the stream's own transform: chat
    usage, or the Responses / Messages stream) on blocks holding its trigger.  The decoder's in-band error event
    ends the leg for the client (``lost`` set; the relay then raises :class:`StreamLost`).

    **Fast path** (chat / completions, after the first block; :meth:`feed`, :mod:`pdproxy.pd.record`, compiled): a
    block whose last event is a token chunk with ids (it ends with ``]}]}`` and a blank line).  vLLM writes its
    usage chunk, its in-band error event and ``[DONE]`` only after the last token chunk
    (``chat_completion/serving.py``, ``completion/serving.py``), and sends the prompt's ids only in the first
    chunk, so such a block holds nothing but token chunks: its ids are recorded and the client's bytes have
    ``"token_ids":null``; no error or usage search, no copy kept.  A chat block that may hold a reasoning delta
    (``unsafe``: a byte search; a JSON string cannot hold an unescaped ``"``, so a false hit only
    sends the block the general way) is kept whole instead, so that :meth:`Resume.refusal` still sees it.  The
    general path (:meth:`_slow`, every other block) is the rule above."""

    __slots__ = ("error", "lost", "openai", "resume", "then", "then_trigger")
    trigger = b""

    def __init__(self, resume: Resume, then: Transform) -> None:
        self.resume = resume
        self.blocks = resume.blocks
        self.tail = resume.tail.append            # every read (its last events): the last few stay
        openai = self.openai = resume.openai      # Responses / Messages streams carry no ids: general path only
        self.keep = bool(resume.keep_ids or not openai)
        self.fast = False
        chat = resume.req.api is Api.CHAT
        self.unsafe = _UNSAFE if chat else ()
        self.error = _ERROR_EVENT if openai else api_streams.ERROR_EVENT
        self.lost = False
        self.then = then
        self.then_trigger: bytes = then.trigger

    @property
    def recomputed(self) -> bool:
        """True once the client's part of this leg is over (the relay's transform contract)."""
        return self.lost or bool(self.then.recomputed)

    def _slow(self, block: bytes, prev: bytes) -> bytes:
        """Any block the fast path does not take (see class docstring): error search, the block kept whole, ids
        stripped, ``then``."""
        if self.lost:
            return b""
        if block.find(self.error) >= 0:
            kept = []
            for event in sse.split_events(block):
                if event.startswith(self.error):
                    self.lost = True                      # nothing after it is for the client
                    self.fast = self.openai = False
                    break
                kept.append(event)
            block = b"".join(kept)
            if not block:
                return b""
        self.blocks.append(block)
        self.tail(last_events(block))
        self.fast = self.openai                   # after the first block (the prompt's ids): the fast path
        if not self.keep:
            block = null_ids(block)
        if block.find(self.then_trigger) >= 0:
            block = self.then.feed(block, prev)
        return block

    def ending(self, block: bytes, prev: bytes) -> bytes:
        """The stream's last block, through the stream's own transform's ending hook."""
        return self.then.ending(block, prev)


class Reframe:
    """A continuation leg's transform (every block; parses each event — the rare path): completions or chat
    chunks in, the client's events out (see the module docstring); the decoder's in-band error event ends the
    leg for the client (``recomputed``).  ``out``: the client's responder (a Responses stream's last
    ``sequence_number`` and its end are noted on it)."""

    __slots__ = ("api", "ctx", "out", "recomputed", "resume")
    trigger = b""

    def __init__(self, resume: Resume, ctx: RequestContext, out: Responder) -> None:
        self.resume = resume
        self.ctx = ctx
        self.out = out
        self.api = resume.req.api
        self.recomputed = False

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        """The client's events for ``block``."""
        resume = self.resume
        if resume.waiting is not None or resume.last_write is not None or resume.cause is not None:
            self.resume.resumed(self.ctx.api_label)   # the continuation's first event: budget met, gap counted
        out: list[bytes] = []
        for event in sse.split_events(block):
            if self.recomputed:
                break
            if event.startswith(_ERROR_EVENT):
                self.recomputed = True
                break
            if sse.event_data(event) == b"[DONE]":
                out.append(self.closing())
                continue
            obj = recompute.parse_event(event)
            if obj is not None:
                out.append(self.chunk(obj))
        if isinstance(self.out.api_stream, api_streams.ResponsesStream):
            self.out.api_stream.sequence = self.resume.events.sequence
        return b"".join(out)

    def ending(self, block: bytes, prev: bytes) -> bytes:
        """The stream's last block, as :meth:`feed` left it."""
        return block

    def chunk(self, obj: dict[str, Any]) -> bytes:
        """One continuation chunk as the client's events (may be empty)."""
        r = self.resume
        if r.prompt_ids is None and isinstance(obj.get("prompt_token_ids"), list):
            r.prompt_ids = token_ids(obj["prompt_token_ids"])         # a chat leg: its prompt holds the text
            if r.prompt_ids is None:                                   # ids that are none: no further leg
                r.bad_ids = True
            elif r.events.input_tokens is None:                        # Responses: the prompt without it
                r.events.input_tokens = max(0, len(r.prompt_ids) - r.delivered)
        choices = obj.get("choices")
        if not choices:
            return b""
        src = choices[0]
        ids = src.get("token_ids")
        delta = src.get("delta")
        text = src.get("text") or (delta.get("content") if isinstance(delta, dict) else None) or ""
        finish = src.get("finish_reason")
        if isinstance(ids, list):
            checked = token_ids(ids)
            if checked is None:                    # as the first leg's (Resume.observe): no further leg
                r.bad_ids = True
            else:
                r.generated.extend(checked)
            if text or finish is not None:
                r.held, r.texted = 0, len(ids)
            else:
                r.held += len(ids)
            if r.replay:                           # regenerated held-back ids the client already got
                ids, r.replay = ids[r.replay:], max(0, r.replay - len(ids))
        self.ctx.completion_tokens = r.tokens
        if finish is not None:
            r.finish = True
            r.finish_reason = str(finish)
        if not text and finish is None and not (r.keep_ids and ids):
            return b""
        if self.api is Api.RESPONSES:
            return self._responses_delta(text)
        if self.api is Api.MESSAGES:
            return self._messages_delta(text)
        shown = ids if r.keep_ids else None
        choice: dict[str, Any]
        if self.api is Api.CHAT:
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                      "finish_reason": finish}
            if finish is not None:
                choice["stop_reason"] = src.get("stop_reason")
            choice["token_ids"] = shown
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                      "stop_reason": src.get("stop_reason"), "prompt_token_ids": None, "token_ids": shown}
            kind = "text_completion"
        return sse.data_event(orjson.dumps({**r.head, "object": kind, "choices": [choice]}))

    def _responses_delta(self, text: str) -> bytes:
        if not text:
            return b""
        r = self.resume
        r.text.append(text)
        st = r.events
        st.sequence += 1
        return api_streams.named_event(b"response.output_text.delta", {
            "content_index": st.content_index, "delta": text, "item_id": st.item_id, "logprobs": [],
            "output_index": st.output_index, "sequence_number": st.sequence, "type": "response.output_text.delta"})

    def _messages_delta(self, text: str) -> bytes:
        if not text:
            return b""
        self.resume.text.append(text)
        return api_streams.named_event(b"content_block_delta", {
            "type": "content_block_delta", "delta": {"type": "text_delta", "text": text},
            "index": self.resume.events.content_index})

    def closing(self) -> bytes:
        """The client's end of stream (:func:`closing`)."""
        return closing(self.resume, self.out)


def closing(r: Resume, out: Responder) -> bytes:
    """The client's end of stream: usage (if asked) + ``[DONE]`` (chat / completions); the text item's done
    events and ``response.completed`` (Responses); ``content_block_stop``, ``message_delta`` and
    ``message_stop`` (Messages)."""
    if r.openai:
        return r.ending(r.req.include_usage)   # the splice marks [DONE] sent when it writes it
    out.done_sent = True
    length = r.finish_reason == "length"
    text = "".join(r.text)
    st = r.events
    if r.req.api is Api.MESSAGES:
        tally: dict[str, Any] = {"input_tokens": r.prompt_tokens(), "output_tokens": r.tokens,
                                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        api_streams.patch_messages_usage(tally, r.cached_tokens)
        return (api_streams.named_event(b"content_block_stop", {"type": "content_block_stop",
                                                                "index": st.content_index})
                + api_streams.named_event(b"message_delta", {
                    "type": "message_delta", "delta": {"stop_reason": "max_tokens" if length else "end_turn",
                                                       "stop_sequence": None}, "usage": tally})
                + api_streams.named_event(b"message_stop", {"type": "message_stop"}))
    part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text", "logprobs": None}
    item = {"id": st.item_id, "content": [part], "role": "assistant", "status": "completed", "type": "message"}
    events = []
    for name, payload in ((b"response.output_text.done", {"content_index": st.content_index,
                                                           "item_id": st.item_id, "logprobs": [],
                                                           "output_index": st.output_index, "text": text}),
                          (b"response.content_part.done", {"content_index": st.content_index,
                                                            "item_id": st.item_id,
                                                            "output_index": st.output_index, "part": part}),
                          (b"response.output_item.done", {"item": item, "output_index": st.output_index})):
        st.sequence += 1
        events.append(api_streams.named_event(name, {**payload, "sequence_number": st.sequence,
                                                     "type": name.decode()}))
    prompt = r.prompt_tokens()
    usage: dict[str, Any] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": r.cached_tokens or 0},
             "output_tokens": r.tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": prompt + r.tokens}
    response = {**st.opening, "output": [item], "usage": usage,
                "status": "incomplete" if length else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if length else None}
    st.sequence += 1
    events.append(api_streams.named_event(b"response.completed", {
        "response": response, "sequence_number": st.sequence, "type": "response.completed"}))
    if isinstance(out.api_stream, api_streams.ResponsesStream):
        out.api_stream.sequence = st.sequence
    return b"".join(events)
