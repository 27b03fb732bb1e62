"""The transfer RPCs: ReportTransfer (an external executor's outcome, applied as the
Conductor's own runner applies its) and AwaitTransfer (wait for a transfer the runner
follows)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.requests import RequestError
from services.common.serving import durations
from services.common.store.interface import StoreError
from services.conductor.leadership import Leadership
from services.conductor.rpc_status import Context, abort, require_leader
from services.conductor.term import CurrentTerm
from services.conductor.transfer_runner import TransferRunner

DEFAULT_AWAIT_S = 30.0  # AwaitTransfer without a timeout
MAX_AWAIT_S = 600.0


class TransferRpcs:
    """Handlers of the transfer RPCs; only the serving leader answers them."""

    def __init__(
        self,
        current: CurrentTerm,
        leadership: Leadership,
        *,
        clock: Callable[[], float],
        time_scale: float,
        transfers: TransferRunner,
        sync: Callable[[], Awaitable[None]],
    ) -> None:
        self.current = current
        self.leadership = leadership
        self.clock = clock  # policy seconds
        self.time_scale = time_scale  # wall seconds per policy second
        self.transfers = transfers
        self.sync = sync  # waits for the term's queued writes to reach etcd

    async def ReportTransfer(
        self, request: pb.ReportTransferRequest, context: Context
    ) -> pb.ReportTransferResponse:
        await require_leader(self.leadership, context)
        try:
            moved = self.current().state.scheduler.transfer_done(
                request.transfer_id,
                request.ok,
                self.clock(),
                nbytes=request.bytes,
                seconds=durations.seconds(request.duration) / self.time_scale,
            )
        except RequestError as exc:
            await abort(context, exc)
        if moved:
            try:
                await self.sync()
            except StoreError as exc:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, f"etcd did not take the session binding: {exc}"
                )
        return pb.ReportTransferResponse(session_moved=moved)

    async def AwaitTransfer(
        self, request: pb.AwaitTransferRequest, context: Context
    ) -> pb.AwaitTransferResponse:
        await require_leader(self.leadership, context)
        timeout = durations.seconds(request.timeout) or DEFAULT_AWAIT_S
        if not 0 < timeout <= MAX_AWAIT_S:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"timeout must be positive and at most {MAX_AWAIT_S:.0f} s, got {timeout} s",
            )
        tid = request.transfer_id
        try:
            outcome = await self.transfers.wait(tid, timeout)
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
