"""The KV event RPCs: PublishKvEvents (one batch) and StreamKvEvents (batches in order until
one is refused, answered with where to resume), applied through the term's cursors."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.requests import RequestError
from services.conductor import convert
from services.conductor.leadership import Leadership
from services.conductor.metrics import ConductorMetrics
from services.conductor.node_access import require_instance_node
from services.conductor.rpc_status import Context, abort, require_leader
from services.conductor.term import CurrentTerm


class KvEventRpcs:
    """Handlers of the KV event RPCs; only the serving leader applies batches, and a
    Messenger's only for its own node's instances (`node_access`)."""

    def __init__(
        self, current: CurrentTerm, leadership: Leadership, metrics: ConductorMetrics
    ) -> None:
        self.current = current
        self.leadership = leadership
        self.metrics = metrics

    def _apply(self, batch: pb.KvEventBatch) -> int:
        """Apply one batch and count it; returns the next expected sequence. Raises
        RequestError."""
        metrics = self.metrics
        try:
            events = convert.kv_events(batch)
            nxt = self.current().cursors.apply(
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
        await require_leader(self.leadership, context)
        await require_instance_node(context, self.current().state, request.batch.instance_id)
        try:
            return pb.PublishKvEventsResponse(next_sequence=self._apply(request.batch))
        except RequestError as exc:
            await abort(context, exc)

    async def StreamKvEvents(
        self, request_iterator: AsyncIterator[pb.StreamKvEventsRequest], context: Context
    ) -> pb.StreamKvEventsResponse:
        await require_leader(self.leadership, context)
        applied = 0
        async for item in request_iterator:
            await require_leader(self.leadership, context)
            await require_instance_node(context, self.current().state, item.batch.instance_id)
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
