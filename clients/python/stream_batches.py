"""How a placement stream coalesces its items into messages (`ScheduleStreamBatch`).

Nothing waits for a placement: the items queued while the stream was busy sending the
previous message (or queued in the same turn of the event loop) go out together, and a lone
placement goes out at once, alone. A message of completions only may wait up to
`finish_window_s` for more items (0 by default, see there); a placement arriving meanwhile
ends the wait and takes them along, and so does closing the stream. A
message holds at most `max_items` items and about `max_bytes` bytes (the server's receive
limit is far above it).

A stream batches only when the Conductor says it takes batches (the
`kvsched-stream-batch-items` initial metadata, with its limit); an older Conductor gets one
item a message, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

BATCH_ITEMS_METADATA: Final = "kvsched-stream-batch-items"
DEFAULT_MAX_ITEMS: Final = 64
DEFAULT_MAX_BYTES: Final = 1 << 20
# No wait by default: a completion held back can be overtaken by its session's next turn
# placed another way (a unary Schedule of a sampled trace, another Router), which then finds
# the session's previous turn still running. Completions still coalesce with whatever is
# queued while the stream is busy writing, which under load is most of them.
DEFAULT_FINISH_WINDOW_S: Final = 0.0
_ITEM_OVERHEAD_BYTES: Final = 256  # ids, counts, durations: a generous bound of the rest

K = TypeVar("K")


@dataclass(frozen=True, slots=True)
class BatchLimits:
    """How far a placement stream coalesces."""

    max_items: int = DEFAULT_MAX_ITEMS
    max_bytes: int = DEFAULT_MAX_BYTES
    finish_window_s: float = DEFAULT_FINISH_WINDOW_S

    def __post_init__(self) -> None:
        if self.max_items < 1 or self.max_bytes < 1 or self.finish_window_s < 0:
            raise ValueError("batch limits: at least one item and one byte, a window >= 0")


DEFAULT_BATCHING: Final = BatchLimits()


def size_estimate(message: pb.ScheduleStreamRequest) -> int:
    """About how many bytes `message` takes on the wire (its hashes dominate), without
    serializing it."""
    kind = message.WhichOneof("kind")
    if kind == "schedule":
        body: pb.ScheduleRequest | pb.FinishRequest = message.schedule
    elif kind == "finish":
        body = message.finish
    else:
        return _ITEM_OVERHEAD_BYTES
    return len(body.packed_block_hashes) + 9 * len(body.block_hashes) + _ITEM_OVERHEAD_BYTES


def as_message(items: list[pb.ScheduleStreamRequest]) -> pb.ScheduleStreamRequest:
    """One stream message for `items`: the item itself when alone, else a batch."""
    if len(items) == 1:
        return items[0]
    return pb.ScheduleStreamRequest(batch=pb.ScheduleStreamBatch(items=items))


class Coalescer(Generic[K]):
    """Builds one message's items from a queue of keys (None: the stream ends).

    `take(key)` turns a key into the message to send (None when the key is stale: already
    answered or already sent on this connection); `limit` is the most items the Conductor
    takes in one message (0: it takes no batches)."""

    def __init__(
        self,
        queue: asyncio.Queue[K | None],
        take: Callable[[K], pb.ScheduleStreamRequest | None],
        limits: BatchLimits,
        hurry: Callable[[], bool] = lambda: False,
    ) -> None:
        self._queue = queue
        self._take = take
        self._limits = limits
        self._hurry = hurry  # true: send what is held at once (the stream is closing)
        self.ended = False  # the end of the stream was read from the queue

    async def next_items(self, first: K, limit: int) -> list[pb.ScheduleStreamRequest]:
        """The items of the next message, starting with `first`'s (possibly none when every
        key was stale)."""
        items: list[pb.ScheduleStreamRequest] = []
        size = self._add(items, first, 0)
        max_items = min(limit, self._limits.max_items)
        if max_items <= 1:
            return items
        queue = self._queue
        while not queue.empty() and len(items) < max_items and size < self._limits.max_bytes:
            key = queue.get_nowait()
            if key is None:
                self.ended = True
                return items
            size = self._add(items, key, size)
        window = self._limits.finish_window_s
        if not items or window <= 0 or any(i.HasField("schedule") for i in items):
            return items
        # Completions only: wait a little for more, unless a placement comes.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + window
        while len(items) < max_items and size < self._limits.max_bytes and not self._hurry():
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                async with asyncio.timeout(left):
                    key = await queue.get()
            except TimeoutError:
                break
            if key is None:
                self.ended = True
                break
            size = self._add(items, key, size)
            if items and items[-1].HasField("schedule"):
                break
        return items

    def _add(self, items: list[pb.ScheduleStreamRequest], key: K, size: int) -> int:
        message = self._take(key)
        if message is None:
            return size
        items.append(message)
        return size + size_estimate(message)
