"""The PD decision: does a request go through a prefiller, or straight to a decoder that prefills it itself?

A named scheduling step the director asks after admission and before the prefill leg
(:meth:`pdproxy.pd.director.Director.admit`): each :class:`Decider` looks at the request and answers a *reason*
to skip the prefiller, or None.  The first reason wins; with none the request is disaggregated.  The reasons are
the ``reason`` label of ``pdproxy_decode_only_total`` (docs/decode-only.md).

- :class:`ShortPrompt` (``short_prompt``): the prompt is at most ``decode_only_max_prompt_tokens`` — the transfer
  would cost more than the decoder computing it (off by default).
- :class:`PrefillersBusyWithLongWork` (``prefillers_busy``): the prompt is at most
  ``decode_only_busy_max_prompt_tokens`` and every prefiller that could take it is computing a long prefill (one of
  at least ``prefill_busy_tokens`` uncached tokens, :meth:`PrefillQueue.congested
  <pdproxy.scheduling.queue.PrefillQueue.congested>`): vLLM finishes a running chunked prefill before it starts a
  newer request, so the small prompt would wait the whole long prefill there, while a decoder computes it at once.
  Many small prefills in flight are not long work, so a burst of short prompts stays disaggregated.

The shape follows llm-d's prompt-length-based PD decider (a plugin that says whether to run the prefill stage);
the thresholds are pdproxy's settings.
"""

from __future__ import annotations

from typing import Protocol

from pdproxy.scheduling.queue import PrefillQueue
from pdproxy.scheduling.request import PickRequest
from pdproxy.settings import Settings


class Decider(Protocol):
    """One rule of the PD decision.  ``name``: the rule's name (for logs and docs)."""

    name: str

    def decode_only(self, prompt_tokens: int, request: PickRequest) -> str | None:
        """The reason to send a ``prompt_tokens``-token request straight to a decoder, or None to keep the
        prefill leg."""
        ...


class ShortPrompt:
    """``short_prompt``: prompts of at most ``max_prompt_tokens`` tokens skip the prefiller."""

    name = "short_prompt"

    def __init__(self, max_prompt_tokens: int) -> None:
        self.max_prompt_tokens = max_prompt_tokens

    def decode_only(self, prompt_tokens: int, request: PickRequest) -> str | None:
        return self.name if prompt_tokens <= self.max_prompt_tokens else None


class PrefillersBusyWithLongWork:
    """``prefillers_busy``: a prompt of at most ``max_prompt_tokens`` tokens skips the prefillers while every one
    that could take it runs a long prefill (``queue``'s :meth:`~PrefillQueue.congested`)."""

    name = "prefillers_busy"

    def __init__(self, queue: PrefillQueue, max_prompt_tokens: int) -> None:
        self.queue = queue
        self.max_prompt_tokens = max_prompt_tokens

    def decode_only(self, prompt_tokens: int, request: PickRequest) -> str | None:
        if prompt_tokens <= self.max_prompt_tokens and self.queue.congested(request):
            return self.name
        return None


class PDDecision:
    """The deciders in order; :meth:`decode_only` is the first reason any of them gives."""

    def __init__(self, deciders: list[Decider]) -> None:
        self.deciders = deciders

    @classmethod
    def from_settings(cls, settings: Settings, queue: PrefillQueue) -> PDDecision:
        """The deciders the settings turn on (a 0 threshold turns its rule off)."""
        deciders: list[Decider] = []
        if settings.decode_only_max_prompt_tokens:
            deciders.append(ShortPrompt(settings.decode_only_max_prompt_tokens))
        if settings.decode_only_busy_max_prompt_tokens:
            deciders.append(PrefillersBusyWithLongWork(queue, settings.decode_only_busy_max_prompt_tokens))
        return cls(deciders)

    def decode_only(self, prompt_tokens: int, request: PickRequest) -> str | None:
        """The first decider's reason to skip the prefiller, or None (disaggregate)."""
        for decider in self.deciders:
            reason = decider.decode_only(prompt_tokens, request)
            if reason is not None:
                return reason
        return None
