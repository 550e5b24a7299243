"""The subscriber against a publisher the test drives message by message (real ZMQ sockets on loopback): gap with
and without replay, a publisher restart, a silent publisher, malformed messages, both encodings."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from pdproxy.prefix.index import PrefixIndex, block_keys
from pdproxy.prefix.kv_events import cleared, removed, seq_frame, stored
from pdproxy.prefix.subscriber import MAX_MESSAGE_BYTES, KVEventSubscriber
from tests.kv_events.support import FakePublisher, subscribed, until

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
BS = 4
E = "http://engine:8000"
A = list(range(100, 112))            # three blocks
B = list(range(200, 208))            # two blocks
C = list(range(300, 304))            # one block


def chain(tokens: list[int], base: int, encoding: str = "map", parent: int | None = None) -> object:
    """A BlockStored of ``tokens`` with engine hashes base, base+1, …"""
    n = len(tokens) // BS
    return stored([base + i for i in range(n)], parent, tokens, BS, encoding=encoding)  # type: ignore[arg-type]


def held(index: object, tokens: list[int]) -> int:
    """Tokens of ``tokens + [0]`` the index says E holds (the +1 keeps vLLM's last-token cap out of the way)."""
    return index.match(block_keys(tokens + [0], BS)).get(E, 0)  # type: ignore[attr-defined]


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_stream_in_order_stores_and_removes(encoding: str) -> None:
    async with FakePublisher(encoding) as pub, subscribed(pub.source()) as (sub, index):
        await pub.prime(sub)
        await pub.publish(chain(A, 1000, encoding))
        await until(lambda: held(index, A) == 12)
        await pub.publish(removed([1002], encoding=encoding))        # the last block of A
        await until(lambda: held(index, A) == 8)
        status = sub.status(E)
        assert status is not None and status.encoding == encoding and status.gaps == 0


async def test_gap_is_filled_by_replay() -> None:
    async with FakePublisher() as pub, subscribed(pub.source()) as (sub, index):
        await pub.prime(sub)
        await pub.publish(chain(A, 1000))
        await pub.publish(chain(B, 2000), deliver=False)             # dropped by the PUB socket
        await pub.publish(chain(C, 3000))
        await until(lambda: held(index, C) == 4, what="C applied")
        status = sub.status(E)
        assert status is not None
        assert status.gaps == 1 and status.replays == {"complete": 1} and status.forgotten == 0
        assert held(index, A) == 12 and held(index, B) == 8           # nothing lost, B came from the replay
        await pub.publish(removed([2001]))                           # the stream goes on after the replay
        await until(lambda: held(index, B) == 4)
        assert status.duplicates >= 1 and status.last_seq == pub.seq - 1


async def test_gap_without_replay_forgets_the_engine() -> None:
    async with FakePublisher(replay=False) as pub, subscribed(pub.source()) as (sub, index):
        await pub.prime(sub)
        await pub.publish(chain(A, 1000))
        await until(lambda: held(index, A) == 12)
        await pub.publish(chain(B, 2000), skip=3)
        await until(lambda: held(index, B) == 8)
        status = sub.status(E)
        assert status is not None and status.gaps == 1 and status.replays == {"none": 1}
        assert held(index, A) == 0                                   # A may have been evicted meanwhile
        assert index.entries(E) == 2


async def test_replay_that_no_longer_reaches_back_forgets_then_follows() -> None:
    async with FakePublisher(buffer_steps=2) as pub, subscribed(pub.source()) as (sub, index):
        await pub.prime(sub)
        await pub.publish(chain(A, 1000))
        await until(lambda: held(index, A) == 12)
        start = sub.status(E)   # the start's own syncs and replays (a loaded machine may see a first event late)
        assert start is not None
        replays, forgotten = dict(start.replays), start.forgotten
        for i in range(3):                                           # older than the 2-batch buffer
            await pub.publish(removed([9000 + i]), deliver=False)
        await pub.publish(chain(B, 2000), deliver=False)
        await pub.publish(chain(C, 3000))
        await until(lambda: held(index, C) == 4)
        status = sub.status(E)
        assert status is not None
        assert {k: n - replays.get(k, 0) for k, n in status.replays.items() if n != replays.get(k, 0)} == {
            "partial": 1}
        assert status.forgotten - forgotten == 1
        assert held(index, A) == 0 and held(index, B) == 8


async def test_publisher_restart_forgets_and_replays_from_zero() -> None:
    async with FakePublisher() as pub, subscribed(pub.source()) as (sub, index):
        await pub.prime(sub)
        await pub.publish(chain(A, 1000))
        await pub.publish(chain(B, 2000))
        await until(lambda: held(index, B) == 8)
        pub.restart()                                                # a new engine process: seq 0 again
        await pub.publish(chain(C, 3000), deliver=False)             # lost before we noticed
        await pub.publish(chain(B, 2000))
        await until(lambda: held(index, C) == 4, what="C from the replay of the new process")
        status = sub.status(E)
        assert status is not None and status.restarts == 1
        assert held(index, A) == 0 and held(index, B) == 8


async def test_all_blocks_cleared() -> None:
    async with FakePublisher() as pub, subscribed(pub.source()) as (sub, index):
        await pub.prime(sub)
        await pub.publish(chain(A, 1000), chain(B, 2000))
        await until(lambda: index.entries(E) == 5)
        await pub.publish(cleared(), chain(C, 3000))                 # reset, then a new block in the same batch
        await until(lambda: held(index, C) == 4)
        assert held(index, A) == 0 and held(index, B) == 0 and index.entries(E) == 1


async def test_malformed_messages_are_counted_and_never_fatal() -> None:
    async with FakePublisher(replay=False) as pub, subscribed(pub.source()) as (sub, index):
        await pub.prime(sub)
        status = sub.status(E)
        assert status is not None
        seq = pub.seq
        await pub.send_raw([b"", b"only two frames"])                      # wrong frame count
        await pub.send_raw([b"", b"\x00\x01", b"x"])                       # 2-byte sequence
        await pub.send_raw([b"", seq_frame(seq), b"\xc1 not msgpack"])     # undecodable payload
        good = pub.encoder.encode(1.0, [chain(A, 1000)], 0)                # [ts, [event], rank] with a junk event
        import msgspec
        ts, events, rank = msgspec.msgpack.decode(good)
        junk = msgspec.msgpack.encode([ts, [{"type": "BlockStored", "block_hashes": "nope"}, 7, *events], rank])
        await pub.send_raw([b"", seq_frame(seq + 1), junk])
        pub.seq = seq + 2
        await until(lambda: held(index, A) == 12, what="the good event of the mixed batch")
        assert status.decode_errors == 3 and status.bad_events == 2
        await pub.publish(chain(B, 2000))                                  # still following
        await until(lambda: held(index, B) == 8)
        assert sub.is_live(E) and status.gaps == 0


async def test_silent_publisher_is_not_live_and_forgotten() -> None:
    pub = FakePublisher()
    await pub.__aenter__()
    async with subscribed(pub.source(), silent_after_s=0.5) as (sub, index):
        await pub.prime(sub)
        await pub.publish(chain(A, 1000))
        await until(lambda: held(index, A) == 12)
        await pub.close()                                            # the engine is gone
        await until(lambda: not sub.is_live(E), what="not live")
        await until(lambda: index.entries(E) == 0, what="aged out")
        status = sub.status(E)
        assert status is not None and status.forgotten_silent and not status.connected


async def test_never_connected_publisher_is_not_live() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.close(0)
    ctx.term()                                                       # nothing listens on `port` now
    from pdproxy.endpoints import KVEventSource
    async with subscribed(KVEventSource(E, f"tcp://127.0.0.1:{port}")) as (sub, _index):
        status = sub.status(E)
        assert status is not None and not sub.is_live(E) and not status.ever_connected
        assert not sub.is_live("http://other:1")


async def test_rank_stamp_is_checked() -> None:
    async with FakePublisher(rank=1) as pub, subscribed(pub.source(dp_rank=0)) as (sub, _index):
        await pub.prime(sub)
        status = sub.status(E)
        assert status is not None and status.rank_mismatches >= 1 and status.last_data_parallel_rank == 1


async def test_reconnect_to_the_same_process_fills_the_gap_by_replay() -> None:
    async with FakePublisher() as pub, subscribed(pub.source()) as (sub, index):
        await pub.prime(sub)
        await pub.publish(chain(A, 1000))
        await until(lambda: held(index, A) == 12)
        status = sub.status(E)
        assert status is not None
        await pub.rebind()                                           # the connection is cut …
        await until(lambda: not status.connected, what="disconnect seen")
        await pub.publish(chain(B, 2000))                            # … this one is lost (nobody subscribed yet)
        await until(lambda: held(index, B) == 8, what="B filled in after the reconnect")
        assert held(index, A) == 12 and status.restarts == 0 and status.forgotten == 0
        assert status.replayed_batches >= 1 and status.replays.get("complete", 0) >= 1


async def test_reconnect_to_a_new_process_forgets_the_old_one() -> None:
    async with FakePublisher() as pub, subscribed(pub.source()) as (sub, index):
        await pub.prime(sub)
        await pub.publish(chain(A, 1000))
        await pub.publish(chain(B, 2000))
        await until(lambda: held(index, B) == 8)
        status = sub.status(E)
        assert status is not None
        await pub.rebind()
        pub.restart()                                                # a new engine: seq 0, empty buffer
        await until(lambda: not status.connected, what="disconnect seen")
        await pub.publish(chain(C, 3000))                            # sent before the subscriber is back
        await until(lambda: held(index, C) == 4, what="C from the new process's replay")
        assert held(index, A) == 0 and held(index, B) == 0 and status.restarts == 1


async def test_a_frame_over_the_size_limit_is_never_read() -> None:
    # ZMQ's MAXMSGSIZE: a publisher's frame past the bound is refused before it is held — without it any frame
    # size was read whole and parsed.  ZMQ drops such a peer for good (a protocol error): it is dialled again once
    # silent, and followed from there.
    async with FakePublisher(replay=False) as pub:
        index = PrefixIndex()
        async with KVEventSubscriber([pub.source()], index, silent_after_s=0.5,
                                     max_message_bytes=1 << 20) as sub:
            await pub.prime(sub)
            status = sub.status(E)
            assert status is not None
            await pub.send_raw([b"", seq_frame(pub.seq), b"\xc1" * (2 << 20)])   # read, it is a decode error
            pub.seq += 1
            for _ in range(500):                          # what is sent while the SUB is away is lost
                await pub.publish(chain(A, 1000))
                if held(index, A) == 12:
                    break
                await asyncio.sleep(0.02)
            assert held(index, A) == 12 and status.decode_errors == 0
    assert KVEventSubscriber([], PrefixIndex()).max_message_bytes == MAX_MESSAGE_BYTES <= 64 << 20


async def test_a_replay_is_read_up_to_its_byte_bound() -> None:
    # a replay answer was held whole, whatever it sent until replay_timeout_s; now up to max_replay_bytes of
    # payload, the rest left unread (the socket replaced, so the next replay is not fed its tail)
    async with FakePublisher() as pub:
        index = PrefixIndex()
        async with KVEventSubscriber([pub.source()], index, replay_timeout_s=5.0, max_replay_bytes=8_000) as sub:
            await pub.prime(sub)
            await pub.publish(chain(A, 1000))
            await until(lambda: held(index, A) == 12)
            status = sub.status(E)
            assert status is not None
            before = status.replayed_batches
            for i in range(20):                                      # ~0.6 KB each, dropped by the PUB socket
                await pub.publish(removed(list(range(10_000 * (i + 1), 10_000 * (i + 1) + 150))), deliver=False)
            await pub.publish(chain(C, 3000))
            await until(lambda: held(index, C) == 4, what="followed after the cut replay")
            assert status.replayed_batches - before < 20 and status.forgotten == 1     # cut: 8 KB of 20
            await pub.publish(chain(B, 2000), deliver=False)          # the next replay reads its own answer
            await pub.publish(removed([3000]))
            await until(lambda: held(index, B) == 8 and held(index, C) == 0, what="the second replay")
            assert status.forgotten == 1 and status.replays.get("complete", 0) >= 1
