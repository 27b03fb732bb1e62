"""The live engine's reference cache mirrored into its KV memory and its block names, and sent
out as vLLM KV events: every block the cache stores gets a page and a `BlockStored`, every
block it evicts frees its page and is named in a `BlockRemoved`."""

from __future__ import annotations

import time
from collections.abc import Callable

from kvsched.cache.prefix_cache import PrefixCache
from kvsched.core.events import BlocksRemoved
from services.dataplane import EngineNames, KvMemory
from services.engine.kv_publisher import KvEventPublisher
from services.kv_events.vllm_wire import Event


class CacheMirror:
    """Applies the cache's changes to the KV memory and names (`sync`) and publishes them."""

    def __init__(
        self,
        cache: PrefixCache,
        memory: KvMemory,
        names: EngineNames,
        publisher: KvEventPublisher,
    ) -> None:
        self.cache = cache
        self.memory = memory
        self.names = names
        self.publisher = publisher
        # Runs when a sync stored blocks: the engine sets it to wake the exports waiting for
        # them (its transfers are made after this, since they call `sync`).
        self.stored: Callable[[], None] = lambda: None
        self._unpublished: list[Event] = []  # named, not yet sent

    def sync(self) -> None:
        """Apply the cache's changes since the last drain: evicted blocks free their KV memory
        pages, stored blocks get pages and content, and both are named as KV events, queued
        for the next `publish`. Exports waiting for blocks are woken.

        Called right after every change to the cache, with no await in between (by the step
        loop after a plan or a step, by transfers after a reservation or a commit), so
        between awaits the memory, the names and the cache agree."""
        memory, names, events = self.memory, self.names, self._unpublished
        stored = False
        for change in self.cache.drain_events():
            if isinstance(change, BlocksRemoved):
                memory.remove(change.hashes)
                events.append(names.removed(change.hashes))
            else:
                memory.store(change.hashes)
                events.append(names.stored(change.hashes, change.parent))
                stored = True
        if stored:
            self.stored()

    async def publish(self) -> None:
        """`sync`, then send every event not sent yet as one vLLM KV-event batch. Its
        sequence number is taken before the first await, so batches go out in the order
        their events were named, whoever sends them."""
        self.sync()
        events, self._unpublished = self._unpublished, []
        if events:
            await self.publisher.publish(events, time.time())
