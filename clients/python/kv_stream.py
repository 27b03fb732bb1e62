"""One long-lived `StreamKvEvents` call that carries the KV event batches of many instances to
the Conductor leader, with per-instance sequence numbers and resume.

The sender (a Messenger) `open`s an instance once it is registered, at the sequence number
the Conductor gave, and `send`s batches: each gets the instance's next sequence number and
waits in a bounded log until the stream carries it; the log keeps sent batches too, so they
can be sent again. The stream follows the leader. Every time it (re)connects it first asks
the leader (KeepAliveInstance) where each instance's events must resume and rewinds the log
there; when the Conductor ends the call at a batch out of sequence, the log is rewound to the
resume point it names. When the log no longer holds that point, the owner is told to resync
(`on_resync`): the instance's batches are dropped until a resync batch comes. When the
Conductor no longer knows the instance, the owner is told to register it again
(`on_unregistered`) and nothing is sent for it until the next `open`.

Each batch is also mirrored to the standby Conductors as it is cut (`kv_mirror.py`), so the
one that takes over already holds the batches the dead leader had not made durable, and the
resume point it answers is past them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from grpc import aio

from clients.python.conductor import ConductorClient
from clients.python.errors import ConductorError, NotFound, Unavailable
from clients.python.kv_mirror import DEFAULT_MIRROR_BATCHES, KvEventMirror
from clients.python.packed_hashes import HASH_BYTES
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

if TYPE_CHECKING:
    from kvsched.api.conductor.v1.conductor_service_pb2_grpc import ConductorServiceAsyncStub

__all__ = ["KvEventStream", "SentBatch", "StreamCounters"]

_log = logging.getLogger(__name__)

DEFAULT_LOG_BATCHES = 1024


@dataclass(frozen=True, slots=True)
class SentBatch:
    """A batch just handed to the stream (for metrics)."""

    instance_id: str
    sequence: int
    events: int
    resync: bool
    resent: bool  # sent before, on an earlier call or before a resume point
    engine_ts: float | None  # when the engine published its oldest event (its clock)


@dataclass(slots=True)
class StreamCounters:
    """What happened to the stream since it started."""

    connects: int = 0  # calls opened
    failures: int = 0  # calls that broke or were refused (not counting a clean close)
    resume_points: int = 0  # calls the Conductor ended at a batch out of sequence
    resent: int = 0  # batches sent again
    resent_blocks: int = 0  # blocks named by the batches sent again (stored or removed)
    resyncs_asked: int = 0  # times the owner was told to resync an instance
    dropped: int = 0  # batches dropped while an instance waited for a resync or a register


class _State(enum.Enum):
    READY = "ready"
    RESYNC = "resync"  # only a resync batch is taken
    UNREGISTERED = "unregistered"  # nothing is taken until `open`


@dataclass(slots=True)
class _Entry:
    request: pb.StreamKvEventsRequest
    events: int
    engine_ts: float | None

    @property
    def sequence(self) -> int:
        return self.request.batch.sequence

    @property
    def resync(self) -> bool:
        return self.request.batch.resync


class _Log:
    """One instance's batches, oldest first, with contiguous sequence numbers."""

    def __init__(self, next_sequence: int, capacity: int) -> None:
        self.entries: deque[_Entry] = deque()
        self.capacity = capacity
        self.next_sequence = next_sequence  # of the next batch cut
        self.cursor = next_sequence  # of the next batch to send
        self.high = next_sequence  # one past the highest sequence ever sent
        self.state = _State.RESYNC

    @property
    def first_sequence(self) -> int:
        return self.next_sequence - len(self.entries)

    def full_of_unsent(self) -> bool:
        """Appending would push out a batch that was never sent."""
        return len(self.entries) >= self.capacity and self.cursor <= self.first_sequence

    def append(self, entry: _Entry) -> None:
        if entry.resync:  # everything before it is replaced: neither sent nor kept
            self.entries.clear()
            self.cursor = entry.sequence
        elif len(self.entries) >= self.capacity:
            self.entries.popleft()
        self.entries.append(entry)
        self.next_sequence = entry.sequence + 1

    def rewind(self, sequence: int) -> bool:
        """Send again from `sequence`; False when the log cannot (it is not held, and no
        resync batch in the log makes it unnecessary)."""
        if self.first_sequence <= sequence <= self.next_sequence:
            self.cursor = sequence
            return True
        resyncs = [e.sequence for e in self.entries if e.resync]
        if resyncs:
            self.cursor = resyncs[-1]
            return True
        return False

    def pending(self) -> _Entry | None:
        index = self.cursor - self.first_sequence
        if 0 <= index < len(self.entries):
            return self.entries[index]
        return None


class KvEventStream:
    """The KV event stream of one sender. Use `start()`, then `open`/`send`/`close_instance`
    from the same event loop, and `close()` at the end.

    `on_resync(instance_id)` and `on_unregistered(instance_id)` are called from the stream's
    task and must not block. `on_sent` sees every batch handed to the call. `mirror_batches`
    bounds each standby's queue of mirrored batches (0: no mirror).
    """

    def __init__(
        self,
        client: ConductorClient,
        *,
        on_resync: Callable[[str], None],
        on_unregistered: Callable[[str], None],
        on_sent: Callable[[SentBatch], None] | None = None,
        log_batches: int = DEFAULT_LOG_BATCHES,
        mirror_batches: int = DEFAULT_MIRROR_BATCHES,
        clock: Callable[[], float] = time.time,
        seed: int | None = None,
    ) -> None:
        if log_batches < 1:
            raise ValueError("log_batches must be at least 1")
        self._client = client
        self._on_resync = on_resync
        self._on_unregistered = on_unregistered
        self._on_sent = on_sent
        self._capacity = log_batches
        self._clock = clock
        self._rng = random.Random(seed)
        self._logs: dict[str, _Log] = {}
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()
        self._runner: asyncio.Task[None] | None = None
        self._turn = 0  # round-robin position over instances
        self.counters = StreamCounters()
        self.mirror = (
            KvEventMirror(client, queue_batches=mirror_batches, seed=seed)
            if mirror_batches > 0
            else None
        )
        self.connected_to: str | None = None  # the leader the open call goes to

    # ---- the sender's side -----------------------------------------------------------------

    def open(self, instance_id: str, next_sequence: int) -> None:
        """Start (or restart) an instance at `next_sequence`, forgetting its log; its first
        batch must be a resync."""
        self._logs[instance_id] = _Log(next_sequence, self._capacity)

    def close_instance(self, instance_id: str) -> None:
        """Stop sending for an instance and forget its log (it left, or is about to)."""
        self._logs.pop(instance_id, None)

    def send(
        self,
        instance_id: str,
        events: Sequence[pb.KvEvent],
        *,
        resync: bool = False,
        merge: bool = False,
        engine_ts: float | None = None,
    ) -> int | None:
        """Cut a batch for the instance; returns its sequence number, or None when it is
        dropped (instance not open, waiting for a resync, or not known to the Conductor). A
        `resync` batch restarts the sequence and replaces the instance's index, or, with
        `merge`, is applied on top of it."""
        log = self._logs.get(instance_id)
        if (
            log is None
            or log.state is _State.UNREGISTERED
            or (log.state is _State.RESYNC and not resync)
        ):
            self.counters.dropped += 1
            return None
        if not resync and log.full_of_unsent():
            # The Conductor has not taken anything for a long while: what would be pushed
            # out is lost, so the instance needs its whole state again.
            self.counters.dropped += 1
            self._need_resync(instance_id, log, "the log of unsent batches is full")
            return None
        created = Timestamp()
        created.FromNanoseconds(int(self._clock() * 1e9))
        batch = pb.KvEventBatch(
            instance_id=instance_id,
            sequence=log.next_sequence,
            resync=resync,
            events=events,
            created_at=created,
            merge=resync and merge,
        )
        log.append(_Entry(pb.StreamKvEventsRequest(batch=batch), len(events), engine_ts))
        if self.mirror is not None:  # before the stream can carry it (see kv_mirror.py)
            self.mirror.put(batch)
        if resync:
            log.state = _State.READY
        self._wake.set()
        return batch.sequence

    def instance_state(self, instance_id: str) -> str | None:
        """Where the instance stands: ready, resync (waiting for a resync batch) or
        unregistered; None when it is not open."""
        log = self._logs.get(instance_id)
        return None if log is None else log.state.value

    def unsent(self, instance_id: str) -> int:
        """Batches cut for the instance and not handed to the current call yet."""
        log = self._logs.get(instance_id)
        return 0 if log is None else log.next_sequence - log.cursor

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start following the leader (on the running loop)."""
        if self._runner is None:
            if self.mirror is not None:
                self.mirror.start()
            self._runner = asyncio.get_running_loop().create_task(
                self._run(), name="kvsched-kv-event-stream"
            )

    async def close(self, timeout_s: float = 2.0) -> None:
        """Half-close the call once what is queued has been handed to it, let the Conductor
        answer (up to `timeout_s`), then stop."""
        self._closing.set()
        self._wake.set()
        runner, self._runner = self._runner, None
        if runner is not None:
            _, pending = await asyncio.wait({runner}, timeout=timeout_s)
            if pending:
                runner.cancel()
                await asyncio.wait({runner})
        if self.mirror is not None:
            await self.mirror.close()

    # ---- the stream's side -----------------------------------------------------------------

    def _need_resync(self, instance_id: str, log: _Log, why: str) -> None:
        if log.state is not _State.READY:
            return
        _log.warning("KV events of %s need a resync: %s", instance_id, why)
        log.state = _State.RESYNC
        log.entries.clear()
        log.cursor = log.next_sequence
        self.counters.resyncs_asked += 1
        self._on_resync(instance_id)

    def _unregistered(self, instance_id: str, log: _Log) -> None:
        if log.state is _State.UNREGISTERED:
            return
        _log.warning("the Conductor does not know instance %s: register it again", instance_id)
        log.state = _State.UNREGISTERED
        log.entries.clear()
        log.cursor = log.next_sequence
        self._on_unregistered(instance_id)

    async def _run(self) -> None:
        failures = 0
        fresh = False
        while not self._closing.is_set():
            if failures:
                await self._pause(self._backoff(failures))
                if self._closing.is_set():
                    break
            try:
                address, stub = await self._client.leader_stub(fresh=fresh)
                await self._sync()
            except Unavailable as err:
                _log.warning("KV event stream: no leader to send to (%s)", err.message)
                failures, fresh = failures + 1, True
                continue
            except ConductorError:  # the client was closed
                break
            try:
                ok = await self._serve(address, stub)
            except Exception:  # a bug must not end the stream: start over
                _log.exception("KV event stream failed; starting over")
                ok = False
            failures = 0 if ok else failures + 1
            fresh = not ok

    def _backoff(self, failures: int) -> float:
        """Exponential backoff with jitter: uniform in [cap/2, cap]."""
        client = self._client
        cap = min(client.max_backoff_s, client.backoff_s * 2.0 ** min(failures - 1, 16))
        return cap / 2 + self._rng.uniform(0.0, cap / 2)

    async def _pause(self, delay: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await self._closing.wait()

    async def _sync(self) -> None:
        """Ask the leader where each open instance resumes; rewind the logs there. Raises
        `Unavailable` when the leader does not answer."""
        for instance_id in list(self._logs):
            log = self._logs.get(instance_id)
            if log is None or log.state is _State.UNREGISTERED:
                continue
            try:
                answer = await self._client.keep_alive(instance_id)
            except NotFound:
                if self._logs.get(instance_id) is log:
                    self._unregistered(instance_id, log)
                continue
            except Unavailable:
                raise
            except ConductorError as err:
                if err.code == grpc.StatusCode.CANCELLED:  # the client was closed
                    raise
                _log.warning("keep-alive of %s refused: %s", instance_id, err)
                continue
            if self._logs.get(instance_id) is not log or log.state is not _State.READY:
                continue  # reopened meanwhile, or waiting for a resync (which takes any number)
            resume = answer.next_event_sequence
            if not log.rewind(resume):
                self._need_resync(instance_id, log, f"resume point {resume} is no longer held")

    async def _serve(self, address: str, stub: ConductorServiceAsyncStub) -> bool:
        """One call to `address`; returns False when it failed (the leader must be found
        again), True when it ended in an orderly way."""
        ended = asyncio.Event()
        self.counters.connects += 1
        call = stub.StreamKvEvents(self._requests(ended))
        self.connected_to = address
        answer = asyncio.ensure_future(_response(call))
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({answer, closing}, return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():
                # Closing: the generator hands over what is queued and half-closes the call;
                # the Conductor then answers.
                self._wake.set()
                await asyncio.wait({answer}, timeout=1.0)
            if not answer.done() or answer.cancelled():
                return True
            try:
                response = answer.result()
            except (grpc.RpcError, aio.UsageError) as err:
                return self._failed(address, err)
            return self._ended(address, response)
        finally:
            closing.cancel()
            if not call.done():
                call.cancel()
            answer.cancel()
            with contextlib.suppress(BaseException):
                await answer
            self.connected_to = None
            ended.set()
            self._wake.set()  # lets the request generator return

    def _failed(self, address: str, err: BaseException) -> bool:
        self.counters.failures += 1
        if isinstance(err, aio.AioRpcError):
            code = err.code()
            _log.warning("KV event stream to %s ended: %s %s", address, code.name, err.details())
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                # A batch the Conductor refuses as malformed would be refused again on every
                # resend: start each instance over from a resync.
                for instance_id, log in list(self._logs.items()):
                    self._need_resync(instance_id, log, f"a batch was refused: {err.details()}")
        else:
            _log.warning("KV event stream to %s ended: %r", address, err)
        return False

    def _ended(self, address: str, response: pb.StreamKvEventsResponse) -> bool:
        """The Conductor ended the call; False when it took nothing (back off before the
        next call, so a resume point that keeps coming back cannot spin)."""
        if not response.HasField("resume"):
            return True  # closed by us, or the server ended it: reconnect and sync
        self.counters.resume_points += 1
        resume = response.resume
        _log.info(
            "KV events of %s resume at %d at %s (%s)",
            resume.instance_id,
            resume.next_sequence,
            address,
            resume.reason,
        )
        log = self._logs.get(resume.instance_id)
        if log is not None and log.state is _State.READY and not log.rewind(resume.next_sequence):
            why = f"resume point {resume.next_sequence} is no longer held"
            self._need_resync(resume.instance_id, log, why)
        return response.batches_applied > 0

    def _next(self) -> tuple[str, _Log, _Entry] | None:
        """The next batch to send, taking instances in turn."""
        logs = list(self._logs.items())
        for i in range(len(logs)):
            instance_id, log = logs[(self._turn + i) % len(logs)]
            if log.state is not _State.READY:
                continue
            entry = log.pending()
            if entry is not None:
                self._turn = (self._turn + i + 1) % len(logs)
                return instance_id, log, entry
        return None

    async def _requests(self, ended: asyncio.Event) -> AsyncIterator[pb.StreamKvEventsRequest]:
        """What the call sends: pending batches as they come; returns (half-closing the call)
        once the call is over, or on close when nothing is left."""
        while not ended.is_set():
            found = self._next()
            if found is None:
                if self._closing.is_set():
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            instance_id, log, entry = found
            resent = entry.sequence < log.high
            log.cursor = entry.sequence + 1
            log.high = max(log.high, log.cursor)
            if resent:
                self.counters.resent += 1
                self.counters.resent_blocks += _blocks(entry.request.batch)
            if self._on_sent is not None:
                self._on_sent(
                    SentBatch(
                        instance_id,
                        entry.sequence,
                        entry.events,
                        entry.resync,
                        resent,
                        entry.engine_ts,
                    )
                )
            yield entry.request


def _blocks(batch: pb.KvEventBatch) -> int:
    """Blocks a batch names (stored or removed), in either form."""
    n = 0
    for event in batch.events:
        which = event.WhichOneof("event")
        if which == "blocks_stored":
            stored = event.blocks_stored
            n += len(stored.block_hashes) + len(stored.packed_block_hashes) // HASH_BYTES
        elif which == "blocks_removed":
            removed = event.blocks_removed
            n += len(removed.block_hashes) + len(removed.packed_block_hashes) // HASH_BYTES
    return n


async def _response(
    call: aio.StreamUnaryCall[pb.StreamKvEventsRequest, pb.StreamKvEventsResponse],
) -> pb.StreamKvEventsResponse:
    return await call
