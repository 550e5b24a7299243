"""What one pick is about: :class:`PickRequest` (a request as routing sees it) and :class:`PrefixHints`.

:class:`PrefixHints` is the seam for prefix-cache-aware routing: whoever knows which endpoint already holds how
much of a prompt (a prefix index fed by the engines' KV events, or an approximation) fills it in; the filters and
scorers only read it.  The default, :data:`NO_HINTS`, says "nothing is cached anywhere", which makes the prefill
score pure load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdproxy.endpoints import Endpoint

if TYPE_CHECKING:
    from pdproxy.apis.request import ProxyRequest


@dataclass(frozen=True, slots=True)
class PrefixHints:
    """What is known about one prompt's prefix across the endpoints.

    ``cached_tokens``: per endpoint, how many leading tokens of this prompt its prefix cache holds (tokens, at most
    the prompt's length; an endpoint absent from the mapping holds none).  ``routing_key``: bytes that name the
    prompt's first block (the same prompt start gives the same key in every pdproxy replica, e.g. a hash of its
    first block's token ids); None when unknown, and the request id is used instead (see
    :attr:`PickRequest.routing_key`).
    """

    cached_tokens: Mapping[Endpoint, int] = field(default_factory=dict)
    routing_key: bytes | None = None

    def cached(self, endpoint: Endpoint) -> int:
        """Tokens of the prompt ``endpoint`` already holds (0 when unknown)."""
        return self.cached_tokens.get(endpoint, 0)


NO_HINTS = PrefixHints()
"""Nothing is cached anywhere and no routing key is known (the default until a prefix index supplies hints)."""


@dataclass(frozen=True, slots=True)
class PickRequest:
    """One request as the filters, scorers and picker see it.

    ``request_id``: pdproxy's id of the request (the routing key when ``hints`` has none); ``model``: the client's
    ``model`` (None: any endpoint); ``prompt_tokens``: counted or estimated prompt tokens (None: not counted yet,
    e.g. a ``/tokenize`` pick); ``prompt_tokens_upper``: an upper bound on them, checked against the engines'
    limits (None: use ``prompt_tokens``); ``max_output_tokens``: the client's ``max_tokens`` /
    ``max_completion_tokens`` (None: the engine decides); ``dp_rank``: a DP rank the request must run on (None:
    any); ``hints``: the prefix cache's view of this prompt; ``affinity``: the prefiller that has just computed
    this very prompt (a fan-out sibling, :mod:`pdproxy.pd.fanout`), preferred while it can take it
    (:class:`~pdproxy.scheduling.filters.Affinity`); ``whole``: the request runs whole on the endpoint picked,
    prompt and output (``/inference/v1/generate``), so its limits are a decoder's whatever the endpoint's role
    (:class:`~pdproxy.scheduling.filters.FitsLimits`).
    """

    request_id: str = ""
    model: str | None = None
    prompt_tokens: int | None = None
    prompt_tokens_upper: int | None = None
    max_output_tokens: int | None = None
    dp_rank: int | None = None
    hints: PrefixHints = NO_HINTS
    affinity: Endpoint | None = None
    whole: bool = False

    @property
    def limit_tokens(self) -> int | None:
        """The prompt length (tokens) checked against ``max_model_len`` and the KV pool: the upper bound if known."""
        return self.prompt_tokens_upper if self.prompt_tokens_upper is not None else self.prompt_tokens

    @property
    def routing_key(self) -> bytes:
        """The key ties are broken by: the prompt's first-block key when known, else the request id (bytes)."""
        key = self.hints.routing_key
        return key if key is not None else self.request_id.encode()

    @classmethod
    def of(cls, req: ProxyRequest, request_id: str, hints: PrefixHints = NO_HINTS, *,
           affinity: Endpoint | None = None) -> PickRequest:
        """The pick request for a client request after admission (``req.prompt_tokens`` counted and
        ``req.prompt_tokens_upper`` its upper bound), with the prefix lookup's ``hints`` and a fan-out sibling's
        prefiller as ``affinity``."""
        return cls(request_id=request_id, model=req.model, prompt_tokens=req.prompt_tokens,
                   prompt_tokens_upper=req.prompt_tokens_upper, max_output_tokens=req.max_output_tokens,
                   hints=hints, affinity=affinity)
