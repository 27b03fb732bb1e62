"""The ConductorService gRPC API over the Conductor's state.

Every handler validates before it changes anything (see `state`), maps refusals to gRPC
status codes with a message a person can act on, and sends writes that reach a standby back
with FAILED_PRECONDITION and the leader's address in the `kvsched-leader` trailer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, NoReturn

import grpc
from opentelemetry import trace

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.api.conductor.v1 import conductor_service_pb2_grpc as pb_grpc
from kvsched.core.decision import Decision, RequestInfo, TransferPlan
from kvsched.core.policies import POLICIES
from kvsched.core.requests import RequestError
from services.common import durations
from services.common.store import Lease, StoreError
from services.conductor import convert, keys
from services.conductor.keys import InstanceRecord
from services.conductor.state import ConductorState

if TYPE_CHECKING:
    from services.conductor.app import Conductor

Context = grpc.aio.ServicerContext[object, object]

_CODES = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "not_found": grpc.StatusCode.NOT_FOUND,
    "out_of_range": grpc.StatusCode.OUT_OF_RANGE,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
}
STREAM_WINDOW = 4096  # placement answers queued on one stream before the reader waits
DEFAULT_AWAIT_S = 30.0  # AwaitTransfer without a timeout
MAX_AWAIT_S = 600.0


async def abort(context: Context, exc: RequestError) -> NoReturn:
    if exc.next_sequence is not None:
        context.set_trailing_metadata((("kvsched-next-sequence", str(exc.next_sequence)),))
    await context.abort(_CODES[exc.kind], str(exc))
    raise AssertionError("unreachable")  # abort raises


class ConductorServicer(pb_grpc.ConductorServiceServicer):
    """One Conductor's RPC handlers."""

    def __init__(self, conductor: Conductor) -> None:
        self.c = conductor
        # Registrations pick a slot, then await etcd: one at a time, or two could pick the
        # same free slot and the second would evict the first.
        self._registering = asyncio.Lock()

    @property
    def state(self) -> ConductorState:
        """The Conductor's current state (rebuilt when a leadership term is lost)."""
        return self.c.state

    # ---- helpers ---------------------------------------------------------------------

    async def _require_leader(self, context: Context) -> None:
        c = self.c
        if c.serving:
            return
        leader = c.election.leader
        here = leader is not None and leader.id == c.settings.conductor_id
        address = "" if leader is None or here else leader.url
        context.set_trailing_metadata((("kvsched-leader", address),))
        where = f"the leader is {leader.id} at {address}" if leader and address else "no leader yet"
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"Conductor {c.settings.conductor_id} does not lead; {where}",
        )

    def _info(self, request: pb.ScheduleRequest) -> RequestInfo:
        return self.state.request_info(
            request.request_id,
            request.prompt_tokens,
            request.output_tokens,
            request.block_hashes[:],  # a list copy: the fastest way out of the message
            request.session_id,
        )

    def _place(self, request: pb.ScheduleRequest) -> tuple[Decision, bool, list[TransferPlan]]:
        """Place one request, count it and start its transfers; returns the decision, whether
        a session was rebound, and the transfers under way that it must wait for (see
        `TransferRunner.landing`). Raises RequestError."""
        metrics = self.c.metrics
        started = time.perf_counter()
        try:
            info = self._info(request)
            decision = self.state.place(info, self.c.clock())
        except RequestError:
            metrics.decisions.labels("error").inc()
            raise
        metrics.decision_seconds.observe(time.perf_counter() - started)
        if decision.rejected:
            metrics.decisions.labels("rejected").inc()
        else:
            metrics.decisions.labels("placed").inc()
            metrics.prompt_tokens.inc(request.prompt_tokens)
            metrics.cached_tokens.inc(decision.cached_tokens)
            if decision.transfers:
                self.c.transfers.launch(decision.transfers, prefill_s=decision.estimated_ttft_s)
            landing = self.c.transfers.landing(
                decision.instance, info.block_hashes, decision.transfers
            )
            return decision, decision.rebound, landing
        return decision, decision.rebound, []

    def _annotate(self, decision: Decision) -> None:
        span = trace.get_current_span()
        if not span.is_recording():
            return
        span.set_attribute("kvsched.policy", self.state.scheduler.spec)
        span.set_attribute("kvsched.rule", decision.rule)
        span.set_attribute("kvsched.rejected", decision.rejected)
        span.set_attribute("kvsched.cached_tokens", decision.cached_tokens)
        span.set_attribute("kvsched.estimated_ttft_s", decision.estimated_ttft_s)
        if decision.instance >= 0:
            span.set_attribute("kvsched.instance", self.state.id_of(decision.instance))
            for name, values in decision.terms.items():
                span.set_attribute(f"kvsched.cost.{name}", float(values[decision.instance]))

    async def _durable(self, context: Context | None) -> None:
        """Wait for the session binding just made to reach etcd."""
        try:
            await self.c.persister.sync()
        except StoreError as exc:
            if context is None:
                raise
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"etcd did not take the session binding: {exc}"
            )

    # ---- instances -------------------------------------------------------------------

    async def RegisterInstance(
        self, request: pb.RegisterInstanceRequest, context: Context
    ) -> pb.RegisterInstanceResponse:
        await self._require_leader(context)
        async with self._registering:
            lease = await self._register(request, context)
        return pb.RegisterInstanceResponse(
            instance=convert.instance_status(self.state, request.spec.instance_id),
            lease_ttl=durations.duration(lease.ttl_s),
        )

    async def _register(self, request: pb.RegisterInstanceRequest, context: Context) -> Lease:
        """Give the instance a slot and a lease, record it in etcd, then in the state."""
        try:
            spec = convert.instance_spec(request.spec)
            slot = self.state.free_slot(spec.instance_id)
        except RequestError as exc:
            await abort(context, exc)
        ttl = max(round(durations.seconds(request.lease_ttl) or self.c.settings.instance_ttl_s), 1)
        previous = self.state.instances.get(spec.instance_id)
        old_lease = previous.record.lease_id if previous else 0
        store = self.c.store
        try:
            lease = await store.grant_lease(ttl)
            record = InstanceRecord(spec, slot, lease.id)
            await store.put(keys.instance_key(spec.instance_id).encode(), record.encode(), lease.id)
        except StoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd is unavailable: {exc}")
        self.state.add_instance(record, previous.next_sequence if previous else 0)
        if old_lease:
            # Its cursor and blocks were bound to the old lease: move them to the new one.
            self.state.rebind_lease(spec.instance_id)
            with contextlib.suppress(StoreError):
                await self.c.persister.sync()  # moved before the old lease takes them away
                await store.revoke_lease(old_lease)
        return lease

    async def KeepAliveInstance(
        self, request: pb.KeepAliveInstanceRequest, context: Context
    ) -> pb.KeepAliveInstanceResponse:
        await self._require_leader(context)
        try:
            inst = self.state.instance(request.instance_id)
            remaining = await self.c.store.keep_alive(inst.record.lease_id)
        except RequestError as exc:
            await abort(context, exc)
        except StoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd is unavailable: {exc}")
        if remaining <= 0:
            self.state.remove_instance(request.instance_id)
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"the lease of instance {request.instance_id!r} lapsed; register it again",
            )
        return pb.KeepAliveInstanceResponse(
            lease_ttl=durations.duration(remaining), next_event_sequence=inst.next_sequence
        )

    async def DeregisterInstance(
        self, request: pb.DeregisterInstanceRequest, context: Context
    ) -> pb.DeregisterInstanceResponse:
        await self._require_leader(context)
        try:
            inst = self.state.instance(request.instance_id)
            await self.c.store.revoke_lease(inst.record.lease_id)  # its keys go with it
        except RequestError as exc:
            await abort(context, exc)
        except StoreError as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd is unavailable: {exc}")
        unbound = self.state.remove_instance(request.instance_id)
        return pb.DeregisterInstanceResponse(sessions_unbound=unbound)

    async def ListInstances(
        self, request: pb.ListInstancesRequest, context: Context
    ) -> pb.ListInstancesResponse:
        state = self.state
        ordered = sorted(state.instances, key=lambda iid: state.instances[iid].slot)
        return pb.ListInstancesResponse(
            instances=[convert.instance_status(state, iid) for iid in ordered]
        )

    # ---- KV events -------------------------------------------------------------------

    def _apply(self, batch: pb.KvEventBatch) -> int:
        """Apply one batch; raises RequestError."""
        metrics = self.c.metrics
        try:
            events = convert.kv_events(batch)
            nxt = self.state.apply_events(
                batch.instance_id, batch.sequence, batch.resync, events, merge=batch.merge
            )
        except RequestError:
            metrics.event_batches.labels("refused").inc()
            raise
        metrics.event_batches.labels("applied").inc()
        if batch.HasField("created_at"):
            lag = time.time() - batch.created_at.ToNanoseconds() * 1e-9
            metrics.event_lag.observe(max(lag, 0.0))
        return nxt

    async def PublishKvEvents(
        self, request: pb.PublishKvEventsRequest, context: Context
    ) -> pb.PublishKvEventsResponse:
        await self._require_leader(context)
        try:
            return pb.PublishKvEventsResponse(next_sequence=self._apply(request.batch))
        except RequestError as exc:
            await abort(context, exc)

    async def StreamKvEvents(
        self, request_iterator: AsyncIterator[pb.StreamKvEventsRequest], context: Context
    ) -> pb.StreamKvEventsResponse:
        await self._require_leader(context)
        applied = 0
        async for item in request_iterator:
            await self._require_leader(context)
            try:
                self._apply(item.batch)
            except RequestError as exc:
                if exc.next_sequence is None:
                    await abort(context, exc)
                resume = pb.ResumePoint(
                    instance_id=item.batch.instance_id,
                    next_sequence=exc.next_sequence,
                    reason=str(exc),
                )
                return pb.StreamKvEventsResponse(batches_applied=applied, resume=resume)
            applied += 1
        return pb.StreamKvEventsResponse(batches_applied=applied)

    # ---- placement -------------------------------------------------------------------

    async def Schedule(self, request: pb.ScheduleRequest, context: Context) -> pb.ScheduleResponse:
        await self._require_leader(context)
        try:
            decision, rebound, landing = self._place(request)
        except RequestError as exc:
            await abort(context, exc)
        self._annotate(decision)
        if decision.rejected:
            retry_ms = round(decision.retry_after_s * 1000)
            context.set_trailing_metadata((("retry-after-ms", str(retry_ms)),))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"rejected by {decision.rule}: no instance meets the latency objectives; "
                f"retry after {retry_ms} ms",
            )
        if rebound:
            await self._durable(context)
        return pb.ScheduleResponse(
            decision=convert.decision_message(
                self.state, decision, landing=landing, explain=request.explain
            )
        )

    def _stream_answer(
        self, item: pb.ScheduleStreamRequest
    ) -> tuple[pb.ScheduleStreamResponse, bool]:
        """Answer one stream item; the flag says the answer must wait for etcd."""
        kind = item.WhichOneof("kind")
        if kind == "schedule":
            request = item.schedule
            rid = request.request_id
            try:
                decision, rebound, landing = self._place(request)
            except RequestError as exc:
                return self._stream_error(rid, exc), False
            if decision.rejected:
                rejection = convert.rejection_message(decision)
                return pb.ScheduleStreamResponse(request_id=rid, rejection=rejection), False
            msg = convert.decision_message(
                self.state, decision, landing=landing, explain=request.explain
            )
            return pb.ScheduleStreamResponse(request_id=rid, decision=msg), rebound
        if kind == "finish":
            try:
                finished = self._finish(item.finish)
            except RequestError as exc:
                return self._stream_error(item.finish.request_id, exc), False
            return pb.ScheduleStreamResponse(
                request_id=item.finish.request_id, finished=finished
            ), False
        return self._stream_error("", RequestError("invalid", "stream item has no kind set")), False

    @staticmethod
    def _stream_error(request_id: str, exc: RequestError) -> pb.ScheduleStreamResponse:
        error = pb.StreamError(code=_CODES[exc.kind].value[0], message=str(exc))
        return pb.ScheduleStreamResponse(request_id=request_id, error=error)

    async def ScheduleStream(
        self, request_iterator: AsyncIterator[pb.ScheduleStreamRequest], context: Context
    ) -> AsyncIterator[pb.ScheduleStreamResponse]:
        await self._require_leader(context)
        answers: asyncio.Queue[pb.ScheduleStreamResponse | None] = asyncio.Queue(STREAM_WINDOW)
        waiting: set[asyncio.Task[None]] = set()

        async def after_sync(answer: pb.ScheduleStreamResponse) -> None:
            try:
                await self._durable(None)
            except StoreError as exc:
                error = pb.StreamError(code=grpc.StatusCode.UNAVAILABLE.value[0], message=str(exc))
                answer = pb.ScheduleStreamResponse(request_id=answer.request_id, error=error)
            await answers.put(answer)

        async def read() -> None:
            try:
                async for item in request_iterator:
                    if not self.c.serving:
                        break
                    answer, durable = self._stream_answer(item)
                    if durable:
                        task = asyncio.create_task(after_sync(answer))
                        waiting.add(task)
                        task.add_done_callback(waiting.discard)
                    else:
                        await answers.put(answer)
                if waiting:
                    await asyncio.gather(*waiting)
            finally:
                await answers.put(None)

        reader = asyncio.create_task(read())
        self.c.open_streams.add(answers)  # a lost term ends the stream (a None) at once
        try:
            while (answer := await answers.get()) is not None:
                yield answer
            await self._require_leader(context)  # ended by a lost term: say who leads now
        finally:
            self.c.open_streams.discard(answers)
            reader.cancel()

    def _finish(self, request: pb.FinishRequest) -> pb.FinishResponse:
        """Record a completion; transfers it causes (an idle-gap migration) start at once."""
        plans = convert.finish(self.state, request, self.c.clock())
        self.c.metrics.reported_cached_tokens.inc(request.cached_tokens)
        self.c.transfers.launch(plans)
        return pb.FinishResponse(transfers=[convert.transfer_message(self.state, p) for p in plans])

    async def Finish(self, request: pb.FinishRequest, context: Context) -> pb.FinishResponse:
        await self._require_leader(context)
        try:
            return self._finish(request)
        except RequestError as exc:
            await abort(context, exc)

    async def ReportTransfer(
        self, request: pb.ReportTransferRequest, context: Context
    ) -> pb.ReportTransferResponse:
        await self._require_leader(context)
        try:
            moved = self.state.transfer_done(
                request.transfer_id,
                request.ok,
                self.c.clock(),
                nbytes=request.bytes,
                seconds=durations.seconds(request.duration) / self.c.settings.time_scale,
            )
        except RequestError as exc:
            await abort(context, exc)
        if moved:
            await self._durable(context)
        return pb.ReportTransferResponse(session_moved=moved)

    async def AwaitTransfer(
        self, request: pb.AwaitTransferRequest, context: Context
    ) -> pb.AwaitTransferResponse:
        await self._require_leader(context)
        timeout = durations.seconds(request.timeout) or DEFAULT_AWAIT_S
        if not 0 < timeout <= MAX_AWAIT_S:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"timeout must be positive and at most {MAX_AWAIT_S:.0f} s, got {timeout} s",
            )
        tid = request.transfer_id
        try:
            outcome = await self.c.transfers.wait(tid, timeout)
        except KeyError:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"transfer {tid!r} is unknown to this leader (never ordered, or long ended)",
            )
        if outcome is None:
            return pb.AwaitTransferResponse(transfer_id=tid, status=pb.TRANSFER_STATUS_RUNNING)
        return pb.AwaitTransferResponse(
            transfer_id=tid,
            status=pb.TRANSFER_STATUS_DONE if outcome.ok else pb.TRANSFER_STATUS_FAILED,
            bytes=outcome.nbytes,
            duration=durations.duration(outcome.seconds),
            error=outcome.error,
            session_moved=outcome.session_moved,
        )

    # ---- sessions, policy, explain, leader -------------------------------------------

    async def GetSession(
        self, request: pb.GetSessionRequest, context: Context
    ) -> pb.GetSessionResponse:
        try:
            session = self.state.session(request.session_id)
        except RequestError as exc:
            await abort(context, exc)
        return pb.GetSessionResponse(session=convert.session_message(self.state, session))

    async def GetPolicy(
        self, request: pb.GetPolicyRequest, context: Context
    ) -> pb.GetPolicyResponse:
        policy = self.state.scheduler.policy
        return pb.GetPolicyResponse(
            spec=self.state.scheduler.spec,
            params={k: str(v) for k, v in policy.params.items()},
            available=sorted(POLICIES),
        )

    async def SetPolicy(
        self, request: pb.SetPolicyRequest, context: Context
    ) -> pb.SetPolicyResponse:
        await self._require_leader(context)
        spec = request.spec.strip()
        try:
            previous = self.state.set_policy(spec)
        except RequestError as exc:
            await abort(context, exc)
        try:
            await self.c.store.put(keys.POLICY.encode(), spec.encode())
        except StoreError as exc:
            self.state.set_policy(previous)  # not recorded: not changed
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"etcd did not take the policy: {exc}")
        return pb.SetPolicyResponse(previous_spec=previous, spec=spec)

    async def Explain(self, request: pb.ExplainRequest, context: Context) -> pb.ExplainResponse:
        try:
            req = convert.explain_request(self.state, request, self.c.hasher)
            decision = self.state.explain(req, self.c.clock())
        except RequestError as exc:
            await abort(context, exc)
        return pb.ExplainResponse(
            decision=convert.decision_message(self.state, decision, explain=True),
            rejected=decision.rejected,
        )

    async def GetLeader(
        self, request: pb.GetLeaderRequest, context: Context
    ) -> pb.GetLeaderResponse:
        c = self.c
        leader = c.election.leader
        return pb.GetLeaderResponse(
            self_id=c.settings.conductor_id,
            is_leader=c.serving,
            leader_id=leader.id if leader else "",
            leader_url=leader.url if leader else "",
            leader_http_url=leader.http_url if leader else "",
        )
