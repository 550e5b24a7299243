"""Which models each endpoint serves, and the union pdproxy lists on ``GET /v1/models``.

Sources, per endpoint:

- the ``id`` of every card its ``GET /v1/models`` listed at the last refresh (``EngineInfo.models``, refreshed by
  :mod:`pdproxy.engines.health`): the served model name(s) and every LoRA adapter, which vLLM lists as its own card with a
  ``parent`` (``vllm/entrypoints/openai/models/serving.py::show_available_models``; ``"max_model_len": null``);
- the operator's pins (endpoint config ``models: [...]``, :class:`pdproxy.settings.EndpointConfig`): the endpoint
  takes only those models, even if it lists more (a pool kept for one model).

Rule: with both, the endpoint serves the pinned ids it also lists; with only pins (not refreshed yet), the pins;
with only the listing, the listing; with neither, *unknown* — it is not ruled out for any model (an engine whose
``/v1/models`` was never read must not turn every request into a 404).

vLLM answers a request for a model it does not serve with 404 before running anything
(``vllm/entrypoints/serve/engine/serving.py::_check_model``); pdproxy says the same, in the same words
(:class:`~pdproxy.errors.ModelNotFound`), before any engine is contacted: :meth:`ServedModels.require`.

Every request needs a decoder serving its model — a generation request's decode leg, and a passthrough route's
check (``pdproxy/app/passthrough.py``) — so a model only prefillers serve is served on no route while there are
decoders: ``GET /v1/models`` does not list it (:meth:`ServedModels.servable`).  A model only decoders serve is
listed: the routes without a PD leg serve it (a pooling or speech engine is configured as a decoder,
``docs/apis-through-pd.md`` "Routes by model kind"), and so does the decode-only path (``docs/decode-only.md``),
though a generation request sent through a prefiller gets the 404.  :meth:`ServedModels.one_role` names both kinds
for the log (:class:`pdproxy.engines.events.EngineEvents`, once per model).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineInfo, request_pool
from pdproxy.errors import BadRequest, ModelNotFound

Pins = Mapping[tuple[Role, str], frozenset[str]]
"""``(role, endpoint URL) → model ids`` the operator pinned that endpoint to."""


class ServedModels:
    """The served-model view of every endpoint (see the module docstring).

    ``infos``: the live ``EngineInfo`` of each endpoint (shared with the health monitor, read at call time);
    ``pins``: the operator's pins.  Lookups are O(1) per endpoint: each endpoint's id set is rebuilt only when its
    refresh replaced ``EngineInfo.models`` (a new list object)."""

    def __init__(self, infos: Mapping[Endpoint, EngineInfo], pins: Pins | None = None) -> None:
        self.infos = infos
        self.pins: dict[tuple[Role, str], frozenset[str]] = dict(pins or {})
        self._ids: dict[Endpoint, tuple[list[dict[str, Any]], frozenset[str] | None]] = {}
        """Per endpoint: the list of cards its ids were read from (held, so that its address cannot be reused
        by a later list while it is cached) and those ids."""

    def pin(self, role: Role, url: str, models: Iterable[str]) -> None:
        """Pin the endpoints at ``(role, url)`` to ``models`` (empty: unpin); the admin API's ``models``."""
        ids = frozenset(models)
        if ids:
            self.pins[(role, url)] = ids
        else:
            self.pins.pop((role, url), None)
        for endpoint in [e for e in self._ids if e.role is role and e.url == url]:
            del self._ids[endpoint]

    def pinned(self, endpoint: Endpoint) -> frozenset[str] | None:
        """The ids ``endpoint`` is pinned to, or None when it is not pinned."""
        return self.pins.get((endpoint.role, endpoint.url)) if self.pins else None

    def listed(self, endpoint: Endpoint) -> list[dict[str, Any]]:
        """The model cards ``endpoint`` listed at its last refresh (empty when never read)."""
        info = self.infos.get(endpoint)
        return info.models if info is not None else []

    def ids(self, endpoint: Endpoint) -> frozenset[str] | None:
        """The model ids ``endpoint`` serves (module docstring's rule); None when unknown."""
        cards = self.listed(endpoint)
        hit = self._ids.get(endpoint)
        if hit is not None and hit[0] is cards:         # the same list: no refresh since (a refresh makes a new one)
            return hit[1]
        listed = frozenset(c["id"] for c in cards if isinstance(c.get("id"), str)) or None
        pins = self.pinned(endpoint)
        ids = (listed & pins if listed is not None else pins) if pins is not None else listed
        if len(self._ids) > 4096:                       # endpoints come and go (admin API): stay bounded
            self._ids.clear()
        self._ids[endpoint] = (cards, ids)
        return ids

    def serves(self, endpoint: Endpoint, model: str | None) -> bool:
        """True when ``endpoint`` may take a request for ``model`` (None: any model; unknown lists accept)."""
        if not model:
            return True
        ids = self.ids(endpoint)
        return ids is None or model in ids

    def known(self, model: str | None) -> bool:
        """True when some endpoint's known ids include ``model`` (a closed set: what the engines listed and the
        operator pinned), False for None, ``""`` and any other name — the metrics' ``model_name`` label takes only
        these, so a client's names cannot grow the series."""
        if not model:
            return False
        for e in self.infos:
            ids = self.ids(e)
            if ids is not None and model in ids:
                return True
        return False

    def endpoints(self, endpoints: Iterable[Endpoint], model: str | None) -> list[Endpoint]:
        """The ``endpoints`` that serve ``model``, in order."""
        return [e for e in endpoints if self.serves(e, model)]

    def base_ids(self, role: Role | None = None) -> list[str]:
        """Sorted ids of the served base models (cards without a ``parent``: not LoRA adapters) of ``role``'s
        endpoints (all roles when None) — what vLLM names as "Valid aliases" in its 404."""
        out: set[str] = set()
        for e in self.infos:
            if role is not None and e.role is not role:
                continue
            ids = self.ids(e) or frozenset()
            out.update(c["id"] for c in self.listed(e) if c.get("id") in ids and not c.get("parent"))
            pins = self.pinned(e)
            if pins is not None and not self.listed(e):
                out.update(pins)
        return sorted(out)

    def route_model(self, model: str | None) -> str | None:
        """The model a generation request is routed as: ``model`` when it names one; for a request without
        ``model`` (absent, null or ``""``: vLLM then runs its own first served model,
        ``vllm/entrypoints/openai/models/serving.py``), the one base model that both prefillers and decoders serve
        (the decoders', with no prefiller: decode-only) — so its prefill and its decode land on engines of the same
        model — or None when none is known yet (any engine takes it, as before a refresh).  Raises
        :class:`BadRequest` (400, ``param: model``) when there are several: which one the client meant cannot be
        told, and a KV handle of one model must never reach an engine of another.  (A passthrough route has no
        second leg: without a model it goes to an engine that serves the route, ``pdproxy/app/passthrough.py``.)"""
        if model:
            return model
        decoders, prefillers = self.base_ids(Role.DECODE), self.base_ids(Role.PREFILL)
        served = sorted(set(decoders) & set(prefillers)) if prefillers else decoders
        if len(served) > 1:
            raise BadRequest(f"the request names no model and this server serves several ({', '.join(served)}): "
                             "set `model` to one of them", param="model")
        return served[0] if served else None

    def _role_takes(self, model: str, role: Role) -> bool:
        """True when an endpoint of ``role`` serves ``model`` (one whose list is unknown included), or there is
        no endpoint of ``role``."""
        known = False
        for e in self.infos:
            if e.role is role:
                if self.serves(e, model):
                    return True
                known = True
        return not known

    def require(self, model: str | None, role: Role = Role.DECODE) -> None:
        """Raise :class:`ModelNotFound` (404, vLLM's words) when there are endpoints of ``role`` and none serves
        ``model``; a request without ``model`` passes (the engine picks its own), and so does any request when no
        endpoint of ``role`` is known (the scheduler then says there is none: 503)."""
        if model and not self._role_takes(model, role):
            raise self.not_found(model, role)

    def servable(self, model: str) -> bool:
        """True when a request for ``model`` can be served on some route: :meth:`require` lets it through (a
        decoder serves it, one whose list is unknown included, or there is no decoder) — what ``/v1/models``
        lists (module docstring)."""
        return self._role_takes(model, Role.DECODE)

    def one_role(self) -> dict[str, Role]:
        """The model ids that the endpoints of one role serve and no endpoint of the other does, while the other
        role has endpoints: id → the role that serves it.  ``Role.PREFILL``: not :meth:`servable` (every request
        gets 404, not on ``/v1/models``); ``Role.DECODE``: served by the routes without a PD leg and the decode-only
        path, a 404 through a prefiller.  An endpoint whose list is unknown serves any model (as :meth:`require`
        says), so no model is named while one of the other role's lists is unknown."""
        by_role: dict[Role, set[str]] = {Role.PREFILL: set(), Role.DECODE: set()}
        for e in self.infos:
            by_role[e.role].update(self.ids(e) or ())
        out: dict[str, Role] = {}
        for role, other in ((Role.PREFILL, Role.DECODE), (Role.DECODE, Role.PREFILL)):
            for model in sorted(by_role[role] - by_role[other]):
                if not self._role_takes(model, other):
                    out[model] = role
        return out

    def not_found(self, model: str, role: Role) -> ModelNotFound:
        """The 404 of ``model``, served by no endpoint of ``role``: vLLM's words, and whether the other role's
        endpoints serve it (a prefill/decode name mismatch)."""
        other = Role.DECODE if role is Role.PREFILL else Role.PREFILL
        elsewhere = any(e.role is other and self.ids(e) is not None and self.serves(e, model) for e in self.infos)
        return ModelNotFound(model, role.value, self.base_ids(role), other.value if elsewhere else None)

    def refusing(self) -> list[Endpoint]:
        """The endpoints whose ``/v1/models`` refused pdproxy's key at the last refresh (HTTP 401/403), decoders
        first: what the engines would list is then unknown to pdproxy."""
        refused = [e for e, info in self.infos.items() if info.auth_failed]
        return sorted(refused, key=lambda e: e.role is not Role.DECODE)

    def cards(self, max_model_len_override: int | None = None) -> list[dict[str, Any]]:
        """The union of the served cards, one per id, in first-seen order, each with the longest context pdproxy
        can serve for it: the largest ``max_model_len`` among its prefillers and among its decoders, the smaller of
        the two (a request needs one of each; a model served by one role only, that role's) — each endpoint's own
        capped by its KV pool (tokens, less vLLM's null block: :func:`~pdproxy.engines.control.request_pool`) when
        that is smaller, the context it can really hold (docs/field-reports.md: 133,120 declared, 4,584 allocated,
        4,580 for a request).  The same bound admission applies (pdproxy/scheduling/filters.py ``FitsLimits``: a longer
        prompt goes to the endpoints that hold it), so a client sizing prompts by it is not cut short by a smaller
        rank.  Every configured endpoint counts, healthy or not, draining or not: the figure is the deployment's,
        as vLLM's is the engine's (while the only engines that hold a prompt are down, it gets the 503 any request
        gets without an engine, not a 400).  Adapters keep the ``null`` vLLM gives them.  ``max_model_len_override``
        (the ``max_model_len`` setting) caps every figure, and stands for one no engine declared (as
        :class:`~pdproxy.engines.limits.Limits` applies it).  Pinned endpoints contribute only their pinned models.
        A model no request can be served for (:meth:`servable`: only prefillers serve it) is left out."""
        merged: dict[str, dict[str, Any]] = {}
        servable: dict[str, bool] = {}
        longest: dict[str, dict[Role, int]] = {}     # model id → role → its largest context
        for e, info in self.infos.items():
            ids = self.ids(e)
            cards = self.listed(e)
            if not cards and ids:
                cards = [{"id": m, "object": "model", "owned_by": "vllm"} for m in sorted(ids)]
            pool = request_pool(info.kv_pool_tokens, info.block_size)
            for card in cards:
                mid = card.get("id")
                if not isinstance(mid, str) or (ids is not None and mid not in ids):
                    continue
                if mid not in servable:
                    servable[mid] = self.servable(mid)
                if not servable[mid]:
                    continue
                mml = card.get("max_model_len")
                if isinstance(mml, bool) or (isinstance(mml, int) and mml <= 0):   # no context (as
                    # EngineClient.refresh reads it: a boolean, 0 or less): none declared
                    card, mml = {**card, "max_model_len": None}, None
                merged.setdefault(mid, dict(card))
                if isinstance(mml, int) and pool is not None and pool < mml:
                    mml = pool
                if isinstance(mml, int):
                    per_role = longest.setdefault(mid, {})
                    per_role[e.role] = max(mml, per_role.get(e.role, mml))
        for mid, per_role in longest.items():
            merged[mid]["max_model_len"] = min(per_role.values())
        if max_model_len_override:
            for entry in merged.values():
                if not entry.get("parent"):
                    own = entry.get("max_model_len")
                    entry["max_model_len"] = min(own, max_model_len_override) if isinstance(own, int) \
                        else max_model_len_override
        return list(merged.values())
