"""The items a `PlacementStream` has in flight: a placement or a completion waiting for its
answer, keyed by its kind and request id.

The request id is an idempotency key: a caller whose key is in flight already waits for the
same answer, and an item sent again after a reconnect may be answered twice (the stream drops
the second answer).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Final, Literal

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

Kind = Literal["schedule", "finish"]
Key = tuple[Kind, str]
WAKE: Final[Key] = ("finish", "")  # no item's key (a finish needs an id): wakes the sender


@dataclass(eq=False)
class PendingItem:
    """A placement or completion sent on the stream and not answered yet."""

    key: Key
    message: pb.ScheduleStreamRequest
    future: asyncio.Future[pb.ScheduleStreamResponse]
    generation: int = -1  # the stream connection it was last sent on
    sent_at: float = 0.0
    stalls: int = 0  # times the stream was reopened because this item got no answer
