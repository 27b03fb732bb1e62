"""Typed asyncio client for `kvsched.conductor.v1.ConductorService` that follows the leader.

Writes go to the leader. A standby refuses them with FAILED_PRECONDITION and the leader's
address in the `kvsched-leader` trailer: the client switches to that address at once (an empty
trailer means an election is running, so it looks for the leader again after a backoff).
UNAVAILABLE is retried for every call and DEADLINE_EXCEEDED only for idempotent calls, with
exponential backoff and jitter, up to `retries` times. Other failures raise a `ConductorError`
subclass; grpc exceptions never reach the caller.

`ConductorClient.placement_stream()` keeps one ScheduleStream call open for many concurrent
placements and completions. When the stream breaks (the leader died or stepped down) it
reconnects to the new leader and sends every unanswered request again; request ids are
idempotency keys, so the caller just waits longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Literal, Self, TypeAlias, TypeVar, cast

import grpc
from google.protobuf import duration_pb2
from grpc import aio

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.api.conductor.v1 import conductor_service_pb2_grpc as pb_grpc

__all__ = [
    "ConductorClient",
    "ConductorError",
    "Interceptor",
    "InvalidRequest",
    "NotFound",
    "PlacementStream",
    "Rejected",
    "Unavailable",
]

_log = logging.getLogger(__name__)

LEADER_TRAILER: Final = "kvsched-leader"
RETRY_AFTER_TRAILER: Final = "retry-after-ms"
DEFAULT_MAX_IN_FLIGHT: Final = 1024

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
_Stub: TypeAlias = "pb_grpc.ConductorServiceAsyncStub"  # exists only in the stubs
Interceptor: TypeAlias = (  # any grpc.aio client interceptor
    "aio.UnaryUnaryClientInterceptor[Any, Any] | aio.UnaryStreamClientInterceptor[Any, Any]"
    " | aio.StreamUnaryClientInterceptor[Any, Any] | aio.StreamStreamClientInterceptor[Any, Any]"
)
_Kind = Literal["schedule", "finish"]
_Key = tuple[_Kind, str]
_CODES: Final = {status.value[0]: status for status in grpc.StatusCode}
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


# ---- errors ----------------------------------------------------------------------------------


class ConductorError(Exception):
    """A call failed. `code` is the gRPC status, `trailers` the server's trailing metadata."""

    def __init__(
        self,
        code: grpc.StatusCode,
        message: str,
        retry_after_s: float | None = None,
        *,
        trailers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.trailers: dict[str, str] = trailers or {}


class Rejected(ConductorError):
    """RESOURCE_EXHAUSTED: no instance can meet the latency objectives; retry after
    `retry_after_s` (None when the server did not say)."""


class InvalidRequest(ConductorError):
    """INVALID_ARGUMENT: the request is malformed; retrying will not help."""


class NotFound(ConductorError):
    """NOT_FOUND: no such instance, session or transfer."""


class Unavailable(ConductorError):
    """No leader (or no Conductor at all) answered within the retry budget: UNAVAILABLE,
    DEADLINE_EXCEEDED, or FAILED_PRECONDITION from standbys that kept refusing."""


_ERRORS: Final[dict[grpc.StatusCode, type[ConductorError]]] = {
    grpc.StatusCode.RESOURCE_EXHAUSTED: Rejected,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
}


def _error(
    code: grpc.StatusCode,
    message: str,
    trailers: dict[str, str] | None = None,
    retry_after_s: float | None = None,
) -> ConductorError:
    trailers = trailers or {}
    if retry_after_s is None and RETRY_AFTER_TRAILER in trailers:
        with contextlib.suppress(ValueError):
            retry_after_s = float(trailers[RETRY_AFTER_TRAILER]) / 1000.0
    return _ERRORS.get(code, ConductorError)(code, message, retry_after_s, trailers=trailers)


def _trailers(err: grpc.RpcError) -> dict[str, str]:
    # At run time an AioRpcError's trailing metadata iterates as (key, value) pairs.
    pairs = cast("Iterable[tuple[str, str | bytes]]", err.trailing_metadata() or ())
    out: dict[str, str] = {}
    for key, value in pairs:
        out.setdefault(key.lower(), value.decode() if isinstance(value, bytes) else value)
    return out


def _from_rpc(err: grpc.RpcError) -> ConductorError:
    if not isinstance(err, aio.AioRpcError):  # e.g. raised by an interceptor
        return ConductorError(grpc.StatusCode.UNKNOWN, str(err))
    return _error(err.code(), err.details() or "", _trailers(err))


def _seconds(d: duration_pb2.Duration) -> float:
    return d.seconds + d.nanos / 1e9


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


def _normalize(address: str) -> str:
    """`host:port` from an address that may carry a scheme or a trailing slash."""
    address = address.strip().rstrip("/")
    for scheme in ("grpc://", "grpcs://", "http://", "https://"):
        if address.startswith(scheme):
            return address[len(scheme) :]
    return address


# ---- client ----------------------------------------------------------------------------------


class ConductorClient:
    """Async client for a set of Conductors; talks to the leader.

    `addresses` are `host:port` gRPC addresses of some or all Conductors. Every call has a
    deadline of `deadline_s` per attempt and is retried at most `retries` times. `seed` seeds
    the backoff jitter. `channel_options` are extra grpc channel arguments.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        deadline_s: float = 2.0,
        retries: int = 5,
        backoff_s: float = 0.05,
        max_backoff_s: float = 1.0,
        credentials: grpc.ChannelCredentials | None = None,
        interceptors: Sequence[Interceptor] | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        seed: int | None = None,
    ) -> None:
        if isinstance(addresses, str):
            addresses = [a for a in addresses.split(",") if a.strip()]
        if not addresses:
            raise ValueError("at least one Conductor address is needed")
        if deadline_s <= 0 or retries < 0 or backoff_s < 0 or max_backoff_s < backoff_s:
            raise ValueError("need deadline_s > 0, retries >= 0, 0 <= backoff_s <= max_backoff_s")
        self.addresses: tuple[str, ...] = tuple(dict.fromkeys(_normalize(a) for a in addresses))
        self.deadline_s = deadline_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._credentials = credentials
        # (grpc-stubs types aio.ClientInterceptor as a placeholder that needs a cast)
        self._interceptors = cast("list[aio.ClientInterceptor]", list(interceptors or ())) or None
        self._options: list[tuple[str, Any]] = [
            # Come back quickly when a restarted Conductor listens again.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", max(100, int(max_backoff_s * 1000))),
            *channel_options,
        ]
        self._rng = random.Random(seed)
        self._channels: dict[str, tuple[aio.Channel, _Stub]] = {}
        self._leader: str | None = None  # address believed to lead
        self._next = 0  # round-robin position in `addresses`
        self._discovering: asyncio.Lock | None = None
        self._streams: set[PlacementStream] = set()
        self._closing = False  # no new placement streams
        self._closed = False

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close open placement streams (each drains first, see `PlacementStream.close`), then
        every channel. Calls made afterwards raise `ConductorError` (CANCELLED)."""
        self._closing = True
        while self._streams:
            await next(iter(self._streams)).close()
        self._closed = True
        channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            await channel.close(None)

    @property
    def current_leader(self) -> str | None:
        """The address the client currently believes leads (None when unknown)."""
        return self._leader

    # ---- leader discovery ------------------------------------------------------------------

    async def leader(self) -> str:
        """Ask the Conductors who leads; returns the leader's gRPC address and uses it from now.

        Asks each address in turn (GetLeader) until one leads or names the leader; repeats
        after a backoff while an election runs, up to `retries` more rounds.
        """
        async with self._lock():
            return await self._discover()

    async def leader_stub(self, *, fresh: bool = False) -> tuple[str, _Stub]:
        """The leader's address and a stub on this client's channel to it (same credentials
        and interceptors), for calls the client does not wrap, such as the KV event stream.
        `fresh` asks who leads first (after the believed leader failed). Raises `Unavailable`."""
        address = await (self.leader() if fresh else self._ensure_leader())
        return address, self._stub(address)

    async def _ensure_leader(self) -> str:
        if self._leader is not None:
            return self._leader
        async with self._lock():  # one discovery for many concurrent callers
            leader = self.current_leader  # another caller may have found it meanwhile
            return leader if leader is not None else await self._discover()

    def _lock(self) -> asyncio.Lock:
        if self._discovering is None:
            self._discovering = asyncio.Lock()
        return self._discovering

    async def _discover(self) -> str:
        """Find the leader: ask each address in turn; a leader another Conductor names is asked
        too, and only taken once it confirms (a standby's answer may be stale)."""
        last = "no answer"
        n = len(self.addresses)
        for round_ in range(self.retries + 1):
            if round_:
                await asyncio.sleep(self._backoff(round_ - 1))
            asked: set[str] = set()
            for _ in range(n):
                address = self.addresses[self._next % n]
                if address not in asked:
                    asked.add(address)
                    answer = await self._ask_leader(address)
                    if isinstance(answer, str):
                        last = answer
                    elif answer.is_leader:
                        self._leader = address  # the address we reached beats the advertised one
                        return address
                    else:
                        named = _normalize(answer.leader_url)
                        last = f"{address}: not the leader; leader {named or '(election running)'}"
                        if named and named not in asked:
                            asked.add(named)
                            confirm = await self._ask_leader(named)
                            if isinstance(confirm, str):
                                last = confirm
                            elif confirm.is_leader:
                                self._leader = named
                                return named
                self._next += 1
        raise Unavailable(
            grpc.StatusCode.UNAVAILABLE,
            f"no Conductor leader found at {', '.join(self.addresses)}; last: {last}",
        )

    async def _ask_leader(self, address: str) -> pb.GetLeaderResponse | str:
        """GetLeader at one address, or why it did not answer."""
        self._check_open()
        try:
            return await self._stub(address).GetLeader(
                pb.GetLeaderRequest(), timeout=self.deadline_s
            )
        except grpc.RpcError as err:
            failure = _from_rpc(err)
            return f"{address}: {failure.code.name} {failure.message}"
        except aio.UsageError as err:  # the channel was closed under the call
            raise ConductorError(grpc.StatusCode.CANCELLED, str(err)) from None

    def _forget(self, address: str) -> None:
        """`address` failed: stop treating it as the leader and move reads elsewhere."""
        if self._leader == address:
            self._leader = None
        if self.addresses[self._next % len(self.addresses)] == address:
            self._next += 1

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with jitter: uniform in [cap/2, cap]."""
        cap = min(self.max_backoff_s, self.backoff_s * 2.0**attempt)
        return cap / 2 + self._rng.uniform(0.0, cap / 2)

    def _check_open(self) -> None:
        if self._closed:
            raise ConductorError(grpc.StatusCode.CANCELLED, "the client is closed")

    def _stub(self, address: str) -> _Stub:
        entry = self._channels.get(address)
        if entry is None:
            if self._credentials is None:
                channel = aio.insecure_channel(
                    address, options=self._options, interceptors=self._interceptors
                )
            else:
                channel = aio.secure_channel(
                    address, self._credentials, self._options, interceptors=self._interceptors
                )
            entry = (channel, pb_grpc.ConductorServiceStub(channel))
            self._channels[address] = entry
        return entry[1]

    # ---- unary calls -----------------------------------------------------------------------

    async def _call(
        self,
        method: Callable[[_Stub], aio.UnaryUnaryMultiCallable[_Req, _Resp]],
        request: _Req,
        *,
        write: bool,
        idempotent: bool,
        deadline_s: float | None = None,
    ) -> _Resp:
        """One call with leader discovery and retries; `deadline_s` overrides the client's
        deadline for each attempt."""
        timeout = self.deadline_s if deadline_s is None else deadline_s
        attempt = 0
        redirected = False
        while True:
            self._check_open()
            if write:
                try:
                    target = await self._ensure_leader()
                except Unavailable:
                    attempt += 1
                    if attempt > self.retries:
                        raise
                    await asyncio.sleep(self._backoff(attempt - 1))
                    continue
            else:  # reads are answered everywhere; prefer the leader (freshest)
                target = self._leader or self.addresses[self._next % len(self.addresses)]
            try:
                return await method(self._stub(target))(request, timeout=timeout)
            except grpc.RpcError as err:
                failure = _from_rpc(err)
            except aio.UsageError as err:  # the channel was closed under the call
                raise ConductorError(grpc.StatusCode.CANCELLED, str(err)) from None
            code = failure.code
            delay: float | None = None
            was_redirect, redirected = redirected, False
            if code == grpc.StatusCode.FAILED_PRECONDITION and LEADER_TRAILER in failure.trailers:
                leader = _normalize(failure.trailers[LEADER_TRAILER])
                if leader and leader != target:
                    self._leader = leader
                    redirected = True
                    # Straight to the named leader, unless standbys keep bouncing us around.
                    delay = self._backoff(attempt) if was_redirect else 0.0
                else:  # election running (or a stale answer): look again after a while
                    self._forget(target)
                    delay = self._backoff(attempt)
            elif code == grpc.StatusCode.UNAVAILABLE or (
                code == grpc.StatusCode.DEADLINE_EXCEEDED and idempotent
            ):
                self._forget(target)
                delay = self._backoff(attempt)
            if delay is None:
                raise failure
            attempt += 1
            if attempt > self.retries:
                raise Unavailable(
                    code,
                    f"gave up after {attempt} attempts; last from {target}: {failure.message}",
                    failure.retry_after_s,
                    trailers=failure.trailers,
                )
            if delay:
                await asyncio.sleep(delay)

    async def register_instance(
        self, spec: pb.InstanceSpec, lease_ttl_s: float = 0
    ) -> pb.RegisterInstanceResponse:
        """Register (or re-register) an instance; `lease_ttl_s` 0 takes the server's default."""
        request = pb.RegisterInstanceRequest(spec=spec)
        if lease_ttl_s > 0:
            request.lease_ttl.CopyFrom(_duration(lease_ttl_s))
        return await self._call(lambda s: s.RegisterInstance, request, write=True, idempotent=True)

    async def keep_alive(self, instance_id: str) -> pb.KeepAliveInstanceResponse:
        """Refresh an instance's lease."""
        request = pb.KeepAliveInstanceRequest(instance_id=instance_id)
        return await self._call(lambda s: s.KeepAliveInstance, request, write=True, idempotent=True)

    async def deregister(self, instance_id: str) -> pb.DeregisterInstanceResponse:
        """Remove an instance at once (not retried after a timeout: a retry could see NOT_FOUND)."""
        request = pb.DeregisterInstanceRequest(instance_id=instance_id)
        return await self._call(
            lambda s: s.DeregisterInstance, request, write=True, idempotent=False
        )

    async def list_instances(self) -> list[pb.InstanceStatus]:
        """Every registered instance, by slot."""
        response = await self._call(
            lambda s: s.ListInstances, pb.ListInstancesRequest(), write=False, idempotent=True
        )
        return list(response.instances)

    async def publish_events(self, batch: pb.KvEventBatch) -> pb.PublishKvEventsResponse:
        """Apply one KV event batch (not retried after a timeout: batches are sequenced)."""
        request = pb.PublishKvEventsRequest(batch=batch)
        return await self._call(lambda s: s.PublishKvEvents, request, write=True, idempotent=False)

    async def schedule(self, request: pb.ScheduleRequest) -> pb.Decision:
        """Place a request. An empty `request.request_id` is set (in place) to a fresh uuid4 hex,
        so every retry carries the same idempotency key. Raises `Rejected` on a refusal."""
        if not request.request_id:
            request.request_id = uuid.uuid4().hex
        response = await self._call(lambda s: s.Schedule, request, write=True, idempotent=True)
        return response.decision

    async def finish(self, request: pb.FinishRequest) -> pb.FinishResponse:
        """Report that a request ended; returns transfers to start now."""
        return await self._call(lambda s: s.Finish, request, write=True, idempotent=True)

    async def report_transfer(self, request: pb.ReportTransferRequest) -> pb.ReportTransferResponse:
        """Report how a transfer ended (not retried after a timeout)."""
        return await self._call(lambda s: s.ReportTransfer, request, write=True, idempotent=False)

    async def await_transfer(self, transfer_id: str, timeout_s: float) -> pb.AwaitTransferResponse:
        """Wait (up to `timeout_s`) for a transfer the Conductor ordered to end; status RUNNING
        when it has not. Raises `NotFound` for a transfer the leader does not know."""
        request = pb.AwaitTransferRequest(transfer_id=transfer_id, timeout=_duration(timeout_s))
        return await self._call(
            lambda s: s.AwaitTransfer,
            request,
            write=True,
            idempotent=True,
            deadline_s=timeout_s + self.deadline_s,
        )

    async def get_session(self, session_id: str) -> pb.Session:
        """One session's binding and history."""
        request = pb.GetSessionRequest(session_id=session_id)
        response = await self._call(lambda s: s.GetSession, request, write=False, idempotent=True)
        return response.session

    async def get_policy(self) -> pb.GetPolicyResponse:
        """The placement policy in force."""
        return await self._call(
            lambda s: s.GetPolicy, pb.GetPolicyRequest(), write=False, idempotent=True
        )

    async def set_policy(self, spec: str) -> pb.SetPolicyResponse:
        """Change the policy (`name` or `name:key=value,...`). A retry after a timeout may report
        `previous_spec` equal to `spec`."""
        request = pb.SetPolicyRequest(spec=spec)
        return await self._call(lambda s: s.SetPolicy, request, write=True, idempotent=True)

    async def explain(self, request: pb.ExplainRequest) -> pb.ExplainResponse:
        """Every candidate's cost terms for a prompt; changes nothing."""
        return await self._call(lambda s: s.Explain, request, write=False, idempotent=True)

    async def get_leader(self) -> pb.GetLeaderResponse:
        """GetLeader as one Conductor (the believed leader, else the next address) answers it."""
        return await self._call(
            lambda s: s.GetLeader, pb.GetLeaderRequest(), write=False, idempotent=True
        )

    def placement_stream(self, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT) -> PlacementStream:
        """A ScheduleStream session; use as `async with client.placement_stream() as stream:`."""
        if self._closing:
            raise ConductorError(grpc.StatusCode.CANCELLED, "the client is closed")
        return PlacementStream(self, max_in_flight=max_in_flight)


# ---- placement stream ------------------------------------------------------------------------


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

    def __init__(self, client: ConductorClient, *, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT):
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self._client = client
        self._max_in_flight = max_in_flight
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
                    target = redirect or await client._ensure_leader()
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
                    leader = _normalize(leader)
                    if leader and leader != target:
                        client._leader = redirect = leader
                        now_redirect = True
                    else:
                        client._forget(target)
                elif end.code in _STREAM_RETRYABLE:
                    client._forget(target)
                else:  # the stream itself is refused (e.g. UNIMPLEMENTED): fail the items
                    self._fail_all(_error(end.code, end.details, end.trailers))
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
            await asyncio.wait_for(self._stop.wait(), delay)

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
        queue: asyncio.Queue[_Key | None] = asyncio.Queue()
        self._queue = queue
        started = loop.time()
        call = client._stub(target).ScheduleStream(self._requests(generation, queue))
        reader = loop.create_task(self._read(call))
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
        self, generation: int, queue: asyncio.Queue[_Key | None]
    ) -> AsyncIterator[pb.ScheduleStreamRequest]:
        loop = asyncio.get_running_loop()
        for item in list(self._items.values()):  # re-send everything still unanswered
            if self._generation != generation:
                return
            if self._items.get(item.key) is item and item.generation != generation:
                item.generation, item.sent_at = generation, loop.time()
                yield item.message
        while (key := await queue.get()) is not None and self._generation == generation:
            new = self._items.get(key)
            if new is not None and new.generation != generation:
                new.generation, new.sent_at = generation, loop.time()
                yield new.message

    async def _read(
        self, call: aio.StreamStreamCall[pb.ScheduleStreamRequest, pb.ScheduleStreamResponse]
    ) -> _End:
        healthy = False
        try:
            async for answer in call:
                healthy = True
                self._deliver(answer)
        except grpc.RpcError as err:
            failure = _from_rpc(err)
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
        code = _CODES.get(answer.error.code, grpc.StatusCode.UNKNOWN)
        return _error(code, answer.error.message)
    return ConductorError(
        grpc.StatusCode.INTERNAL,
        f"unexpected answer {answer.WhichOneof('outcome')!r} for {answer.request_id!r}",
    )
