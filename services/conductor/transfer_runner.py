"""The Conductor's side of KV transfers: every transfer its policy plans (a fetched prefix, a
migrating session, a replicated prefix, a prefill→decode hand-off) is ordered from the
Messenger of the target's node, followed to its end over `WatchTransfer`, and its outcome
applied: the policy learns it (a migrating session is rebound to its target only now, once
every block landed verified, and the binding reaches etcd before anyone is told), the cost
model learns the measured bandwidth, and whoever waits (`AwaitTransfer`) is answered.

A transfer that fails, outlives its deadline, or loses an end (an instance or a Messenger
gone) changes no binding: the session stays on its source, which still holds its KV. Every
transfer is one span and is counted by kind and outcome.

Only the leader runs transfers; a lost term cancels the following (the Messengers end them on
their own, and the new term's state never saw them).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import grpc
from opentelemetry.trace import Status, StatusCode, Tracer

from kvsched.api.messenger.v1 import messenger_service_pb2 as mpb
from kvsched.api.messenger.v1 import messenger_service_pb2_grpc as mpb_grpc
from kvsched.core.decision import TransferKind, TransferPlan
from kvsched.core.requests import RequestError
from services.common.security.tls import aio_channel
from services.common.serving import durations
from services.common.serving.log_ids import session_tag
from services.common.store.interface import StoreError
from services.common.telemetry import client_interceptors
from services.conductor import placement_messages
from services.conductor.metrics import ConductorMetrics
from services.conductor.settings import ConductorSettings
from services.conductor.term import CurrentTerm

log = logging.getLogger(__name__)
_Stub: TypeAlias = "mpb_grpc.MessengerServiceAsyncStub"  # exists only in the stubs
OUTCOMES_KEPT = 4096  # ended transfers a late AwaitTransfer can still be told about
START_TIMEOUT_S = 5.0  # for StartTransfer and CancelTransfer themselves
# Beyond the transfer's own deadline, which the Messenger enforces, before the Conductor
# stops following it and cancels it itself.
WATCH_MARGIN_S = 2.0


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    """How a transfer ended."""

    transfer_id: str
    ok: bool
    nbytes: int
    seconds: float  # wall seconds it ran
    error: str
    session_moved: bool


class TransferRunner:
    """Transfers the leader has ordered and not yet forgotten."""

    def __init__(
        self,
        settings: ConductorSettings,
        current: CurrentTerm,
        *,
        clock: Callable[[], float],
        sync: Callable[[], Awaitable[None]],
        metrics: ConductorMetrics,
        tracer: Tracer,
    ) -> None:
        self.settings = settings  # time scale, deadlines, Messenger TLS, whether to execute
        self.current = current
        self.clock = clock  # policy seconds
        self.sync = sync  # waits for the term's queued writes to reach etcd
        self.metrics = metrics
        self.tracer = tracer
        self._tasks: dict[str, asyncio.Task[TransferOutcome]] = {}
        # Target slot -> the transfers under way to it (for placements that count on them).
        self._landing: dict[int, dict[str, TransferPlan]] = {}
        self._outcomes: OrderedDict[str, TransferOutcome] = OrderedDict()
        self._channels: dict[str, tuple[grpc.aio.Channel, _Stub]] = {}

    @property
    def running(self) -> int:
        return len(self._tasks)

    def launch(self, plans: Sequence[TransferPlan], *, prefill_s: float = 0.0) -> None:
        """Start every plan not started yet (a retried placement names the same ids). A
        hand-off's deadline also covers `prefill_s` (policy seconds), the prefill it follows.
        With `--execute-transfers` off, nothing starts: an external executor reports them."""
        if not self.settings.execute_transfers:
            return
        for plan in plans:
            tid = plan.transfer_id
            if tid in self._tasks or tid in self._outcomes:
                continue
            wait_s = prefill_s if plan.kind is TransferKind.HANDOFF else 0.0
            task = asyncio.get_running_loop().create_task(
                self._run(plan, self.deadline_s(plan, wait_s)), name=f"transfer {tid}"
            )
            self._tasks[tid] = task
            self._landing.setdefault(plan.target, {})[tid] = plan
            task.add_done_callback(functools.partial(self._forget, plan))

    def _forget(self, plan: TransferPlan, _: asyncio.Task[TransferOutcome]) -> None:
        self._tasks.pop(plan.transfer_id, None)
        self._landed(plan)

    def _landed(self, plan: TransferPlan) -> None:
        """`plan` no longer brings anything to its target (it ended, or was stopped)."""
        landing = self._landing.get(plan.target)
        if landing is not None:
            landing.pop(plan.transfer_id, None)
            if not landing:
                del self._landing[plan.target]

    def landing(
        self, target: int, block_hashes: Sequence[int], own: Sequence[TransferPlan] = ()
    ) -> list[TransferPlan]:
        """The transfers under way to slot `target`, other than `own`, that bring blocks of
        the chain `block_hashes` (those whose first block to copy is the chain's block there):
        a request placed on `target` that counts on them must wait for them, or its engine
        computes what is still arriving. Changes nothing."""
        under_way = self._landing.get(target)
        if not under_way:
            return []
        own_ids = {plan.transfer_id for plan in own}
        return [
            plan
            for tid, plan in under_way.items()
            if tid not in own_ids
            and plan.skip_blocks < min(len(block_hashes), len(plan.block_hashes))
            and block_hashes[plan.skip_blocks] == plan.block_hashes[plan.skip_blocks]
        ]

    def deadline_s(self, plan: TransferPlan, wait_s: float) -> float:
        """Wall seconds a transfer may take: a floor, plus a multiple of its estimate."""
        s = self.settings
        estimate = (plan.est_seconds + (wait_s if math.isfinite(wait_s) else 0.0)) * s.time_scale
        return s.transfer_timeout_s + s.transfer_timeout_factor * estimate

    async def wait(self, transfer_id: str, timeout_s: float) -> TransferOutcome | None:
        """The transfer's outcome once it has ended, or None when it still runs after
        `timeout_s`. Raises KeyError for a transfer this leader does not know."""
        done = self._outcomes.get(transfer_id)
        if done is not None:
            return done
        task = self._tasks.get(transfer_id)
        if task is None:
            raise KeyError(transfer_id)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(task)
        return None

    async def stop(self) -> None:
        """Stop following every transfer (a lost term, or shutdown)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._landing.clear()

    async def close(self) -> None:
        await self.stop()
        channels, self._channels = self._channels, {}
        for channel, _ in channels.values():
            await channel.close(None)

    # ---- one transfer ----------------------------------------------------------------------

    async def _run(self, plan: TransferPlan, deadline_s: float) -> TransferOutcome:
        state = self.current().state
        attributes = {
            "kvsched.transfer.id": plan.transfer_id,
            "kvsched.transfer.kind": plan.kind.value,
            "kvsched.transfer.source": state.id_of(plan.source),
            "kvsched.transfer.target": state.id_of(plan.target),
            "kvsched.transfer.blocks": plan.n_blocks,
            "kvsched.transfer.planned_bytes": plan.nbytes,
            "kvsched.transfer.on_critical_path": plan.on_critical_path,
        }
        started = time.monotonic()
        with self.tracer.start_as_current_span(
            f"transfer {plan.kind.value}", attributes=attributes
        ) as span:
            try:
                last = await self._follow(plan, deadline_s)
                ok = last.state == mpb.TRANSFER_STATE_DONE
                nbytes = int(last.bytes_done)
                error = "" if ok else last.error or mpb.TransferState.Name(last.state)
            except _Failed as exc:
                ok, nbytes, error = False, 0, str(exc)
            self._landed(plan)  # placements from now on find its blocks, or not, in the index
            seconds = time.monotonic() - started
            moved = await self._apply(plan, ok, nbytes, seconds)
            span.set_attribute("kvsched.transfer.bytes", nbytes)
            span.set_attribute("kvsched.transfer.outcome", "done" if ok else "failed")
            span.set_attribute("kvsched.transfer.session_moved", moved)
            if not ok:
                span.set_status(Status(StatusCode.ERROR, error))
                log.warning("transfer %s (%s) failed: %s", plan.transfer_id, plan.kind.value, error)
        outcome = TransferOutcome(plan.transfer_id, ok, nbytes, seconds, error, moved)
        self._outcomes[plan.transfer_id] = outcome
        if len(self._outcomes) > OUTCOMES_KEPT:
            self._outcomes.popitem(last=False)
        return outcome

    async def _follow(self, plan: TransferPlan, deadline_s: float) -> mpb.WatchTransferResponse:
        """Order the transfer from the target's Messenger and follow it to its end; returns
        its last progress message. Raises `_Failed` when it cannot be ordered or followed."""
        if plan.n_blocks <= 0:  # e.g. a hand-off of a prompt shorter than a block
            return mpb.WatchTransferResponse(
                transfer_id=plan.transfer_id, state=mpb.TRANSFER_STATE_DONE
            )
        state = self.current().state
        source = state.instances.get(state.id_of(plan.source))
        target = state.instances.get(state.id_of(plan.target))
        if source is None or target is None:
            raise _Failed("an end of the transfer is no longer registered")
        if not target.spec.messenger_url or not source.spec.messenger_url:
            raise _Failed("an end of the transfer has no Messenger")
        stub = self._stub(target.spec.messenger_url)
        request = mpb.StartTransferRequest(
            plan=placement_messages.transfer_message(state, plan),
            timeout=durations.duration(deadline_s),
            source_messenger_url=source.spec.messenger_url,
        )
        tid = plan.transfer_id
        last: mpb.WatchTransferResponse | None = None
        try:
            await stub.StartTransfer(request, timeout=START_TIMEOUT_S)
            watch = stub.WatchTransfer(
                mpb.WatchTransferRequest(transfer_id=tid), timeout=deadline_s + WATCH_MARGIN_S
            )
            async for progress in watch:
                last = progress
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                await self._cancel(stub, tid)
            raise _Failed(
                f"Messenger {target.spec.messenger_url}: {exc.code().name}: {exc.details()}"
            ) from None
        except asyncio.CancelledError:
            await self._cancel(stub, tid)
            raise
        if last is None or last.state not in _ENDED:
            raise _Failed("the Messenger ended the watch before the transfer ended")
        return last

    @staticmethod
    async def _cancel(stub: _Stub, transfer_id: str) -> None:
        """Best effort: the Messenger also ends a transfer at its own deadline."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await stub.CancelTransfer(
                mpb.CancelTransferRequest(transfer_id=transfer_id), timeout=START_TIMEOUT_S
            )

    async def _apply(self, plan: TransferPlan, ok: bool, nbytes: int, seconds: float) -> bool:
        """Tell the policy and the cost model; make a rebinding durable. Returns whether a
        session moved."""
        try:
            moved = self.current().state.scheduler.transfer_done(
                plan.transfer_id,
                ok,
                self.clock(),
                nbytes=nbytes,
                seconds=seconds / self.settings.time_scale,
            )
        except RequestError:  # an end left meanwhile and took its orders with it
            moved = False
        if moved:
            try:
                await self.sync()
            except StoreError as exc:  # kept in memory; the write-behind retries it
                tag = session_tag(plan.session_id) if plan.session_id else None
                log.warning("etcd did not take the binding of session %s yet: %s", tag, exc)
        m = self.metrics
        kind = plan.kind.value
        m.transfers.labels(kind, "done" if ok else "failed").inc()
        m.transfer_bytes.labels(kind).inc(nbytes)
        m.transfer_seconds.labels(kind).observe(seconds)
        return moved

    def _stub(self, url: str) -> _Stub:
        entry = self._channels.get(url)
        if entry is None:
            channel = aio_channel(
                url, self.settings.messenger_tls, interceptors=client_interceptors(self.tracer)
            )
            entry = self._channels[url] = (channel, mpb_grpc.MessengerServiceStub(channel))
        return entry[1]


_ENDED = frozenset(
    {mpb.TRANSFER_STATE_DONE, mpb.TRANSFER_STATE_FAILED, mpb.TRANSFER_STATE_CANCELLED}
)


class _Failed(Exception):
    """The transfer could not be ordered or followed (its message says why)."""
