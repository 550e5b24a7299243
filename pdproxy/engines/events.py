"""What ``pdproxy serve`` says about its engines: each change logged once, never per request or per probe.

:class:`EngineEvents` is told the outcome of every health probe (``observe``) and every breaker transition
(``breaker_changed``) by :class:`pdproxy.engines.health.HealthMonitor`, remembers what it last said per endpoint, and
logs (logger ``pdproxy.engines``) only when that changes:

=========================  =======  ===================================================================
``event``                  level    when
=========================  =======  ===================================================================
``engine_up``              INFO     first successful probe: model(s), ``max_model_len``, KV pool
``engine_unreachable``     WARNING  a probe failed (first probe, or the engine was up): the error
``engine_reachable``       INFO     up again after being unreachable, with its limits
``engine_limits_changed``  WARNING  ``max_model_len`` or the KV pool differ from the last figures
``breaker_opened``         WARNING  the endpoint's circuit breaker opened (consecutive failures, or refused)
``breaker_closed``         INFO     it closed again (a request succeeded)
``models_disjoint``        WARNING  the prefillers and the decoders list no model in common (every request
                                    would get 404): each role's models
``models_agree``           INFO     they list one in common again
``model_unservable``       WARNING  a model only prefillers serve (no decoder does): every request for it gets
                                    404 and ``/v1/models`` does not list it — once per model, until a decoder
                                    serves it (:meth:`pdproxy.engines.models.ServedModels.servable`)
``model_decoders_only``    INFO     a model only decoders serve while there are prefillers: served by the
                                    routes without a PD leg (a pooling or speech model) and decode-only
                                    requests, a 404 for a request through a prefiller — once per model
=========================  =======  ===================================================================

Every record carries ``event``, ``endpoint`` and ``role`` (and the figures) in ``extra``, so the JSON log format
(:mod:`pdproxy.ops.logs`) has them as fields.  Holds no lock: one event loop calls it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.breaker import BreakerState
from pdproxy.engines.control import EngineInfo
from pdproxy.engines.limits import EngineLimits
from pdproxy.engines.models import ServedModels

log = logging.getLogger("pdproxy.engines")


@dataclass(frozen=True, slots=True)
class _Said:
    up: bool
    max_model_len: int | None
    kv_pool_tokens: int | None


def _num(n: int | None) -> str:
    return "unknown" if n is None else f"{n:,}"


def describe(info: EngineInfo, role: Role = Role.PREFILL) -> str:
    """``model m, max_model_len 4,096, KV pool 16,384 tokens (4,096 blocks × 4)`` from the info of an engine of
    ``role`` — and, when its pool rather than ``max_model_len`` bounds the prompts it takes, the largest it takes
    (admission's own figure, :meth:`pdproxy.engines.limits.EngineLimits.prompt_bounds`): the pool on a prefiller,
    one token less on a decoder (the answer's first token must fit too).  A request needs a prefiller *and* a
    decoder, so a prefiller's line also gives what a decoder with the same pool takes: with equal pools, that is
    the largest prompt pdproxy admits."""
    models = ", ".join(str(m.get("id")) for m in info.models) or "none"
    blocks = (f" ({info.num_gpu_blocks:,} blocks × {info.block_size}, one of them vLLM's null block)"
              if info.num_gpu_blocks and info.block_size else "")
    text = f"model {models}, max_model_len {_num(info.max_model_len)}, KV pool {_num(info.kv_pool_tokens)} tokens{blocks}"
    pool, mml = info.kv_pool_tokens, info.max_model_len
    if pool is None or mml is None:
        return text
    limits = EngineLimits(max_model_len=mml, kv_pool_tokens=pool, block_size=info.block_size)
    by_len, largest = limits.prompt_bounds(role)
    if largest is not None and by_len is not None and largest < by_len:
        if role is Role.DECODE:
            takes = f"this decoder takes prompts of at most {largest:,} tokens (the answer's first token must fit too)"
        else:
            decoder = limits.prompt_bounds(Role.DECODE)[1]
            takes = (f"this prefiller takes prompts of at most {largest:,} tokens and a decoder with the same pool "
                     f"{decoder:,} (the answer's first token must fit too)")
        text += (f" — below max_model_len: {takes}; longer ones would queue forever in the engine, so a prompt is "
                 "refused with a 400 unless some prefiller and some decoder take it")
    return text


class EngineEvents:
    """Logs each change of an engine's reachability, limits or breaker once (see module docstring)."""

    def __init__(self, served: ServedModels | None = None) -> None:
        self._said: dict[Endpoint, _Said] = {}
        self._disjoint = False
        self.served = served
        """The served-model view the models of one role are judged by (the operator's pins applied); None: one
        without pins, over the ``infos`` :meth:`served_models` is given."""
        self._one_role: dict[str, Role] = {}
        """The models last said to be served by one role only (``model_unservable``, ``model_decoders_only``)."""

    def served_models(self, infos: Mapping[Endpoint, EngineInfo]) -> None:
        """After a refresh: warn once when the prefillers and the decoders that listed their models have none in
        common (a ``--served-model-name`` that differs between them: every request would get 404), and say once
        when they agree again; and once per model served by one role only (``model_unservable``,
        ``model_decoders_only``)."""
        self._models_of_one_role(infos)
        ids: dict[Role, set[str]] = {Role.PREFILL: set(), Role.DECODE: set()}
        for e, info in infos.items():
            ids[e.role].update(info.model_ids())
        prefill, decode = sorted(ids[Role.PREFILL]), sorted(ids[Role.DECODE])
        disjoint = bool(prefill and decode and not ids[Role.PREFILL] & ids[Role.DECODE])
        if disjoint == self._disjoint:
            return
        self._disjoint = disjoint
        if disjoint:
            log.warning("no model is served by both a prefiller and a decoder (prefillers: %s; decoders: %s): every "
                        "request gets 404 until the engines' --served-model-name agree", ", ".join(prefill),
                        ", ".join(decode), extra={"event": "models_disjoint", "prefill_models": prefill,
                                                  "decode_models": decode})
        else:
            log.info("the prefillers and the decoders serve a model in common again",
                     extra={"event": "models_agree"})

    def _models_of_one_role(self, infos: Mapping[Endpoint, EngineInfo]) -> None:
        """Say once per model when only one role's endpoints serve it (module docstring); a model served by both
        again, or by none, is forgotten (said again if it comes back to one role)."""
        served = self.served if self.served is not None else ServedModels(infos)
        now = served.one_role()
        for model, role in now.items():
            if self._one_role.get(model) is role:
                continue
            if role is Role.PREFILL:
                log.warning("model %s is served by prefillers only, by no decoder: every request for it gets 404 "
                            "and /v1/models does not list it (check the decoders' --served-model-name)", model,
                            extra={"event": "model_unservable", "model": model, "role": role.value})
            else:
                log.info("model %s is served by decoders only, by no prefiller: its routes without a PD leg (a "
                         "pooling or speech model's) and decode-only requests are served, a generation request "
                         "through a prefiller gets 404", model,
                         extra={"event": "model_decoders_only", "model": model, "role": role.value})
        self._one_role = now

    def observe(self, endpoint: Endpoint, info: EngineInfo | None, up: bool) -> None:
        """A probe of ``endpoint`` ended: ``up`` (``/health`` 200 and ``/v1/models`` answered), ``info`` (what the
        engine declared, possibly stale when ``up`` is False)."""
        before = self._said.get(endpoint)
        now = _Said(up, info.max_model_len if info and up else None, info.kv_pool_tokens if info and up else None)
        fields = {"endpoint": endpoint.name, "role": endpoint.role.value}
        if not up:
            if before is None or before.up:
                error = (info.error if info is not None and info.error else None) or "/health did not answer 200"
                log.warning("engine %s (%s) unreachable: %s", endpoint.name, endpoint.role.value, error,
                            extra={"event": "engine_unreachable", "error": error, **fields})
                self._said[endpoint] = _Said(False, before.max_model_len if before else None,
                                             before.kv_pool_tokens if before else None)
            return
        assert info is not None
        limits = {"max_model_len": info.max_model_len, "kv_pool_tokens": info.kv_pool_tokens, **fields}
        if before is None or not before.up:
            event = "engine_up" if before is None or before.max_model_len is None else "engine_reachable"
            log.info("engine %s (%s) %s: %s", endpoint.name, endpoint.role.value,
                     "up" if event == "engine_up" else "reachable again", describe(info, endpoint.role),
                     extra={"event": event, **limits})
            if before is not None and before.max_model_len is not None and \
                    (before.max_model_len, before.kv_pool_tokens) != (now.max_model_len, now.kv_pool_tokens):
                self._limits_changed(endpoint, before, now, limits)
        elif (before.max_model_len, before.kv_pool_tokens) != (now.max_model_len, now.kv_pool_tokens):
            self._limits_changed(endpoint, before, now, limits)
        self._said[endpoint] = now

    def _limits_changed(self, endpoint: Endpoint, before: _Said, now: _Said, limits: Mapping[str, object]) -> None:
        parts = []
        if before.max_model_len != now.max_model_len:
            parts.append(f"max_model_len {_num(before.max_model_len)} → {_num(now.max_model_len)}")
        if before.kv_pool_tokens != now.kv_pool_tokens:
            parts.append(f"KV pool {_num(before.kv_pool_tokens)} → {_num(now.kv_pool_tokens)} tokens")
        log.warning("engine %s (%s) limits changed: %s", endpoint.name, endpoint.role.value, ", ".join(parts),
                    extra={"event": "engine_limits_changed", "previous_max_model_len": before.max_model_len,
                           "previous_kv_pool_tokens": before.kv_pool_tokens, **limits})

    def breaker_changed(self, endpoint: Endpoint, before: BreakerState, after: BreakerState, *,
                        failures: int = 0, retry_in_s: float = 0.0) -> None:
        """The breaker of ``endpoint`` went from ``before`` to ``after`` (``failures``: consecutive failures;
        ``retry_in_s``: seconds until it lets a trial through)."""
        if before is after:
            return
        fields = {"endpoint": endpoint.name, "role": endpoint.role.value, "breaker": after.value}
        if after is BreakerState.OPEN:
            log.warning("breaker of %s (%s) opened after %d consecutive failure(s): no traffic for %.1f s, then a "
                        "trial request", endpoint.name, endpoint.role.value, failures, retry_in_s,
                        extra={"event": "breaker_opened", "failures": failures, "retry_in_s": round(retry_in_s, 3),
                               **fields})
        elif after is BreakerState.CLOSED:
            log.info("breaker of %s (%s) closed: the engine serves again", endpoint.name, endpoint.role.value,
                     extra={"event": "breaker_closed", **fields})
        else:
            log.debug("breaker of %s (%s) half-open: one trial request", endpoint.name, endpoint.role.value,
                      extra={"event": "breaker_half_open", **fields})

    def forget(self, endpoint: Endpoint) -> None:
        """``endpoint`` left the pool (admin API): nothing more is said about it."""
        self._said.pop(endpoint, None)
