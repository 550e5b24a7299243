"""Stream continuation on real vLLM (docs/stream-continuation.md): a real decoder process is SIGKILLed while
streams are live on it, and every client stream completes through the other decoder; its text is compared with an
uninterrupted greedy run, for every stream (docs/stream-continuation.md § Measured; a cut right after tokens
whose text vLLM held back, inside a UTF-8 character — in events of their own or at the end of an event of several
tokens — is continued from before them).

The module starts a second real decoder beside the stage's (``RealEngines.extra_decoder``: the same model, KV
connector and arguments, its own ports, its own process group).  pdproxy gets both decoders with
``stream_continuation``.  The uninterrupted runs go to the stage's decoder (the extra one drained); then the same
requests — chat and completions at once — go to the extra decoder (the stage's drained until every stream has
its first token event), and at that moment the extra decoder's whole process group (API server, EngineCore,
worker) is stopped (SIGSTOP); once pdproxy has read all it sent, it is SIGKILLed if a stream is still live at
pdproxy (else resumed, and the round run again).  Each stream then continues with real ``return_token_ids``, a real token-id ``prompt`` on
``/v1/completions`` and a real NIXL handoff from the prefiller to the stage's decoder.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from pdproxy.apis.request import Api, parse_request
from pdproxy.endpoints import Role
from pdproxy.pd.continuation import RecordIds, Resume, held_in_text
from tests.real_vllm.support import START_TIMEOUT_S, Engines, ExtraDecoder, Prompts, RealEngines, metric, scrape
from tests.support import ProxyThread, wait_until

pytestmark = [pytest.mark.real_vllm, pytest.mark.timeout(START_TIMEOUT_S + 240)]
MAX_TOKENS = 400
"""Long enough that no stream ends before the last one has its first token event on the dying decoder: one run saw
a stream start about 6 s (90 token events of the others) after the rest; the 2-core machine decodes the tiny model
at roughly 50-150 tokens/s over all streams."""
APIS = ("chat", "completions") * 3
"""The streams live on the decoder when it dies: 3 chat + 3 completions."""
SEED = 700
"""Stream i's prompt is the words `` s{SEED + i}w0 s{SEED + i}w1 ...`` (``Prompts.unique``)."""
ROUNDS = 3
"""Rounds of the streams on the extra decoder until one finds a stream live at pdproxy when the decoder stops."""


@pytest.fixture(scope="module")
def extra_decoder(real_engines: RealEngines, engines: Engines) -> Iterator[ExtraDecoder]:
    """A second real decoder for this module (stopped at its end when the test has not killed it)."""
    with real_engines.extra_decoder() as extra:
        yield extra


def _body(api: str, engines: Engines, prompt: str) -> dict[str, Any]:
    base: dict[str, Any] = {"model": engines.served_model, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if api == "chat":
        return {**base, "messages": [{"role": "user", "content": prompt}]}
    return {**base, "prompt": prompt}


@dataclass
class Stream:
    """One client stream, read in its own thread: what arrived so far (``lock`` guards the counters)."""

    api: str
    body: dict[str, Any]
    events: list[dict[str, Any]] = field(default_factory=list)
    raw: bytearray = field(default_factory=bytearray)
    token_events: int = 0
    """Events carrying a choice that is neither the role chunk nor the finish: counted by events, not non-empty
    text (the tiny model's random weights, made anew by each setup, can answer tokens of empty text)."""
    finished: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def run(self, url: str) -> Stream:
        with httpx.stream("POST", url + self.path, json=self.body, timeout=120) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                self.raw += line.encode() + b"\n"
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = orjson.loads(line[6:])
                with self.lock:
                    self.events.append(obj)
                    for choice in obj.get("choices") or []:
                        if choice.get("finish_reason") is not None:
                            self.finished = True
                        elif "role" not in (choice.get("delta") or {}):
                            self.token_events += 1
        return self

    def snapshot(self) -> tuple[int, bool, int]:
        """(token events, finished, characters of text) so far."""
        with self.lock:
            return self.token_events, self.finished, len(self.text())

    def text(self) -> str:
        return "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                       for e in self.events for c in e.get("choices") or [])


def _live(streams: list[Stream]) -> bool:
    """Some stream has token events and is not finished."""
    return any(events and not finished for events, finished, _ in (s.snapshot() for s in streams))


def _ready_to_stop(streams: list[Stream], running: list[Future[Stream]]) -> bool:
    """Some stream is live to the client and every stream has its first token event, or one has ended, or one is
    half-way (``MAX_TOKENS // 2`` token events)."""
    snapshots = [s.snapshot() for s in streams]
    return _live(streams) and (all(events for events, _, _ in snapshots) or any(r.done() for r in running)
                               or any(events >= MAX_TOKENS // 2 for events, _, _ in snapshots))


def _ready_or_ended(streams: list[Stream], running: list[Future[Stream]]) -> bool:
    """``_ready_to_stop``, or every stream has ended."""
    return _ready_to_stop(streams, running) or all(r.done() for r in running)


def _first_difference(api: str, text: str, reference: str, cut: int) -> str:
    """Where ``text`` first differs from ``reference`` (character index, and ``cut``: characters delivered before
    the kill), with the context on both sides."""
    i = next((k for k, (a, b) in enumerate(zip(text, reference, strict=False)) if a != b),
             min(len(text), len(reference)))
    return f"{api}: differs at {i} (cut at {cut}): {text[max(i - 30, 0):i + 30]!r} != {reference[max(i - 30, 0):i + 30]!r}"


def _unread_from(port: int) -> int:
    """Bytes the server listening on ``port`` (any address) has sent that its clients have not read: the receive queues
    of connections to ``port`` plus the send queues of the server's side of them (/proc/net/tcp and tcp6: fields
    ``local_address``, ``rem_address``, ``st``, ``tx_queue:rx_queue``; a listening socket's queues are its backlog,
    not bytes, and are skipped)."""
    total = 0
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            _, local, remote, state, queues, *_ = row.split()
            if state == "0A":                                   # TCP_LISTEN
                continue
            tx, rx = (int(q, 16) for q in queues.split(":"))
            if int(remote.rsplit(":", 1)[1], 16) == port:
                total += rx
            elif int(local.rsplit(":", 1)[1], 16) == port:
                total += tx
    return total


def _settled(proxy: ProxyThread, read: Callable[[], int]) -> int:
    """``read()`` run on pdproxy's event loop once the work already scheduled there has run (callbacks a read of
    the socket woke, and what those woke in turn: 20 loop iterations)."""
    async def after_pending() -> int:
        for _ in range(20):
            await asyncio.sleep(0)
        return read()
    assert proxy.loop is not None
    return asyncio.run_coroutine_threadsafe(after_pending(), proxy.loop).result(timeout=30)


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of process group ``pgid`` remains (reads /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def test_sigkill_of_a_decoder_process_mid_stream_continues(
        engines: Engines, extra_decoder: ExtraDecoder, prompts: Prompts) -> None:
    # Only the SIGKILL may end a leg: no stall detection, and a /health answer slow on the loaded machine (seen:
    # the extra decoder taken out by 3 probes of 1 s while it streamed, so the other streams waited for a decoder)
    # does not take an engine out.
    proxy = ProxyThread(prefill=[engines.prefill_url], decode=[extra_decoder.url, engines.decode_url],
                        stream_continuation=True, stream_continuation_stall_min_s=60.0, health_timeout_s=10.0,
                        health_unhealthy_threshold=10).start()
    try:
        wait_until(lambda: len(proxy.state.infos) == 3 and all(
            i.max_model_len for i in proxy.state.infos.values()), 30, 0.05, "engine limits read")
        by_url = {e.url: e for e in proxy.state.pool.endpoints(Role.DECODE)}
        stage, extra = proxy.state.pool.load(by_url[engines.decode_url]), proxy.state.pool.load(
            by_url[extra_decoder.url])
        bodies = [(api, _body(api, engines, prompts.unique(24, seed=SEED + i))) for i, api in enumerate(APIS)]

        extra.draining = True                               # the uninterrupted runs: on the stage's decoder
        with ThreadPoolExecutor(len(bodies)) as pool:
            references = [s.text() for s in pool.map(lambda ab: Stream(*ab).run(proxy.url), bodies)]
        assert all(references)
        extra.draining, stage.draining = False, True        # the first legs: on the extra decoder
        extra_name, extra_port = by_url[extra_decoder.url].name, int(extra_decoder.url.rsplit(":", 1)[1])
        for round_ in range(1, ROUNDS + 1):
            streams = [Stream(api, body) for api, body in bodies]
            with ThreadPoolExecutor(len(streams)) as pool:
                running = [pool.submit(s.run, proxy.url) for s in streams]
                # stop once every stream has its first token event — or, should their starts be far apart on the
                # loaded machine (seen: one ~6 s after the rest) or one end early, once a stream is half-way: a
                # stream not started by then fails over before its first byte, one already ended is simply
                # complete; both must still equal their uninterrupted run.  Never before one stream is live to
                # the client (token events in, not finished)
                # or once every stream has ended unseen: seen in CI (2026-12-05) — six streams of 400 tokens ended
                # with no poll finding one live, so that round is run again like one that found none live at pdproxy
                wait_until(partial(_ready_or_ended, streams, running), 120, 0.005,
                           "a live stream and the streams' first token events on the extra decoder")
                if all(r.done() for r in running) and not _live(streams):
                    movable, at_kill = 0, [s.snapshot() for s in streams]
                    print(f"\nround {round_}: every stream ended before one was seen live; token events: "
                          f"{[e for e, _, _ in at_kill]}")
                    assert [r.result().text() for r in running] == references
                    continue
                # the client's view lags pdproxy's and pdproxy's the engine's (seen in CI: five streams at 1 token
                # event, one at 281, and every stream had in fact been sent whole, so the kill ended none): the
                # decoder is stopped, pdproxy reads what it had sent, and it is killed only with a stream still
                # live at pdproxy — else resumed, its streams end there, and the round is run again
                os.killpg(extra_decoder.pgid, signal.SIGSTOP)
                try:
                    # read twice: a segment moving between the decoder's send queue and pdproxy's receive queue
                    # between two rows of one read is seen by the next (the wait stays under the stall limit, 60 s)
                    wait_until(lambda: _unread_from(extra_port) == 0 and _unread_from(extra_port) == 0, 30, 0.005,
                               "pdproxy has read all the stopped decoder sent")
                    movable = _settled(proxy, lambda: proxy.state.live_streams.count(extra_name, movable=True))
                except BaseException:
                    os.killpg(extra_decoder.pgid, signal.SIGCONT)   # its streams end; the fixture stops it
                    raise
                at_kill = [s.snapshot() for s in streams]
                if movable:
                    stage.draining = False
                    os.killpg(extra_decoder.pgid, signal.SIGKILL)
                else:
                    os.killpg(extra_decoder.pgid, signal.SIGCONT)
                for r in running:
                    r.result(timeout=180)
            print(f"\nround {round_}: {movable} of {len(streams)} streams live at pdproxy when the extra decoder "
                  f"stopped; token events / characters delivered to the client: {[(e, c) for e, _, c in at_kill]}")
            if movable:
                break
            assert [s.text() for s in streams] == references     # ended on the resumed decoder
        else:
            pytest.fail(f"no stream was live at pdproxy when the extra decoder stopped, in {ROUNDS} rounds")
        live = [i for i, (events, finished, _) in enumerate(at_kill) if events and not finished]
        wait_until(lambda: not _group_alive(extra_decoder.pgid), 30, 0.05, "the extra decoder's processes gone")

        # a cut inside a character (docs/stream-continuation.md, "A cut inside a character"): the client's text
        # stops before a token vLLM held back — its character, here the tiny model's invalid byte shown as U+FFFD,
        # comes right at the cut in the uninterrupted run.  Seen once in CI (2026-12-02, 1 stream of 6) after a
        # token event of several tokens, before pdproxy asked /detokenize about such events: now checked like
        # every other stream, and counted in the report
        inside_char = [i for i, (ref, (_, _, cut)) in enumerate(zip(references, at_kill, strict=True))
                       if ref[cut:cut + 1] == "\ufffd"]
        mismatches = [_first_difference(s.api, s.text(), ref, cut) for s, ref, (_, _, cut) in
                      zip(streams, references, at_kill, strict=True) if s.text() != ref]
        continued = metric(scrape(proxy.url), "pdproxy_continuations_total")
        print(f"killed with {len(live)} of {len(streams)} streams live to the client; continued {continued:g}; "
              f"text == the uninterrupted run: "
              f"{len(streams) - len(mismatches)} of {len(streams)} {mismatches}; cut inside a held-back "
              f"character: {[streams[i].api for i in inside_char]}")
        for i, (stream, reference, (_, _, chars)) in enumerate(zip(streams, references, at_kill, strict=True)):
            raw = bytes(stream.raw)
            assert b'"error"' not in raw, (stream.api, raw[-400:])
            assert raw.rstrip().endswith(b"data: [DONE]"), (stream.api, raw[-400:])
            if i in live:
                assert chars < len(reference)
                assert stream.text()[:chars] == reference[:chars], stream.api
            usage = [e["usage"] for e in stream.events if e.get("usage")]
            assert len(usage) == 1 and usage[0]["completion_tokens"] == MAX_TOKENS, (stream.api, usage)
            assert len({e["id"] for e in stream.events}) == 1, stream.api
            roles = sum(1 for e in stream.events for c in e.get("choices") or []
                        if "role" in (c.get("delta") or {}))
            assert roles == (1 if stream.api == "chat" else 0), stream.api
        # every stream live at pdproxy when the decoder died, and only those, was continued (the client's view
        # lags pdproxy's: a stream live to the client may have ended at pdproxy)
        assert continued == movable, (continued, movable)
        proxy.wait_idle(20)
        assert not mismatches, mismatches
    finally:
        proxy.stop()


class _Plain:
    """The stream's own transform of a plain completions stream: none."""

    trigger = b"\x00"
    recomputed = False

    def feed(self, block: bytes, prev: bytes = b"") -> bytes:
        return block

    def ending(self, block: bytes, prev: bytes) -> bytes:
        return block


def _token_events(url: str, body: dict[str, Any]) -> tuple[list[bytes], list[tuple[str, list[int]]]]:
    """A greedy completions stream straight from an engine with ``return_token_ids``: its data events (whole) and
    each event's ``(text, token_ids)``."""
    raw: list[bytes] = []
    events: list[tuple[str, list[int]]] = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "return_token_ids": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                raw.append(line.encode() + b"\n\n")
                choice = orjson.loads(line[6:])["choices"][0]
                events.append((choice.get("text") or "", choice.get("token_ids") or []))
    return raw, events


def test_a_held_back_token_at_the_end_of_an_event_of_several_is_found_and_continued_exactly(
        engines: Engines, prompts: Prompts) -> None:
    """The cut seen once in CI, made on purpose on the stage's decoder: a token event with text whose last token
    vLLM held back (inside a character).  vLLM's own stream gives one such token as an event of empty text; merged
    with the event before it (what the API server sends when both accumulated), it is the cut pdproxy must find.
    pdproxy's record of that stream, read on loss, and :func:`held_in_text` asking the real ``/detokenize`` count
    the held token; the continuation pdproxy builds, run on the real engine, gives exactly the uninterrupted text
    after what the client had (primed after the held token, it would begin with the prompt's text)."""
    url, model = engines.decode_url, engines.served_model

    def text_of(ids: list[int]) -> str:
        return str(httpx.post(url + "/detokenize", json={"model": model, "tokens": ids}, timeout=30).json()["prompt"])

    def inside_a_character(events: list[tuple[str, list[int]]], j: int) -> bool:
        """Event ``j`` is one token of empty text that ends inside a character (not a special token that decodes
        to nothing), after an event with text."""
        if events[j][0] or len(events[j][1]) != 1 or not events[j - 1][0]:
            return False
        ids = [i for _, event_ids in events[:j + 1] for i in event_ids][-16:]
        return text_of(ids).endswith("\ufffd") and not text_of(ids[:-1]).endswith("\ufffd")

    found = None
    for seed in range(SEED, SEED + 5):       # the tiny model's weights are random per setup: ~4 % held tokens
        body = {"model": model, "prompt": prompts.unique(24, seed=seed), "max_tokens": 120, "temperature": 0,
                "ignore_eos": True, "stream": True}
        raw, events = _token_events(url, body)
        j = next((j for j in range(2, len(events) - 8) if inside_a_character(events, j)), None)
        if j is not None:
            found = body, raw, events, j
            break
    assert found is not None, "no held-back token in 5 streams of 120 tokens"
    body, raw, events, j = found
    merged = orjson.loads(raw[j - 1][6:])
    merged["choices"][0]["token_ids"] += events[j][1]         # events j-1 and j as one: j-1's text, both ids
    req = parse_request(orjson.dumps(body), Api.COMPLETIONS)
    resume = Resume.of(req, True)
    assert resume is not None
    record = RecordIds(resume, _Plain())
    for block in [*raw[:j - 1], b"data: " + orjson.dumps(merged) + b"\n\n"]:
        record.feed(block)
    resume.read_transcript()
    assert resume.held == 0 and resume.texted == len(events[j - 1][1]) + 1      # nothing seen without asking

    async def detokenize(ids: list[int]) -> str | None:
        async with httpx.AsyncClient(timeout=30) as client:
            return str((await client.post(url + "/detokenize", json={"model": model, "tokens": ids})).json()[
                "prompt"])

    asyncio.run(held_in_text(resume, detokenize))
    assert resume.held == 1
    leg = resume.next_leg()
    assert leg is not None
    delivered = "".join(text for text, _ in events[:j + 1])
    full = "".join(text for text, _ in events)
    cont = httpx.post(url + "/v1/completions", json={**{k: v for k, v in leg.body.items() if k != "stream_options"},
                                                     "stream": False, "max_tokens": 6}, timeout=60).json()
    text = cont["choices"][0]["text"]
    assert text and text == full[len(delivered):len(delivered) + len(text)], (text, full[len(delivered):][:40])


def _stream_events(url: str, path: str, body: dict[str, Any], stop_after: int) -> tuple[list[bytes], int, str | None]:
    """A stream straight from an engine, read until ``stop_after`` token events or its end (the connection is then
    closed: vLLM aborts the rest): its data events (whole), the token events read and the finish reason seen."""
    raw: list[bytes] = []
    tokens, finish = 0, None
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            raw.append(line.encode() + b"\n\n")
            for choice in orjson.loads(line[6:]).get("choices") or []:
                finish = choice.get("finish_reason") or finish
                tokens += len(choice.get("token_ids") or []) if "token_ids" in choice else int(
                    bool(choice.get("text") or (choice.get("delta") or {}).get("content")))
            if tokens >= stop_after or finish:
                break
    return raw, tokens, finish


def test_a_chat_without_an_output_limit_continues_past_vllms_completion_default(
        engines: Engines, prompts: Prompts) -> None:
    """A chat stream that set no ``max_tokens``, read for a few events as pdproxy's record reads it: the
    continuation pdproxy builds (``/v1/completions`` on the token ids) asks for the room ``max_model_len`` leaves,
    which the real engine accepts and generates past 16 tokens — where the same leg with a null ``max_tokens``
    (old code) ends after 16 tokens with "length" (vLLM's ``CompletionRequest`` default)."""
    url, model = engines.decode_url, engines.served_model
    body = {"model": model, "messages": [{"role": "user", "content": prompts.unique(24, seed=SEED + 50)}],
            "temperature": 0, "ignore_eos": True, "stream": True}
    req = parse_request(orjson.dumps(body), Api.CHAT)
    assert req.max_output_tokens is None
    resume = Resume.of(req, True)
    assert resume is not None
    record = RecordIds(resume, _Plain())
    raw, _, _ = _stream_events(url, "/v1/chat/completions", {**body, "return_token_ids": True}, 6)
    for block in raw:
        record.feed(block)
    resume.read_transcript()
    max_model_len = int(httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"])
    leg = resume.next_leg(max_model_len)
    assert leg is not None and resume.prompt_ids is not None
    assert leg.body["max_tokens"] == max_model_len - len(leg.body["prompt"]) > 1000
    cont = {k: v for k, v in leg.body.items() if k != "stream_options"} | {"ignore_eos": True}
    _, tokens, finish = _stream_events(url, "/v1/completions", cont, 40)
    assert tokens >= 40 and finish is None                  # runs on: the room, not 16
    _, tokens, finish = _stream_events(url, "/v1/completions", {**cont, "max_tokens": None}, 40)
    assert (tokens, finish) == (16, "length")               # what the old leg asked for
