"""Per-endpoint context limits — ``max_model_len`` and the real KV pool — and the over-length 400.

Sources: ``max_model_len`` from ``/v1/models`` (vLLM ``ModelCard.max_model_len``), the KV pool from ``/metrics``
``vllm:cache_config_info`` (``num_gpu_blocks × block_size`` tokens, or ``kv_cache_size_tokens``; docs/real-vllm.md),
both read from ``state.infos`` (:class:`~pdproxy.engines.control.EngineInfo`, refreshed by ``health.py``).  The
``max_model_len`` setting caps what engines declare (never raises it: the engine refuses past its own, so a larger
setting is logged once per engine and the engine's figure kept) and stands alone for an engine that declares
none.  Unknown values impose no limit (the engine decides).

Rules (the PD trap: the prefiller validates a leg of ``max_tokens=1``, so only the proxy can check the decoder's
rule before a prefill is spent):

- prefiller: ``prompt + 1 <= max_model_len`` (the prefill leg asks for ``max_tokens=1``, and vLLM checks
  ``prompt + max_tokens <= max_model_len``) and ``prompt <= kv_pool`` (a prompt larger than the pool can never be
  scheduled: ``vllm/v1/core/sched/scheduler.py``, ``schedule``, stops admitting at the first waiting request
  ``allocate_slots`` cannot place; on vLLM-Ascend 0.23 one such request held every other one for 36 minutes,
  ``docs/field-reports.md``);
- decoder: ``prompt + 1 <= kv_pool`` (room for the prompt and at least one output token), and against
  ``max_model_len`` one of two rules (setting ``max_tokens_overflow``):

  - ``clamp`` (default; what vLLM 0.32 does, seen on the real engine — ``tests/real_vllm/captures/length_*.json``):
    the engine lowers ``max_tokens`` to the room left, so only ``prompt + 1 <= max_model_len`` is required; a prompt
    of exactly ``max_model_len`` tokens gets vLLM's "max_tokens must be at least 1, got 0" (``param: max_tokens``);
  - ``reject`` (vLLM ≤ 0.26, ``renderers/params.py::_token_len_check``, and vLLM-Ascend builds on it):
    ``prompt + max_tokens <= max_model_len``, checked here so that no prefill is spent on a request the decoder
    would refuse (the PD trap above).

A request is admitted when some prefiller and some decoder *serving its model* allow its prompt
(:mod:`pdproxy.engines.models`: two models on two pools have their own limits); :meth:`Limits.max_prompt_tokens`
is that threshold ("M"), so a counted prompt of M tokens passes and M + 1 is rejected.  Which endpoints a request
then goes to is the scheduler's limits filter (:class:`pdproxy.scheduling.filters.FitsLimits`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineInfo, request_pool
from pdproxy.engines.models import ServedModels
from pdproxy.engines.pool import EndpointPool
from pdproxy.errors import PromptTooLong

log = logging.getLogger("pdproxy.limits")

LimitKind = Literal["max_model_len", "kv_pool"]

SNAPSHOT_TTL_S = 0.05
"""How long (seconds) a snapshot of every endpoint's limits is reused."""


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What bounds one endpoint, in tokens (None = unknown)."""

    max_model_len: int | None = None
    kv_pool_tokens: int | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None

    @property
    def usable_pool(self) -> int | None:
        """The KV tokens one request can hold: :func:`~pdproxy.engines.control.request_pool` (the pool less vLLM's
        null block)."""
        return request_pool(self.kv_pool_tokens, self.block_size)

    def allowed_prompt(self, role: Role, max_output: int | None, clamp: bool = True) -> int | None:
        """The largest prompt (tokens) this endpoint accepts in ``role``; None = no known limit.  ``clamp``: the
        engine lowers ``max_tokens`` to fit (vLLM 0.32), so only one output token must fit."""
        caps: list[int] = []
        if self.max_model_len is not None:
            out = 1 if role is Role.PREFILL or clamp else max_output or 1
            caps.append(self.max_model_len - out)
        pool = self.usable_pool
        if pool is not None:                    # a decoder's pool holds the output too (pdproxy caps it there, or
            out = 0 if role is Role.PREFILL else 1 if clamp else max_output or 1   # with reject refuses)
            caps.append(pool - out)
        return min(caps) if caps else None

    def output_room(self, prompt: int, asked: int | None, choices: int = 1) -> int | None:
        """The output-token limit (tokens, ≥ 1) a request of ``prompt`` tokens and ``choices`` sequences must carry
        for its answer to fit this engine's KV pool (less vLLM's null block), each sequence a share; None when the
        pool is unknown or ``asked`` fits — the limit the engine would apply, None for the room ``max_model_len``
        leaves (vLLM's limit when a chat sets none).  Why the pool binds: ``DecodeLeg.output_room``
        (pdproxy/pd/decode.py)."""
        pool = self.usable_pool
        if pool is None:
            return None
        room = max(1, (pool - prompt) // max(1, choices))
        if asked is None:
            asked = None if self.max_model_len is None else self.max_model_len - prompt
        return None if asked is not None and asked <= room else room

    def prompt_bounds(self, role: Role) -> tuple[int | None, int | None]:
        """The two bounds :meth:`allowed_prompt` (clamped: one output token) takes the smaller of, in tokens: (the
        largest prompt ``max_model_len`` lets this endpoint take in ``role``, the largest its KV pool holds — the
        pool on a prefiller, one less on a decoder, whose pool holds the answer's first token too); None where
        unknown.  A pool bound below the other is a cliff: prompts between the two fit ``max_model_len`` but would
        wait forever for the pool (the start-up line and ``pdproxy doctor`` say so)."""
        by_len = None if self.max_model_len is None else self.max_model_len - 1
        pool = self.usable_pool
        by_pool = None if pool is None else pool - (0 if role is Role.PREFILL else 1)
        return by_len, by_pool

    def violation(self, role: Role, endpoint: Endpoint, prompt: int, max_output: int | None,
                  clamp: bool = True) -> Violation | None:
        """The rule ``prompt`` breaks on this endpoint, max_model_len first; None if it fits."""
        requested = role is Role.DECODE and max_output is not None and not clamp
        out = max_output if requested and max_output is not None else 1
        if self.max_model_len is not None and prompt + out > self.max_model_len:
            return Violation(role, endpoint.name, "max_model_len", self.max_model_len, out, self, requested)
        kv_out = out if role is Role.DECODE else 0
        pool = self.usable_pool
        if pool is not None and prompt + kv_out > pool:
            return Violation(role, endpoint.name, "kv_pool", pool, kv_out, self, requested)
        return None


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule: ``limit`` tokens of ``limit_kind`` on ``endpoint`` (role ``role``), with
    ``output_tokens`` counted on top of the prompt (``requested``: the client's ``max_tokens``; else the one token
    every leg must generate)."""

    role: Role
    endpoint: str
    limit_kind: LimitKind
    limit: int
    output_tokens: int
    limits: EngineLimits
    requested: bool = False

    def ambiguous(self, prompt_tokens: int, *, exact: bool) -> bool:
        """True when a lower bound of ``prompt_tokens`` cannot choose vLLM's wording: a ``max_model_len`` L
        rejection at a bound of at most L (exactly L gets the ``max_tokens`` 400, more than L the ``input_tokens``
        one), so the prompt must be counted exactly."""
        return not exact and self.limit_kind == "max_model_len" and prompt_tokens <= self.limit

    def error(self, prompt_tokens: int, *, exact: bool) -> PromptTooLong:
        """The HTTP 400 for this violation (``prompt_tokens``: the counted prompt, a lower bound unless ``exact``).

        ``max_model_len`` — vLLM 0.32's own bodies, word for word (``vllm/renderers/params.py``; seen on the real
        engine, ``tests/real_vllm/captures/length_*.json``), so the client reads what the engine would have said:

        - a prompt over ``max_model_len`` L: "... your prompt contains at least L+1 input tokens, which exceeds this
          limit even without any output tokens ..." (``param: input_tokens``, ``value=L+1``) whatever the count —
          vLLM's tokenizer truncates at L+1;
        - a prompt of exactly L (no room for one output token): "max_tokens must be at least 1, got 0."
          (``param: max_tokens``) — the caller must know the count is exactly L, not a lower bound;
        - ``requested`` (``max_tokens_overflow = reject``, vLLM ≤ 0.26): "you requested N output tokens and your
          prompt contains ..." with pdproxy's count.

        ``kv_pool`` has no vLLM equivalent (vLLM queues the request forever: ``vllm/v1/core/sched/scheduler.py``,
        ``schedule``): pdproxy's message keeps the phrase "maximum context length" and names the counted tokens and
        the pool (blocks × block size).
        """
        n = f"{prompt_tokens}" if exact else f"at least {prompt_tokens}"
        total = prompt_tokens + self.output_tokens
        total_s = f"{total}" if exact else f"at least {total}"
        tail = f"(parameter=input_tokens, value={prompt_tokens})"
        param = "input_tokens"
        if self.limit_kind == "max_model_len":
            if prompt_tokens > self.limit:
                value = self.limit + 1
                msg = (f"This model's maximum context length is {self.limit} tokens. However, your prompt contains "
                       f"at least {value} input tokens, which exceeds this limit even without any output tokens. "
                       f"Please reduce the length of the input prompt. (parameter=input_tokens, value={value})")
            elif self.requested:
                msg = (f"This model's maximum context length is {self.limit} tokens. However, you requested "
                       f"{self.output_tokens} output tokens and your prompt contains {n} input tokens, for a total "
                       f"of {total_s} tokens. Please reduce the length of the input prompt or the number of "
                       f"requested output tokens. {tail}")
            else:  # the prompt fills the context: vLLM 0.32 clamps max_tokens to 0 and refuses that
                room = max(0, self.limit - prompt_tokens)
                param = "max_tokens"
                msg = f"max_tokens must be at least 1, got {room}. (parameter=max_tokens, value={room})"
        else:
            lim = self.limits
            declared = (f"is declared as {lim.max_model_len} tokens, but" if lim.max_model_len is not None
                        else "is limited by")
            blocks = (f" ({lim.num_gpu_blocks} blocks × {lim.block_size} tokens less vLLM's null block)"
                      if lim.num_gpu_blocks and lim.block_size else "")
            needs = (f"you requested {self.output_tokens} output tokens and your prompt contains {n} input tokens, "
                     f"for a total of {total_s} tokens" if self.requested
                     else f"your prompt contains {n} input tokens and needs room for at least 1 output token, "
                     f"for a total of {total_s} tokens" if self.output_tokens
                     else f"your prompt contains {n} input tokens")
            msg = (f"This model's maximum context length {declared} the KV cache pool of the {self.role.value} "
                   f"engine {self.endpoint} holds only {self.limit} tokens{blocks}, which is the effective maximum "
                   f"context length. However, {needs}, which exceeds the KV pool. Please reduce the length of the "
                   f"input prompt{' or the number of requested output tokens' if self.requested else ''}. {tail}")
        return PromptTooLong(msg, limit_kind=self.limit_kind, prompt_tokens=prompt_tokens, limit=self.limit,
                             param=param)


class Limits:
    """Every endpoint's limits, read from the pool's endpoints and ``infos``.  The table is rebuilt at most every
    :data:`SNAPSHOT_TTL_S` seconds (engines' figures change only when ``health.py`` refreshes them), which keeps
    the per-request cost to a few dictionary lookups."""

    def __init__(self, pool: EndpointPool, infos: Mapping[Endpoint, EngineInfo], *,
                 max_model_len_override: int | None = None, clamp: bool = True,
                 served: ServedModels | None = None) -> None:
        self.pool = pool
        self.clamp = clamp
        self.infos = infos
        self.served = served if served is not None else ServedModels(infos)
        self.max_model_len_override = max_model_len_override
        self._over: set[Endpoint] = set()     # endpoints whose own max_model_len is under the setting (logged once)
        self._table: dict[Endpoint, EngineLimits] = {}
        self._by_role: dict[Role, list[tuple[Endpoint, EngineLimits]]] = {}
        self._m: dict[tuple[int | None, str | None], int | None] = {}
        self._built_at = -1.0

    def _snapshot(self) -> dict[Role, list[tuple[Endpoint, EngineLimits]]]:
        now = time.monotonic()
        if now - self._built_at > SNAPSHOT_TTL_S:
            self._table = {e: self._read(e) for e in self.pool.endpoints()}
            self._by_role = {r: [(e, lim) for e, lim in self._table.items() if e.role is r] for r in Role}
            self._m = {}
            self._built_at = now
        return self._by_role

    def of(self, endpoint: Endpoint) -> EngineLimits:
        """The limits of ``endpoint`` (tokens; None = unknown)."""
        self._snapshot()
        found = self._table.get(endpoint)
        return found if found is not None else self._read(endpoint)

    def table(self) -> Mapping[Endpoint, EngineLimits]:
        """Every pool endpoint's limits as of the current snapshot (for a filter that reads many at once; an
        endpoint missing from it is read with :meth:`of`)."""
        self._snapshot()
        return self._table

    def _read(self, endpoint: Endpoint) -> EngineLimits:
        info = self.infos.get(endpoint)
        cap = self.max_model_len_override
        if info is None:
            return EngineLimits(max_model_len=cap)
        mml = info.max_model_len
        if cap and mml is not None and cap > mml and endpoint not in self._over:
            self._over.add(endpoint)
            log.warning("max_model_len %d is over engine %s's own (%d): that engine's limit stays", cap,
                        endpoint.name, mml)
        mml = cap if mml is None else min(cap, mml) if cap else mml
        return EngineLimits(max_model_len=mml,
                            kv_pool_tokens=info.kv_pool_tokens, num_gpu_blocks=info.num_gpu_blocks,
                            block_size=info.block_size)

    def _best(self, role: Role, max_output: int | None, model: str | None = None, rule: Role | None = None
              ) -> tuple[int | None, Endpoint | None]:
        """The most permissive endpoint of ``role`` serving ``model`` (configured, healthy or not), judged by the
        limits of ``rule`` (default: ``role``'s): (allowed prompt, endpoint)."""
        rule = rule or role
        best: int | None = None
        best_ep: Endpoint | None = None
        serves = self.served.serves
        for e, lim in self._snapshot()[role]:
            if model and not serves(e, model):
                continue
            allowed = lim.allowed_prompt(rule, max_output, self.clamp)
            if allowed is None:
                return None, e
            if best is None or allowed > best:
                best, best_ep = allowed, e
        return best, best_ep

    def context_len(self, role: Role, model: str | None = None) -> int | None:
        """The largest ``max_model_len`` (tokens) among the endpoints of ``role`` serving ``model`` (None: any);
        None when one of them does not declare it or there are none."""
        best: int | None = None
        serves = self.served.serves
        for e, lim in self._snapshot()[role]:
            if model and not serves(e, model):
                continue
            if lim.max_model_len is None:
                return None
            best = lim.max_model_len if best is None else max(best, lim.max_model_len)
        return best

    def max_prompt_tokens(self, max_output: int | None, *, roles: tuple[Role, ...] = (Role.PREFILL, Role.DECODE),
                          model: str | None = None) -> int | None:
        """M: the largest prompt some endpoint of every role in ``roles`` serving ``model`` (None: any) accepts
        (None = no known limit).  A role with an endpoint of unknown limits, or with no endpoints, imposes none."""
        by_role = self._snapshot()
        key = (max_output, model)
        cached = roles == (Role.PREFILL, Role.DECODE)
        if cached and key in self._m:
            return self._m[key]
        bests = [b for b in (self._best(r, max_output, model)[0] for r in roles if by_role[r]) if b is not None]
        found = min(bests) if bests else None
        if cached:
            if len(self._m) > 4096:
                self._m.clear()
            self._m[key] = found
        return found

    def violation(self, prompt_tokens: int, max_output: int | None,
                  roles: tuple[Role, ...] = (Role.PREFILL, Role.DECODE), model: str | None = None,
                  rule: Role | None = None) -> Violation | None:
        """The rule a prompt breaks on the most permissive endpoint serving ``model`` of the first role (prefill,
        then decode) where no endpoint accepts it; None when every role has an endpoint that does.  ``rule``: judge
        every role's endpoints by that role's limits (``Role.DECODE`` for a request run whole on one engine, prompt
        and output: ``PickRequest.whole``); default: each role's own."""
        for role in roles:
            best, endpoint = self._best(role, max_output, model, rule)
            if best is not None and endpoint is not None and prompt_tokens > best:
                found = self.of(endpoint).violation(rule or role, endpoint, prompt_tokens, max_output, self.clamp)
                if found is not None:
                    return found
        return None
