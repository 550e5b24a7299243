"""``pdproxy sim --kv-events-config JSON``: the rank's prefix cache published as vLLM's ``ZmqEventPublisher`` does.

``JSON`` is vLLM's ``--kv-events-config`` (``vllm/config/kv_events.py::KVEventsConfig``): ``enable_kv_cache_events``,
``publisher`` (``"zmq"``; ``"null"`` or events disabled = no publisher), ``endpoint`` (default ``tcp://*:5557``),
``replay_endpoint``, ``buffer_steps``, ``hwm``, ``max_queue_size``, ``topic``.  As in vLLM
(``vllm/distributed/kv_events.py``): DP rank ``k`` binds ``endpoint``'s port + k (and the replay port + k), an
endpoint with ``*`` is bound and any other is connected to, each message is ``[topic, seq, payload]`` with an
8-byte big-endian ``seq`` from 0 and a msgpack ``[ts, events, data_parallel_rank]`` payload, and the replay
ROUTER answers ``["", seq]`` with every buffered batch from ``seq`` on and then sequence -1 with an empty payload.

``encoding``: ``"map"`` (newer vLLM, events as maps tagged ``type``; replay answers carry the topic) or ``"array"``
(vLLM ≤ 0.23: events as positional arrays; replay answers ``[seq, payload]`` without the topic).

Events are gathered from the pool's event sink and flushed as one batch per event-loop turn (an engine step runs
in one turn), like vLLM's one ``KVEventBatch`` per scheduler step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Final

import zmq
import zmq.asyncio

from pdproxy.prefix.kv_events import END_SEQ, Encoding, KVEvent, cleared, removed, seq_frame, stored
from pdproxy.sim.kv_wire import BatchEncoder

KNOWN_KEYS: Final = frozenset({"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps",
                               "hwm", "max_queue_size", "topic"})


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields the simulator honours (``max_queue_size`` is accepted and unused)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        """Whether a ZMQ publisher runs."""
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """Parse ``--kv-events-config`` JSON.  Raises ``ValueError`` on bad JSON, unknown keys or bad values."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    unknown = sorted(set(raw) - KNOWN_KEYS)
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}")
    enabled = bool(raw.get("enable_kv_cache_events", False))
    publisher = raw.get("publisher") or ("zmq" if enabled else "null")
    if publisher not in ("zmq", "null"):
        raise ValueError(f"--kv-events-config: unknown publisher {publisher!r} (zmq | null)")
    cfg = KVEventsConfig(enabled, publisher, str(raw.get("endpoint", "tcp://*:5557")),
                         raw.get("replay_endpoint"), int(raw.get("buffer_steps", 10_000)),
                         int(raw.get("hwm", 100_000)), str(raw.get("topic", "")))
    for address in (cfg.endpoint, cfg.replay_endpoint):
        if address is not None and not address.startswith("tcp://"):
            raise ValueError(f"--kv-events-config: only tcp:// endpoints are simulated, got {address!r}")
    if cfg.buffer_steps < 1:
        raise ValueError("--kv-events-config: buffer_steps must be >= 1")
    return cfg


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """vLLM's ``ZmqEventPublisher.offset_endpoint_port`` for tcp: port + rank (port 0 stays 0)."""
    if endpoint is None or rank == 0:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + rank}"


class SimKVEventPublisher:
    """One DP rank's publisher.  ``async with SimKVEventPublisher(config, rank)``; feed it with
    ``pool.event_sink = publisher.sink``.  ``endpoint`` / ``replay_endpoint`` are the bound addresses
    (``tcp://127.0.0.1:<port>`` for a ``*`` or port-0 endpoint)."""

    def __init__(self, config: KVEventsConfig, dp_rank: int = 0, encoding: Encoding = "map") -> None:
        self.config = config
        self.dp_rank = dp_rank
        self.encoding: Encoding = encoding
        self.endpoint = offset_endpoint_port(config.endpoint, dp_rank) or config.endpoint
        self.replay_endpoint = offset_endpoint_port(config.replay_endpoint, dp_rank)
        self.published = 0
        self._encoder = BatchEncoder(encoding)
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._pending: list[KVEvent] = []
        self._flush_scheduled = False
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._sockets: list[zmq.asyncio.Socket] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> SimKVEventPublisher:
        self._ctx = zmq.asyncio.Context()
        try:
            pub = self._ctx.socket(zmq.PUB)
            self._sockets.append(pub)
            pub.setsockopt(zmq.LINGER, 0)
            pub.set_hwm(self.config.hwm)
            self.endpoint = self._attach(pub, self.endpoint)
            self._pub = zmq.Socket.shadow(pub.underlying)
            if self.replay_endpoint is not None:
                router = self._ctx.socket(zmq.ROUTER)
                self._sockets.append(router)
                router.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._attach(router, self.replay_endpoint, always_bind=True)
                self._router = router
                self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="sim-kv-replay")
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._pending:
            self._flush()
        self._pub = None
        for sock in self._sockets:  # every socket, bound or not: Context.term waits for open sockets
            sock.close(0)
        self._sockets.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    @staticmethod
    def _attach(sock: zmq.asyncio.Socket, endpoint: str, always_bind: bool = False) -> str:
        """vLLM's rule: bind a ``*`` / ``::`` endpoint, connect to any other (the replay socket always binds)."""
        if not always_bind and "*" not in endpoint and "::" not in endpoint:
            sock.connect(endpoint)
            return endpoint
        base, _, port = endpoint.rpartition(":")
        if int(port) == 0:
            bound = sock.bind_to_random_port(base.replace("*", "127.0.0.1"))
            return f"tcp://127.0.0.1:{bound}"
        sock.bind(endpoint)
        return endpoint.replace("*", "127.0.0.1")

    def sink(self, kind: str, fields: dict[str, Any]) -> None:
        """The pool's event sink: queue one event; the batch goes out at the end of this loop turn."""
        enc = self.encoding
        group = 0 if enc == "map" else None
        if kind == "BlockStored":
            n = len(fields["block_hashes"])
            self._pending.append(stored(fields["block_hashes"], fields["parent_block_hash"], fields["token_ids"],
                                        fields["block_size"], encoding=enc, medium="GPU",
                                        extra_keys=[None] * n if enc == "map" else None, group_idx=group,
                                        kv_cache_spec_kind="full_attention" if enc == "map" else None))
        elif kind == "BlockRemoved":
            self._pending.append(removed(fields["block_hashes"], encoding=enc, medium="GPU", group_idx=group))
        else:
            self._pending.append(cleared(encoding=enc))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            try:
                asyncio.get_running_loop().call_soon(self._flush)
            except RuntimeError:  # no loop (a unit test driving the pool directly): publish now
                self._flush()

    def _flush(self) -> None:
        self._flush_scheduled = False
        events, self._pending = self._pending, []
        if not events or self._pub is None:
            return
        seq = self.published
        payload = self._encoder.encode(time.time(), events, self.dp_rank)
        with contextlib.suppress(zmq.ZMQError):  # PUB drops at HWM; never blocks
            self._pub.send_multipart((self._topic, seq_frame(seq), payload), flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        self.published = seq + 1

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _empty, start_b = frames
            start = int.from_bytes(start_b, "big")
            with_topic = self.encoding == "map"
            for seq, payload in list(self._buffer):
                if seq >= start:
                    head = [client, b"", self._topic] if with_topic else [client, b""]
                    await router.send_multipart([*head, seq_frame(seq), payload])
            tail = [client, b"", b""] if with_topic else [client, b""]
            await router.send_multipart([*tail, END_SEQ, b""])
