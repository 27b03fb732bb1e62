"""The KV event RPCs: PublishKvEvents (one batch) and StreamKvEvents (batches in order until
one is refused, answered with where to resume), applied through the term's cursors; and
MirrorKvEvents, the copies a standby keeps (`mirror.py`) and applies once it takes over."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.requests import RequestError
from services.conductor import kv_event_batches
from services.conductor.leadership import Leadership
from services.conductor.metrics import ConductorMetrics
from services.conductor.mirror import Cursor, MirroredBatches
from services.conductor.node_access import require_instance_node
from services.conductor.rpc_status import Context, abort, require_leader
from services.conductor.state import ConductorState
from services.conductor.term import CurrentTerm

log = logging.getLogger(__name__)


class KvEventRpcs:
    """Handlers of the KV event RPCs; only the serving leader applies batches, and a
    Messenger's only for its own node's instances (`node_access`)."""

    def __init__(
        self,
        current: CurrentTerm,
        leadership: Leadership,
        metrics: ConductorMetrics,
        mirrored: MirroredBatches | None = None,
    ) -> None:
        self.current = current
        self.leadership = leadership
        self.metrics = metrics
        self.mirrored = mirrored or MirroredBatches()

    def _apply(self, batch: pb.KvEventBatch) -> int:
        """Apply one batch and count it; returns the next expected sequence. Raises
        RequestError."""
        metrics = self.metrics
        try:
            term = self.current()
            events = kv_event_batches.kv_events(batch, term.state.scheduler.limits.max_blocks)
            nxt = term.cursors.apply(
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

    async def MirrorKvEvents(
        self, request_iterator: AsyncIterator[pb.MirrorKvEventsRequest], context: Context
    ) -> pb.MirrorKvEventsResponse:
        kept = 0
        outcomes = self.metrics.mirrored_batches
        with self.metrics.mirror_calls.track_inprogress():
            async for item in request_iterator:
                state = self.current().state
                for batch in item.batches:
                    await require_instance_node(context, state, batch.instance_id)
                if self.leadership.serving:  # the leader has them from the event stream
                    outcomes.labels("ignored").inc(len(item.batches))
                    continue
                for batch in item.batches:
                    if self.mirrored.keep(batch, _cursor(state, batch.instance_id)):
                        kept += 1
                        outcomes.labels("kept").inc()
                    else:
                        outcomes.labels("not_kept").inc()
        return pb.MirrorKvEventsResponse(batches_kept=kept)

    def apply_mirrored(self) -> int:
        """Once elected, with the cursors read from etcd and before serving: apply the kept
        batches that continue each instance's cursor, as the event stream would (index and
        write-behind), so the resume points this leader answers are past them. Stops at an
        instance's first batch refused. Empties the kept batches; returns how many applied."""
        state = self.current().state
        applied = 0
        for iid, batches in self.mirrored.take(lambda i: _cursor(state, i)).items():
            for batch in batches:
                try:
                    self._apply(batch)
                except RequestError as exc:
                    log.warning("a mirrored batch of %s was not applied: %s", iid, exc)
                    break
                applied += 1
        if applied:
            self.metrics.mirrored_batches.labels("applied").inc(applied)
            log.info(
                "applied %d mirrored KV event batches the dead leader had not flushed", applied
            )
        return applied


def _cursor(state: ConductorState, instance_id: str) -> Cursor | None:
    inst = state.instances.get(instance_id)
    return None if inst is None else Cursor(inst.next_sequence, inst.record.lease_id)
