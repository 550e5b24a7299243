"""Helpers for the KV-event tests: an async ``until``, a vLLM-like publisher the test drives message by message
(real PUB and ROUTER sockets on loopback), and a subscriber + index bundle."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from pdproxy.endpoints import KVEventSource
from pdproxy.prefix.index import PrefixIndex
from pdproxy.prefix.kv_events import END_SEQ, Encoding, KVEvent, removed, seq_frame
from pdproxy.prefix.subscriber import KVEventSubscriber
from pdproxy.sim.kv_wire import BatchEncoder


async def until(cond: Callable[[], Any], timeout_s: float = 15.0, what: str = "") -> Any:
    """Poll ``cond`` (every 10 ms, yielding to the loop) until truthy; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what or cond}: last={last!r}")


class FakePublisher:
    """vLLM's ``ZmqEventPublisher`` behaviour, one message at a time: :meth:`publish` sends ``[topic, seq,
    payload]`` on a PUB socket and keeps it for the replay ROUTER (answers ``["", topic?, seq, payload]`` then
    sequence -1); ``deliver=False`` keeps a message for replay only (the PUB dropped it)."""

    def __init__(self, encoding: Encoding = "map", replay: bool = True, topic: str = "",
                 buffer_steps: int = 10_000, rank: int | None = 0) -> None:
        self.encoding: Encoding = encoding
        self.with_replay = replay
        self.topic = topic.encode()
        self.rank = rank
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.encoder = BatchEncoder(encoding)
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router: zmq.asyncio.Socket | None = None
        self.replay_port: int | None = None
        self.replay_requests = 0
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self._task: asyncio.Task[None] | None = None

    def source(self, endpoint: str = "http://engine:8000", dp_rank: int | None = None) -> KVEventSource:
        return KVEventSource(endpoint, f"tcp://127.0.0.1:{self.pub_port}",
                             f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None, dp_rank,
                             self.topic.decode())

    async def __aenter__(self) -> FakePublisher:
        if self.router is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)
        self.ctx.term()

    async def publish(self, *events: KVEvent, deliver: bool = True, skip: int = 0) -> int:
        """Send one batch; returns its sequence number.  ``skip``: sequence numbers jumped over first."""
        self.seq += skip
        seq = self.seq
        payload = self.encoder.encode(time.time(), list(events), self.rank)
        self.buffer.append((seq, payload))
        if deliver:
            await self.pub.send_multipart([self.topic, seq_frame(seq), payload])
        self.seq += 1
        return seq

    async def rebind(self) -> None:
        """Close the PUB socket and bind a new one on the same port (subscribers see a disconnect, then a
        reconnect): the same process after a network cut, or with :meth:`restart` a new one."""
        self.pub.close(0)
        await asyncio.sleep(0)
        for _ in range(200):
            sock = self.ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(f"tcp://127.0.0.1:{self.pub_port}")
            except zmq.ZMQError:
                sock.close(0)
                await asyncio.sleep(0.02)
                continue
            self.pub = sock
            return
        raise AssertionError(f"port {self.pub_port} not free again")

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    def restart(self) -> None:
        """A new publisher process: sequence from 0, empty replay buffer."""
        self.seq = 0
        self.buffer.clear()

    async def prime(self, sub: KVEventSubscriber, endpoint: str = "http://engine:8000") -> None:
        """Publish harmless batches until the subscriber has one (a SUB misses what is sent before its
        subscription reaches the PUB)."""
        await until(lambda: sub.is_live(endpoint), what="connected")
        status = sub.status(endpoint)
        assert status is not None
        start = status.batches
        while status.batches == start:
            await self.publish(removed([0xDEAD], encoding=self.encoding))
            for _ in range(20):
                if status.batches > start:
                    break
                await asyncio.sleep(0.01)

    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            client, _empty, start_b = await self.router.recv_multipart()
            self.replay_requests += 1
            start = int.from_bytes(start_b, "big")
            head = [self.topic] if self.encoding == "map" else []
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart([client, b"", *head, seq_frame(seq), payload])
            await self.router.send_multipart([client, b"", *([b""] if head else []), END_SEQ, b""])


@contextlib.asynccontextmanager
async def subscribed(*sources: KVEventSource, silent_after_s: float = 10.0,
                     replay_timeout_s: float = 5.0) -> AsyncIterator[tuple[KVEventSubscriber, PrefixIndex]]:
    """A :class:`PrefixIndex` fed by a running :class:`KVEventSubscriber` of ``sources``."""
    index = PrefixIndex()
    async with KVEventSubscriber(sources, index, silent_after_s=silent_after_s,
                                 replay_timeout_s=replay_timeout_s) as sub:
        yield sub, index


class SubscriberThread:
    """A subscriber + index on their own event loop in a background thread, for synchronous tests (the real-vLLM
    stage): :meth:`call` runs a function on that loop (the index is not thread-safe) and returns its result."""

    def __init__(self, *sources: KVEventSource, silent_after_s: float = 10.0) -> None:
        import threading

        self.sources = sources
        self.silent_after_s = silent_after_s
        self.loop = asyncio.new_event_loop()
        self.index = PrefixIndex()
        self.sub: KVEventSubscriber | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-subscriber")

    def _run(self) -> None:
        async def main() -> None:
            self._stop = asyncio.Event()
            async with KVEventSubscriber(self.sources, self.index, silent_after_s=self.silent_after_s) as sub:
                self.sub = sub
                self._ready.set()
                await self._stop.wait()

        self.loop.run_until_complete(main())
        self.loop.close()

    def __enter__(self) -> SubscriberThread:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def call(self, fn: Callable[[], Any]) -> Any:
        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)
