"""Subscribing to one engine's KV events: decode every message, notice gaps by sequence
number, fill them from the engine's replay socket, and say so when they cannot be filled (the
instance then needs a full resync). Malformed messages are counted and skipped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import zmq
import zmq.asyncio

from services.common.kv_events import EventBatch, Limits, MalformedFrames, decode_frames

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True, slots=True)
class Resync:
    """Batches after `last_seq` and before `next_seq` are lost for good."""

    last_seq: int
    next_seq: int


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
    ) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        self._sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.limits = limits
        self.replay_timeout_s = replay_timeout_s
        self.malformed = 0  # messages that were not KV-event batches
        self.skipped_events = 0  # events dropped inside good batches
        self.duplicates = 0
        self.replayed = 0  # batches recovered from the replay socket
        self.resyncs = 0  # gaps that could not be filled
        self.last_seq: int | None = None

    async def batches(self) -> AsyncIterator[EventBatch | Resync]:
        """Batches in sequence order, with a `Resync` where some are lost for good."""
        while True:
            frames = await self._sub.recv_multipart()
            batch = self._decode(frames)
            if batch is None:
                continue
            last = self.last_seq
            if last is not None and batch.seq <= last:
                self.duplicates += 1
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

    async def _fill(self, start: int, upto: int) -> AsyncIterator[EventBatch | Resync]:
        """Ask the replay socket for [start, upto); yield what comes back in order."""
        expected = start
        if self.replay_endpoint is not None:
            async for frames in self._replay(start):
                seq = int.from_bytes(frames[1], "big")
                if seq != expected or seq >= upto:
                    continue  # older, newer, or past an evicted hole: handled below
                batch = self._decode(frames)
                if batch is None:
                    break
                self.replayed += 1
                self.last_seq, expected = seq, seq + 1
                yield batch
        if expected < upto:
            self.resyncs += 1
            yield Resync(expected - 1, upto)

    async def _replay(self, start: int) -> AsyncIterator[list[bytes]]:
        """The replayed messages as [topic, seq, payload], until the end marker or timeout."""
        assert self.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                try:
                    reply = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout_s)
                except TimeoutError:
                    return
                if len(reply) != 3 or reply[1] == END_SEQ:
                    return
                yield [b"", reply[1], reply[2]]
        finally:
            dealer.close()

    def close(self) -> None:
        self._sub.close()
