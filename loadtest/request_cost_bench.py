"""Per-request CPU of pdproxy's request path, in process, step by step: where the microseconds of one request go
before the first byte reaches an engine.

Bodies (chat completions, ``stream: true``, 32 output tokens):

- ``long_64k``: one user message of ~64K tokens of ordinary words (~250 KB), unique per request (the users
  bench's ``long_16``);
- ``agent``: a shared system prompt (~8K tokens) + 12 tools + a growing history of tool-calling turns (~24K
  tokens in all), the next turn of one conversation per request;
- ``short``: a 40-token chat (the users bench's ``short_100``).

Steps, each timed alone with ``time.process_time`` (median over ``--runs`` requests, µs per request), in the
order the request path runs them (``pdproxy/app/application.py`` → ``pdproxy/pd/director.py``):

- ``read``: the server joins the body's chunks (64 KiB reads);
- ``parse``: :func:`pdproxy.apis.request.parse_request` (JSON, vLLM's field types) + ``client_handle_fault``;
- ``admit``: :meth:`Admission.admit` (bounds; ``max_model_len`` 1M as the fake engine declares);
- ``prefix``: :meth:`PrefixRouter.hints` (prefix keys + the index query), ``prefix_routing`` auto, no tokenizer
  and no KV events (text keys: the users bench's configuration), against an index holding earlier requests;
- ``prefill_body``: the prefill leg's bytes;
- ``answer``: the prefiller's JSON answer read as the leg reads it (``kv_transfer.load_prefill_answer``: the
  handle, one block id per 16 prompt tokens as NixlConnector lists them, stays bytes) and its handle taken;
- ``decode_body``: the decode leg's bytes with that handle;
- ``record``: the prefill leg's prefix bookkeeping around the prefiller's answer (in flight, then recorded);

and ``total`` (all of them, in one asyncio task, the worker-thread hops included).  ``--profile STEP`` prints
cProfile's top functions of one step.  Run: ``python -m loadtest.request_cost_bench [--runs 200] [--json FILE]``.

``--full-index``: instead, the approximate index's ``record`` (its expiry and eviction walk ``sent`` from the
head) once the endpoint's entries are at capacity (65,536 keys, 60-key chains, the ``short``/``agent`` churn),
with ``sent`` as the index keeps it (an ``OrderedDict``) and as a plain dict (what it was): mean and worst µs
per record (CPU time, ``time.process_time``).  A plain dict's head walk passes every slot deleted since its last resize.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import pstats
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from pdproxy.apis import kv_transfer
from pdproxy.apis.request import Api, ProxyRequest, parse_request
from pdproxy.app.state import ProxyState
from pdproxy.prefix.index import ApproxPrefixIndex, BlockKeys
from pdproxy.settings import Settings
from pdproxy.timeline import RequestContext, new_request_id

WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "that", "on", "as", "with", "by", "he", "it", "at", "from", "his", "an", "were", "are", "which", "this", "be", "or", "has", "had", "not", "but", "first", "one", "their", "its", "new", "after", "who", "they", "have", "her", "she", "two", "been", "other", "when", "there", "all", "during", "into", "school", "time", "may", "years", "more", "most", "only", "over", "city", "some", "world", "would", "where", "later", "up", "such", "used", "many", "can", "state", "about", "national", "out", "known", "university", "united", "then", "made"]


def handle(prompt_tokens: int) -> dict[str, Any]:
    """A NixlConnector handle for a prompt of ``prompt_tokens`` (one block id per 16 tokens)."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [list(range(prompt_tokens // 16))], "remote_engine_id": "e5f6a7b8",
            "remote_request_id": "chatcmpl-x", "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}


def answer_bytes(prompt_tokens: int) -> bytes:
    """A vLLM chat answer to a prefill leg of ``prompt_tokens`` tokens, with its handle (:func:`handle`)."""
    return orjson.dumps({
        "id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "a", "tool_calls": []},
                     "logprobs": None, "finish_reason": "length", "stop_reason": None}],
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + 1, "completion_tokens": 1,
                  "prompt_tokens_details": {"cached_tokens": 0}},
        "prompt_logprobs": None, "kv_transfer_params": handle(prompt_tokens)})


def words(rng: random.Random, n: int) -> str:
    """``n`` ordinary words (≈ 1.1 tokens each with a BPE tokenizer, ≈ 4 bytes each)."""
    return " ".join(rng.choices(WORDS, k=n))


def long_body(rng: random.Random) -> bytes:
    """A ~250 KB chat: one user message of ~58K words (~64K tokens)."""
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": words(rng, 58_000)}],
                         "max_tokens": 32, "stream": True, "stream_options": {"include_usage": True}})


def tools(rng: random.Random) -> list[dict[str, Any]]:
    """Twelve function tools with JSON-schema parameters."""
    return [{"type": "function", "function": {
        "name": f"tool_{i}", "description": words(rng, 60),
        "parameters": {"type": "object", "properties": {
            f"arg_{j}": {"type": "string", "description": words(rng, 12)} for j in range(6)},
            "required": [f"arg_{j}" for j in range(3)]}}} for i in range(12)]


class Agent:
    """One agent conversation: a shared system prompt and tools, then turns of tool calls and results; each
    :meth:`next_body` is the next turn's request (the whole history so far)."""

    def __init__(self, rng: random.Random, system: str, tool_list: list[dict[str, Any]]) -> None:
        self.rng = rng
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                               {"role": "user", "content": words(rng, 400)}]
        self.tools = tool_list
        self.turn = 0

    def next_body(self) -> bytes:
        rng = self.rng
        body = orjson.dumps({"model": "m", "messages": self.messages, "tools": self.tools, "max_tokens": 32,
                             "stream": True, "stream_options": {"include_usage": True}})
        self.turn += 1
        call_id = f"call_{self.turn}"
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "tool_3", "arguments": orjson.dumps(
                {"arg_0": words(rng, 8), "arg_1": words(rng, 4)}).decode()}}]})
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": words(rng, 1200)})
        if len(self.messages) > 40:               # keep the history bounded: a new conversation
            del self.messages[2:]
        return body


def short_body(rng: random.Random) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": words(rng, 36)}], "max_tokens": 64,
                         "stream": True, "stream_options": {"include_usage": True}})


def make_bodies(kind: str, n: int, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    if kind == "long_64k":
        base = long_body(rng)                     # one text, a unique prefix per request (cheap to make)
        return [base.replace(b'"content":"', f'"content":"{i} {words(rng, 8)} '.encode(), 1) for i in range(n)]
    if kind == "agent":
        system, tool_list = words(rng, 7000), tools(rng)
        agents = [Agent(random.Random(seed + i), system, tool_list) for i in range(8)]
        return [agents[i % len(agents)].next_body() for i in range(n)]
    return [short_body(rng) for _ in range(n)]


def chunks(raw: bytes, size: int = 65536) -> list[bytes]:
    return [raw[i:i + size] for i in range(0, len(raw), size)]


class Path:
    """One ProxyState (1 prefiller + 1 decoder as the fake engine declares them) and the request path's steps."""

    def __init__(self, **overrides: Any) -> None:
        self.settings = Settings(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:10"], **overrides)
        self.state = ProxyState.build(self.settings)
        for e in self.state.pool.endpoints():
            info = self.state.infos[e]
            info.models = [{"id": "m", "object": "model", "max_model_len": 1_000_000}]
            info.max_model_len, info.block_size, info.num_gpu_blocks = 1_000_000, 16, 1_000_000
            info.kv_pool_tokens, info.reachable = 16_000_000, True
            self.state.prefix_cache.update_engine(e, info)
        self.prefiller = self.state.pool.endpoints()[0]

    async def start(self) -> None:
        await self.state.admission.start()

    async def stop(self) -> None:
        await self.state.admission.aclose()

    def ctx(self) -> RequestContext:
        return RequestContext(request_id=new_request_id(None), client_request_id=None, api_label="chat")

    def parse(self, raw: bytes) -> ProxyRequest:
        req = parse_request(raw, Api.CHAT, self.settings.max_json_depth)
        kv_transfer.client_handle_fault(req.body)
        return req

    async def admit(self, req: ProxyRequest, ctx: RequestContext) -> None:
        await self.state.admission.admit(req, ctx)

    async def prefix(self, req: ProxyRequest, ctx: RequestContext) -> None:
        await self.state.prefix.hints(req, ctx)

    def record(self, req: ProxyRequest, ctx: RequestContext) -> None:
        """What the prefill leg does around the prefiller's answer (in flight, then recorded)."""
        with self.state.prefix.prefilling(req, ctx, self.prefiller):
            ctx.engine_prompt_tokens = (req.prompt_tokens or 0)

    def prefill_body(self, req: ProxyRequest, ctx: RequestContext) -> bytes:
        return orjson.dumps(kv_transfer.prefill_body(req.body, req.api, engine_judges=req.engine_judges,
                                                     request_id=ctx.request_id,
                                                     relax=self.settings.prefill_relax_constraints))

    @staticmethod
    def answer(data: bytes) -> kv_transfer.KVHandle | None:
        return kv_transfer.extract_params(kv_transfer.load_prefill_answer(data))

    def decode_body(self, req: ProxyRequest, ctx: RequestContext, params: kv_transfer.KVHandle | None) -> bytes:
        return kv_transfer.decode_leg_body(req.api, req.raw, req.body, params, ctx.request_id)


def timed(fn: Callable[[], Any]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


async def atimed(fn: Callable[[], Awaitable[Any]]) -> float:
    start = time.process_time()
    await fn()
    return time.process_time() - start


STEPS = ("read", "parse", "admit", "prefix", "prefill_body", "answer", "decode_body", "record")


async def whole(path: Path, parts: list[bytes], ctx: RequestContext, answer: bytes) -> None:
    """Every step of one request, in order (``answer``: the prefiller's answer bytes)."""
    req = path.parse(b"".join(parts))
    await path.admit(req, ctx)
    await path.prefix(req, ctx)
    path.prefill_body(req, ctx)
    path.decode_body(req, ctx, path.answer(answer))
    path.record(req, ctx)


async def measure(kind: str, runs: int, prefix_routing: str = "auto") -> dict[str, float]:
    """Median µs per request of each step, and of the whole path (``total``)."""
    path = Path(prefix_routing=prefix_routing)
    await path.start()
    try:
        bodies = make_bodies(kind, runs + 20)
        parts = [chunks(b) for b in bodies]
        samples: dict[str, list[float]] = {s: [] for s in (*STEPS, "total")}
        for i, raw in enumerate(bodies):
            ctx = path.ctx()
            t_read = timed(functools.partial(b"".join, parts[i]))
            started = time.process_time()
            req = path.parse(raw)
            t_parse = time.process_time() - started
            t_admit = await atimed(functools.partial(path.admit, req, ctx))
            t_prefix = await atimed(functools.partial(path.prefix, req, ctx))
            t_pre = timed(functools.partial(path.prefill_body, req, ctx))
            answer = answer_bytes(req.prompt_tokens or 0)
            t_ans = timed(functools.partial(path.answer, answer))
            t_dec = timed(functools.partial(path.decode_body, req, ctx, path.answer(answer)))
            t_rec = timed(functools.partial(path.record, req, ctx))
            # the same request again, whole (a fresh parse: nothing cached on the request object)
            t_total = await atimed(functools.partial(whole, path, parts[i], path.ctx(), answer))
            if i < 20:                            # warm-up
                continue
            for name, t in zip((*STEPS, "total"),
                               (t_read, t_parse, t_admit, t_prefix, t_pre, t_ans, t_dec, t_rec, t_total), strict=True):
                samples[name].append(t)
        out = {name: round(statistics.median(v) * 1e6, 1) for name, v in samples.items()}
        out["body_bytes"] = float(statistics.median(len(b) for b in bodies))
        return out
    finally:
        await path.stop()


async def profile(kind: str, step: str, runs: int) -> None:
    path = Path()
    await path.start()
    bodies = make_bodies(kind, runs)
    prof = cProfile.Profile()
    for raw in bodies:
        ctx = path.ctx()
        if step == "parse":
            prof.enable()
        req = path.parse(raw)
        prof.disable()
        if step == "admit":
            prof.enable()
        await path.admit(req, ctx)
        prof.disable()
        if step == "prefix":
            prof.enable()
        await path.prefix(req, ctx)
        prof.disable()
        if step == "prefill_body":
            prof.enable()
        path.prefill_body(req, ctx)
        prof.disable()
        answer = answer_bytes(req.prompt_tokens or 0)
        if step == "answer":
            prof.enable()
        params = path.answer(answer)
        prof.disable()
        if step == "decode_body":
            prof.enable()
        path.decode_body(req, ctx, params)
        prof.disable()
        if step == "record":
            prof.enable()
        path.record(req, ctx)
        prof.disable()
    await path.stop()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def full_index(runs: int, capacity: int = 65536, chain: int = 60) -> dict[str, dict[str, float]]:
    """µs per ``ApproxPrefixIndex.record`` of a fresh ``chain``-key prompt on an endpoint held at ``capacity``
    keys (after 3× capacity of churn), per container of ``sent``: ``{"OrderedDict"|"dict": {mean, p50, max}}``."""
    out: dict[str, dict[str, float]] = {}
    for name, container in (("OrderedDict", OrderedDict), ("dict", dict)):
        approx = ApproxPrefixIndex(default_capacity_blocks=capacity, ttl_s=1e9, clock=lambda: 1.0)
        loc = approx._loc("http://e:1", "text", 256)
        loc.sent = container()  # type: ignore[assignment]
        key = 0
        times = []
        for i in range(3 * capacity // chain + runs):
            keys = BlockKeys(list(range(key, key + chain)), 256, chain * 64, kind="text")
            key += chain
            started = time.process_time()
            approx.record("http://e:1", keys)
            if i >= 3 * capacity // chain:
                times.append(time.process_time() - started)
        out[name] = {"mean": round(statistics.fmean(times) * 1e6, 1),
                     "p50": round(statistics.median(times) * 1e6, 1), "max": round(max(times) * 1e6, 1)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=150)
    ap.add_argument("--kinds", nargs="+", default=["long_64k", "agent", "short"])
    ap.add_argument("--prefix-routing", nargs="+", default=["auto", "off"])
    ap.add_argument("--profile", metavar="STEP", choices=STEPS[1:])
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--full-index", action="store_true", help="time the approximate index's record at capacity")
    args = ap.parse_args(argv)
    if args.full_index:
        figures = full_index(max(args.runs, 2000))
        print("µs per approximate-index record at capacity (65,536 keys, 60-key chains)")
        for name, row in figures.items():
            print(f"sent as {name:12} mean {row['mean']:>8.1f}  p50 {row['p50']:>8.1f}  max {row['max']:>8.1f}")
        return 0
    if args.profile:
        for kind in args.kinds:
            print(f"== {kind}: {args.profile}")
            asyncio.run(profile(kind, args.profile, args.runs))
        return 0
    doc: dict[str, Any] = {}
    header = f"{'body':10} {'prefix':7} {'bytes':>8} " + " ".join(f"{s:>12}" for s in (*STEPS, "total"))
    print("µs of CPU per request (median), in process\n" + header)
    for kind in args.kinds:
        for mode in args.prefix_routing:
            row = asyncio.run(measure(kind, args.runs, mode))
            doc[f"{kind}/{mode}"] = row
            print(f"{kind:10} {mode:7} {int(row['body_bytes']):>8} "
                  + " ".join(f"{row[s]:>12.1f}" for s in (*STEPS, "total")))
    if args.json:
        with open(args.json, "wb") as f:
            f.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
