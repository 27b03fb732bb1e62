"""The Conductor's bounds under overload: how many placements may wait for an answer, how long
one may wait before it is decided, and how far the etcd write-behind may fall behind. Beyond
each a placement is refused with RESOURCE_EXHAUSTED (the Router answers its client 429 +
Retry-After) before anything is decided or counted; completions are never refused, since
they are what frees the load.

Why refuse rather than queue: a placement answered after the Router's deadline was shed
there anyway (the Router releases it again), so deciding it spends the Conductor's time on a
request nobody waits for, and the queue grows without bound while the overload lasts. Why
refuse new placements when etcd falls behind on session bindings rather than drop writes:
dropping a committed binding would silently lose state a new leader needs, so the
back-pressure goes to the cause (new placements) instead. Only the bindings count: they are
what placements add. The outbox coalesces writes to the same key, and what the engines' KV
events add (never refused: they say what the caches hold) stays within the index's own size,
one key a block, however long etcd is away; a flood of stored blocks that etcd takes a while
to write must not turn clients away while every binding is safely written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import grpc

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

# What a refused placement is told to wait (milliseconds, the `retry-after-ms` trailer). The
# queues bounded here drain within their wait bound; a second retries soon without piling up.
OVERLOAD_RETRY_MS: Final = 1000


@dataclass(frozen=True, slots=True)
class PlacementBounds:
    """The flags: `max_pending` placements accepted and not yet answered (all streams
    together), `max_wait_s` wall seconds one may wait to be decided, `max_outbox` session
    bindings queued for etcd before new placements are refused."""

    max_pending: int = 1024
    max_wait_s: float = 0.25
    max_outbox: int = 50_000

    def __post_init__(self) -> None:
        if self.max_pending < 1 or self.max_wait_s <= 0 or self.max_outbox < 1:
            raise ValueError(
                "--max-pending-placements, --max-placement-wait and --max-persist-pending "
                "must be positive"
            )


class PendingPlacements:
    """Placements accepted on any stream and not yet answered, under `bounds.max_pending`.
    `admit()` counts one more if it fits (else changes nothing); `done()` ends one."""

    def __init__(self, bounds: PlacementBounds) -> None:
        self.bounds = bounds
        self.depth = 0
        self.refused = 0

    def admit(self) -> bool:
        if self.depth >= self.bounds.max_pending:
            self.refused += 1
            return False
        self.depth += 1
        return True

    def done(self) -> None:
        if self.depth <= 0:
            raise RuntimeError("done() without a matching admit()")
        self.depth -= 1

    def overdue(self, waited_s: float) -> bool:
        """Whether a placement that waited `waited_s` to be decided is past its bound."""
        return waited_s > self.bounds.max_wait_s

    def outbox_full(self, pending_bindings: int) -> bool:
        """Whether the write-behind is too far behind on session bindings to take another
        placement."""
        return pending_bindings >= self.bounds.max_outbox


def overloaded_answer(request_id: str, why: str) -> pb.ScheduleStreamResponse:
    """A stream placement refused under overload (RESOURCE_EXHAUSTED: the client's
    `Rejected`)."""
    error = pb.StreamError(
        code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
        message=f"the Conductor is overloaded ({why}); retry after {OVERLOAD_RETRY_MS} ms",
    )
    return pb.ScheduleStreamResponse(request_id=request_id, error=error)
