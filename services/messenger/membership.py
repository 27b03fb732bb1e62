"""One instance's registration with the Conductor: register it (until the Conductor takes
it), keep its lease alive every third of its TTL, register it again when the lease lapsed or
the event stream says the Conductor forgot it, and deregister it when its engine is gone.

Keep-alives go to any Conductor that answers (a standby renews the lease in etcd), and a failed
one is tried again within a tenth of the TTL: the lease never depends on the leader being up,
so a leader change, however slow, neither unregisters the instance nor costs a resync.

Every registration opens the instance's event sequence at the number the Conductor gives
and calls `on_registered` (the relay then resyncs: what the Conductor held may be stale)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from clients.python import ConductorClient, ConductorError, NotFound
from clients.python.kv_stream import KvEventStream
from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from services.common.serving.durations import seconds

log = logging.getLogger(__name__)

ROLES = {"both": common.ROLE_BOTH, "prefill": common.ROLE_PREFILL, "decode": common.ROLE_DECODE}


class Membership:
    """Registration of the instance `spec` describes; `registered` says whether it is."""

    def __init__(
        self,
        spec: pb.InstanceSpec,
        *,
        client: ConductorClient,
        stream: KvEventStream,
        lease_ttl_s: float,
        on_registered: Callable[[], None],
    ) -> None:
        self.spec = spec
        self._client = client
        self._stream = stream
        self._asked_ttl_s = lease_ttl_s
        self.lease_ttl_s = lease_ttl_s  # as granted
        self._on_registered = on_registered
        self.registered = False
        self.registrations = 0
        self._again = asyncio.Event()

    @property
    def instance_id(self) -> str:
        return self.spec.instance_id

    def lost(self) -> None:
        """The Conductor no longer knows the instance: register it again soon (from the
        `keep_alive` task)."""
        self._again.set()

    async def register(self) -> None:
        """Register, retrying with backoff until the Conductor takes it."""
        delay = 0.05
        while True:
            try:
                answer = await self._client.register_instance(self.spec, self._asked_ttl_s)
                break
            except ConductorError as exc:
                log.warning("cannot register %s yet: %s", self.instance_id, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self._asked_ttl_s / 3)
        ttl = seconds(answer.lease_ttl)
        self.lease_ttl_s = ttl or self._asked_ttl_s
        first = answer.instance.next_event_sequence
        self._stream.open(self.instance_id, first)
        self.registered = True
        self.registrations += 1
        log.info(
            "registered instance %s (slot %d, lease %.1f s, events from %d)",
            self.instance_id,
            answer.instance.slot,
            self.lease_ttl_s,
            first,
        )
        self._on_registered()

    async def keep_alive(self) -> None:
        """Keep the lease alive until cancelled (start once registered)."""
        self._again.clear()
        wait_s = self.lease_ttl_s / 3
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(wait_s):
                    await self._again.wait()
            wait_s = self.lease_ttl_s / 3
            if self._again.is_set():
                self._again.clear()
                await self.register()
                continue
            try:
                # A quarter of the TTL per Conductor: a hung one leaves time for the next.
                await self._client.renew_lease(self.instance_id, deadline_s=self.lease_ttl_s / 4)
            except NotFound:
                log.warning("the lease of %s lapsed; registering again", self.instance_id)
                await self.register()
            except ConductorError as exc:
                log.warning("keep-alive of %s failed: %s", self.instance_id, exc)
                wait_s = self.lease_ttl_s / 10  # soon again: the lease is running out

    async def leave(self) -> bool:
        """Stop the instance's events and take it out of the Conductor at once; returns
        whether it was registered."""
        self._stream.close_instance(self.instance_id)
        was, self.registered = self.registered, False
        if not was:
            return False
        try:
            await self._client.deregister(self.instance_id)
            log.info("deregistered instance %s", self.instance_id)
        except NotFound:
            pass
        except ConductorError as exc:  # its lease lapses on its own
            log.warning("could not deregister %s: %s", self.instance_id, exc)
        return True
