"""Exact greedy continuation in the simulator: a prompt that ends with tokens this engine generated greedily
continues where that generation stopped, as a real model's greedy decode does.

A greedy request's word offset is ``crc32`` of its prompt ids (:mod:`pdproxy.sim.completion`), so a request for
``prompt + generated`` would otherwise start elsewhere in the word list.  :func:`greedy_offset` finds the shortest
prefix ``prompt[:j]`` whose own greedy output is ``prompt[j:]`` (the trailing run of consecutive words starting at
that prefix's offset) and returns that prefix's offset advanced by ``len(prompt) - j``.  The shortest such prefix
is the same for a prompt and for that prompt plus its own greedy output, so continuing a cut stream with its prompt
ids and every delivered id (``return_token_ids``) reproduces the uninterrupted run token for token.
"""

from __future__ import annotations

import asyncio
import struct
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdproxy.sim.outputs import WORDS, TokenTable

if TYPE_CHECKING:
    from aiohttp import web

    from pdproxy.sim.generation import Writer

MID_STREAM_KINDS = ("error_after_events", "stall_after_events")
"""Fault kinds (:mod:`pdproxy.sim.faults`) that end a stream after ``events`` events the way a lost decoder
does: vLLM's in-band error event (then the route's terminator), or silence with the connection kept open."""


def greedy_offset(prompt: Sequence[int], table: TokenTable) -> int:
    """The word offset of a greedy request for ``prompt`` (token ids): see the module docstring.  A generated word
    in the prompt may be its output id (a continuation by ids) or its text's full encoding (a continuation by
    text, ``continue_final_message``)."""
    n = len(WORDS)
    bounds, words = _trailing_words(prompt, table)
    packed = struct.pack(f"<{len(prompt)}q", *prompt)
    first = bounds[0] if bounds else len(prompt)
    crc = zlib.crc32(packed[:8 * first])
    done = first
    for i, j in enumerate(bounds):
        crc = zlib.crc32(packed[8 * done:8 * j], crc)
        done = j
        if crc % n == words[i]:
            return crc + (len(words) - i)
    return zlib.crc32(packed[8 * done:], crc)


def _trailing_words(prompt: Sequence[int], table: TokenTable) -> tuple[list[int], list[int]]:
    """The trailing run of consecutive words (word index ``k`` then ``k + 1`` mod ``len(WORDS)``) in ``prompt``:
    ``(start position of each word, word index of each word)``, in prompt order."""
    n = len(WORDS)
    starts: list[int] = []
    words: list[int] = []
    end = len(prompt)
    while end > 0:
        candidates = range(n) if not words else ((words[-1] - 1) % n,)
        found = None
        for k in candidates:
            enc = table.word_encodings[k]
            if len(enc) > 1 and end >= len(enc) and tuple(prompt[end - len(enc):end]) == enc:
                found = (k, len(enc))
                break
            if prompt[end - 1] == table.word_ids[k]:
                found = (k, 1)
                break
        if found is None:
            break
        words.append(found[0])
        end -= found[1]
        starts.append(end)
    starts.reverse()
    words.reverse()
    return starts, words


async def mid_stream_fault(resp: web.StreamResponse, kind: str, writer: Writer | None) -> None:
    """Fire a :data:`MID_STREAM_KINDS` fault on a started stream: ``error_after_events`` writes the writer's
    failure events (vLLM's ``data: {"error": …}`` for the OpenAI routes) and its terminator;
    ``stall_after_events`` never writes again (the handler is cancelled when the client leaves)."""
    if kind == "error_after_events" and writer is not None:
        await resp.write(error_events(writer))
        return
    await asyncio.Event().wait()


def error_events(writer: Writer) -> bytes:
    """vLLM's in-band error event(s) of ``writer``'s route and its terminator, as one write."""
    return b"".join([*writer.failure(), writer.done])
