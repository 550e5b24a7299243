"""What one simulated output sequence says: its text per token, token ids, logprobs and where it ends by itself.

The simulator's "model" is a deterministic word list: output token ``i`` of a plain-text sequence is
``WORDS[(offset + i) % len(WORDS)]`` (each word is one token of the built-in tokenizer; some are multi-byte UTF-8,
``" naïve"``, ``" 世界"``). A sequence whose content is fixed (a JSON answer for ``response_format`` /
``structured_outputs`` / ``text.format``, a tool call's arguments) is that string cut into 4-character pieces, one
per token, and ends by itself after the last piece ("EOS").

:func:`plan_output` applies what vLLM's engine applies to a sequence (``vllm/v1/core/sched/utils.py::check_stop``,
``vllm/v1/engine/detokenizer.py``, the min-tokens logits processor):

* ``stop_token_ids``: the sequence stops on the first such token at index ≥ ``min_tokens``; the token is counted
  (``completion_tokens``) but its text is left out unless ``include_stop_str_in_output``; ``stop_reason`` is the
  token id (an int);
* ``stop`` strings: the first match that completes after the first ``min_tokens`` tokens' text stops the
  sequence at the token that completes it; the text is cut before the stop string (or after it with
  ``include_stop_str_in_output``); ``stop_reason`` is the string;
* EOS (chat's natural end after ``--output-tokens`` tokens, the end of a fixed content) is not sampled before
  ``min_tokens`` tokens, and never with ``ignore_eos`` (plain text);
* ``max_tokens`` stays the engine's cap (finish ``"length"``): a stop that would complete after it never happens.

Logprobs are plausible, not a model's: the sampled token is the most likely one (as at temperature 0), with a
deterministic logprob in ``[-1.05, -0.05]``; the alternatives are other words, each at least 0.4 lower.
"""

from __future__ import annotations

import bisect
import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

from pdproxy.tokens import Tokenizer

WORDS = (" Hello", " from", " the", " simulated", " engine", " naïve", " token", " stream", " 世界", " café",
         " prefill", " decode", " block", " cache", " step", " done")
_UNITS = tuple(a for a in range(1, len(WORDS)) if math.gcd(a, len(WORDS)) == 1)
PIECE_CHARS = 4
"""Characters of fixed content (JSON, tool arguments) per output token."""


class TokenTable:
    """Token ids of :data:`WORDS` under a tokenizer: the first id of each word's encoding (one id each with the
    built-in tokenizer). Fixed-content pieces get ``crc32(piece) % vocab`` ids."""

    def __init__(self, tokenizer: Tokenizer, held_back: bool = False) -> None:
        ids = []
        encodings = []
        for word in WORDS:
            encoded = tokenizer.encode(word)
            ids.append(encoded[0] if encoded else zlib.crc32(word.encode()) & 0xFFFF)
            encodings.append(tuple(encoded))
        self.word_ids: tuple[int, ...] = tuple(ids)
        self.word_encodings: tuple[tuple[int, ...], ...] = tuple(encodings)
        """Each word's full encoding (a word's text sent back in a prompt; :mod:`pdproxy.sim.continuation`)."""
        self.held: tuple[bool, ...] = tuple(held_back and not w.isascii() for w in WORDS)
        """Per word: its text is held back (``--held-back``: the non-ASCII words, as vLLM's detokenizer holds back
        a token that ends inside a UTF-8 character, ``vllm/v1/engine/detokenizer.py``): the word's own chunk has
        empty text and the next chunk of a word not held starts with it; a greedy output's first token never gets
        the held text of the prompt's last token (vLLM primes its detokenizer with the prompt and does not start at
        such a cut either)."""
        self.held_ids: frozenset[int] = frozenset(i for i, h in zip(ids, self.held, strict=True) if h)
        """Ids of the held-back words: the simulator's ``/detokenize`` of ids ending with one ends with U+FFFD, as a
        real tokenizer's decode of a token that ends inside a UTF-8 character does."""

    @staticmethod
    def piece_id(piece: str) -> int:
        """A stable id for a fixed-content piece."""
        return 256 + (zlib.crc32(piece.encode()) & 0x7FFF)


@dataclass(frozen=True, slots=True)
class StopRules:
    """The stop parameters of one request (see the module docstring)."""

    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    ignore_eos: bool = False


class OutputPlan:
    """One sequence's output. Token counts are tokens; ``end`` is the natural end (tokens after which it
    finishes ``"stop"``), None when only ``max_tokens`` ends it; ``stop_reason`` is what vLLM reports when it ends
    there (None for EOS, a string or a token id for a stop)."""

    __slots__ = ("_ids", "_limit", "_offsets", "_pieces", "_table", "end", "offset", "sampled", "stop_reason")

    def __init__(self, offset: int, table: TokenTable, pieces: list[str] | None = None, sampled: bool = False) -> None:
        self.offset = offset
        self.sampled = sampled
        self._table = table
        self._pieces = pieces
        self._offsets: list[int] | None = None
        self._ids: list[int] | None = None
        self._limit: int | None = None
        self.end: int | None = len(pieces) if pieces is not None else None
        self.stop_reason: str | int | None = None

    # ---- per token -------------------------------------------------------------------------------------
    def word(self, i: int) -> int:
        """The index in :data:`WORDS` of plain output token ``i``.  Greedy (``sampled`` False, temperature 0 as
        vLLM's ``SAMPLING_EPS``): the words in order from ``offset``.  Sampled (temperature > 0): each run of
        ``len(WORDS)`` tokens is a permutation of the words drawn from ``offset`` (the request's ``seed``, else a
        per-request draw) and the run number, so a seed repeats its answer, ``n`` choices differ, and every word
        (any one-word stop string) still comes within ``len(WORDS)`` tokens.  Stateless: any ``i`` at any time."""
        n = len(WORDS)
        if not self.sampled:
            return (self.offset + i) % n
        run, j = divmod(i, n)
        h = (self.offset * 0x9E3779B97F4A7C15 + run * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
        h = (h * 0xD6E8FEB86659FD93) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 32
        scale = _UNITS[h % len(_UNITS)]  # a unit mod n: j ↦ scale·j + shift is a permutation of 0..n-1
        return (scale * j + (h >> 16)) % n

    def piece(self, i: int) -> str:
        """The full text of output token ``i`` (before any stop-string cut)."""
        pieces = self._pieces
        if pieces is not None:
            return pieces[i] if i < len(pieces) else " "
        return WORDS[self.word(i)]

    def token_id(self, i: int) -> int:
        """The id of output token ``i``."""
        pieces = self._pieces
        if pieces is not None:
            return self._table.piece_id(pieces[i] if i < len(pieces) else " ")
        return self._table.word_ids[self.word(i)]

    def text(self, start: int, end: int) -> str:
        """The text of output tokens ``[start, end)`` as the client sees it (cut at a matched stop string)."""
        if self._limit is None:
            if self._pieces is None:
                if self.sampled:
                    return "".join(WORDS[self.word(i)] for i in range(start, end))
                words, off, n = WORDS, self.offset, len(WORDS)
                if any(self._table.held):
                    return self._held_text(start, end)
                return "".join(words[(off + i) % n] for i in range(start, end))
            return "".join(self.piece(i) for i in range(start, end))
        offsets = self._char_offsets(end)
        full = "".join(self.piece(i) for i in range(start, end))
        lo, hi = offsets[start], offsets[end]
        return full[:max(min(hi, self._limit) - lo, 0)]

    def _held_text(self, start: int, end: int) -> str:
        """:meth:`text` of a greedy output with held-back words (:attr:`TokenTable.held`): a held token's chunk is
        empty; the next token that is not held carries the run of held tokens right before it (none of the prompt's:
        output token 0 starts the run), then its own text — as vLLM holds text back while it ends inside a
        character, however many tokens that takes."""
        held, n, off = self._table.held, len(WORDS), self.offset
        out: list[str] = []
        for i in range(start, end):
            if held[(off + i) % n]:
                continue
            j = i
            while j > 0 and held[(off + j - 1) % n]:
                j -= 1
            out.extend(WORDS[(off + k) % n] for k in range(j, i + 1))
        return "".join(out)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Ids of output tokens ``[start, end)``."""
        return [self.token_id(i) for i in range(start, end)]

    def logprobs(self, i: int, top: int) -> tuple[str, float, list[tuple[str, float]]]:
        """``(token text, its logprob, [(alternative, logprob), ...])`` for output token ``i``: ``top`` entries,
        the sampled token first (most likely)."""
        token = self.piece(i)
        seed = zlib.crc32(f"{self.offset}:{i}".encode())
        lp = -round(0.05 + (seed % 1000) / 1000.0, 4)
        out: list[tuple[str, float]] = [(token, lp)]
        k = 1
        while len(out) < top and k <= len(WORDS):
            alt = WORDS[(seed + 5 * k) % len(WORDS)]
            k += 1
            if all(alt != t for t, _ in out):
                out.append((alt, round(lp - 0.4 * len(out) - (seed % 7) / 10.0, 4)))
        return token, lp, out[:top]

    # ---- stop resolution ------------------------------------------------------------------------------
    def _char_offsets(self, upto: int) -> list[int]:
        offsets = self._offsets
        if offsets is None or len(offsets) <= upto:
            offsets = [0]
            total = 0
            for i in range(upto):
                total += len(self.piece(i))
                offsets.append(total)
            self._offsets = offsets
        return offsets

    def apply(self, rules: StopRules, max_tokens: int, eos: int | None) -> None:
        """Resolve where this sequence ends by itself under ``rules`` (``eos``: the plain-text EOS position,
        tokens; ``max_tokens``: the engine's cap)."""
        natural = self.end if self._pieces is not None else (None if rules.ignore_eos else eos)
        if natural is not None:
            natural = max(natural, rules.min_tokens)
        self.end, self.stop_reason = natural, None
        if not rules.stop and not rules.stop_token_ids:
            return
        scan = rules.min_tokens + len(WORDS) + max((len(s) for s in rules.stop), default=0) + 1
        if self._pieces is not None:
            scan = max(scan, len(self._pieces))
        scan = min(scan, max_tokens, natural if natural is not None else max_tokens)
        found = self._first_stop(rules, scan)
        if found is not None:
            end, reason, limit = found
            self.end, self.stop_reason, self._limit = end, reason, limit

    def _first_stop(self, rules: StopRules, scan: int) -> tuple[int, str | int, int] | None:
        offsets = self._char_offsets(scan)
        best: tuple[int, str | int, int] | None = None
        if rules.stop_token_ids:
            wanted = set(rules.stop_token_ids)
            for i in range(rules.min_tokens, scan):
                tid = self.token_id(i)
                if tid in wanted:
                    best = (i + 1, tid, offsets[i + 1] if rules.include_stop_str_in_output else offsets[i])
                    break
        if rules.stop:
            text = "".join(self.piece(i) for i in range(scan))
            check_from = offsets[min(rules.min_tokens, scan)]
            for stop in rules.stop:
                idx = text.find(stop, max(check_from - len(stop) + 1, 0))
                if idx < 0:
                    continue
                stop_end = idx + len(stop)
                tokens = bisect.bisect_left(offsets, stop_end, lo=1)
                if best is None or tokens < best[0]:
                    best = (tokens, stop, stop_end if rules.include_stop_str_in_output else idx)
        return best


def plan_output(offset: int, table: TokenTable, rules: StopRules, max_tokens: int, eos: int | None,
                content: str | None = None, sampled: bool = False) -> OutputPlan:
    """The plan of one sequence: plain words from ``offset``, or the fixed ``content`` string (JSON, tool
    arguments) in :data:`PIECE_CHARS`-character pieces; ``rules`` and ``eos`` as in :meth:`OutputPlan.apply`."""
    pieces = None
    if content is not None:
        pieces = [content[i:i + PIECE_CHARS] for i in range(0, len(content), PIECE_CHARS)] or [""]
    plan = OutputPlan(offset, table, pieces, sampled)
    plan.apply(rules, max_tokens, eos)
    return plan


# ---- JSON that fits a schema ------------------------------------------------------------------------------
_SCALARS: Final[Mapping[str, Any]] = MappingProxyType({"string": "sim", "integer": 1, "number": 1.5, "boolean": True,
                                                       "null": None})


def json_example(schema: Any, root: Any = None, depth: int = 0, required_only: bool = False) -> Any:
    """A small JSON value valid under ``schema`` (JSON Schema subset: ``type`` (or a list of types), ``enum``,
    ``const``, ``properties`` + ``required``, ``items``/``prefixItems`` + ``minItems``, ``minLength``,
    ``minimum``, ``anyOf``/``oneOf``/``allOf`` (first branch), local ``$ref``). Every declared property is
    filled (``required_only``: only the required ones at the top level, as a tool call's arguments), so
    ``additionalProperties: false`` holds."""
    root = schema if root is None else root
    if not isinstance(schema, dict) or depth > 12:
        return "sim"
    if "$ref" in schema and isinstance(schema["$ref"], str) and schema["$ref"].startswith("#/"):
        target: Any = root
        for part in schema["$ref"][2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return json_example(target, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return json_example(schema[key][0], root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), kind[0] if kind else "object")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        raw_props = schema.get("properties")
        props: dict[str, Any] = raw_props if isinstance(raw_props, dict) else {}
        if required_only and schema.get("required"):
            props = {k: props.get(k, {}) for k in schema["required"]}
        out = {name: json_example(sub, root, depth + 1) for name, sub in props.items()}
        for name in schema.get("required") or ():
            out.setdefault(name, "sim")
        return out
    if kind == "array":
        if isinstance(schema.get("prefixItems"), list):
            return [json_example(s, root, depth + 1) for s in schema["prefixItems"]]
        count = max(int(schema.get("minItems") or 1), 1)
        return [json_example(schema.get("items", {}), root, depth + 1) for _ in range(count)]
    if kind == "string":
        return "sim".ljust(int(schema.get("minLength") or 0), "m")
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        if isinstance(low, (int, float)):
            value = low + (1 if "exclusiveMinimum" in schema and "minimum" not in schema else 0)
            return int(value) if kind == "integer" else float(value)
        return _SCALARS[kind]
    return _SCALARS.get(str(kind), "sim")


def json_text(value: Any) -> str:
    """``value`` as the JSON text a model writes (``json.dumps`` spacing)."""
    return json.dumps(value, ensure_ascii=False)


def tool_arguments(tool_schema: Any) -> str:
    """Arguments JSON for a function tool whose ``parameters`` schema is ``tool_schema`` (compact, as the
    simulator has always written them)."""
    value = json_example(tool_schema if isinstance(tool_schema, dict) and tool_schema else {"type": "object"},
                         required_only=True)
    return json.dumps(value if isinstance(value, dict) else {}, separators=(",", ":"), ensure_ascii=False)


