"""The subscriber fills gaps from a replay socket speaking either framing vLLM has used,
with the batches a real vLLM 0.32 published, byte for byte: `[b"", topic, seq, payload]` then
`[b"", b"", -1, b""]` (vLLM 0.32), or `[b"", seq, payload]` then `[b"", -1, b""]` (older).
Replies in neither framing, or under another topic, are counted; a peer sending garbage
without end cannot hold the subscriber."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, replace

import pytest
import zmq
import zmq.asyncio

from services.kv_events.vllm_wire import EventBatch, decode_frames
from services.messenger.kv_subscriber import END_SEQ, KvEventSubscriber, Resync
from tests.common.test_kv_events_capture import captured
from tests.fixtures.poll import wait_for

TOPIC = b"kv-events"
SALT = captured("frames_salt")  # seq 10 to 16
DECODED = [decode_frames(frames) for frames in SALT]

Answer = Callable[[int], Iterable[list[bytes]]]


def current(start: int, topic: bytes | None = None) -> list[list[bytes]]:
    """vLLM 0.32's reply to a request from `start` (under `topic` instead, when given)."""
    batches = [[b"", topic or t, seq, payload] for t, seq, payload in SALT if seq_of(seq) >= start]
    return [*batches, [b"", b"", END_SEQ, b""]]


def legacy(start: int) -> list[list[bytes]]:
    """Older vLLM's reply to a request from `start`: no topic frame."""
    batches = [[b"", seq, payload] for _, seq, payload in SALT if seq_of(seq) >= start]
    return [*batches, [b"", END_SEQ, b""]]


def seq_of(frame: bytes) -> int:
    return int.from_bytes(frame, "big")


def replayed(batch: EventBatch, answer: Answer) -> EventBatch:
    """`batch` as the subscriber gets it from `answer`'s framing (the legacy one has no topic)."""
    return batch if answer is current else replace(batch, topic=b"")


class ReplayPeer:
    """A replay ROUTER answering every request `[b"", start]` with `answer(start)`, each reply
    frame for frame as the DEALER receives it; paced, so an endless answer leaves the event
    loop to the subscriber."""

    def __init__(self, answer: Answer) -> None:
        self.socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind("tcp://127.0.0.1:*")
        self.requests: list[int] = []
        self._task = asyncio.get_running_loop().create_task(self._serve(answer))

    @property
    def endpoint(self) -> str:
        return str(self.socket.getsockopt_string(zmq.LAST_ENDPOINT))

    async def _serve(self, answer: Answer) -> None:
        while True:
            client, _, start = await self.socket.recv_multipart()
            self.requests.append(seq_of(start))
            for reply in answer(seq_of(start)):
                await self.socket.send_multipart([client, *reply])
                await asyncio.sleep(0.001)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.socket.close()


@dataclass
class Rig:
    live: zmq.asyncio.Socket  # the engine's PUB side, an XPUB to see the subscription land
    peer: ReplayPeer
    sub: KvEventSubscriber
    items: list[EventBatch | Resync]  # what the subscriber yielded, in order


@contextlib.asynccontextmanager
async def rig(
    answer: Answer,
    *,
    tail_probe_s: float,
    replay_timeout_s: float = 1.0,
    start_at: int | None = None,
) -> AsyncIterator[Rig]:
    """A subscriber on a live socket and `answer`'s replay peer, yielding into `items` from
    `start_at` on (when given: as after a snapshot) or from the first live batch."""
    live = zmq.asyncio.Context.instance().socket(zmq.XPUB)
    live.setsockopt(zmq.LINGER, 0)
    live.bind("tcp://127.0.0.1:*")
    peer = ReplayPeer(answer)
    sub = KvEventSubscriber(
        live.getsockopt_string(zmq.LAST_ENDPOINT),
        peer.endpoint,
        topic=TOPIC,
        tail_probe_s=tail_probe_s,
        replay_timeout_s=replay_timeout_s,
    )
    if start_at is not None:
        sub.skip_to(start_at)
    items: list[EventBatch | Resync] = []

    async def consume() -> None:
        async for item in sub.batches():
            items.append(item)

    consumer = asyncio.get_running_loop().create_task(consume())
    try:
        # The XPUB hands the subscription up once it is in force: what it sends from now on
        # reaches the SUB socket.
        assert await asyncio.wait_for(live.recv(), 5.0) == b"\x01" + TOPIC
        yield Rig(live, peer, sub, items)
    finally:
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        sub.close()
        await peer.close()
        live.close()


async def live_10_then_16(r: Rig) -> None:
    """vLLM publishes seq 10 to 16; the subscriber sees only the first and the last live."""
    await r.live.send_multipart(SALT[0])
    await r.live.send_multipart(SALT[-1])
    await wait_for(lambda: len(r.items) >= 3, message="the live batches came")


@pytest.mark.parametrize("answer", [current, legacy], ids=["vllm-0.32", "legacy"])
async def test_a_gap_is_filled_from_either_framing(answer: Answer) -> None:
    async with rig(answer, tail_probe_s=60.0) as r:  # no probing: only the gap asks
        await live_10_then_16(r)
        await wait_for(lambda: len(r.items) >= 7, message="the gap filled")
        middle = [replayed(b, answer) for b in DECODED[1:-1]]
        assert r.items == [DECODED[0], *middle, DECODED[-1]]
        assert (r.sub.replayed, r.sub.resyncs, r.sub.malformed) == (5, 0, 0)
        assert r.peer.requests == [11]


@pytest.mark.parametrize("answer", [current, legacy], ids=["vllm-0.32", "legacy"])
async def test_a_replay_ends_at_either_end_marker(answer: Answer) -> None:
    # Idle after a snapshot up to 10: the tail probe asks from 11, then, the replay having
    # ended at the end marker (not at the minute-long timeout), from 17 again and again.
    async with rig(answer, start_at=11, tail_probe_s=0.02, replay_timeout_s=60.0) as r:
        await wait_for(lambda: r.peer.requests.count(17) >= 2, message="probes after the end")
        assert r.items == [replayed(b, answer) for b in DECODED[1:]]
        assert (r.sub.replayed, r.sub.resyncs, r.sub.malformed) == (6, 0, 0)
        assert r.peer.requests[0] == 11


async def test_replies_under_another_topic_are_counted_not_taken() -> None:
    async with rig(lambda start: current(start, topic=b"kv-other"), tail_probe_s=60.0) as r:
        await live_10_then_16(r)
        assert r.items == [DECODED[0], Resync(10, 16), DECODED[-1]]
        assert (r.sub.replayed, r.sub.resyncs, r.sub.malformed) == (0, 1, 6)  # 11 to 16


GARBAGE = [
    [b"", b"x"],  # two frames
    [b"not a delimiter", *SALT[1]],
    [b"", TOPIC, b"\x0b", SALT[1][2]],  # a one-byte sequence number
    [b"", SALT[1][1], SALT[1][2], b"", b""],  # five frames
    [b"", b"\x00" * 4, b""],  # a legacy end marker, cut short
]


async def test_a_replay_peer_sending_garbage_without_end_is_counted_not_fatal() -> None:
    def answer(start: int) -> Iterable[list[bytes]]:
        return itertools.chain(GARBAGE, itertools.repeat([b"", b"junk"]))

    async with rig(answer, tail_probe_s=60.0, replay_timeout_s=0.3) as r:
        await live_10_then_16(r)  # the replay gave up, not waiting for an end that never came
        assert r.items == [DECODED[0], Resync(10, 16), DECODED[-1]]
        assert r.sub.malformed >= len(GARBAGE)
        assert (r.sub.replayed, r.sub.resyncs) == (0, 1)
