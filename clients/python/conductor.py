"""Typed asyncio client for `kvsched.conductor.v1.ConductorService` that follows the leader.

Writes go to the leader. A standby refuses them with FAILED_PRECONDITION and the leader's
address in the `kvsched-leader` trailer: the client switches to that address at once (an empty
trailer means an election is running, so it looks for the leader again after a backoff).
UNAVAILABLE is retried for every call and DEADLINE_EXCEEDED only for idempotent calls, with
exponential backoff and jitter, up to `retries` times. Other failures raise a `ConductorError`
subclass; grpc exceptions never reach the caller.

`ConductorClient.placement_stream()` keeps one ScheduleStream call open for many concurrent
placements and completions (`clients.python.placement_stream`). The other parts: `errors`
(what failures raise), `channels` (one channel per Conductor) and `leader` (finding the
leader).
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, Self, TypeVar

import grpc
from google.protobuf import duration_pb2
from grpc import aio

from clients.python.channels import Channels, ConductorStub, Interceptor, normalize_address
from clients.python.errors import (
    LEADER_TRAILER,
    ConductorError,
    Unavailable,
    from_rpc_error,
)
from clients.python.leader import LeaderFinder
from clients.python.placement_stream import DEFAULT_MAX_IN_FLIGHT, PlacementStream
from clients.python.stream_batches import DEFAULT_BATCHING, BatchLimits
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

__all__ = ["ConductorClient"]

MAX_RECONNECT_BACKOFF_MS = 250  # longest wait between connection attempts to one Conductor

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(round(seconds * 1e9))
    return d


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
        self.addresses: tuple[str, ...] = tuple(
            dict.fromkeys(normalize_address(a) for a in addresses)
        )
        self.deadline_s = deadline_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._rng = random.Random(seed)
        self._channels = Channels(
            credentials,
            interceptors,
            [
                # Come back quickly when a restarted Conductor listens again: a channel that
                # failed to connect fails every call at once until its next attempt, so a
                # standby that was down a while and now leads must not wait a long backoff
                # out (Conductors are few: a few connection attempts a second cost nothing).
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
                *channel_options,
            ],
        )
        self._leaders = LeaderFinder(
            self.addresses,
            self._channels,
            deadline_s=deadline_s,
            retries=retries,
            backoff=self._backoff,
            check_open=self._check_open,
        )
        self._renewer: str | None = None  # the address that renewed a lease last
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
        await self._channels.close()

    @property
    def current_leader(self) -> str | None:
        """The address the client currently believes leads (None when unknown)."""
        return self._leaders.current

    # ---- leader discovery ------------------------------------------------------------------

    async def leader(self) -> str:
        """Ask the Conductors who leads; returns the leader's gRPC address and uses it from now.

        Asks each address in turn (GetLeader) until one leads or names the leader; repeats
        after a backoff while an election runs, up to `retries` more rounds.
        """
        return await self._leaders.find()

    async def leader_stub(self, *, fresh: bool = False) -> tuple[str, ConductorStub]:
        """The leader's address and a stub on this client's channel to it (same credentials
        and interceptors), for calls the client does not wrap, such as the KV event stream.
        `fresh` asks who leads first (after the believed leader failed). Raises `Unavailable`."""
        address = await (self.leader() if fresh else self._leaders.ensure())
        return address, self._channels.stub(address)

    def stub_at(self, address: str) -> ConductorStub:
        """A stub on this client's channel to `address`, leader or not (same credentials and
        interceptors), for calls meant for one Conductor, such as a KV event mirror."""
        self._check_open()
        return self._channels.stub(address)

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with jitter: uniform in [cap/2, cap]."""
        cap = min(self.max_backoff_s, self.backoff_s * 2.0**attempt)
        return cap / 2 + self._rng.uniform(0.0, cap / 2)

    def _check_open(self) -> None:
        if self._closed:
            raise ConductorError(grpc.StatusCode.CANCELLED, "the client is closed")

    # ---- unary calls -----------------------------------------------------------------------

    async def _call(
        self,
        method: Callable[[ConductorStub], aio.UnaryUnaryMultiCallable[_Req, _Resp]],
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
                    target = await self._leaders.ensure()
                except Unavailable:
                    attempt += 1
                    if attempt > self.retries:
                        raise
                    await asyncio.sleep(self._backoff(attempt - 1))
                    continue
            else:  # reads are answered everywhere; prefer the leader (freshest)
                target = self._leaders.read_target()
            try:
                return await method(self._channels.stub(target))(request, timeout=timeout)
            except grpc.RpcError as err:
                failure = from_rpc_error(err)
            except aio.UsageError as err:  # the channel was closed under the call
                raise ConductorError(grpc.StatusCode.CANCELLED, str(err)) from None
            code = failure.code
            delay: float | None = None
            was_redirect, redirected = redirected, False
            if code == grpc.StatusCode.FAILED_PRECONDITION and LEADER_TRAILER in failure.trailers:
                leader = normalize_address(failure.trailers[LEADER_TRAILER])
                if leader and leader != target:
                    self._leaders.follow(leader)
                    redirected = True
                    # Straight to the named leader, unless standbys keep bouncing us around.
                    delay = self._backoff(attempt) if was_redirect else 0.0
                else:  # election running (or a stale answer): look again after a while
                    self._leaders.forget(target)
                    delay = self._backoff(attempt)
            elif code == grpc.StatusCode.UNAVAILABLE or (
                code == grpc.StatusCode.DEADLINE_EXCEEDED and idempotent
            ):
                self._leaders.forget(target)
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

    async def renew_lease(
        self, instance_id: str, *, deadline_s: float | None = None
    ) -> pb.KeepAliveInstanceResponse:
        """Refresh an instance's lease at whichever Conductor answers first (the one that
        renewed last, the believed leader, then every address once), with no leader search:
        a standby renews the lease in etcd itself, so the lease outlives a leader change, or a
        leader that hangs.
        `deadline_s` bounds each attempt (default: the client's deadline; keep it well under
        the lease's TTL, so a hung Conductor leaves time to ask the next). Raises `NotFound`
        when the lease lapsed (register again), `Unavailable` when no Conductor renewed it.
        The answer's `next_event_sequence` is the leader's only when the leader answered: use
        `keep_alive` to learn where events resume."""
        request = pb.KeepAliveInstanceRequest(instance_id=instance_id)
        timeout = self.deadline_s if deadline_s is None else deadline_s
        first = [a for a in (self._renewer, self._leaders.current) if a]
        order = dict.fromkeys([*first, *self.addresses])
        last = "no Conductor answered"
        for address in order:
            self._check_open()
            try:
                answer = await self._channels.stub(address).KeepAliveInstance(
                    request, timeout=timeout
                )
            except grpc.RpcError as err:
                failure = from_rpc_error(err)
            except aio.UsageError as err:  # the channel was closed under the call
                raise ConductorError(grpc.StatusCode.CANCELLED, str(err)) from None
            else:
                self._renewer = address  # asked first next time: a hung leader costs once
                return answer
            if failure.code == grpc.StatusCode.NOT_FOUND:
                raise failure
            if failure.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._leaders.forget(address)
                if self._renewer == address:
                    self._renewer = None
            last = f"{address}: {failure.code.name} {failure.message}"
        raise Unavailable(grpc.StatusCode.UNAVAILABLE, f"no Conductor renewed the lease; {last}")

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

    def placement_stream(
        self,
        *,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        batching: BatchLimits | None = DEFAULT_BATCHING,
    ) -> PlacementStream:
        """A ScheduleStream session; use as `async with client.placement_stream() as stream:`.
        `batching` bounds how items queued together are coalesced into one message (None:
        one item a message)."""
        if self._closing:
            raise ConductorError(grpc.StatusCode.CANCELLED, "the client is closed")
        return PlacementStream(self, max_in_flight=max_in_flight, batching=batching)
