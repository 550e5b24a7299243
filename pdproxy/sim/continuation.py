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
    """The word offset of a greedy request for ``prompt`` (token ids): see the module docstring."""
    n = len(WORDS)
    index = {tid: k for k, tid in enumerate(table.word_ids)}
    packed = struct.pack(f"<{len(prompt)}q", *prompt)
    run = len(prompt)  # start of the trailing run of consecutive words
    while run > 0:
        k = index.get(prompt[run - 1])
        if k is None:
            break
        if run < len(prompt) and (k + 1) % n != index[prompt[run]]:
            break
        run -= 1
    crc = zlib.crc32(packed[:8 * run])
    for j in range(run, len(prompt)):
        if crc % n == index[prompt[j]] % n:
            return crc + (len(prompt) - j)
        crc = zlib.crc32(packed[8 * j:8 * j + 8], crc)
    return crc


async def mid_stream_fault(resp: web.StreamResponse, kind: str, writer: Writer | None) -> None:
    """Fire a :data:`MID_STREAM_KINDS` fault on a started stream: ``error_after_events`` writes the writer's
    failure events (vLLM's ``data: {"error": …}`` for the OpenAI routes) and its terminator;
    ``stall_after_events`` never writes again (the handler is cancelled when the client leaves)."""
    if kind == "error_after_events" and writer is not None:
        for event in [*writer.failure(), writer.done]:
            if event:
                await resp.write(event)
        return
    await asyncio.Event().wait()
