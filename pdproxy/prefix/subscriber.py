"""Subscribes to the engines' KV event publishers (ZMQ SUB, zmq.asyncio) and keeps :class:`PrefixIndex` in step.

One :class:`KVEventSource` per publisher: an engine DP rank's PUB socket (vLLM binds ``endpoint`` and offsets its
port by the DP rank: rank ``k`` of ``tcp://*:5557`` publishes on ``5557 + k``), and optionally its
replay ROUTER socket (``replay_endpoint``, offset the same way).  Per message (``docs/kv-events.md``):

- ``seq == last + 1``: apply the batch;
- ``seq > last + 1`` (a **gap**: the PUB socket dropped messages, or we reconnected): ask the replay socket for
  ``last + 1 …`` (a DEALER sends ``["", seq]``; the answers are ``["", topic, seq, payload]`` — ``["", seq,
  payload]`` before vLLM added the topic — ending with sequence -1 and an empty payload); when there is no
  replay socket, or the replay does not reach back to ``last + 1`` in ``replay_timeout_s``, the endpoint's
  entries are **forgotten** and the stream is followed from this message on;
- ``seq <= last`` that is not a replayed duplicate: the publisher restarted (a new process counts from 0):
  forget, then replay from 0 if a replay socket is configured;
- a **reconnect** (the ZMQ monitor reports the connection back): with a replay socket, ask it from our last
  sequence; the same batch (same ``ts``) there means the same process (fill the gap), anything else a new
  process (forget, replay from 0); without one, forget (messages sent meanwhile are lost);
- the first connection, with a replay socket: 0.2 s later (once the subscription has reached the publisher),
  fetch what was published before it, from 0 (the publisher keeps ``buffer_steps`` batches); likewise a first
  message whose sequence is not 0;
- a connection down for ``silent_after_s`` (the peer is found dead by ZMQ heartbeats or TCP): the publisher is
  **not live** (:meth:`KVEventSubscriber.is_live` is False, routing falls back to the approximate index) and its
  entries are forgotten.  vLLM publishes only when the cache changes, so an idle engine on a live connection
  stays live with its entries;
- a message or event that does not decode: logged (the first few per publisher, then every 1000th), counted
  (``decode_errors`` / ``bad_events``), skipped; never fatal.

No module-level state: every socket belongs to one subscriber, opened in ``__aenter__`` and closed in
``__aexit__``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdproxy.endpoints import KVEventSource
from pdproxy.prefix.index import PrefixIndex
from pdproxy.prefix.kv_events import BatchDecoder, DecodeError, EventBatch, Frame, parse_frames, seq_frame

log = logging.getLogger("pdproxy.kv_events")

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000
LOGGED_ERRORS = 5
SYNC_DELAY_S = 0.2
"""After the first connection, wait this long (for the subscription to reach the publisher) before asking the
replay socket for what was published until then."""
MAX_REPLAY_BYTES = 256 << 20
"""The most payload bytes one replay answer is read for: past it the rest is left unread (the replay socket is
replaced, as after a timeout) and the replay counts as partial — a replay socket that kept answering held
everything it sent until ``replay_timeout_s``.  vLLM keeps ``buffer_steps`` (10,000) batches to replay."""
MAX_MESSAGE_BYTES = 64 << 20
"""The largest frame read from a publisher or its replay socket (ZMQ's ``MAXMSGSIZE``): a peer that sends a larger
one is disconnected by ZMQ before the frame is held.  ZMQ takes that for a protocol error and never dials that peer
again by itself, so a publisher disconnected for ``silent_after_s`` is dialled afresh (then followed as after any
reconnect).  vLLM's batches are one engine step's events: a 128K-token prompt's ``BlockStored`` is under 1 MB."""


@dataclass(slots=True)
class SourceStatus:
    """What one publisher did so far.  Times are ``clock()`` seconds (monotonic); counters only grow."""

    source: KVEventSource
    connected: bool = False
    ever_connected: bool = False
    disconnected_since: float | None = None
    last_seq: int | None = None
    last_ts: float | None = None
    last_message_at: float | None = None
    last_data_parallel_rank: int | None = None
    encoding: str | None = None
    forgotten_silent: bool = False
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays: dict[str, int] = field(default_factory=dict)
    replayed_batches: int = 0
    duplicates: int = 0
    restarts: int = 0
    forgotten: int = 0
    decode_errors: int = 0
    bad_events: int = 0
    rank_mismatches: int = 0
    replay_window: tuple[int, int] | None = None
    sync_at: float | None = None

    def replay_outcome(self, outcome: str) -> None:
        self.replays[outcome] = self.replays.get(outcome, 0) + 1


class KVEventSubscriber:
    """Feeds ``index`` from ``sources`` (see the module docstring).  ``async with KVEventSubscriber(...)``.

    ``silent_after_s``: a connection down that long makes the publisher not live and its entries forgotten;
    ``replay_timeout_s``: the longest wait for one replay; ``clock``: monotonic seconds; ``on_forget``: called
    with the endpoint name whenever its entries are dropped (gap, restart, silence), e.g. to count it;
    ``max_message_bytes``: the largest frame read (:data:`MAX_MESSAGE_BYTES`); ``max_replay_bytes``: the most
    payload bytes one replay is read for (:data:`MAX_REPLAY_BYTES`).
    """

    def __init__(self, sources: Iterable[KVEventSource], index: PrefixIndex, *, silent_after_s: float = 10.0,
                 replay_timeout_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 on_forget: Callable[[str], None] | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_replay_bytes: int = MAX_REPLAY_BYTES) -> None:
        self.index = index
        self.max_message_bytes = max_message_bytes
        self.max_replay_bytes = max_replay_bytes
        self.silent_after_s = silent_after_s
        self.replay_timeout_s = replay_timeout_s
        self._clock = clock
        self._on_forget = on_forget
        self._status: dict[str, SourceStatus] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._started_at = clock()
        for src in sources:
            if src.endpoint in self._status:
                raise ValueError(f"two KV event sources for {src.endpoint}")
            self._status[src.endpoint] = SourceStatus(src)

    # ---- lifecycle
    async def __aenter__(self) -> KVEventSubscriber:
        self._ctx = zmq.asyncio.Context()
        self._started_at = self._clock()
        for name in self._status:
            self._spawn(name)
        return self

    async def __aexit__(self, *exc: object) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    def _spawn(self, name: str) -> None:
        self._tasks[name] = asyncio.get_running_loop().create_task(self._follow(self._status[name]),
                                                                   name=f"kv-events {name}")

    # ---- state for routing and metrics
    def is_live(self, endpoint: str) -> bool:
        """Whether ``endpoint``'s entries can be trusted: its publisher is connected (or was, less than
        ``silent_after_s`` ago).  False for endpoints without a source: use the approximate index there."""
        st = self._status.get(endpoint)
        if st is None or not st.ever_connected:
            return False
        if st.connected:
            return True
        since = st.disconnected_since
        return since is not None and self._clock() - since < self.silent_after_s

    def status(self, endpoint: str) -> SourceStatus | None:
        """The status of ``endpoint``'s publisher (None without a source)."""
        return self._status.get(endpoint)

    def statuses(self) -> list[SourceStatus]:
        """Every source's status, by endpoint."""
        return [self._status[k] for k in sorted(self._status)]

    # ---- per source
    def _forget(self, st: SourceStatus, why: str) -> None:
        dropped = self.index.forget(st.source.endpoint)
        st.forgotten += 1
        log.info("kv events %s: %s, forgot %d block entries", st.source.endpoint, why, dropped)
        if self._on_forget is not None:
            self._on_forget(st.source.endpoint)

    def _log_error(self, st: SourceStatus, what: str) -> None:
        n = st.decode_errors + st.bad_events
        if n <= LOGGED_ERRORS or n % 1000 == 0:
            log.warning("kv events %s: %s (%d so far)", st.source.endpoint, what, n)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        return sock

    async def _follow(self, st: SourceStatus) -> None:
        src = st.source
        sub = self._socket(zmq.SUB)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        replay: list[zmq.asyncio.Socket | None] = [None]
        decoder = BatchDecoder()
        st.disconnected_since = self._clock()
        try:
            sub.connect(src.publisher)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            tick_ms = max(int(min(self.silent_after_s, 1.0) * 250), 10)
            redialed_at = 0.0
            while True:
                ready = dict(await poller.poll(tick_ms))
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    await self._on_monitor(st, int(event["event"]), decoder, replay)
                if sub in ready:
                    frames = await sub.recv_multipart()
                    await self._on_message(st, frames, decoder, replay)
                if st.sync_at is not None and self._clock() >= st.sync_at:
                    st.sync_at = None
                    await self._initial_sync(st, decoder, replay)
                self._check_silence(st)
                redialed_at = self._redial(st, sub, redialed_at)
        finally:
            with contextlib.suppress(Exception):
                sub.disable_monitor()
            monitor.close(0)
            sub.close(0)
            if replay[0] is not None:
                replay[0].close(0)

    async def _on_monitor(self, st: SourceStatus, event: int, decoder: BatchDecoder,
                          replay: list[zmq.asyncio.Socket | None]) -> None:
        if event == zmq.EVENT_CONNECTED:
            again = st.ever_connected
            st.connected = st.ever_connected = True
            st.disconnected_since = None
            st.forgotten_silent = False
            if again and st.last_seq is not None:
                await self._resync(st, decoder, replay)
            elif st.source.replay:
                st.sync_at = self._clock() + SYNC_DELAY_S
        elif event == zmq.EVENT_DISCONNECTED and st.connected:
            st.connected = False
            st.disconnected_since = self._clock()

    def _check_silence(self, st: SourceStatus) -> None:
        since = st.disconnected_since
        if (since is not None and not st.forgotten_silent and st.ever_connected
                and self._clock() - since >= self.silent_after_s):
            st.forgotten_silent = True
            st.last_seq = st.last_ts = None
            self._forget(st, f"publisher silent (disconnected {self.silent_after_s:g} s)")

    def _redial(self, st: SourceStatus, sub: zmq.asyncio.Socket, redialed_at: float) -> float:
        """Dial ``st``'s publisher afresh once it has been disconnected for ``silent_after_s`` (and again every
        ``silent_after_s``): ZMQ does not reconnect after a protocol error (a frame over ``max_message_bytes``).
        Returns when it last dialled."""
        since = st.disconnected_since
        if st.connected or since is None or not st.ever_connected:
            return redialed_at
        now = self._clock()
        if now - max(since, redialed_at) < self.silent_after_s:
            return redialed_at
        with contextlib.suppress(zmq.ZMQError):        # no such connection left: ZMQ dropped it
            sub.disconnect(st.source.publisher)
        sub.connect(st.source.publisher)
        return now

    async def _on_message(self, st: SourceStatus, frames: list[bytes], decoder: BatchDecoder,
                          replay: list[zmq.asyncio.Socket | None]) -> None:
        st.last_message_at = self._clock()
        try:
            frame = parse_frames(frames)
        except DecodeError as exc:
            st.decode_errors += 1
            self._log_error(st, f"malformed message: {exc}")
            return
        seq, last = frame.seq, st.last_seq
        if seq < 0:
            st.decode_errors += 1
            self._log_error(st, f"negative sequence {seq} on the live stream")
            return
        if last is None:
            if seq > 0 and st.source.replay:
                await self._replay(st, 0, seq, decoder, replay)
        elif seq > last + 1:
            st.gaps += 1
            if st.source.replay:
                await self._replay(st, last + 1, seq, decoder, replay)
            else:
                st.replay_outcome("none")
                self._forget(st, f"sequence gap {last} -> {seq}, no replay endpoint")
        elif seq <= last:
            window = st.replay_window
            if window is not None and window[0] <= seq <= window[1]:
                st.duplicates += 1
                return
            st.restarts += 1
            self._forget(st, f"sequence went back {last} -> {seq} (publisher restarted)")
            st.last_seq = st.last_ts = None
            if st.source.replay and seq > 0:
                await self._replay(st, 0, seq, decoder, replay)
        if st.last_seq is not None and seq <= st.last_seq:
            st.duplicates += 1  # the replay already delivered it
            return
        if st.last_seq is not None and seq > st.last_seq + 1:
            self._forget(st, f"sequence gap {st.last_seq} -> {seq} not covered by the replay")
        if st.replay_window is not None and seq > st.replay_window[1]:
            st.replay_window = None
        self._apply(st, frame, decoder)

    def _apply(self, st: SourceStatus, frame: Frame, decoder: BatchDecoder) -> None:
        st.last_seq = frame.seq
        try:
            batch: EventBatch = decoder.decode(frame.payload)
        except DecodeError as exc:
            st.decode_errors += 1
            self._log_error(st, f"undecodable batch {frame.seq}: {exc}")
            return
        if batch.bad_events:
            st.bad_events += batch.bad_events
            self._log_error(st, f"batch {frame.seq}: {batch.bad_events} undecodable event(s) skipped")
        st.last_ts = batch.ts
        st.encoding = batch.encoding
        st.last_data_parallel_rank = batch.data_parallel_rank
        expected = st.source.dp_rank
        if expected is not None and batch.data_parallel_rank is not None and batch.data_parallel_rank != expected:
            st.rank_mismatches += 1
            if st.rank_mismatches <= LOGGED_ERRORS:
                log.warning("kv events %s: batch stamped data_parallel_rank %d, expected %d (check the port)",
                            st.source.endpoint, batch.data_parallel_rank, expected)
        st.batches += 1
        st.events += len(batch.events)
        self.index.apply(st.source.endpoint, batch.events)

    async def _fetch(self, st: SourceStatus, start: int,
                     holder: list[zmq.asyncio.Socket | None]) -> list[Frame] | None:
        """Every batch the replay socket still has from ``start`` on, in order (None: no answer within
        ``replay_timeout_s``; the socket is then replaced so a late answer is not read as the next one's), or the
        first of them up to ``max_replay_bytes`` of payload (the socket replaced too)."""
        address = st.source.replay
        assert address is not None
        sock = holder[0]
        if sock is None:
            sock = holder[0] = self._socket(zmq.DEALER)
            sock.connect(address)
        await sock.send_multipart([b"", seq_frame(start)])
        deadline = self._clock() + self.replay_timeout_s
        frames_out: list[Frame] = []
        held = 0
        while True:
            remaining_ms = int((deadline - self._clock()) * 1000)
            if remaining_ms <= 0 or not await sock.poll(remaining_ms):
                sock.close(0)
                holder[0] = None
                return None
            frames = await sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            try:
                frame = parse_frames(frames)
            except DecodeError as exc:
                st.decode_errors += 1
                self._log_error(st, f"malformed replay message: {exc}")
                continue
            if frame.seq < 0:
                return frames_out
            if frame.seq >= start and (not frames_out or frame.seq > frames_out[-1].seq):
                held += len(frame.payload)
                if held > self.max_replay_bytes:     # the rest stays unread: a partial replay
                    sock.close(0)
                    holder[0] = None
                    return frames_out
                frames_out.append(frame)

    async def _replay(self, st: SourceStatus, start: int, until: int, decoder: BatchDecoder,
                      holder: list[zmq.asyncio.Socket | None]) -> None:
        """Fetch and apply batches from ``start`` on (the live message ``until`` is in hand).  A replay that does
        not begin at ``start`` (the buffer moved on) forgets the endpoint first; no answer forgets it too."""
        frames = await self._fetch(st, start, holder)
        self._apply_replayed(st, start, until, frames, decoder)

    def _apply_replayed(self, st: SourceStatus, start: int, until: int, frames: list[Frame] | None,
                        decoder: BatchDecoder) -> None:
        if frames is None:
            outcome = "timeout"
            self._forget(st, f"replay from {start} unanswered")
        elif not frames:
            outcome = "empty"
            if start < until:
                self._forget(st, f"replay from {start} returned nothing")
        else:
            outcome = "complete"
            if frames[0].seq > start:
                outcome = "partial"
                self._forget(st, f"replay starts at {frames[0].seq}, needed {start}")
            for frame in frames:
                self._apply(st, frame, decoder)
            st.replayed_batches += len(frames)
            st.replay_window = (min(start, until), frames[-1].seq)
        st.replay_outcome(outcome)
        log.info("kv events %s: replay from %d: %s, %d batch(es)", st.source.endpoint, start, outcome,
                 len(frames or ()))

    async def _initial_sync(self, st: SourceStatus, decoder: BatchDecoder,
                            holder: list[zmq.asyncio.Socket | None]) -> None:
        """Shortly after the first connection: fetch what the publisher sent before our subscription reached it
        (a SUB misses those messages), from the start of its history or after the last batch we have."""
        start = 0 if st.last_seq is None else st.last_seq + 1
        frames = await self._fetch(st, start, holder)
        if not frames:
            st.replay_outcome("sync_empty" if frames is not None else "timeout")
            return
        for frame in frames:
            self._apply(st, frame, decoder)
        st.replayed_batches += len(frames)
        st.replay_window = (start, frames[-1].seq)
        st.replay_outcome("sync")

    async def _resync(self, st: SourceStatus, decoder: BatchDecoder,
                      holder: list[zmq.asyncio.Socket | None]) -> None:
        """After a reconnect: the same publisher process (its replay still has our last batch, same timestamp)
        → fill what was missed; a new process, or no way to tell (no replay socket) → forget and start over."""
        last, last_ts = st.last_seq, st.last_ts
        if last is None:
            return
        if not st.source.replay:
            st.last_seq = st.last_ts = None
            self._forget(st, "reconnected without a replay endpoint (messages may be lost)")
            return
        frames = await self._fetch(st, last, holder)
        if frames is None:
            st.last_seq = st.last_ts = None
            st.replay_outcome("timeout")
            self._forget(st, "reconnected; the replay endpoint did not answer")
            return
        if frames and frames[0].seq == last:
            try:
                same = decoder.decode(frames[0].payload).ts == last_ts
            except DecodeError:
                same = False
            if same:
                if len(frames) > 1:
                    self._apply_replayed(st, last + 1, frames[-1].seq + 1, frames[1:], decoder)
                return
        st.restarts += 1
        st.last_seq = st.last_ts = None
        self._forget(st, "reconnected to a new publisher process")
        frames = await self._fetch(st, 0, holder)
        if frames:
            self._apply_replayed(st, 0, frames[-1].seq + 1, frames, decoder)
