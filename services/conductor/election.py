"""Leader election through one etcd key bound to the leader's lease.

The leader keeps its lease alive every third of its time to live. A keep-alive that fails
(etcd slow under a burst of writes, or away) is tried again sooner; the leader steps down when
its lease has lapsed by its own clock (counted from the send of the last renewal etcd
answered, so never after etcd's own expiry), when etcd says the lease is gone, when a guarded
write is refused (`fenced`), or when the watch shows the key gone or another's. Standbys wait
for the key to go (the replica's watch wakes them, or `services.conductor.takeover` ends a dead
leader's term early) and campaign; whoever creates the key leads. Every write of a term is
guarded by the leader key and the lease it was elected with (`guard()`), so a leader that lost
its term writes nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from services.common.store.interface import Guard, Store, StoreError
from services.conductor import keys

log = logging.getLogger(__name__)
_LEADER = keys.LEADER.encode()


@dataclass(frozen=True, slots=True)
class LeaderInfo:
    """Who leads and where."""

    id: str
    url: str
    http_url: str

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @staticmethod
    def decode(value: bytes) -> LeaderInfo:
        body = json.loads(value)
        return LeaderInfo(str(body["id"]), str(body["url"]), str(body["http_url"]))


class Election:
    """Campaigns for `self_info` and tracks the current leader."""

    def __init__(self, store: Store, self_info: LeaderInfo, ttl_s: int) -> None:
        self.store = store
        self.self_info = self_info
        self.ttl_s = max(int(ttl_s), 1)
        self.leader: LeaderInfo | None = None
        self.is_leader = False
        self.changed = asyncio.Event()  # set when the leader key may have changed
        self._lease = 0
        self._lease_lapses_at = 0.0  # by this Conductor's clock, at the latest
        self._elected_at = 0  # revision that created this Conductor's leader key
        self._lost = asyncio.Event()  # set when this leader's term is over before its lease
        # When this Conductor last lost a term while it lived (another took the key, or
        # fenced its writes), on the monotonic clock; None if never.
        self.deposed_at: float | None = None

    def observe(self, value: bytes | None, revision: int = 0) -> None:
        """The leader key was written (or deleted: None) at `revision`; called by the
        replica's watch. A leader that sees a later change of the key (gone or another's)
        steps down at once; changes from before its election are old news."""
        if self.is_leader and revision and revision < self._elected_at:
            return
        self.leader = LeaderInfo.decode(value) if value else None
        if self.is_leader and self.leader != self.self_info:
            log.warning("the leader key is no longer this Conductor's; stepping down")
            self._deposed()
        self.changed.set()

    def guard(self) -> Guard | None:
        """What this term's writes are guarded by: the leader key bound to the lease it was
        elected with; None when this Conductor does not lead."""
        return Guard(_LEADER, self._lease) if self.is_leader else None

    def fenced(self) -> None:
        """A guarded write was refused: the term is over, step down now."""
        if self.is_leader:
            log.warning("a write was fenced off: another term leads; stepping down")
            self._deposed()

    def _deposed(self) -> None:
        self.deposed_at = time.monotonic()
        self._lost.set()

    async def run(
        self,
        on_elected: Callable[[], Awaitable[None]],
        on_lost: Callable[[], Awaitable[None]],
    ) -> None:
        """Campaign, lead, step down, campaign again; until cancelled."""
        while True:
            try:
                if await self._campaign():
                    await on_elected()
                    await self._lead()
                    await self._step_down(on_lost)
                else:
                    await self._wait_for_change()
            except StoreError as exc:
                log.warning("election: %s", exc)
                if self.is_leader:
                    await self._step_down(on_lost)
                await self._wait_for_change()

    async def _step_down(self, on_lost: Callable[[], Awaitable[None]]) -> None:
        self.is_leader = False
        try:
            await on_lost()
        except StoreError as exc:  # etcd is away: campaign again when it is back
            log.warning("stepping down: %s", exc)

    async def _campaign(self) -> bool:
        asked_at = time.monotonic()
        lease = await self.store.grant_lease(self.ttl_s)
        if await self.store.create(_LEADER, self.self_info.encode(), lease.id):
            self._lease = lease.id
            self._lease_lapses_at = asked_at + lease.ttl_s
            self._lost.clear()
            mine = await self.store.get(_LEADER)
            self._elected_at = mine.mod_revision if mine and mine.lease == lease.id else 0
            self.leader = self.self_info
            self.is_leader = True
            log.info("elected leader: %s", self.self_info.id)
            return True
        await self.store.revoke_lease(lease.id)
        current = await self.store.get(_LEADER)
        self.leader = LeaderInfo.decode(current.value) if current else None
        return False

    async def _lead(self) -> None:
        """Keep the lease alive until it lapses, or the term is over (`_lost`). Leading on
        while a renewal is retried is safe: every write of the term is guarded by the lease."""
        wait_s = self.ttl_s / 3
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._lost.wait()
            if self._lost.is_set():
                with contextlib.suppress(StoreError):
                    await self.store.revoke_lease(self._lease)  # nothing more under it
                return
            sent_at = time.monotonic()
            try:
                async with asyncio.timeout(max(self._lease_lapses_at - sent_at, 0.0)):
                    remaining = await self.store.keep_alive(self._lease)
            except (StoreError, TimeoutError) as exc:
                if time.monotonic() >= self._lease_lapses_at:
                    log.warning("leader lease lapsed (%s); stepping down", str(exc) or "no answer")
                    return
                log.warning(
                    "renewing the leader lease failed (%s); trying again", str(exc) or "no answer"
                )
                wait_s = self.ttl_s / 10
                continue
            if remaining <= 0:
                if self.is_leader:  # else it resigned (shutting down)
                    log.warning("leader lease lapsed; stepping down")
                return
            self._lease_lapses_at, wait_s = sent_at + remaining, self.ttl_s / 3

    async def _wait_for_change(self) -> None:
        self.changed.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.ttl_s / 2):
                await self.changed.wait()

    async def resign(self) -> None:
        """Give up leadership now (graceful shutdown): standbys take over at once."""
        if self.is_leader:
            self.is_leader = False
            with contextlib.suppress(StoreError):
                await self.store.revoke_lease(self._lease)
