"""``pdproxy doctor``: the four manual verification steps of ``docs/field-reports.md``, automated
against every configured engine, printed as it goes and over within a time budget (``--budget-s``, 55 s).

Checks, in order (each row of the report is one check on one engine or one P→D pair; rows appear as soon as
their check completes, engines and pairs concurrently):

1. ``engine`` — reachable (``/health`` 200, ``/v1/models`` answers), served model(s), ``max_model_len``
   (``/v1/models``, vLLM ``ModelCard``), version (``/version``);
2. ``kv_pool`` — KV pool = ``num_gpu_blocks × block_size`` (or ``kv_cache_size_tokens``) from
   ``vllm:cache_config_info`` on ``/metrics`` vs ``max_model_len``, with the consequence in words: below it,
   "prompts between pool+1 and max_model_len−1 tokens will queue forever" on a prefiller, from pool on a decoder
   (room for the answer's first token; a prompt of max_model_len tokens is the engine's own 400) — a 4,584-token
   pool under a 133,120-token ``max_model_len`` in ``docs/field-reports.md``, where vLLM's scheduler never admits
   such a prompt (``vllm/v1/core/sched/scheduler.py``, ``schedule``); below twice the pool the largest prompt
   needs, two such prompts cannot be held at once;
3. ``idle`` — ``vllm:num_requests_running`` / ``num_requests_waiting`` / ``kv_cache_usage_perc`` at zero when
   there is no traffic (a waiting request with nothing running is a stall: "200 OK but nothing happens");
4. ``tool_call`` — a P→D round trip of a chat with a tool, expecting ``finish_reason: "tool_calls"`` (reported,
   never a failure: the model may simply not call tools);
5. ``cold_context`` — unique-text prompts on each engine (engines concurrently), each given a bounded wait
   (:mod:`pdproxy.tools.doctor_probes`): when step 2 already proved the KV-pool cliff, one prompt just under the pool
   and one just over it confirm it; otherwise growing sizes up to ``max_model_len`` find the largest size that
   completes and where it stalls.  Progress (size, elapsed) goes to stderr (:mod:`pdproxy.tools.doctor_output`);
6. ``pd_models`` / ``pd_limits`` / ``kv_connector`` — prefillers and decoders serve the same model with
   compatible limits, and every prefiller returns ``kv_transfer_params`` (a KV connector in the producer role);
   a decoder that cannot use them, or params naming ``localhost`` for a decoder on another host, is reported.

Statuses: ``ok``, ``warn`` (reported, exit 0), ``fail`` (a problem: exit 1), ``skip`` (including checks the time
budget cut short).  ``--json`` prints the same rows as one JSON document at the end.  Steps 4 and 5 send real
requests; ``--no-round-trip`` / ``--no-cold-probe`` skip them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import asdict, dataclass, field
from types import MappingProxyType
from typing import Any, Final, Literal, TypeVar

import httpx
import orjson

from pdproxy.endpoints import Endpoint, Role
from pdproxy.engines.control import EngineClient, EngineInfo
from pdproxy.engines.limits import EngineLimits
from pdproxy.errors import ProxyError
from pdproxy.settings import Settings
from pdproxy.tools.doctor_output import Console, status_text
from pdproxy.tools.doctor_probes import ColdPlan, ColdProbe, RoundTrip, cold_probe, pd_round_trip

Status = Literal["ok", "warn", "fail", "skip"]
T = TypeVar("T")


@dataclass(slots=True)
class Check:
    """One row of the report.  ``data`` holds the numbers behind ``detail`` (tokens, seconds)."""

    check: str
    target: str
    status: Status
    detail: str
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class DoctorOptions:
    """Knobs of a doctor run (seconds, tokens).  ``budget_s`` bounds the whole run; ``cold_timeout_s`` /
    ``cold_min_timeout_s`` bound the wait given to one cold prompt (scaled from the previous size's time,
    :func:`pdproxy.tools.doctor_probes.stall_wait_s`); ``cold_budget_s`` bounds the cold probes (within ``budget_s``)."""

    probe_timeout_s: float = 10.0
    round_trip: bool = True
    cold_probe: bool = True
    cold_timeout_s: float = 30.0
    cold_min_timeout_s: float = 5.0
    cold_budget_s: float = 45.0
    cold_start_tokens: int = 1024
    cold_bisect_steps: int = 2
    budget_s: float = 55.0


@dataclass(slots=True)
class Report:
    """All checks of a run; ``ok`` is False when any check failed.  ``listener`` sees each check as it is added
    (``pdproxy doctor`` prints it at once)."""

    checks: list[Check] = field(default_factory=list)
    listener: Callable[[Check], None] | None = None

    @property
    def ok(self) -> bool:
        """True unless some check has status ``"fail"`` (warnings and skips still count as ok)."""
        return not any(c.status == "fail" for c in self.checks)

    def add(self, check: str, target: str, status: Status, detail: str, **data: Any) -> None:
        """Append one check result: ``check`` name, ``target`` engine (URL / name), ``status``
        (ok / warn / fail / skip), a one-line ``detail`` and any JSON-serialisable ``data`` for ``--json``."""
        c = Check(check, target, status, detail, data)
        self.checks.append(c)
        if self.listener is not None:
            self.listener(c)

    def to_json(self) -> bytes:
        """The report as indented JSON bytes: ``{"ok": bool, "counts": {status: n}, "checks": [{check, target,
        status, detail, data}, ...]}``."""
        counts = {s: sum(c.status == s for c in self.checks) for s in ("ok", "warn", "fail", "skip")}
        return orjson.dumps({"ok": self.ok, "counts": counts, "checks": [asdict(c) for c in self.checks]},
                            option=orjson.OPT_INDENT_2)

    def table(self) -> str:
        """A plain-text table: check | engine | status | detail."""
        rows = [("CHECK", "ENGINE", "STATUS", "DETAIL")]
        rows += [(c.check, c.target, status_text(c.status), c.detail) for c in self.checks]
        w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
        lines = [f"{a:<{w0}}  {b:<{w1}}  {s:<6}  {d}" for a, b, s, d in rows]
        fails, warns = (sum(c.status == s for c in self.checks) for s in ("fail", "warn"))
        lines.append("")
        lines.append(f"{'OK' if self.ok else 'PROBLEMS FOUND'}: {fails} problem(s), {warns} warning(s), "
                     f"{len(self.checks)} check(s)")
        return "\n".join(lines)


def _n(value: int | None) -> str:
    return "unknown" if value is None else f"{value:,}"


_ROLE_NOUN: Final = MappingProxyType({Role.PREFILL: "prefiller", Role.DECODE: "decoder"})


def _kv_figures(role: Role, pool: int, mml: int, block_size: int | None) -> tuple[int, int, int, int]:
    """Admission's figures for an engine of ``role`` (:meth:`pdproxy.engines.limits.EngineLimits.prompt_bounds`):
    (the largest prompt its KV pool holds, the largest ``max_model_len`` lets it take, the pool that prompt needs,
    the pool one request can use: less vLLM's null block, :attr:`~pdproxy.engines.limits.EngineLimits.usable_pool`).
    A prompt of ``max_model_len`` tokens is refused by the engine itself (no room for one output token); a
    prefiller holds a prompt of the usable pool, a decoder one token less (the answer's first token must fit
    too).  The prompts between the first figure + 1 and the second fit ``max_model_len`` but never the pool."""
    limits = EngineLimits(max_model_len=mml, kv_pool_tokens=pool, block_size=block_size)
    by_len, by_pool = limits.prompt_bounds(role)
    usable = limits.usable_pool
    assert by_pool is not None and by_len is not None and usable is not None
    return by_pool, by_len, by_len + (usable - by_pool), usable


def check_engine(report: Report, e: Endpoint, info: EngineInfo, healthy: bool, version: str | None) -> bool:
    """Steps 1–3 for one engine from its refreshed info.  Returns False when it is unreachable."""
    if not info.reachable:
        report.add("engine", e.name, "fail", f"unreachable: {info.error or 'no answer'}", role=e.role.value)
        return False
    models = [str(m.get("id")) for m in info.models]
    report.add("engine", e.name, "ok" if healthy and models else "fail",
               f"{e.role.value}; model {', '.join(models) or 'NONE'}; max_model_len {_n(info.max_model_len)}; "
               f"version {version or 'unknown'}" + ("" if healthy else "; /health is not 200"),
               role=e.role.value, models=models, max_model_len=info.max_model_len, version=version)
    pool, mml = info.kv_pool_tokens, info.max_model_len
    data = {"kv_pool_tokens": pool, "max_model_len": mml, "num_gpu_blocks": info.num_gpu_blocks,
            "block_size": info.block_size}
    where = (f" (num_gpu_blocks {_n(info.num_gpu_blocks)} × block_size {_n(info.block_size)})"
             if info.num_gpu_blocks and info.block_size else "")
    held, largest, needs, usable = (_kv_figures(e.role, pool, mml, info.block_size) if pool is not None
                                    and mml is not None else (0, 0, 0, 0))
    if usable != pool and where:
        where = f"{where[:-1]}; {usable:,} for one request: vLLM keeps a block as its null block)"
    if pool is None or mml is None:
        report.add("kv_pool", e.name, "warn", "KV pool unknown: no vllm:cache_config_info on /metrics", **data)
    elif held < largest:
        prompts = (f"a prompt of {largest:,} tokens" if held + 1 == largest
                   else f"prompts between {held + 1:,} and {largest:,} tokens")
        why = "its pool must hold the answer's first token too; " if e.role is Role.DECODE else ""
        report.add("kv_pool", e.name, "fail",
                   f"KV pool {pool:,} tokens{where} < max_model_len {mml:,}: {prompts} will queue forever on this "
                   f"{_ROLE_NOUN[e.role]} ({why}declare --max-model-len ≤ {usable:,} or grow the pool)", **data)
    elif usable < 2 * needs:
        report.add("kv_pool", e.name, "warn",
                   f"KV pool {pool:,} tokens{where} holds one prompt of the largest size max_model_len {mml:,} allows "
                   f"({largest:,} tokens) but not two: a second long prompt waits in the engine until the first "
                   "finishes", **data)
    else:
        report.add("kv_pool", e.name, "ok", f"KV pool {pool:,} tokens{where} holds two prompts of the largest size "
                   f"max_model_len {mml:,} allows ({largest:,} tokens)", **data)
    g = info.gauges
    running, waiting = g.get("vllm:num_requests_running"), g.get("vllm:num_requests_waiting")
    usage = g.get("vllm:kv_cache_usage_perc")
    reasons = {k.rsplit(":", 1)[1]: v for k, v in g.items() if k.startswith("vllm:num_requests_waiting_by_reason:")}
    gauges = {"running": running, "waiting": waiting, "kv_cache_usage_perc": usage, "waiting_by_reason": reasons}
    text = (f"running {running:g}, waiting {waiting:g}"
            + "".join(f" ({k} {v:g})" for k, v in reasons.items() if v) + f", KV usage {_percent(usage or 0)}"
            if running is not None and waiting is not None else "")
    if running is None or waiting is None:
        report.add("idle", e.name, "warn", "no vllm:num_requests_running/waiting on /metrics", **gauges)
    elif waiting > 0 and running == 0:
        report.add("idle", e.name, "fail", f"{text}: requests wait with nothing running — the engine is stalled "
                   "(a queued prompt that can never get KV blocks blocks everything behind it)", **gauges)
    elif running or waiting or (usage or 0) > 0:
        report.add("idle", e.name, "warn", f"{text}: not idle (traffic, or requests that never finish)", **gauges)
    else:
        report.add("idle", e.name, "ok", text, **gauges)
    return True


def check_consistency(report: Report, infos: dict[Endpoint, EngineInfo]) -> None:
    """Step 6 (static part): same model and compatible limits across prefillers and decoders."""
    def by_role(role: Role) -> list[EngineInfo]:
        return [i for e, i in infos.items() if e.role is role and i.reachable]

    p_infos, d_infos = by_role(Role.PREFILL), by_role(Role.DECODE)
    if not p_infos or not d_infos:
        report.add("pd_models", "P/D", "fail", "need at least one reachable prefiller and one reachable decoder")
        return
    p_models = set().union(*(i.model_ids() for i in p_infos))      # a model needs some prefiller and some decoder
    d_models = set().union(*(i.model_ids() for i in d_infos))      # (several models: each on its own engines)
    common = p_models & d_models
    if not common:
        report.add("pd_models", "P/D", "fail", f"no model is served by both a prefiller and a decoder (every "
                   f"request would get 404): prefillers serve {sorted(p_models)}, decoders {sorted(d_models)}; "
                   "check each engine's --served-model-name")
    elif p_models != d_models:
        alone = sorted(p_models ^ d_models)
        report.add("pd_models", "P/D", "warn", f"served by prefillers and decoders: {', '.join(sorted(common))}; "
                   f"by one role only (their requests get 404): {', '.join(alone)}", models=sorted(common))
    else:
        report.add("pd_models", "P/D", "ok", f"prefillers and decoders serve {', '.join(sorted(common))}",
                   models=sorted(common))
    p_len = {i.max_model_len for i in p_infos if i.max_model_len is not None}
    d_len = {i.max_model_len for i in d_infos if i.max_model_len is not None}
    lens = {"prefill_max_model_len": sorted(p_len), "decode_max_model_len": sorted(d_len)}
    if len(p_len | d_len) > 1:
        report.add("pd_limits", "P/D", "warn", f"max_model_len differs: prefillers {sorted(p_len)}, decoders "
                   f"{sorted(d_len)}; a request must fit the smallest of its pair", **lens)
    else:
        report.add("pd_limits", "P/D", "ok", f"max_model_len {_n(next(iter(p_len | d_len), None))} on every engine",
                   **lens)


def check_round_trip(report: Report, rt: RoundTrip, p: Endpoint, d: Endpoint, *,
                     tools_refused: str | None = None) -> None:
    """Steps 4 and 6 (dynamic part) from one P→D round trip (``tools_refused``: the engine's 400 to the request
    with tools, when the round trip was then made without them)."""
    pair = f"{p.name} → {d.name}"
    data = {"prefill_s": rt.prefill_s, "decode_s": rt.decode_s}
    if rt.error and rt.kv_transfer_params is None:
        report.add("kv_connector", pair, "fail", rt.error, **data)
        return
    params = rt.kv_transfer_params
    if params is None:
        report.add("kv_connector", pair, "fail", "the prefiller answered without kv_transfer_params: no KV connector "
                   "in the producer role (--kv-transfer-config), or the first token was EOS", **data)
        return
    host = str(params.get("remote_host") or "")
    if host in ("localhost", "127.0.0.1", "::1") and p.host not in ("localhost", "127.0.0.1", "::1") \
            and p.host != d.host:
        report.add("kv_connector", pair, "warn", f"kv_transfer_params name remote_host {host!r}: a decoder on "
                   "another host cannot pull (set VLLM_NIXL_SIDE_CHANNEL_HOST / the connector's host)", **data)
    if rt.error:
        report.add("kv_connector", pair, "fail", f"the decoder could not use the prefiller's kv_transfer_params: "
                   f"{rt.error}", **data)
        return
    report.add("kv_connector", pair, "ok", f"kv_transfer_params returned ({len(params)} fields: "
               f"{', '.join(sorted(params))}); decode leg answered", **data)
    if tools_refused:
        report.add("tool_call", pair, "warn", f"the engine refused a request with tools ({tools_refused}); start "
                   "vLLM with --enable-auto-tool-choice --tool-call-parser … to serve agents", **data)
    elif rt.finish_reason == "tool_calls":
        report.add("tool_call", pair, "ok", 'finish_reason "tool_calls"', **data)
    else:
        report.add("tool_call", pair, "warn", f"finish_reason {rt.finish_reason!r}, not \"tool_calls\": the model did "
                   "not call the tool (vLLM needs --enable-auto-tool-choice --tool-call-parser …)", **data)


def check_cold(report: Report, probe: ColdProbe, max_model_len: int) -> None:
    """Step 5 for one engine (the boundary plan confirms the KV-pool cliff; the ladder finds the largest size)."""
    data: dict[str, Any] = {"plan": probe.plan, "limit": probe.limit, "kv_pool_tokens": probe.kv_pool,
                            "largest_ok": probe.largest_ok, "stalled_at": probe.stalled_at,
                            "completed": probe.completed,
                            "attempts": [[a.tokens, a.outcome, round(a.elapsed_s, 3), round(a.wait_s, 3)]
                                         for a in probe.attempts]}
    best, stalled = probe.largest_ok, probe.stalled_at
    took = {n: s for n, s in probe.completed}
    if probe.plan == "boundary" and probe.kv_pool is not None:
        pool = probe.kv_pool
        under = next((a for a in probe.attempts if a.tokens <= pool), None)
        over = next((a for a in probe.attempts if a.tokens > pool), None)
        if under is not None and under.outcome == "ok" and over is not None and over.outcome == "stalled":
            report.add("cold_context", probe.endpoint, "fail",
                       f"KV-pool cliff confirmed: a cold prompt of {under.tokens:,} tokens completed in "
                       f"{under.elapsed_s:.2f} s, one of {over.tokens:,} tokens (just over the {pool:,}-token pool) "
                       f"got no answer within {over.wait_s:.0f} s, although max_model_len is {max_model_len:,}",
                       **data)
            return
        if over is not None and over.outcome == "ok":
            report.add("cold_context", probe.endpoint, "warn",
                       f"a cold prompt of {over.tokens:,} tokens, over the reported KV pool of {pool:,}, completed in "
                       f"{over.elapsed_s:.2f} s: the pool figure on /metrics may be stale", **data)
            return
        if under is not None and under.outcome == "stalled":
            report.add("cold_context", probe.endpoint, "fail",
                       f"even {under.tokens:,} tokens (under the {pool:,}-token KV pool) got no answer within "
                       f"{under.wait_s:.0f} s: the engine is stalled or very slow", **data)
            return
    if stalled is not None:
        report.add("cold_context", probe.endpoint, "fail",
                   f"largest cold prompt completed: {_n(best)} tokens; stalled at {stalled:,} tokens (no answer "
                   f"within {probe.wait_of(stalled) or 0:.0f} s) although max_model_len is {max_model_len:,}", **data)
    elif probe.error:
        report.add("cold_context", probe.endpoint, "fail", f"largest completed {_n(best)} tokens; then {probe.error}",
                   **data)
    elif probe.skipped:
        report.add("cold_context", probe.endpoint, "warn", f"largest completed {_n(best)} tokens; {probe.skipped}",
                   **data)
    else:
        report.add("cold_context", probe.endpoint, "ok",
                   f"cold prompts up to {_n(best)} tokens completed (limit {probe.limit:,}; slowest "
                   f"{max(took.values(), default=0.0):.2f} s)", **data)


def probe_model(wanted: str | None, *infos: EngineInfo) -> str | None:
    """The model to probe engines with: ``wanted`` (the ``model_name`` setting) when every one of ``infos``
    serves it, else the first model they all serve (in the first one's order), else None."""
    common = frozenset.intersection(*(i.model_ids() for i in infos)) if infos else frozenset()
    if wanted and wanted in common:
        return wanted
    return next((str(m["id"]) for m in infos[0].models if m.get("id") in common), None) if infos else None


def pairs(prefillers: list[Endpoint], decoders: list[Endpoint],
          infos: dict[Endpoint, EngineInfo] | None = None) -> list[tuple[Endpoint, Endpoint]]:
    """The P→D pairs the round trip covers: every prefiller and every decoder at least once (round robin), each
    paired with one that serves a model it serves when its round-robin partner does not (``infos``: what each
    listed; several models run each on their own engines; None before the engines answered: round robin, the
    console's first list of rows).  Empty when a role has no endpoint."""
    if not prefillers or not decoders:
        return []
    if infos is None:
        return [(prefillers[i % len(prefillers)], decoders[i % len(decoders)])
                for i in range(max(len(prefillers), len(decoders)))]

    def shares(p: Endpoint, d: Endpoint) -> bool:
        return bool(infos[p].model_ids() & infos[d].model_ids())

    out: list[tuple[Endpoint, Endpoint]] = []
    for i in range(max(len(prefillers), len(decoders))):
        p, d = prefillers[i % len(prefillers)], decoders[i % len(decoders)]
        if not shares(p, d):                   # the round-robin partner serves another model: one that shares
            if i < len(prefillers):
                d = next((x for x in decoders if shares(p, x)), d)
            else:
                p = next((x for x in prefillers if shares(x, d)), p)
        if (p, d) not in out:
            out.append((p, d))
    return out


async def _as_completed(aws: dict[Any, Coroutine[Any, Any, T]], deadline: float
                        ) -> AsyncIterator[tuple[Any, T | None]]:
    """Run ``aws`` concurrently; yield ``(key, result)`` as each finishes, then ``(key, None)`` for every one still
    running at ``deadline`` (``time.monotonic()``), which is cancelled."""
    tasks = {asyncio.ensure_future(coro): key for key, coro in aws.items()}
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                                               return_when=asyncio.FIRST_COMPLETED)
            if not done:
                break
            for t in done:
                yield tasks[t], t.result()
    finally:
        for t in pending:
            t.cancel()
        for t in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
    for t in pending:
        yield tasks[t], None


async def run_doctor(settings: Settings, options: DoctorOptions, console: Console | None = None) -> Report:
    """Run every check against the engines in ``settings``, adding rows to the report (and so to ``console``) as
    each completes.  Ends within ``options.budget_s`` seconds: checks still running then are reported as
    skipped.  Never raises for engine problems."""
    t0 = time.monotonic()
    deadline = t0 + options.budget_s
    report = Report(listener=console.row if console is not None else None)
    endpoints = settings.all_endpoints()
    key = settings.engine_api_key
    engines = EngineClient(timeout_s=options.probe_timeout_s, api_key=key)
    budget_note = f"the doctor's time budget of {options.budget_s:g} s ran out (--budget-s)"
    try:
        infos = {e: EngineInfo() for e in endpoints}

        async def inspect(e: Endpoint) -> tuple[bool, str | None]:
            async def version() -> str | None:
                try:
                    found = (await engines.get_json(e, "/version")).get("version")
                    return str(found) if found is not None else None
                except (ProxyError, ValueError, AttributeError):
                    return None
            _, healthy, ver = await asyncio.gather(engines.refresh(e, infos[e]), engines.health(e), version())
            return healthy, ver

        usable: list[Endpoint] = []
        static_deadline = min(deadline, time.monotonic() + 2 * options.probe_timeout_s + 1.0)
        async for e, result in _as_completed({e: inspect(e) for e in endpoints}, static_deadline):
            if result is None:
                report.add("engine", e.name, "fail", f"no answer to /v1/models, /metrics and /health within "
                           f"{static_deadline - t0:.0f} s", role=e.role.value)
            elif check_engine(report, e, infos[e], *result):
                usable.append(e)
        usable.sort(key=endpoints.index)
        check_consistency(report, infos)
        wanted = settings.model_name
        async with httpx.AsyncClient() as client:
            prefillers = [e for e in usable if e.role is Role.PREFILL]
            decoders = [e for e in usable if e.role is Role.DECODE]
            if options.round_trip and prefillers and decoders:
                async def trip(p: Endpoint, d: Endpoint) -> tuple[RoundTrip, str | None]:
                    model = probe_model(wanted, infos[p], infos[d]) or wanted or ""
                    rt = await pd_round_trip(client, p, d, model, timeout_s=options.probe_timeout_s, api_key=key)
                    refused = rt.error if rt.error and rt.error.startswith("prefill leg: HTTP 400") else None
                    if refused:  # e.g. vLLM without --enable-auto-tool-choice: check the PD path without tools
                        rt = await pd_round_trip(client, p, d, model, timeout_s=options.probe_timeout_s,
                                                 api_key=key, tools=False)
                    return rt, refused

                trips = {}
                for p, d in pairs(prefillers, decoders, infos):
                    if probe_model(wanted, infos[p], infos[d]) is None and not wanted:
                        report.add("kv_connector", f"{p.name} → {d.name}", "skip", "no model served by both")
                    else:
                        trips[(p, d)] = trip(p, d)
                trip_deadline = min(deadline, time.monotonic() + 4 * options.probe_timeout_s + 1.0)
                async for (p, d), found in _as_completed(trips, trip_deadline):
                    if found is None:
                        report.add("kv_connector", f"{p.name} → {d.name}", "skip", budget_note)
                    else:
                        check_round_trip(report, found[0], p, d, tools_refused=found[1])
            elif not options.round_trip:
                report.add("tool_call", "P/D", "skip", "--no-round-trip")
            if options.cold_probe:  # engines are independent: probe them concurrently, report as each ends
                plan = ColdPlan(start_tokens=options.cold_start_tokens, min_wait_s=options.cold_min_timeout_s,
                                max_wait_s=options.cold_timeout_s, bisect_steps=options.cold_bisect_steps,
                                deadline=min(deadline - 1.0, time.monotonic() + options.cold_budget_s))
                for e in usable:
                    if infos[e].max_model_len is None:
                        report.add("cold_context", e.name, "skip", "max_model_len unknown")
                probes = {e: cold_probe(client, e, probe_model(wanted, infos[e]) or wanted or "",
                                        infos[e].max_model_len or 0,
                                        kv_pool_tokens=EngineLimits(kv_pool_tokens=infos[e].kv_pool_tokens,
                                                                    block_size=infos[e].block_size).usable_pool,
                                        plan=plan, api_key=key,
                                        progress=console) for e in usable if infos[e].max_model_len is not None}
                ticking = console.ticking() if console is not None else contextlib.nullcontext()
                async with ticking:
                    async for e, probe in _as_completed(probes, deadline):
                        if probe is None:
                            report.add("cold_context", e.name, "skip", budget_note)
                        else:
                            check_cold(report, probe, infos[e].max_model_len or 0)
            else:
                report.add("cold_context", "*", "skip", "--no-cold-probe")
    finally:
        await engines.aclose()
    return report


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Doctor-only flags (the engines come from the engine flags shared with ``serve`` / ``--config``)."""
    d = DoctorOptions()
    p.add_argument("--json", action="store_true", help="print the report as one JSON document at the end")
    p.add_argument("--budget-s", type=float, default=d.budget_s,
                   help=f"the whole run ends within this many seconds (default {d.budget_s:g})")
    p.add_argument("--probe-timeout-s", type=float, default=d.probe_timeout_s,
                   help=f"timeout of each control/round-trip request (seconds, default {d.probe_timeout_s:g})")
    p.add_argument("--no-round-trip", dest="round_trip", action="store_false", help="skip the P→D tool-call trips")
    p.add_argument("--no-cold-probe", dest="cold_probe", action="store_false", help="skip the long-context probe")
    p.add_argument("--cold-timeout-s", type=float, default=d.cold_timeout_s,
                   help="longest wait for one cold prompt before it counts as stalled (seconds; the wait scales "
                        f"from the previous size's time, default {d.cold_timeout_s:g})")
    p.add_argument("--cold-min-timeout-s", type=float, default=d.cold_min_timeout_s,
                   help=f"shortest wait for one cold prompt (seconds, default {d.cold_min_timeout_s:g})")
    p.add_argument("--cold-budget-s", type=float, default=d.cold_budget_s,
                   help=f"total time for cold probes (seconds, default {d.cold_budget_s:g}; within --budget-s)")
    p.add_argument("--cold-start-tokens", type=int, default=d.cold_start_tokens,
                   help="first cold prompt size when the KV pool does not already show the cliff")
    p.add_argument("--cold-bisect-steps", type=int, default=d.cold_bisect_steps,
                   help="sizes tried between the last success and the first stall")


def run(settings: Settings, args: argparse.Namespace) -> int:
    """Run the doctor, printing rows as checks complete (or one JSON document with ``--json``); exit code 0 (no
    problem), 1 (problems) or 2 (no engines)."""
    endpoints = settings.all_endpoints()
    if not endpoints:
        print("pdproxy doctor: no engines configured (give --prefill/--decode URLs or a --config file)",
              file=sys.stderr)
        return 2
    options = DoctorOptions(probe_timeout_s=args.probe_timeout_s, round_trip=args.round_trip,
                            cold_probe=args.cold_probe, cold_timeout_s=args.cold_timeout_s,
                            cold_min_timeout_s=args.cold_min_timeout_s, cold_budget_s=args.cold_budget_s,
                            cold_start_tokens=args.cold_start_tokens, cold_bisect_steps=args.cold_bisect_steps,
                            budget_s=args.budget_s)
    prefillers = [e for e in endpoints if e.role is Role.PREFILL]
    decoders = [e for e in endpoints if e.role is Role.DECODE]
    targets = [e.name for e in endpoints] + [f"{p.name} → {d.name}" for p, d in pairs(prefillers, decoders)]
    console = Console(targets, table=not args.json)
    t0 = time.monotonic()
    console.header(len(endpoints), options.budget_s)
    report = asyncio.run(run_doctor(settings, options, console))
    console.footer(report, time.monotonic() - t0)
    if args.json:
        sys.stdout.buffer.write(report.to_json() + b"\n")
        sys.stdout.flush()
    return 0 if report.ok else 1


def _percent(fraction: float) -> str:
    """``fraction`` (0–1) as a percentage that never reads 0.0 % when it is not zero (one pinned block of a large
    pool is 0.0122 %)."""
    if 0 < fraction < 0.001:
        return f"{fraction * 100:.2g}%"
    return f"{fraction:.1%}"
