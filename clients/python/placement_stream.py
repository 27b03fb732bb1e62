"""`PlacementStream`: one ScheduleStream call kept open for many concurrent placements and
completions.

When the stream breaks (the leader died or stepped down) it reconnects to the new leader and
sends every unanswered request again; request ids are idempotency keys, so the caller just
waits longer. Items queued together go out in one message, and their answers may come back
in one (`stream_batches`).

This module owns the stream's face (placing, finishing, closing) and its table of unanswered
items (`placement_items`), which matches each answer to its callers. Each call to a Conductor
is `placement_calls`'s; which Conductor it goes to is `placement_reconnect`'s.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from types import TracebackType
from typing import Final, Protocol, Self

import grpc
from google.protobuf import duration_pb2

from clients.python.errors import STATUS_CODES, ConductorError, InvalidRequest, Rejected, error_for
from clients.python.placement_calls import CallsClient, ScheduleStreamCalls, StreamEnd
from clients.python.placement_items import WAKE, Key, Kind, PendingItem
from clients.python.placement_reconnect import ReconnectClient, follow_leader
from clients.python.stream_batches import DEFAULT_BATCHING, BatchLimits
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

_log = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT: Final = 1024


class StreamOwner(CallsClient, ReconnectClient, Protocol):
    """What a placement stream uses of the client that opened it (`ConductorClient`): its
    deadline and retries, its channels and leader finder, and the set of its open streams,
    which the stream joins on creation and leaves when it closes."""

    _streams: set[PlacementStream]
    _closed: bool


def _seconds(d: duration_pb2.Duration) -> float:
    return d.seconds + d.nanos / 1e9


class PlacementStream:
    """One long-lived ScheduleStream call with many placements and completions in flight.

    Answers are matched to callers by request id. If the stream breaks, it reconnects to the
    (new) leader and re-sends everything unanswered. An item unanswered for `deadline_s` on a
    live stream makes it reopen the stream too (a stuck leader); after `retries` such reopens
    the item fails with `Unavailable`. At most `max_in_flight` items are in flight; further
    callers wait for a slot.
    """

    def __init__(
        self,
        client: StreamOwner,
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        batching: BatchLimits | None = DEFAULT_BATCHING,
    ):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        if batching is not None and batching.finish_window_s * 4 > client.deadline_s:
            # The stall watchdog counts an item's wait from when it is taken into a message.
            raise ValueError("finish_window_s must be at most a quarter of the deadline")
        self._client = client
        self._max_in_flight = max_in_flight
        self._items: dict[Key, PendingItem] = {}
        self._slots: asyncio.Semaphore | None = None
        self._queue: asyncio.Queue[Key | None] | None = None  # new items for the live stream
        self._work: asyncio.Event | None = None  # an item arrived (wakes an idle runner)
        self._stop: asyncio.Event | None = None
        self._runner: asyncio.Task[None] | None = None
        self._closing = False
        self._calls = ScheduleStreamCalls(
            client,
            self._items,
            batching=batching,  # None: one item a message, always
            deliver=self._deliver,
            resolve=self._resolve,
            closing=lambda: self._closing,
        )
        client._streams.add(self)

    async def __aenter__(self) -> Self:
        self._start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    @property
    def in_flight(self) -> int:
        """Requests sent and not answered yet."""
        return len(self._items)

    def _start(self) -> None:
        if self._runner is None:
            self._slots = asyncio.Semaphore(self._max_in_flight)
            self._work, self._stop = asyncio.Event(), asyncio.Event()
        elif not self._runner.done():
            return
        elif not self._runner.cancelled() and self._runner.exception() is not None:
            _log.error(
                "placement stream runner failed; restarting", exc_info=self._runner.exception()
            )
        self._runner = asyncio.get_running_loop().create_task(
            self._run(), name="kvsched-placement-stream"
        )

    async def schedule(self, request: pb.ScheduleRequest) -> pb.Decision:
        """Place a request (request_id filled in place when empty). Raises `Rejected` on a
        refusal and `ConductorError` when the server refuses the item."""
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        message = pb.ScheduleStreamRequest(schedule=request)
        answer = await self._submit(("schedule", request.request_id), message)
        outcome = answer.WhichOneof("outcome")
        if outcome == "decision":
            return answer.decision
        if outcome == "rejection":
            r = answer.rejection
            raise Rejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"rejected by rule {r.rule!r}; best estimated TTFT "
                f"{_seconds(r.estimated_ttft):.3f}s",
                _seconds(r.retry_after) if r.HasField("retry_after") else None,
            )
        raise _stream_error(answer)

    async def finish(self, request: pb.FinishRequest) -> pb.FinishResponse:
        """Report that a request ended; returns transfers to start now."""
        if not request.request_id:
            raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, "finish needs a request_id")
        message = pb.ScheduleStreamRequest(finish=request)
        answer = await self._submit(("finish", request.request_id), message)
        if answer.WhichOneof("outcome") == "finished":
            return answer.finished
        raise _stream_error(answer)

    async def _submit(
        self, key: Key, message: pb.ScheduleStreamRequest
    ) -> pb.ScheduleStreamResponse:
        self._check_open()
        self._start()
        assert self._slots is not None and self._work is not None
        item = self._items.get(key)
        if item is None:
            await self._slots.acquire()
            item = self._items.get(key)  # someone may have sent the same id meanwhile
            if item is not None or self._closing:
                self._slots.release()
                self._check_open()
        if item is None:
            future = asyncio.get_running_loop().create_future()
            item = PendingItem(key, message, future)
            self._items[key] = item
            if self._queue is not None:
                self._queue.put_nowait(key)
            self._work.set()
        # A caller's cancellation must not cancel an answer others (same id) wait for.
        return await asyncio.shield(item.future)

    def _check_open(self) -> None:
        if self._closing or self._client._closed:
            raise ConductorError(grpc.StatusCode.CANCELLED, "the placement stream is closed")

    async def close(self) -> None:
        """Wait (up to `deadline_s`) for answers in flight, half-close the stream, let the server
        end it, and fail whatever is still unanswered with CANCELLED."""
        if self._closing:
            return
        self._closing = True
        if self._queue is not None:  # completions held for company go now
            self._queue.put_nowait(WAKE)
        self._client._streams.discard(self)
        runner = self._runner
        if runner is None:
            return
        if self._items:
            futures = [item.future for item in self._items.values()]
            await asyncio.wait(futures, timeout=self._client.deadline_s)
        assert self._stop is not None and self._work is not None
        self._stop.set()
        self._work.set()
        _, pending = await asyncio.wait({runner}, timeout=2 * self._client.deadline_s)
        if pending:
            runner.cancel()
            await asyncio.wait({runner})

    # ---- the table of unanswered items, and the runner that sends them ---------------------

    def _resolve(
        self, item: PendingItem, outcome: pb.ScheduleStreamResponse | ConductorError
    ) -> None:
        if self._items.get(item.key) is not item:
            return
        del self._items[item.key]
        assert self._slots is not None
        self._slots.release()
        if item.future.done():
            return
        if isinstance(outcome, ConductorError):
            item.future.set_exception(outcome)
        else:
            item.future.set_result(outcome)

    def _fail_all(self, error: ConductorError) -> None:
        for item in list(self._items.values()):  # one exception object per waiter
            copy = type(error)(
                error.code, error.message, error.retry_after_s, trailers=error.trailers
            )
            self._resolve(item, copy)

    def _deliver(self, answer: pb.ScheduleStreamResponse) -> None:
        outcome = answer.WhichOneof("outcome")
        if outcome == "batch":
            for each in answer.batch.items:
                if each.WhichOneof("outcome") != "batch":  # never nested; ignore if it were
                    self._deliver(each)
            return
        kinds: tuple[Kind, ...]
        if outcome in ("decision", "rejection"):
            kinds = ("schedule",)
        elif outcome == "finished":
            kinds = ("finish",)
        else:  # an error names only the id: a pending placement first, then a completion
            kinds = ("schedule", "finish")
        for kind in kinds:
            item = self._items.get((kind, answer.request_id))
            if item is not None:
                self._resolve(item, answer)
                return
        # Otherwise: a duplicate answer to an item re-sent after a reconnect; drop it.

    async def _run(self) -> None:
        assert self._stop is not None
        try:
            await follow_leader(
                self._client,
                self._stop,
                serve=self._serve,
                fail_all=self._fail_all,
                idle=self._idle,
            )
        finally:
            self._fail_all(
                ConductorError(grpc.StatusCode.CANCELLED, "the placement stream is closed")
            )

    async def _idle(self) -> bool:
        """Wait for new work after a failure was reported; False when closed meanwhile."""
        assert self._work is not None and self._stop is not None
        self._work.clear()
        if not self._items:
            await self._work.wait()
        return not self._stop.is_set()

    async def _serve(self, target: str) -> StreamEnd | None:
        """One call to `target`: everything unanswered goes first, then new items. Returns
        how it ended, or None when closed."""
        assert self._stop is not None
        queue: asyncio.Queue[Key | None] = asyncio.Queue()
        for key in self._items:
            queue.put_nowait(key)
        self._queue = queue
        try:
            return await self._calls.serve(target, queue, self._stop)
        finally:
            if self._queue is queue:
                self._queue = None


def _stream_error(answer: pb.ScheduleStreamResponse) -> ConductorError:
    if answer.WhichOneof("outcome") == "error":
        code = STATUS_CODES.get(answer.error.code, grpc.StatusCode.UNKNOWN)
        return error_for(code, answer.error.message)
    return ConductorError(
        grpc.StatusCode.INTERNAL,
        f"unexpected answer {answer.WhichOneof('outcome')!r} for {answer.request_id!r}",
    )
