"""`PlacementStream`: one ScheduleStream call kept open for many concurrent placements and
completions.

When the stream breaks (the leader died or stepped down) it reconnects to the new leader and
sends every unanswered request again; request ids are idempotency keys, so the caller just
waits longer. Items queued together go out in one message, and their answers may come back
in one (`stream_batches`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Final, Literal, Protocol, Self

import grpc
from google.protobuf import duration_pb2
from grpc import aio

from clients.python.channels import Channels, normalize_address
from clients.python.errors import (
    LEADER_TRAILER,
    STATUS_CODES,
    ConductorError,
    InvalidRequest,
    Rejected,
    Unavailable,
    error_for,
    from_rpc_error,
)
from clients.python.leader import LeaderFinder
from clients.python.stream_batches import (
    BATCH_ITEMS_METADATA,
    DEFAULT_BATCHING,
    BatchLimits,
    Coalescer,
    as_message,
)
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

_log = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT: Final = 1024


class StreamOwner(Protocol):
    """What a placement stream uses of the client that opened it (`ConductorClient`): its
    deadline and retries, its channels and leader finder, and the set of its open streams,
    which the stream joins on creation and leaves when it closes."""

    deadline_s: float
    retries: int
    _channels: Channels
    _leaders: LeaderFinder
    _streams: set[PlacementStream]
    _closed: bool

    def _backoff(self, attempt: int) -> float: ...


_Kind = Literal["schedule", "finish"]
_Key = tuple[_Kind, str]
_WAKE: Final[_Key] = ("finish", "")  # no item's key (a finish needs an id): wakes the sender
_LEARN_WAIT_S: Final = 0.05  # at most this long to learn whether a Conductor takes batches
# How a placement stream may end and still be worth reopening (every item is idempotent).
_STREAM_RETRYABLE: Final = frozenset(
    {
        grpc.StatusCode.OK,  # the server ended the stream without being asked to
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.ABORTED,
        # grpc reports a connection lost while a message was being sent as INTERNAL
        # ("Failed execute_batch"): seen when the leader is killed mid-stream.
        grpc.StatusCode.INTERNAL,
    }
)


def _seconds(d: duration_pb2.Duration) -> float:
    return d.seconds + d.nanos / 1e9


@dataclass(eq=False)
class _Item:
    """A placement or completion sent on the stream and not answered yet."""

    key: _Key
    message: pb.ScheduleStreamRequest
    future: asyncio.Future[pb.ScheduleStreamResponse]
    generation: int = -1  # the stream connection it was last sent on
    sent_at: float = 0.0
    stalls: int = 0  # times the stream was reopened because this item got no answer


@dataclass
class _End:
    """How one stream connection ended."""

    code: grpc.StatusCode
    details: str
    trailers: dict[str, str] = field(default_factory=dict)
    healthy: bool = False  # it answered something (or stayed up a while)


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
        self._batching = batching  # None: one item a message, always
        self._batch_limit = 0  # items the connected Conductor takes in one message (0: none)
        self._items: dict[_Key, _Item] = {}
        self._slots: asyncio.Semaphore | None = None
        self._queue: asyncio.Queue[_Key | None] | None = None  # new items for the live stream
        self._generation = 0
        self._work: asyncio.Event | None = None  # an item arrived (wakes an idle runner)
        self._stop: asyncio.Event | None = None
        self._runner: asyncio.Task[None] | None = None
        self._closing = False
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
        self, key: _Key, message: pb.ScheduleStreamRequest
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
            item = _Item(key, message, future)
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
            self._queue.put_nowait(_WAKE)
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

    # ---- the runner: connect, send, read, reconnect ----------------------------------------

    def _resolve(self, item: _Item, outcome: pb.ScheduleStreamResponse | ConductorError) -> None:
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
        kinds: tuple[_Kind, ...]
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
        client = self._client
        assert self._stop is not None and self._work is not None
        failures = 0
        redirect: str | None = None
        was_redirect = False
        last = "no attempt yet"
        try:
            while not self._stop.is_set():
                if failures > client.retries:
                    self._fail_all(
                        Unavailable(
                            grpc.StatusCode.UNAVAILABLE,
                            f"placement stream: no leader within {client.retries} retries; "
                            f"last: {last}",
                        )
                    )
                    failures = 0
                    if not await self._idle():
                        break
                try:
                    target = redirect or await client._leaders.ensure()
                except Unavailable as err:
                    last, was_redirect = err.message, False
                    failures += 1
                    if failures <= client.retries:
                        await self._pause(client._backoff(failures - 1))
                    continue
                except ConductorError:  # the client was closed
                    break
                redirect = None
                end = await self._serve(target)
                if end is None:  # closed
                    break
                if end.healthy:
                    failures = 0
                last = f"{target}: {end.code.name} {end.details}"
                now_redirect = False
                leader = end.trailers.get(LEADER_TRAILER)
                if end.code == grpc.StatusCode.FAILED_PRECONDITION and leader is not None:
                    leader = normalize_address(leader)
                    if leader and leader != target:
                        client._leaders.follow(leader)
                        redirect = leader
                        now_redirect = True
                    else:
                        client._leaders.forget(target)
                elif end.code in _STREAM_RETRYABLE:
                    client._leaders.forget(target)
                else:  # the stream itself is refused (e.g. UNIMPLEMENTED): fail the items
                    self._fail_all(error_for(end.code, end.details, end.trailers))
                    failures = 0
                    if not await self._idle():
                        break
                    continue
                delay = 0.0 if now_redirect and not was_redirect else client._backoff(failures)
                was_redirect = now_redirect
                failures += 1
                if failures <= client.retries and delay:
                    await self._pause(delay)
        finally:
            self._fail_all(
                ConductorError(grpc.StatusCode.CANCELLED, "the placement stream is closed")
            )

    async def _pause(self, delay: float) -> None:
        """Sleep, but wake when closed."""
        assert self._stop is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._stop.wait()

    async def _idle(self) -> bool:
        """Wait for new work after a failure was reported; False when closed meanwhile."""
        assert self._work is not None and self._stop is not None
        self._work.clear()
        if not self._items:
            await self._work.wait()
        return not self._stop.is_set()

    async def _serve(self, target: str) -> _End | None:
        """One connection: send everything unanswered, then new items; deliver the answers.
        Returns how it ended, or None when closed."""
        client = self._client
        assert self._stop is not None
        loop = asyncio.get_running_loop()
        self._generation += 1
        generation = self._generation
        self._batch_limit = 0  # until this connection's Conductor says it takes batches
        queue: asyncio.Queue[_Key | None] = asyncio.Queue()
        for key in self._items:  # everything still unanswered goes first, then new items
            queue.put_nowait(key)
        self._queue = queue
        learned = asyncio.Event()  # this connection's initial metadata was read (or never)
        started = loop.time()
        call = client._channels.stub(target).ScheduleStream(
            self._requests(generation, queue, learned)
        )
        reader = loop.create_task(self._read(call, learned))
        watchdog = loop.create_task(self._watch(generation))
        stop = loop.create_task(self._stop.wait())
        try:
            done, _ = await asyncio.wait(
                {reader, watchdog, stop}, return_when=asyncio.FIRST_COMPLETED
            )
            if reader in done:
                end = reader.result()
            elif stop in done:
                queue.put_nowait(None)  # half-close; the server ends the stream
                await asyncio.wait({reader}, timeout=client.deadline_s)
                return None
            else:
                end = _End(grpc.StatusCode.DEADLINE_EXCEEDED, "a request got no answer in time")
        finally:
            queue.put_nowait(None)
            if self._queue is queue:
                self._queue = None
            call.cancel()
            for task in (reader, watchdog, stop):
                task.cancel()
            await asyncio.wait({reader, watchdog, stop})
        end.healthy = end.healthy or loop.time() - started >= client.deadline_s
        return end

    async def _requests(
        self, generation: int, queue: asyncio.Queue[_Key | None], learned: asyncio.Event
    ) -> AsyncIterator[pb.ScheduleStreamRequest]:
        loop = asyncio.get_running_loop()
        if self._batching is not None and queue.qsize() > 1:
            # Several items wait already (a reconnect, or a burst before the first connect):
            # learn whether the Conductor takes batches before sending them. One that says
            # nothing before its first answer (an older one) costs this bounded wait.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(_LEARN_WAIT_S, self._client.deadline_s / 4)):
                    await learned.wait()

        def take(key: _Key) -> pb.ScheduleStreamRequest | None:
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
        coalescer = Coalescer(queue, take, self._batching, hurry=lambda: self._closing)
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
    ) -> _End:
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
            return _End(failure.code, failure.message, failure.trailers, healthy)
        return _End(grpc.StatusCode.OK, "the server ended the stream", {}, healthy)

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


def _stream_error(answer: pb.ScheduleStreamResponse) -> ConductorError:
    if answer.WhichOneof("outcome") == "error":
        code = STATUS_CODES.get(answer.error.code, grpc.StatusCode.UNKNOWN)
        return error_for(code, answer.error.message)
    return ConductorError(
        grpc.StatusCode.INTERNAL,
        f"unexpected answer {answer.WhichOneof('outcome')!r} for {answer.request_id!r}",
    )
