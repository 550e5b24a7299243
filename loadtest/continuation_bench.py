"""Benchmark: CPU per relayed event of a stream with continuation on (``--stream-continuation``: the decoder asked
for ``return_token_ids``, the relay strips the ids and records them; docs/stream-continuation.md) against the same
stream with it off.

Run: ``python -m loadtest.continuation_bench [--events 200000] [--repeat 5] [--process] [--reps 3] [--quick]``.
Prints one JSON document.

**Splice** (always; in this process): ns per event, best of ``--repeat`` runs, of the relay's
``_Splice.data`` (pdproxy/pd/relay.py) on vLLM-shaped one-token chunks, for chat and completions, in blocks of 1
event (vLLM writes one event per engine step; a paced stream's reads hold one) and of 8 (a full-speed read holds
several), for

- ``off``: the chunks as a stream without continuation gets them (``"token_ids":null``), through the relay built
  as ``stream_continuation`` off builds it;
- ``on``: the chunks with ``token_ids`` (what the decoder sends when asked for ``return_token_ids``) through
  :class:`~pdproxy.pd.continuation.RecordIds` (the client gets ``"token_ids":null``, byte for byte the ``off``
  stream).

The client transport is a stub that drops the bytes (a socket write costs the same either way), so these are the
splice's own figures: ``on_minus_off_ns`` is what continuation adds per event.

**Process** (``--process``): whole-process CPU in the users' conditions, the way ``make bench``
(:mod:`loadtest.users_bench`) measures, with its machinery: two ``pdproxy serve`` processes, one with
``--stream-continuation``, against the same pair of ``loadtest.fake_engine`` processes (which send token ids when
asked, like vLLM), in the same run, nothing pinned; CPU = ``utime + stime`` of each proxy's process tree from the
first request to the last answer, divided by the SSE events its clients received; scenarios ``full_100`` (100
streams × 2,000 tokens at full speed, the engine writing bursts of 8 events) and ``paced_1000`` (1,000 streams ×
150 tokens at 10 tokens/s, started over 3 s); ``--reps`` repetitions interleaved (off, on, off, on, …), medians
reported with the ``on / off`` ratio.  The machine's other load is recorded per run (``others_cpu_frac``, CPUs'
worth); on a shared machine read the ratio.  ``--quick``: small sizes, shape only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

from pdproxy.apis.request import Api, parse_request
from pdproxy.pd.continuation import Resume
from pdproxy.pd.relay import StreamRelay, _Splice
from pdproxy.timeline import RequestContext


class _Conn:
    flow: Any = None
    paused = False

    def body_writer(self) -> Callable[[bytes], None]:
        return _sink


def _sink(data: bytes) -> None:
    """The client transport's write, dropped."""


class _Out:
    def __init__(self) -> None:
        self.conn = _Conn()
        self.ended = False
        self.done_sent = False
        self.api_stream = None


class _Resp:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop


_HEAD = {"id": "chatcmpl-0123456789abcdef0123456789abcdef", "created": 1765000000, "model": "Qwen/Qwen3-0.6B"}


def chunk(i: int, ids: bool, api: Api = Api.CHAT) -> bytes:
    """One vLLM chunk of one token (compact JSON, as vLLM writes it); ``ids``: with ``return_token_ids``."""
    tid = [1000 + i % 5000] if ids else None
    if api is Api.CHAT:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": " token"}, "logprobs": None,
                                  "finish_reason": None, "token_ids": tid}
        obj = {**_HEAD, "object": "chat.completion.chunk", "choices": [choice]}
    else:
        choice = {"index": 0, "text": " token", "logprobs": None, "finish_reason": None, "stop_reason": None,
                  "prompt_token_ids": None, "token_ids": tid}
        obj = {**_HEAD, "id": "cmpl-0123456789abcdef0123456789abcdef", "object": "text_completion",
               "choices": [choice]}
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def first_chunk(ids: bool, api: Api) -> bytes:
    """The stream's first block: chat's role chunk (``prompt_token_ids`` at the top level), or completions' first
    token chunk (``prompt_token_ids`` in the choice)."""
    prompt = list(range(100, 164)) if ids else None
    if api is Api.CHAT:
        return b"data: " + orjson.dumps({**_HEAD, "object": "chat.completion.chunk", "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
            "prompt_token_ids": prompt, "prompt_text": None}) + b"\n\n"
    return chunk(0, ids, api).replace(b'"prompt_token_ids":null', b'"prompt_token_ids":' + orjson.dumps(prompt))


def splice_ns(loop: asyncio.AbstractEventLoop, events: int, on: bool, api: Api, per_block: int) -> float:
    """ns per event of ``_Splice.data`` over ``events`` events in blocks of ``per_block``."""
    body: dict[str, Any] = {"model": "m", "stream": True}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if api is Api.CHAT else {"prompt": "hi"})
    req = parse_request(orjson.dumps(body), api)
    resume = Resume.of(req, True) if on else None
    ctx = RequestContext(request_id="bench", client_request_id=None, api_label=api.value)
    relay = StreamRelay(_Resp(loop), _Out(), ctx, cached_tokens=None, first_event_timeout_s=1.0,  # type: ignore[arg-type]
                        resume=resume, lost_when=(20.0, 2.0))
    splice = _Splice(relay, relay.transforms(), b"", time.monotonic())
    blocks = [b"".join(chunk(i * per_block + k, on, api) for k in range(per_block)) for i in range(1000)]
    data = splice.data
    data(first_chunk(on, api))
    gc.collect()
    n = max(1, events // per_block)
    start = time.process_time_ns()
    record = resume.blocks if resume is not None else []
    for k in range(n):
        data(blocks[k % 1000])
        if k % 1000 == 999:
            del record[1:]       # a stream holds its own record; keep memory flat across "streams"
    return (time.process_time_ns() - start) / (n * per_block)


def splice_figures(events: int, repeat: int) -> dict[str, Any]:
    """Best-of-``repeat`` ns per event, off and on, per API and block size."""
    loop = asyncio.new_event_loop()
    best: dict[str, float] = {}
    try:
        for _ in range(repeat):
            for api in (Api.CHAT, Api.COMPLETIONS):
                for per_block in (1, 8):
                    for on in (False, True):
                        key = f"{api.value}/{per_block}/{'on' if on else 'off'}"
                        ns = splice_ns(loop, events, on, api, per_block)
                        best[key] = min(best.get(key, ns), ns)
    finally:
        loop.close()
    out: dict[str, Any] = {}
    for api in (Api.CHAT, Api.COMPLETIONS):
        for per_block in (1, 8):
            off, on = best[f"{api.value}/{per_block}/off"], best[f"{api.value}/{per_block}/on"]
            out[f"{api.value}, {per_block}-event blocks"] = {
                "off_ns": round(off, 1), "on_ns": round(on, 1), "on_minus_off_ns": round(on - off, 1)}
    return out


def process_figures(reps: int, quick: bool) -> dict[str, Any]:
    """Whole-process CPU per event of pdproxy off vs on (see module docstring); medians of ``reps``."""
    from loadtest import fleet, procstat, users_bench
    from loadtest.bench import PDPROXY

    full, paced = (users_bench.Scenario("full_100", 100, 2000, 0.0, 0.0),
                   users_bench.Scenario("paced_1000", 1000, 150, 0.1, 3.0))
    if quick:
        full, paced = (users_bench.Scenario("full_100", 10, 200, 0.0, 0.0),
                       users_bench.Scenario("paced_1000", 100, 20, 0.1, 0.3))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    run = users_bench.Run((), reps, workers=False)
    run.commands = {}                       # no pdproxy / vllm-router of its own: the two below
    with run:
        for name, template in (("off", PDPROXY), ("on", PDPROXY + " --stream-continuation")):
            run.proxies[name] = fleet.proxy_child(f"pdproxy-{name}", template, run.prefiller.url,
                                                  run.decoder.url, None).start()
        for sc in (full, paced):
            runs[sc.name] = {"off": [], "on": []}
            for _ in range(reps):
                for target in ("off", "on"):
                    runs[sc.name][target].append(run.once(target, sc))
        machine = procstat.describe_machine()
    out: dict[str, Any] = {"machine": machine, "reps": reps}
    for sc in (full, paced):
        summ = {t: users_bench.summary(ws, sc.streams) for t, ws in runs[sc.name].items()}
        off, on = summ["off"]["cpu_us_per_event"], summ["on"]["cpu_us_per_event"]
        per_rep = [round(b["cpu_s"]["proxy"] / b["events"] / (a["cpu_s"]["proxy"] / a["events"]), 3)
                   for a, b in zip(runs[sc.name]["off"], runs[sc.name]["on"], strict=True)
                   if a["events"] and b["events"] and a["cpu_s"].get("proxy") and b["cpu_s"].get("proxy")]
        out[sc.name] = {
            "scenario": f"{sc.streams} streams × {sc.tokens} tokens, "
                        + ("full speed (bursts of 8)" if sc.itl_s == 0 else f"{1 / sc.itl_s:g} tokens/s"),
            "cpu_us_per_event_off": off, "cpu_us_per_event_on": on,
            "ratio_on_off": round(on / off, 3) if off and on else None, "ratio_per_rep": per_rep,
            "ratio_median_of_reps": round(statistics.median(per_rep), 3) if per_rep else None,
            "events": {t: summ[t]["events"] for t in summ}, "errors": {t: summ[t]["errors"] for t in summ},
            "stalls": {t: summ[t]["stalls"] for t in summ},
            "peak_rss_mib": {t: summ[t]["peak_rss_mib"] for t in summ},
            "others_cpu_frac": {t: summ[t]["others_cpu_frac"] for t in summ}}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.continuation_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--process", action="store_true", help="also the whole-process off/on runs (≈ 6 min)")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each process run (median)")
    parser.add_argument("--quick", action="store_true", help="process runs at small sizes: shape only")
    parser.add_argument("--no-splice", action="store_true", help="skip the in-process splice figures")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {"python": sys.version.split()[0]}
    if not args.no_splice:
        result["splice_ns_per_event"] = splice_figures(args.events, args.repeat)
        result["splice"] = {"events": args.events, "repeat": args.repeat, "figure": "best of repeat"}
    if args.process:
        result["process"] = process_figures(args.reps, args.quick)
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
