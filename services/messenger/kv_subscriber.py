"""Subscribing to one engine's KV events: decode every message, notice gaps by sequence
number, fill them from the engine's replay socket, and say so when they cannot be filled (the
instance then needs a full resync). Malformed messages are counted and skipped. A sequence
number that goes back means the engine restarted (its numbering starts again): that is
reported like a gap that cannot be filled.

The replay socket is asked with `[b"", start_seq]` from a DEALER and answers each buffered
batch from `start_seq` on, then an end marker (sequence number −1), in either framing vLLM has
used: `[b"", topic, seq, payload]` and `[b"", b"", -1, b""]` (vLLM 0.32), or `[b"", seq,
payload]` and `[b"", -1, b""]` (older vLLM). A reply in neither framing, or with a topic the
subscription would not match, is counted as malformed and skipped; a replay ends at the end
marker, at a batch out of order, or once `replay_timeout_s` pass without a well-formed reply
(so a peer sending garbage cannot keep it going).

A gap shows only when a later batch arrives, so a lost last batch (or the first ones,
published while the SUB socket was still joining) would stay unnoticed while the engine is
idle. With a replay socket, an idle subscriber therefore asks it every `tail_probe_s` for
what follows its last batch: usually nothing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from services.kv_events.vllm_wire import EventBatch, Limits, MalformedFrames, decode_frames

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class Resync:
    """Batches after `last_seq` and before `next_seq` are lost for good (`restarted`: the
    engine's numbering started again at `next_seq`)."""

    last_seq: int
    next_seq: int
    restarted: bool = False


@dataclass(frozen=True, slots=True)
class History:
    """What the replay socket held: `batches` in order, the first batch after them
    (`next_seq`; None when the engine said nothing), and whether they are the engine's whole
    history (they start at its first batch, or it answered that it has none)."""

    batches: list[EventBatch]
    next_seq: int | None
    whole: bool


class KvEventSubscriber:
    """One engine's event stream; counters say what was dropped or recovered."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: bytes = b"",
        limits: Limits | None = None,
        replay_timeout_s: float = 1.0,
        tail_probe_s: float = 0.25,
        drop: int = 0,
    ) -> None:
        """`drop`: lose the next this many live messages as a network would (tests)."""
        self._ctx = zmq.asyncio.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._monitor: zmq.asyncio.Socket | None = self._sub.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        self._sub.connect(endpoint)
        self.topic = topic
        self.replay_endpoint = replay_endpoint
        self.limits = limits
        self.replay_timeout_s = replay_timeout_s
        self.tail_probe_s = tail_probe_s
        self.malformed = 0  # messages (live or replayed) that were not KV-event batches
        self.skipped_events = 0  # events dropped inside good batches
        self.duplicates = 0
        self.replayed = 0  # batches recovered from the replay socket
        self.resyncs = 0  # gaps that could not be filled
        self.restarts = 0  # sequence numbers that went back
        self.tail_probes = 0  # replay requests made while idle
        self.last_seq: int | None = None  # batches up to it are delivered or covered
        self._received: int | None = None  # the last sequence number the SUB socket gave
        self._replay_ended = False  # the last replay reached the end marker
        self._drop = drop

    def skip_to(self, next_seq: int) -> None:
        """Batches before `next_seq` are covered elsewhere (a snapshot of the engine): drop
        them when they come, and fill a gap only from `next_seq` on."""
        if self.last_seq is None or self.last_seq < next_seq - 1:
            self.last_seq = next_seq - 1

    async def joined(self, timeout_s: float) -> bool:
        """Wait until the SUB socket has connected to the publisher (then its subscription is
        on the way: batches published from a moment later reach it); False on timeout."""
        monitor = self._monitor
        if monitor is None:
            return True
        try:
            async with asyncio.timeout(timeout_s):
                await monitor.recv_multipart()
        except TimeoutError:
            return False
        self._stop_monitor()
        return True

    def _stop_monitor(self) -> None:
        if self._monitor is not None:
            self._sub.disable_monitor()
            self._monitor.close()
            self._monitor = None

    async def batches(self) -> AsyncGenerator[EventBatch | Resync, None]:
        """Batches in sequence order, with a `Resync` where some are lost for good."""
        while True:
            last = self.last_seq
            probe_ms = round(self.tail_probe_s * 1000)
            if (
                last is not None
                and self.replay_endpoint is not None
                and not await self._sub.poll(probe_ms)
            ):
                self.tail_probes += 1
                async for item in self._fill(last + 1, None):
                    yield item
                continue
            frames = await self._sub.recv_multipart()
            if self._drop > 0:
                self._drop -= 1
                continue
            batch = self._decode(frames)
            if batch is None:
                continue
            # PUB/SUB neither reorders nor repeats: a number at or below the last one the
            # socket gave means the publisher started again.
            received, self._received = self._received, batch.seq
            if received is not None and batch.seq <= received:
                self.restarts += 1
                self.last_seq = batch.seq
                yield Resync(received, batch.seq, restarted=True)
                yield batch
                continue
            last = self.last_seq
            if last is not None and batch.seq <= last:
                self.duplicates += 1  # covered by a snapshot, or replayed already
                continue
            if last is not None and batch.seq > last + 1:
                async for item in self._fill(last + 1, batch.seq):
                    yield item
            self.last_seq = batch.seq
            yield batch

    def _decode(self, frames: list[bytes]) -> EventBatch | None:
        try:
            batch = decode_frames(frames, self.limits)
        except MalformedFrames:
            self.malformed += 1
            return None
        self.skipped_events += batch.skipped
        return batch

    async def _fill(self, start: int, upto: int | None) -> AsyncIterator[EventBatch | Resync]:
        """Ask the replay socket for [start, upto) (or everything from `start`: `upto` None);
        yield what comes back in order, and a `Resync` for what it cannot give."""
        expected = start
        if self.replay_endpoint is not None:
            async with contextlib.aclosing(self._replay(start)) as replayed:
                async for frames in replayed:
                    seq = int.from_bytes(frames[1], "big")
                    # The replay answers in order from `start`: anything but the next batch
                    # ends it (a later one: the replay buffer lost the ones between too).
                    if seq != expected or (upto is not None and seq >= upto):
                        if upto is None and seq > expected:
                            upto = seq
                        break
                    batch = self._decode(frames)
                    if batch is None:
                        break
                    self.replayed += 1
                    self.last_seq, expected = seq, seq + 1
                    yield batch
        if upto is not None and expected < upto:
            self.resyncs += 1
            yield Resync(expected - 1, upto)

    async def history(self) -> History:
        """Every batch the engine's replay socket still holds, from its first on (an engine
        without one has no history to give). Moves nothing: the caller decides, then calls
        `skip_to`."""
        if self.replay_endpoint is None:
            return History([], None, whole=False)
        batches: list[EventBatch] = []
        self._replay_ended = False
        async with contextlib.aclosing(self._replay(0)) as replayed:
            async for frames in replayed:
                batch = self._decode(frames)
                if batch is None or (batches and batch.seq != batches[-1].seq + 1):
                    break  # a replay answers in order; anything else cuts the history here
                batches.append(batch)
        self.replayed += len(batches)
        if batches:
            return History(batches, batches[-1].seq + 1, whole=batches[0].seq == 0)
        ended = self._replay_ended  # an end marker with nothing before it: no batch yet
        return History([], 0 if ended else None, whole=ended)

    async def _replay(self, start: int) -> AsyncGenerator[list[bytes], None]:
        """The replayed messages as [topic, seq, payload], until the end marker or until
        `replay_timeout_s` pass without a well-formed reply; malformed replies are counted."""
        assert self.replay_endpoint is not None
        loop = asyncio.get_running_loop()
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = loop.time() + self.replay_timeout_s
            while True:
                try:
                    async with asyncio.timeout_at(deadline):
                        reply = await dealer.recv_multipart()
                except TimeoutError:
                    return
                frames = self._parse_reply(reply)
                if frames is None:
                    self.malformed += 1  # and the deadline stays where it was
                    continue
                if frames[1] == END_SEQ:
                    self._replay_ended = True
                    return
                yield frames
                deadline = loop.time() + self.replay_timeout_s
        finally:
            dealer.close()

    def _parse_reply(self, reply: list[bytes]) -> list[bytes] | None:
        """One replay reply as [topic, seq, payload] (the legacy framing has no topic: b"");
        None when it is in neither framing or its topic is not subscribed to."""
        if len(reply) == 4 and reply[0] == b"":
            topic, seq, payload = reply[1:]
            # The SUB socket's filter: the subscribed topic is a prefix. The end marker's
            # topic is empty.
            if seq != END_SEQ and not topic.startswith(self.topic):
                return None
        elif len(reply) == 3 and reply[0] == b"":
            topic, seq, payload = b"", reply[1], reply[2]
        else:
            return None
        return [topic, seq, payload] if len(seq) == 8 else None

    def close(self) -> None:
        self._stop_monitor()
        self._sub.close()
