"""A copy of the KV event batches a sender streams to the Conductor leader, sent to every
other Conductor it knows (the standbys), so the one that takes over holds the batches the dead
leader had applied but not yet made durable, and applies them itself (warm standby state):
the sender is not asked for them again.

Fire-and-forget: each standby has its own bounded queue and its own `MirrorKvEvents` call,
each message carrying what was queued within a few ms (up to `_PER_MESSAGE` batches: a
message costs far more than a batch); a slow or dead standby fills its queue and loses its
oldest batches (counted), never slowing the leader's stream. Nothing depends on the mirror for
correctness: a batch a standby lacks is sent again by the event stream from the new leader's
resume point, as without a mirror.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc import aio

from clients.python.conductor import ConductorClient
from clients.python.errors import ConductorError
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb

__all__ = ["DEFAULT_MIRROR_BATCHES", "KvEventMirror", "MirrorCounters"]

_log = logging.getLogger(__name__)

DEFAULT_MIRROR_BATCHES = 1024
_BACKOFF_S = 0.05  # first retry of a broken mirror call
_MAX_BACKOFF_S = 0.5  # a restarted standby must be warm again soon: it may lead next
_PER_MESSAGE = 64  # batches per mirror message at most
# A message waits this long for more batches: a few per message instead of one under load,
# and still at the standby long before a takeover could start (two missed probes, 0.1 s+).
_GATHER_S = 0.005


@dataclass(slots=True)
class MirrorCounters:
    """What the mirror did since it started (all standbys together)."""

    mirrored: int = 0  # batches handed to a standby's call
    dropped: int = 0  # batches pushed out of a full queue (a slow or unreachable standby)
    failures: int = 0  # mirror calls that broke or were refused


class _Standby:
    """One standby's queue and call."""

    def __init__(self, address: str, capacity: int) -> None:
        self.address = address
        self.queue: deque[pb.KvEventBatch] = deque()
        self.capacity = capacity
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


class KvEventMirror:
    """Mirrors batches to the Conductors other than the leader. `put` from the event loop the
    mirror was `start`ed on; `close` at the end."""

    def __init__(
        self,
        client: ConductorClient,
        *,
        queue_batches: int = DEFAULT_MIRROR_BATCHES,
        seed: int | None = None,
    ) -> None:
        if queue_batches < 1:
            raise ValueError("queue_batches must be at least 1")
        self._client = client
        self._rng = random.Random(seed)
        self._standbys = {a: _Standby(a, queue_batches) for a in client.addresses}
        self._closing = False
        self.counters = MirrorCounters()

    def start(self) -> None:
        """Open a call to every Conductor (each waits for its first batch)."""
        if len(self._standbys) < 2:
            return  # a single Conductor has no standby to keep warm
        loop = asyncio.get_running_loop()
        for standby in self._standbys.values():
            if standby.task is None:
                standby.task = loop.create_task(
                    self._run(standby), name=f"kvsched-kv-mirror-{standby.address}"
                )

    def put(self, batch: pb.KvEventBatch) -> None:
        """Queue `batch` for every Conductor but the believed leader (it gets the batch from
        the event stream); a full queue loses its oldest batch. Never blocks."""
        if self._closing or len(self._standbys) < 2:
            return
        leader = self._client.current_leader
        for address, standby in self._standbys.items():
            if address == leader:
                continue
            if len(standby.queue) >= standby.capacity:
                standby.queue.popleft()
                self.counters.dropped += 1
            standby.queue.append(batch)  # never changed once cut: shared, not copied
            standby.wake.set()

    def queued(self, address: str) -> int:
        """Batches waiting for `address`'s call."""
        standby = self._standbys.get(address)
        return 0 if standby is None else len(standby.queue)

    async def close(self) -> None:
        """Stop every call; what is still queued is dropped."""
        self._closing = True
        tasks = [s.task for s in self._standbys.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self, standby: _Standby) -> None:
        failures = 0
        while not self._closing:
            await standby.wake.wait()  # no call is opened before there is a batch to carry
            try:
                # Waits for the channel to connect (it tries every 250 ms at most), so a
                # restarted standby gets its call as soon as it listens.
                call = self._client.stub_at(standby.address).MirrorKvEvents(
                    self._requests(standby), wait_for_ready=True
                )
                await call
                failures = 0  # the Conductor ended it (a restart, a shutdown): open another
            except ConductorError:  # the client was closed
                return
            except (grpc.RpcError, aio.UsageError) as err:
                failures += 1
                self.counters.failures += 1
                if failures == 1:
                    _log.info("KV event mirror to %s broke: %s", standby.address, _brief(err))
                cap = min(_MAX_BACKOFF_S, _BACKOFF_S * 2.0 ** min(failures - 1, 8))
                await asyncio.sleep(cap / 2 + self._rng.uniform(0.0, cap / 2))

    async def _requests(self, standby: _Standby) -> AsyncIterator[pb.MirrorKvEventsRequest]:
        while not self._closing:
            if not standby.queue:
                standby.wake.clear()
                await standby.wake.wait()
                continue
            queue = standby.queue
            if len(queue) < _PER_MESSAGE:
                await asyncio.sleep(_GATHER_S)
            batches = [queue.popleft() for _ in range(min(len(queue), _PER_MESSAGE))]
            self.counters.mirrored += len(batches)
            yield pb.MirrorKvEventsRequest(batches=batches)


def _brief(err: BaseException) -> str:
    if isinstance(err, aio.AioRpcError):
        return f"{err.code().name} {err.details()}"
    return repr(err)
