"""Cheap bounds on a prompt's token count, computed without a tokenizer.

Admission uses them to skip the exact count when a bound already decides (vLLM itself runs a character pre-check
before tokenizing: ``vllm/renderers/params.py::TokenizeParams._text_len_check``).  Both bounds are in tokens.

**Lower bound — whitespace-to-word transitions.**  Every BPE tokenizer that pre-tokenizes with a GPT-2-style
regex (GPT-2, Llama 3, Qwen 2/3, DeepSeek, GLM-4, pdproxy's :class:`~pdproxy.tokens.SimTokenizer`) or splits on
whitespace (SentencePiece, ``split_by_whitespace``) never merges across a place where a whitespace character is
followed by a non-whitespace one: each such place starts a different pre-token, and each pre-token is at least one
token.  So ``tokens >= transitions``.  Only ASCII whitespace (space, tab, CR, LF, VT, FF — whitespace for every
regex flavour) is counted; text holding other whitespace (NBSP, U+3000, the ASCII separators 0x1C–0x1F, which
Python and Rust regexes disagree on) uses the exact but slower regex count.  Only message contents that chat
templates insert verbatim are counted (not assistant turns: templates such as Qwen 3's drop their reasoning), and
each content is stripped first (templates may ``trim`` it).  Media parts (images, audio) add nothing: their token
cost depends on the engine's processor.

**Upper bound — bytes.**  A byte-level BPE token covers at least one UTF-8 byte, and SentencePiece's byte
fallback emits at most one token per byte, so ``tokens <= bytes`` of the rendered prompt.  Without the engine's
chat template (engine ``/tokenize`` counting) the rendered size is bounded as: bytes of every string in the
messages + the tools as ``json.dumps(indent=4)`` (Llama 3.1's template, the most verbose common one) +
``per_message_overhead`` per message + ``template_overhead`` (the operator's ``chat_template_max_overhead_tokens``).
A request with media parts has no useful upper bound (:data:`NO_UPPER_BOUND`): it is always counted.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from xxhash import xxh3_64_intdigest

from pdproxy.settings import MAX_JSON_DEPTH
from pdproxy.tokens import MEDIA_PART_TOKENS

PER_MESSAGE_OVERHEAD_TOKENS = 32
"""Upper bound on the tokens a chat template adds around one message (role markers, separators)."""

NO_UPPER_BOUND = 1 << 62
"""The upper bound of a prompt whose size cannot be bounded without the engine (media parts)."""

ESTIMATE_BYTES_PER_TOKEN = 4
"""Bytes per token of the routing estimate used when no exact count was needed (English text with BPE)."""

_WS_TABLE = bytes(0x20 if c in b" \t\n\r\x0b\x0c" else 0x21 if 0x1C <= c < 0x20 else 0x78 for c in range(256))
"""``bytes.translate`` table: ASCII whitespace → space, the separators 0x1C-0x1F → ``!``, every other byte → ``x``."""
_UNICODE_WS = re.compile(rb"\xc2[\x85\xa0]|\xe1\x9a\x80|\xe2\x80[\x80-\x8a\xa8\xa9\xaf]|\xe2\x81\x9f|\xe3\x80\x80")
_TRANSITION = re.compile(r"[ \t\n\r\x0b\x0c](?=\S)")


def word_transitions(text: str) -> int:
    """A lower bound on the tokens of ``text`` (see module docstring): the number of pre-token starts marked by
    an ASCII whitespace character followed by a non-whitespace one, plus one if ``text`` starts with a word.

    About 6 ns per byte on the fast path (ASCII whitespace only).
    """
    if not text:
        return 0
    data = text.encode()
    mapped = data.translate(_WS_TABLE)
    if b"!" in mapped or (not text.isascii() and _UNICODE_WS.search(data)):
        count = len(_TRANSITION.findall(text))
        return count + (0 if text[0].isspace() else 1)
    return mapped.count(b" x") + (1 if mapped[:1] == b"x" else 0)


def utf8_len(text: str) -> int:
    """UTF-8 length of ``text`` in bytes (no copy for ASCII)."""
    return len(text) if text.isascii() else len(text.encode())


def _content_parts(content: Any) -> tuple[list[str], int]:
    """(text parts, media parts) of an OpenAI message content (str, list of parts, or None)."""
    if content is None:
        return [], 0
    if isinstance(content, str):
        return [content], 0
    texts: list[str] = []
    media = 0
    if isinstance(content, list):
        for part in content:
            if not isinstance(part, dict):
                continue
            if part.get("type") in (None, "text"):
                texts.append(str(part.get("text", "")))
            else:
                media += 1
    return texts, media


def _strings_bytes(value: Any) -> int:
    """At least the UTF-8 bytes of every string (keys and values) and number in a JSON-like value, as ``str()``
    writes them: a container's compact JSON length (orjson, in C: its quotes and separators make it longer than
    the strings and numbers it holds — a float's exponent, one or two bytes shorter in JSON, sits beside a
    separator — and a chat template that prints the value prints at least that much); Python's own walk only for
    what orjson does not encode (integers beyond 64 bits).  A 3 MB ``chat_template_kwargs`` walked in Python
    held the event loop 0.5 s."""
    if isinstance(value, str):
        return utf8_len(value)
    if isinstance(value, dict | list):
        try:
            return len(orjson.dumps(value))
        except orjson.JSONEncodeError:
            return _walked_bytes(value)
    return len(str(value)) if value is not None else 0


def _walked_bytes(value: Any) -> int:
    """:func:`_strings_bytes` walked in Python (a value orjson does not encode)."""
    if isinstance(value, str):
        return utf8_len(value)
    if isinstance(value, dict):
        return sum(utf8_len(str(k)) + _walked_bytes(v) for k, v in value.items())
    if isinstance(value, list):
        return sum(_walked_bytes(v) for v in value)
    return len(str(value)) if value is not None else 0


@dataclass(frozen=True, slots=True)
class PromptBounds:
    """Token bounds of one prompt.

    ``lower`` ≤ true prompt tokens ≤ ``upper``; ``exact`` when both are equal by construction (token-id prompts);
    ``estimate``: the routing figure (``estimated_prompt_tokens``) used when no exact count is made;
    ``text_bytes``: UTF-8 bytes of the prompt text, which sizes the counting work.
    """

    lower: int
    upper: int
    estimate: int
    text_bytes: int

    @property
    def exact(self) -> bool:
        return self.lower == self.upper


def _finish(lower: int, upper: int, text_bytes: int) -> PromptBounds:
    estimate = min(upper, max(lower, -(-text_bytes // ESTIMATE_BYTES_PER_TOKEN)))
    return PromptBounds(lower=lower, upper=max(upper, lower), estimate=estimate, text_bytes=text_bytes)


def _single_prompt(body: dict[str, Any]) -> Any:
    """A completions body's ``prompt``, a one-element list unwrapped (``["text"]`` → ``"text"``, ``[[1, 2]]`` →
    ``[1, 2]``); anything else as given."""
    prompt = body.get("prompt")
    return prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt


def prompt_bounds(body: dict[str, Any], chat: bool, *, template_overhead: int, lower: bool = True,
                  tools_bytes: Callable[[Any], int] | None = None) -> PromptBounds:
    """Bounds for a validated request body (``chat``: a ``messages`` body, else a ``prompt`` body).

    ``template_overhead`` (tokens) bounds what the chat template adds beyond the messages and tools (ignored for
    completions, which vLLM encodes without a template; 2 tokens are allowed for BOS/EOS).  ``lower`` False skips
    the word count (the bound is then 0): it reads every byte of the prompt (~3 ns a byte), where the upper bound
    only sums lengths, so admission asks for it only when the upper bound does not decide.  ``tools_bytes``: the
    tools' size (default :func:`indented_json_bytes`; admission passes a :class:`ToolsBytes` cache).
    """
    if not chat:
        prompt = _single_prompt(body)
        if isinstance(prompt, list):                      # token ids: exact
            return PromptBounds(len(prompt), len(prompt), len(prompt), 0)
        text = prompt if isinstance(prompt, str) else ""
        size = utf8_len(text)
        return _finish(word_transitions(text.strip()) if lower else 0, size + 2, size)
    messages = body.get("messages")
    if not isinstance(messages, list):                    # not vLLM's shape: the engine judges it, any count does
        messages = []
    words, size, media = _messages_size(messages, lower)
    tools = body.get("tools")
    if tools:                                             # vLLM renders them even with tool_choice "none"
        size += (tools_bytes or indented_json_bytes)(tools)
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, dict):
        size += _strings_bytes(kwargs)
    upper = size + len(messages) * PER_MESSAGE_OVERHEAD_TOKENS + template_overhead if not media else NO_UPPER_BOUND
    return _finish(words, upper, size + media * MEDIA_PART_TOKENS * ESTIMATE_BYTES_PER_TOKEN)


def _messages_size(messages: list[Any], lower: bool, skip: frozenset[str] = frozenset()) -> tuple[int, int, int]:
    """``(words, bytes, media parts)`` of chat ``messages``: the word transitions of the text a template keeps
    (not the assistant's: 0 unless ``lower``), the UTF-8 bytes of every text part and of every other field's
    strings (roles, tool calls' arguments, reasoning) — the fields named in ``skip`` left out — and how many media
    parts (their data not counted)."""
    words = size = media = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        texts, n_media = _content_parts(message.get("content"))
        media += n_media
        if lower and message.get("role") != "assistant":
            words += sum(word_transitions(t.strip()) for t in texts)
        for key, value in message.items():
            if key != "content" and key not in skip:
                size += utf8_len(key) + (utf8_len(value) if isinstance(value, str) else _strings_bytes(value))
        size += sum(map(utf8_len, texts))
    return words, size, media


REASONING_FIELDS = frozenset(("reasoning", "reasoning_content", "thinking"))
"""Message fields holding a turn's reasoning (vLLM's ``reasoning`` / ``reasoning_content``)."""


def text_bytes_floor(body: dict[str, Any], chat: bool) -> int:
    """About the fewest bytes of text an engine renders and tokenizes to count this prompt (``/tokenize``): the
    prompt's text, or the messages' text parts and fields' strings, the tools' compact JSON and the template
    arguments' strings — media parts' data and the layout a template adds left out (a token-id prompt: 0).  What
    :meth:`pdproxy.admission.admission.Admission.admit` weighs against the token limit before asking an engine to
    count; unlike ``PromptBounds.upper`` it is not inflated for media or for tools too large to lay out, and leaves
    out the reasoning of earlier turns, which templates commonly drop (Qwen3's, DeepSeek-R1's)."""
    if not chat:
        prompt = _single_prompt(body)
        return utf8_len(prompt) if isinstance(prompt, str) else 0
    messages = body.get("messages")
    size = _messages_size(messages, False, REASONING_FIELDS)[1] if isinstance(messages, list) else 0
    tools = body.get("tools")
    if tools:
        size += _strings_bytes(tools)
    kwargs = body.get("chat_template_kwargs")
    return size + (_strings_bytes(kwargs) if isinstance(kwargs, dict) else 0)


class ToolsBytes:
    """:func:`indented_json_bytes` of tool lists, remembered for the last ``entries`` distinct lists by the XXH3-64
    of their compact JSON: an agent sends the same tools on every turn (16 tools of ~800 bytes: ~60 µs to measure,
    ~6 µs to recognise).  Safe from worker threads (one dict, read and written under the GIL); forgets everything
    when full.  A hash collision (2⁻⁶⁴ per pair) would give one request another list's size: a wrong upper bound,
    which the engine's own length check still catches."""

    __slots__ = ("_sizes", "entries")

    def __init__(self, entries: int = 256) -> None:
        self.entries = entries
        self._sizes: dict[int, int] = {}

    def __call__(self, tools: Any) -> int:
        try:
            compact = orjson.dumps(tools)
        except orjson.JSONEncodeError:
            return indented_json_bytes(tools)
        key = xxh3_64_intdigest(compact)
        size = self._sizes.get(key)
        if size is None:
            size = indented_json_bytes(tools, compact)
            if len(self._sizes) >= self.entries:
                self._sizes.clear()
            self._sizes[key] = size
        return size


LAYOUT_WALK_CONTAINERS = 10_000
"""Containers :func:`indented_json_bytes` visits one by one at most (~0.5 µs each; an agent's tools hold hundreds);
a value with more is bounded from its bytes alone (:func:`_loose_layout`)."""
_CONTAINERS = frozenset((dict, list))


def indented_json_bytes(value: Any, compact: bytes | None = None) -> int:
    """At least the UTF-8 bytes of ``json.dumps(value, indent=4, ensure_ascii=False)`` (the most verbose way a
    chat template prints tools, Llama 3.1's), without rendering it: the compact JSON (``compact``: orjson's bytes
    of ``value`` when the caller has them) plus what the layout adds — per non-empty container of ``k`` members at
    depth ``d`` (the value itself at 0), ``k`` line breaks indented ``4(d+1)`` spaces, its closing line indented
    ``4d``, and for an object the space after each ``:``.  Rendering grows with depth × members (a 1.8 MB tools
    list 195 levels deep rendered to 712 MB: 1 s of the event loop); this visits each container once, a depth at
    a time, and scans long runs of scalars in C: ~10 ms for that list, ~50 µs for 16 tools (rendering them:
    ~30 µs).  Exact but for float exponents (Python writes ``1e+16`` / ``1e-07`` where orjson writes ``1e16`` /
    ``1e-7``: up to two bytes each, which ``chat_template_max_overhead_tokens`` covers many times over).  A value
    of more than :data:`LAYOUT_WALK_CONTAINERS` containers gets :func:`_loose_layout`'s bound instead (no agent's
    tools have that many: the bound is for hostile bodies).  What orjson does not encode (integers beyond 64
    bits) is measured from Python's compact ``json``."""
    if compact is None:
        try:
            compact = orjson.dumps(value)
        except orjson.JSONEncodeError:
            compact = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    if not (type(value) is dict or type(value) is list) or not value:
        return len(compact)
    extra = 0
    level: list[Any] = [value]
    depth = visits = 0
    while level:                                  # one depth at a time
        visits += len(level)
        if visits > LAYOUT_WALK_CONTAINERS:
            return len(compact) + _loose_layout(compact)
        below: list[Any] = []
        objects = members = 0
        for node in level:
            members += len(node)
            if type(node) is dict:
                objects += len(node)
                node = node.values()
            if len(node) < 64 or not _CONTAINERS.isdisjoint(map(type, node)):    # long runs of scalars: in C
                below += [m for m in node if (type(m) is dict or type(m) is list) and m]
        extra += members * (4 * depth + 5) + objects + len(level) * (4 * depth + 1)
        level = below
        depth += 1
    return len(compact) + extra


def _loose_layout(compact: bytes) -> int:
    """At least what indentation adds to the compact JSON ``compact``, from its bytes alone: no more members than
    ``,`` ``[`` ``{`` bytes (each member but a container's first follows a ``,``), none deeper than
    :data:`MAX_JSON_DEPTH` (~0.3 ms per MB; an upper bound far above the exact figure)."""
    members = compact.count(b",") + compact.count(b"[") + compact.count(b"{")
    return members * (8 * MAX_JSON_DEPTH + 7)
