"""Ending a dead leader's term without waiting for its lease: a standby that finds the leader's
process gone takes the leader key away and campaigns at once.

"Gone" means refused: the leader's gRPC address (the one it advertises, which every client
must reach) answers a TCP connection with a reset, `refusals` probes in a row. Only a host
where nothing listens on that port does that: a leader whose event loop stalls (a loaded
machine, a long GC pause) still has its listening socket, the kernel still accepts for it, so
it is never taken for dead and keeps its term until its lease lapses, as before. A probe that
times out or fails otherwise proves nothing and resets the count. The probe connects and
closes without a byte, so it costs the leader nothing and logs nothing (TLS included).

Taking the key away is one etcd transaction guarded by the key's lease (the dead leader's):
it deletes the key only if that term still holds it, so of several standbys one wins and a
newer leader is never removed. The dead leader's lease is then revoked (had it been alive
after all, its next keep-alive fails, its watch shows the key gone, and its writes, guarded
by that lease, are refused: fencing makes a wrong guess safe). A wrong guess means the
leader's address refuses connections from here while it lives (a firewall that rejects, a
wrong advertised address): the deposed Conductor then stops probing for `pause_s`, so two
Conductors that cannot reach each other do not take the lead from one another in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from services.common.store.interface import Delete, Fenced, Guard, Store, StoreError
from services.conductor import keys
from services.conductor.election import Election, LeaderInfo

log = logging.getLogger(__name__)
_LEADER = keys.LEADER.encode()

Refuses = Callable[[str], Awaitable[bool]]  # does this address refuse connections?


async def refuses_connections(url: str, timeout_s: float = 0.5) -> bool:
    """Whether a TCP connection to `url`'s host and port (`host:port` or a URL) is refused
    (nothing listens there). Connects and closes without sending a byte."""
    parts = urlsplit(url if "//" in url else f"//{url}")
    if parts.hostname is None or parts.port is None:
        return False
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(parts.hostname, parts.port)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


class DeadLeaderProbe:
    """While this Conductor stands by, probes the leader's gRPC address every `interval_s`;
    after `refusals` refused connections in a row, fences the leader's term off
    (`take_over`) so this Conductor's election campaigns at once. Probes nothing for
    `pause_s` after this Conductor was deposed while it lived (`Election.deposed_at`)."""

    def __init__(
        self,
        store: Store,
        election: Callable[[], Election],
        *,
        interval_s: float,
        refusals: int = 2,
        pause_s: float = 30.0,
        refuses: Refuses = refuses_connections,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.election = election
        self.interval_s = interval_s
        self.refusals = max(refusals, 1)
        self.pause_s = pause_s
        self.refuses = refuses
        self.clock = clock
        self.takeovers = 0  # dead leaders' terms this Conductor ended

    def _paused(self, election: Election) -> bool:
        deposed = election.deposed_at
        return deposed is not None and self.clock() - deposed < self.pause_s

    async def run(self) -> None:
        """Probe until cancelled."""
        refused, probed = 0, None
        while True:
            await asyncio.sleep(self.interval_s)
            election = self.election()
            leader = election.leader
            if election.is_leader or leader is None or not leader.url or self._paused(election):
                refused, probed = 0, None
                continue
            if leader != probed:
                refused, probed = 0, leader
            refused = refused + 1 if await self.refuses(leader.url) else 0
            if refused >= self.refusals:
                refused = 0
                with contextlib.suppress(StoreError):
                    if await self.take_over(leader):
                        election.changed.set()  # campaign now

    async def take_over(self, dead: LeaderInfo) -> bool:
        """End `dead`'s term if it still holds the leader key: delete the key in a
        transaction guarded by the key's lease, then revoke that lease. Returns whether this
        call ended it."""
        held = await self.store.get(_LEADER)
        if held is None or LeaderInfo.decode(held.value) != dead:
            return False
        try:
            await self.store.commit([Delete(_LEADER)], Guard(_LEADER, held.lease))
        except Fenced:
            return False  # another standby was first, or the leader changed meanwhile
        with contextlib.suppress(StoreError):
            await self.store.revoke_lease(held.lease)
        self.takeovers += 1
        log.warning(
            "leader %s refuses connections at %s: its term is ended, campaigning",
            dead.id,
            dead.url,
        )
        return True
