"""Exact prompt token counts: a local tokenizer (run in a worker thread, with a block cache) or the engine's own
``/tokenize`` (vLLM ``entrypoints/serve/tokenize``: ``{"count", "max_model_len", "tokens"}``, chat bodies rendered
with the chat template and ``add_special_tokens=False``, completion prompts with ``add_special_tokens=True``).

Counting the way the engine does: chat prompts are rendered with the tokenizer's chat template (``tools``,
multi-part content, ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``) by
:mod:`pdproxy.tokens`, exactly as ``pdproxy sim`` renders them; token-id prompts count as their length.

**Blocks and the cache.**  A rendered prompt is cut into *blocks* whose counts add up to the whole count: around
added special tokens for a Hugging Face tokenizer (``tokenizers`` extracts them before pre-tokenization, so the text
between them is encoded independently), and before each ``<|role|>`` marker the sim tokenizer's regex is known to
start at.  Blocks of 256 characters or more are cached by a 128-bit BLAKE2b digest, so a repeated system prompt or
tool block is counted once.  A large block is split further at "word | space word" points (a space after a letter or
digit and before a non-space), where GPT-2-style pre-tokenizers always split; those chunks are counted in parallel
(``encode_batch`` releases the GIL) and counting stops as soon as the running total passes ``cap`` — the prompt is
then reported as "at least" that many tokens, as vLLM does.  The chunking is enabled for a Hugging Face tokenizer
only when it has no normalizer, a byte-level (regex) pre-tokenizer and passes a self-check at load.

**Token ids** (prefix routing, :mod:`pdproxy.prefix.routing`): :meth:`LocalCounter.token_ids` encodes the same
blocks and keeps the ids of each cached-size block in an :class:`IdsCache` bounded in tokens, so a conversation's
next turn encodes only its new messages; ``/tokenize`` answers carry the ids too (:func:`parse_tokenize_ids`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from pdproxy.tokens import MEDIA_PART_TOKENS, MEDIA_TOKEN_ID, SimTokenizer, Tokenizer, load_tokenizer

CACHE_MIN_CHARS = 256
"""Blocks shorter than this (characters) are counted, not cached."""
CACHE_MAX_CHARS = 1 << 20
"""Blocks longer than this are not cached (hashing them would cost a third of counting them)."""
CHUNK_CHARS = 16_384
"""Target size (characters) of the chunks a large block is split into."""
GROUP_CHARS = 131_072
"""Characters counted between two checks of the running total against ``cap``."""
V = TypeVar("V")
_SIM_MARKER = re.compile(r"<\|[a-z_]{1,24}\|>")
_SELF_CHECK = ("Hello world, this is 2024: naïve café — 東京タワー tokens.\n\n  indented code(x) = 42;\tTabs and "
               "UPPER lower MiXeD 12345 67 digits, it's we'll they're 'quoted' \"double\" {json: [1, 2]} ") * 8


@dataclass(frozen=True, slots=True)
class TokenCount:
    """A prompt's counted tokens.  ``exact`` False: counting stopped past the cap, so the prompt has *at least*
    ``tokens`` tokens.  ``method``: ``"local"`` or ``"engine"``."""

    tokens: int
    exact: bool
    method: str


class _SizedLRU(Generic[V]):
    """Thread-safe LRU of ``digest(block text) -> V`` bounded by the summed ``size`` of its values (``bound``):
    the least recently used entries go first.  ``hits`` / ``misses`` count :meth:`get` results."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.size = 0
        self._data: OrderedDict[bytes, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(text: str) -> bytes:
        """The 16-byte BLAKE2b digest of ``text`` (UTF-8)."""
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    def get(self, key: bytes) -> V | None:
        """The cached value, or None."""
        with self._lock:
            found = self._data.get(key)
            if found is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return found[0]

    def _put(self, key: bytes, value: V, size: int) -> None:
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.size -= old[1]
            self._data[key] = (value, size)
            self.size += size
            while self.size > self.bound:
                _, (_, dropped) = self._data.popitem(last=False)
                self.size -= dropped


class BlockCache(_SizedLRU[int]):
    """``digest(block text) -> token count``, ``entries`` blocks at most (0: caches nothing)."""

    def __init__(self, entries: int) -> None:
        super().__init__(entries)

    def put(self, key: bytes, value: int) -> None:
        """Remember ``value`` tokens for ``key``, evicting the least recently used entries."""
        if self.bound > 0:
            self._put(key, value, 1)


IDS_ENTRY_TOKENS = 80
"""What one :class:`IdsCache` entry's bookkeeping costs, in its bound's 4-byte tokens (~300 bytes measured by
tracemalloc: the key's digest, the value's object, the LRU's node): charged to every block beside its ids, so blocks
of few tokens (256 spaces can be 4) cannot hold 30 times the memory the bound says."""


class IdsCache(_SizedLRU[bytes]):
    """``digest(block text) -> token ids``, at most ``max_tokens`` in all — each block's ids plus
    :data:`IDS_ENTRY_TOKENS` for its entry, so the bound is about its memory in 4-byte units.  Ids are stored as the
    bytes of an ``array('i')`` (4 bytes a token; a ``bytes`` object the garbage collector does not track, so a full
    cache adds nothing to a collection's pause); :meth:`ids` reads them back without a copy.  A block longer than a
    quarter of the bound is not kept."""

    def __init__(self, max_tokens: int) -> None:
        super().__init__(max_tokens)

    def put(self, key: bytes, ids: Sequence[int]) -> None:
        """Remember ``ids`` for ``key``, evicting the least recently used blocks past ``max_tokens``."""
        if len(ids) * 4 <= self.bound:
            self._put(key, array("i", ids).tobytes(), len(ids) + IDS_ENTRY_TOKENS)

    def ids(self, key: bytes) -> Sequence[int] | None:
        """The ids cached for ``key`` (a read-only view of the stored bytes), or None."""
        raw = self.get(key)
        return None if raw is None else memoryview(raw).cast("i")


def word_cuts(text: str, size: int) -> Iterator[str]:
    """Split ``text`` lazily into pieces of about ``size`` characters, each cut just before a space that follows a
    letter or digit and precedes a non-space (a pre-token boundary for GPT-2-style regexes).  The pieces joined give
    ``text``."""
    start = 0
    n = len(text)
    while n - start > size:
        i = text.find(" ", start + size)
        while i != -1 and i + 1 < n and not (text[i - 1].isalnum() and not text[i + 1].isspace()):
            i = text.find(" ", i + 1)
        if i == -1 or i + 1 >= n:
            break
        yield text[start:i]
        start = i
    yield text[start:]


class _SimBackend:
    """Counting with :class:`SimTokenizer`: one token per pre-token of its regex."""

    chunkable = True

    def __init__(self, tok: SimTokenizer) -> None:
        self.tok = tok

    def blocks(self, text: str) -> list[tuple[str, int | None]]:
        """Cut before every ``<|role|>`` marker the regex must start at: one preceded by a letter/digit, the text
        start, or another such marker."""
        cuts = [0]
        recognized_end = -1
        for m in _SIM_MARKER.finditer(text):
            i = m.start()
            if i == 0 or text[i - 1].isalnum() or i == recognized_end:
                recognized_end = m.end()
                if i > cuts[-1]:
                    cuts.append(i)
        cuts.append(len(text))
        return [(text[a:b], None) for a, b in itertools.pairwise(cuts) if b > a]

    def count_many(self, pieces: Sequence[str]) -> list[int]:
        return [self.tok.count(p) for p in pieces]

    def ids_many(self, pieces: Sequence[str]) -> list[list[int]]:
        return [self.tok.encode(p) for p in pieces]

    def special_id(self, text: str) -> int:
        raise AssertionError("the sim tokenizer has no special tokens")  # pragma: no cover


class _HFBackend:
    """Counting with a ``tokenizers`` tokenizer loaded from ``tokenizer.json`` (``add_special_tokens=False``)."""

    def __init__(self, directory: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        self.tok = RustTokenizer.from_file(str(directory / "tokenizer.json"))
        spec = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
        added = [t for t in spec.get("added_tokens") or [] if isinstance(t, dict) and t.get("content")]
        plain = all(not (t.get("normalized") or t.get("lstrip") or t.get("rstrip") or t.get("single_word"))
                    for t in added)
        contents = sorted({t["content"] for t in added}, key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, contents))) if plain and contents else None
        self.bos_ids: list[int] = list(self.tok.encode("", add_special_tokens=True).ids)
        self.bos_tokens = len(self.bos_ids)
        pre = spec.get("pre_tokenizer") or {}
        members = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
        byte_level = [m for m in members if m.get("type") == "ByteLevel"]
        regex_ok = all(m.get("type") in ("Split", "ByteLevel", "Digits") for m in members) and bool(byte_level) and (
            byte_level[0].get("use_regex", True) or any(m.get("type") == "Split" for m in members))
        self.chunkable = spec.get("normalizer") is None and regex_ok
        if self.chunkable:
            whole = len(self.tok.encode(_SELF_CHECK, add_special_tokens=False).ids)
            self.chunkable = whole == sum(self.count_many(list(word_cuts(_SELF_CHECK, 64))))

    def blocks(self, text: str) -> list[tuple[str, int | None]]:
        if self._specials is None:
            return [(text, None)]
        out: list[tuple[str, int | None]] = []
        last = 0
        for m in self._specials.finditer(text):
            if m.start() > last:
                out.append((text[last:m.start()], None))
            out.append((m.group(), 1))
            last = m.end()
        if last < len(text):
            out.append((text[last:], None))
        return out

    def count_many(self, pieces: Sequence[str]) -> list[int]:
        if len(pieces) == 1:
            return [len(self.tok.encode(pieces[0], add_special_tokens=False).ids)]
        return [len(e.ids) for e in self.tok.encode_batch(list(pieces), add_special_tokens=False)]

    def ids_many(self, pieces: Sequence[str]) -> list[list[int]]:
        if len(pieces) == 1:
            return [list(self.tok.encode(pieces[0], add_special_tokens=False).ids)]
        return [list(e.ids) for e in self.tok.encode_batch(list(pieces), add_special_tokens=False)]

    def special_id(self, text: str) -> int:
        """The id of an added special token's text (a block :meth:`blocks` gave a fixed count of 1)."""
        token_id = self.tok.token_to_id(text)
        return int(token_id) if token_id is not None else len(self.tok.encode(text, add_special_tokens=False).ids)


class LocalCounter:
    """Counts prompts with a local tokenizer (``"sim"`` for the built-in one, or a directory with
    ``tokenizer.json``).  :meth:`count` is synchronous and meant for a worker thread.  Raises
    ``FileNotFoundError`` for a directory without ``tokenizer.json``."""

    def __init__(self, source: str, *, cache_entries: int = 4096, ids_cache_tokens: int = 4_000_000) -> None:
        self.tokenizer: Tokenizer = load_tokenizer(None if source == "sim" else source)
        if isinstance(self.tokenizer, SimTokenizer):
            self.backend: _SimBackend | _HFBackend = _SimBackend(self.tokenizer)
        else:
            self.backend = _HFBackend(Path(source))
        self.cache = BlockCache(cache_entries)
        self.ids_cache = IdsCache(ids_cache_tokens)

    def render(self, body: dict[str, Any], chat: bool) -> tuple[str, int] | list[int]:
        """The prompt text and its extra tokens (media parts, BOS), or the token ids of an id prompt.
        Raises ``ValueError`` when the chat template rejects or cannot render the messages (``render_chat``'s, or
        messages of the wrong shape)."""
        if not chat:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, list):
                return prompt
            bos = self.backend.bos_tokens if isinstance(self.backend, _HFBackend) else 0
            return str(prompt or ""), bos
        messages = body["messages"]
        tools = body.get("tools") or None            # rendered even with tool_choice "none", as vLLM does
        try:
            text = self.tokenizer.render_chat(
                messages, tools=tools, add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message", False)),
                chat_template_kwargs=body.get("chat_template_kwargs"))
            media = sum(1 for m in messages if isinstance(m.get("content"), list)
                        for p in m["content"] if isinstance(p, dict) and p.get("type") not in (None, "text"))
        except (TypeError, AttributeError, KeyError, IndexError) as exc:   # messages of the wrong shape (not
            # objects, content of another type): the engine judges them (the template's own errors: render_chat)
            raise ValueError(f"the chat template cannot render these messages: {type(exc).__name__}: {exc}") from exc
        return text, media * MEDIA_PART_TOKENS

    def count_text(self, text: str, cap: int | None = None) -> tuple[int, bool]:
        """``(tokens, exact)`` of ``text``; stops early (``exact`` False) once the total passes ``cap``."""
        total = 0
        batch: list[tuple[bytes | None, str]] = []
        batch_chars = 0

        def flush() -> None:
            nonlocal total, batch, batch_chars
            if batch:
                for (key, _), n in zip(batch, self.backend.count_many([t for _, t in batch]), strict=True):
                    if key is not None:
                        self.cache.put(key, n)
                    total += n
            batch, batch_chars = [], 0

        for block, fixed in self.backend.blocks(text):
            if fixed is not None:
                total += fixed
                continue
            key = BlockCache.key(block) if CACHE_MIN_CHARS <= len(block) <= CACHE_MAX_CHARS else None
            cached = self.cache.get(key) if key is not None else None
            if cached is not None:
                total += cached
            elif len(block) <= GROUP_CHARS or not self.backend.chunkable:
                batch.append((key, block))
                batch_chars += len(block)
                if batch_chars >= GROUP_CHARS:
                    flush()
            else:
                flush()
                done, n = self._count_large(block, None if cap is None else cap - total)
                total += n
                if not done:
                    return total, False
                if key is not None:
                    self.cache.put(key, n)
            if cap is not None and total > cap:
                return total, False
        flush()
        return total, True

    def _count_large(self, block: str, cap: int | None) -> tuple[bool, int]:
        """Count one large block chunk group by chunk group (1, 2, 4 … chunks: a small cap stops after little
        work, a large count runs in parallel); ``(False, n)`` when stopped past ``cap``."""
        chunks = word_cuts(block, CHUNK_CHARS)
        most = max(1, GROUP_CHARS // CHUNK_CHARS)
        n = 0
        group = 1
        while True:
            pieces = list(itertools.islice(chunks, group))
            if not pieces:
                return True, n
            n += sum(self.backend.count_many(pieces))
            group = min(group * 2, most)
            if cap is not None and n > cap:
                return False, n

    def text_ids(self, text: str) -> list[int]:
        """Token ids of rendered ``text`` (no special tokens added): its blocks' ids, concatenated, the blocks of
        cacheable size taken from :attr:`ids_cache` when there and encoded together (``encode_batch``) when not;
        a large block is split at word boundaries when the tokenizer allows it (:func:`word_cuts`)."""
        backend = self.backend
        parts: list[Sequence[int] | None] = []
        todo: list[tuple[int, bytes | None, list[str]]] = []
        for block, fixed in backend.blocks(text):
            if fixed is not None:
                parts.append([backend.special_id(block)])
                continue
            key = BlockCache.key(block) if CACHE_MIN_CHARS <= len(block) <= CACHE_MAX_CHARS else None
            cached = self.ids_cache.ids(key) if key is not None else None
            if cached is not None:
                parts.append(cached)
                continue
            pieces = list(word_cuts(block, CHUNK_CHARS)) if len(block) > GROUP_CHARS and backend.chunkable else [block]
            todo.append((len(parts), key, pieces))
            parts.append(None)
        if todo:
            flat = [p for _, _, pieces in todo for p in pieces]
            encoded = iter(backend.ids_many(flat))
            for slot, key, pieces in todo:
                ids = [t for _ in pieces for t in next(encoded)] if len(pieces) > 1 else next(encoded)
                parts[slot] = ids
                if key is not None:
                    self.ids_cache.put(key, ids)
        out: list[int] = []
        for part in parts:
            assert part is not None
            out.extend(part)
        return out

    def token_ids(self, body: dict[str, Any], chat: bool, *, add_special_tokens: bool = False) -> list[int]:
        """The prompt's token ids as the engine builds them (what :func:`pdproxy.tokens.prompt_token_ids` gives,
        with the block cache): chat bodies rendered with the chat template plus media placeholder ids (and the
        tokenizer's BOS first with ``add_special_tokens``, as :meth:`count`), completion prompts with the
        tokenizer's BOS, id prompts as they are.  Raises ``ValueError`` when the chat template rejects the
        messages or a list prompt holds something no token id is (a list, null)."""
        if not chat:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, list):
                try:
                    return [int(t) for t in prompt]
                except (TypeError, OverflowError) as exc:   # ([[1, 2], 5], [None]: no id prompt; the engine judges it)
                    raise ValueError(f"the prompt is no list of token ids: {exc}") from None
            head = list(self.backend.bos_ids) if isinstance(self.backend, _HFBackend) else []
            return head + self.text_ids(str(prompt or ""))
        rendered = self.render(body, chat)
        assert not isinstance(rendered, list)
        text, media = rendered
        ids = self.text_ids(text)
        if add_special_tokens and isinstance(self.backend, _HFBackend):
            ids[:0] = self.backend.bos_ids
        if media:
            ids.extend([MEDIA_TOKEN_ID] * media)
        return ids

    def count(self, body: dict[str, Any], chat: bool, cap: int | None = None, *,
              add_special_tokens: bool = False) -> TokenCount:
        """Count a request body's prompt tokens (see module docstring); ``add_special_tokens``: the rendered chat
        is encoded with the tokenizer's special tokens (BOS), as vLLM encodes a Responses prompt.  Raises
        ``ValueError`` (bad messages)."""
        rendered = self.render(body, chat)
        if isinstance(rendered, list):
            return TokenCount(len(rendered), True, "local")
        text, extra = rendered
        if chat and add_special_tokens and isinstance(self.backend, _HFBackend):
            extra += self.backend.bos_tokens
        tokens, exact = self.count_text(text, None if cap is None else cap - extra)
        return TokenCount(tokens + extra, exact, "local")


def tokenize_body(body: dict[str, Any], chat: bool, add_special_tokens: bool = False) -> dict[str, Any]:
    """The ``POST /tokenize`` request for a client body: the fields that shape the prompt (vLLM
    ``TokenizeChatRequest`` / ``TokenizeCompletionRequest``, ``vllm/entrypoints/serve/tokenize/protocol.py``);
    ``add_special_tokens`` asks for the tokenizer's special tokens on a chat (a Responses prompt)."""
    keys = (("model", "messages", "tools", "add_generation_prompt", "continue_final_message",
             "chat_template_kwargs", "mm_processor_kwargs") if chat else ("model", "prompt"))
    out = {k: body[k] for k in keys if body.get(k) is not None}
    if chat and add_special_tokens:
        out["add_special_tokens"] = True
    return out


def engine_cache_key(body: dict[str, Any], chat: bool, add_special_tokens: bool = False) -> bytes:
    """Digest of what determines an engine's count (``tokenize_body``), for the whole-prompt cache."""
    import orjson

    return hashlib.blake2b(orjson.dumps(tokenize_body(body, chat, add_special_tokens),
                                        option=orjson.OPT_SORT_KEYS), digest_size=16).digest()


def parse_tokenize_ids(reply: dict[str, Any]) -> list[int] | None:
    """``tokens`` (the prompt's token ids) from a ``/tokenize`` answer, or None when absent or not ints."""
    tokens = reply.get("tokens")
    if isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        return tokens
    return None


def parse_tokenize_reply(reply: dict[str, Any]) -> int:
    """``count`` from a ``/tokenize`` answer.  Raises ``ValueError`` if absent."""
    count = reply.get("count")
    if isinstance(count, int) and not isinstance(count, bool):
        return count
    tokens = reply.get("tokens")
    if isinstance(tokens, list):
        return len(tokens)
    raise ValueError("/tokenize answer has no count")

