"""`ScheduleStreamCalls`: the ScheduleStream calls of one `PlacementStream`, one at a time.

A call (`serve`) sends the keys its queue holds (the stream queues everything unanswered
first, then new items), coalescing items into messages (`stream_batches`) once the Conductor
says in its initial metadata that it takes batches, and hands every answer to the stream. It
ends when the server ends it or it breaks, when the stream stops, or when an item sent on it
waits past the deadline (a stuck leader). Where the next call goes is `placement_reconnect`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Final, Protocol

import grpc
from grpc import aio

from clients.python.channels import Channels
from clients.python.errors import ConductorError, Unavailable, from_rpc_error
from clients.python.placement_items import Key, PendingItem
from clients.python.stream_batches import BATCH_ITEMS_METADATA, BatchLimits, Coalescer, as_message
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

_LEARN_WAIT_S: Final = 0.05  # at most this long to learn whether a Conductor takes batches


class CallsClient(Protocol):
    """What the calls use of the client (`ConductorClient`): its channels, and its deadline
    and retries, which bound how long and how often an item may go unanswered."""

    deadline_s: float
    retries: int
    _channels: Channels


@dataclass
class StreamEnd:
    """How one stream connection ended."""

    code: grpc.StatusCode
    details: str
    trailers: dict[str, str] = field(default_factory=dict)
    healthy: bool = False  # it answered something (or stayed up a while)


class ScheduleStreamCalls:
    """Opens a placement stream's ScheduleStream calls, one at a time (`serve`).

    `items` is the stream's table of unanswered items, which the calls read and stamp with
    the call each was sent on; answers go back through `deliver`, and `resolve` fails an
    item that stalled more than `retries` times. `closing` says the stream is closing, so
    completions held back for company go at once."""

    def __init__(
        self,
        client: CallsClient,
        items: dict[Key, PendingItem],
        *,
        batching: BatchLimits | None,
        deliver: Callable[[pb.ScheduleStreamResponse], None],
        resolve: Callable[[PendingItem, ConductorError], None],
        closing: Callable[[], bool],
    ) -> None:
        self._client = client
        self._items = items
        self._batching = batching  # None: one item a message, always
        self._deliver = deliver
        self._resolve = resolve
        self._closing = closing
        self._generation = 0  # the calls opened so far (an item's `generation` names one)
        self._batch_limit = 0  # items the connected Conductor takes in one message (0: none)

    async def serve(
        self, target: str, queue: asyncio.Queue[Key | None], stop: asyncio.Event
    ) -> StreamEnd | None:
        """One call to `target`: send the keys `queue` holds and those put on it later (None
        ends it), deliver the answers. Returns how it ended, or None when `stop` was set."""
        client = self._client
        loop = asyncio.get_running_loop()
        self._generation += 1
        generation = self._generation
        self._batch_limit = 0  # until this connection's Conductor says it takes batches
        learned = asyncio.Event()  # this connection's initial metadata was read (or never)
        started = loop.time()
        call = client._channels.stub(target).ScheduleStream(
            self._requests(generation, queue, learned)
        )
        reader = loop.create_task(self._read(call, learned))
        watchdog = loop.create_task(self._watch(generation))
        stopped = loop.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait(
                {reader, watchdog, stopped}, return_when=asyncio.FIRST_COMPLETED
            )
            if reader in done:
                end = reader.result()
            elif stopped in done:
                queue.put_nowait(None)  # half-close; the server ends the stream
                await asyncio.wait({reader}, timeout=client.deadline_s)
                return None
            else:
                end = StreamEnd(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "a request got no answer in time"
                )
        finally:
            queue.put_nowait(None)
            call.cancel()
            for task in (reader, watchdog, stopped):
                task.cancel()
            await asyncio.wait({reader, watchdog, stopped})
        end.healthy = end.healthy or loop.time() - started >= client.deadline_s
        return end

    async def _requests(
        self, generation: int, queue: asyncio.Queue[Key | None], learned: asyncio.Event
    ) -> AsyncIterator[pb.ScheduleStreamRequest]:
        loop = asyncio.get_running_loop()
        if self._batching is not None and queue.qsize() > 1:
            # Several items wait already (a reconnect, or a burst before the first connect):
            # learn whether the Conductor takes batches before sending them. One that says
            # nothing before its first answer (an older one) costs this bounded wait.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(_LEARN_WAIT_S, self._client.deadline_s / 4)):
                    await learned.wait()

        def take(key: Key) -> pb.ScheduleStreamRequest | None:
            new = self._items.get(key)
            if new is None or new.generation == generation:
                return None  # answered meanwhile, or already sent on this connection
            new.generation, new.sent_at = generation, loop.time()
            return new.message

        if self._batching is None:
            while (key := await queue.get()) is not None and self._generation == generation:
                if (message := take(key)) is not None:
                    yield message
            return
        coalescer = Coalescer(queue, take, self._batching, hurry=self._closing)
        while (key := await queue.get()) is not None and self._generation == generation:
            items = await coalescer.next_items(key, self._batch_limit)
            if items and self._generation == generation:
                yield as_message(items)
            if coalescer.ended:
                return

    async def _read(
        self,
        call: aio.StreamStreamCall[pb.ScheduleStreamRequest, pb.ScheduleStreamResponse],
        learned: asyncio.Event,
    ) -> StreamEnd:
        healthy = False
        try:
            try:
                metadata = dict(await call.initial_metadata() or ())
                limit = metadata.get(BATCH_ITEMS_METADATA, "0")
                self._batch_limit = int(limit) if isinstance(limit, str) and limit.isdigit() else 0
            finally:
                learned.set()
            async for answer in call:
                healthy = True
                self._deliver(answer)
        except grpc.RpcError as err:
            failure = from_rpc_error(err)
            return StreamEnd(failure.code, failure.message, failure.trailers, healthy)
        return StreamEnd(grpc.StatusCode.OK, "the server ended the stream", {}, healthy)

    async def _watch(self, generation: int) -> None:
        """Return when an item sent on this connection has waited more than `deadline_s`."""
        client = self._client
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(client.deadline_s / 4)
            now = loop.time()
            stalled = [
                item
                for item in self._items.values()
                if item.generation == generation and now - item.sent_at > client.deadline_s
            ]
            for item in stalled:
                item.stalls += 1
                if item.stalls > client.retries:
                    self._resolve(
                        item,
                        Unavailable(
                            grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no answer for {item.key[0]} {item.key[1]!r} after "
                            f"{item.stalls} attempts",
                        ),
                    )
            if any(self._items.get(item.key) is item for item in stalled):
                return
