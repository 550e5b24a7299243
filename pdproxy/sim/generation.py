"""What the generation loop (``completion.py``) and each API's writer share: the output sequences of one request,
their usage figures, and the :class:`Writer` interface every API implements.

One request is one or more :class:`Seq` (``n`` sequences per prompt, several prompts for a completions list):
choice ``index = prompt_index * n + k``, each its own engine request with its own :class:`OutputPlan`.

A writer turns progress into bytes: :meth:`Writer.head` (events sent as soon as a stream starts: the Responses
API's ``response.created``/``response.in_progress``), :meth:`Writer.output` (new tokens of one sequence),
:meth:`Writer.tail` (after every sequence finished: the usage chunk, ``response.completed``, ``message_delta`` +
``message_stop``), ``done`` (the terminator: ``data: [DONE]`` for the OpenAI chat/completions/generate routes,
nothing for Responses and Messages), :meth:`Writer.failure` (a mid-stream engine failure) and :meth:`Writer.body`
(the JSON answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pdproxy.sim.outputs import OutputPlan
    from pdproxy.sim.scheduler import EngineRequest


@dataclass(slots=True)
class Seq:
    """One output sequence: its choice ``index``, the prompt it continues, its engine request and plan, and how
    many of its tokens were sent so far."""

    index: int
    prompt_index: int
    ereq: EngineRequest
    plan: OutputPlan
    sent: int = 0
    started: bool = False
    finish: str | None = None
    reason: Any = None

    def settle(self) -> None:
        """Take the finish reason and ``stop_reason`` from the finished engine request (the plan's stop string or
        token id when it ended the sequence)."""
        e = self.ereq
        self.finish = e.finish_reason
        if e.stop_reason is not None:
            self.reason = e.stop_reason
        elif e.finish_reason == "stop" and self.plan.end is not None and e.num_output_tokens >= self.plan.end:
            self.reason = self.plan.stop_reason
        else:
            self.reason = None


@dataclass(frozen=True, slots=True)
class Usage:
    """Token figures of a whole request (every prompt counted once, every sequence's output summed).
    ``created``: prompt tokens this engine wrote to its prefix cache (full blocks it computed itself)."""

    prompt: int
    completion: int
    cached: int
    created: int

    @property
    def total(self) -> int:
        """``prompt + completion``."""
        return self.prompt + self.completion


class Writer(Protocol):
    """The bytes of one API's answer (see the module docstring). ``done`` is the stream terminator (may be
    empty); ``include_usage`` / ``continuous_usage`` are the OpenAI ``stream_options``."""

    done: bytes
    include_usage: bool
    continuous_usage: bool

    def head(self) -> list[bytes]:
        """Events sent when the stream starts, before any output."""

    def opening(self, seq: Seq) -> list[bytes]:
        """Events that open ``seq`` when its first output arrives (chat: the role chunk), sent before it; marks
        ``seq.started``."""

    def output(self, seq: Seq, start: int, end: int, finish: str | None, stop_reason: Any,
               usage: Usage | None, last: bool) -> list[bytes]:
        """Events for output tokens ``[start, end)`` of ``seq`` (``finish`` set on its last event; ``last``: no
        later event follows in an OpenAI stream without a usage chunk)."""

    def tail(self, seqs: list[Seq], usage: Usage, kv_params: dict[str, Any] | None) -> list[bytes]:
        """Events after every sequence finished."""

    def failure(self) -> list[bytes]:
        """Events for an engine failure after the stream started (a failed KV pull)."""

    def body(self, seqs: list[Seq], usage: Usage, kv_params: dict[str, Any] | None) -> bytes:
        """The JSON answer of a non-streaming request."""

    def failure_body(self) -> tuple[int, bytes]:
        """Status and JSON body of a non-streaming request the engine failed (a failed KV pull)."""
