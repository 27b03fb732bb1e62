"""The node KV pool's store (`PoolStore`): its shared memory with the prefix cache over its
pages, the blocks' names and checksums, and the exports and imports over them; it turns the
cache's changes into the pool's KV events (medium `CPU`). `NodePool` (`kv_pool`) keeps one
per attached format."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from kvsched.cache.prefix_cache import PrefixCache
from kvsched.core.events import BlocksRemoved
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.dataplane.kv_layout import block_checksums
from services.dataplane.kv_memory import KvMemory
from services.dataplane.kv_names import EngineNames
from services.dataplane.kv_transfer import KvTransfers
from services.kv_events.vllm_wire import Event

MEDIUM = "CPU"  # how vLLM's events name host memory


class PoolStore:
    """The pool's memory with its cache, names and transfers."""

    def __init__(
        self,
        memory: KvMemory,
        hasher: VllmBlockHasher,
        on_events: Callable[[list[Event]], None],
    ) -> None:
        self.memory = memory
        # The checksum of the block each page holds (`block_checksums`), set when it commits.
        self.sums = np.zeros(memory.layout.pages, dtype=np.uint64)
        self.cache = PrefixCache(memory.layout.pages)
        self.names = EngineNames(memory.layout.block_size, medium=MEDIUM)
        self._on_events = on_events
        self._events: list[Event] = []
        self.transfers = KvTransfers(
            self.cache,
            memory=memory,
            names=self.names,
            hasher=hasher,
            clock=time.monotonic,
            sync=self.sync,
        )

    @property
    def empty(self) -> bool:
        """No block held, pinned or staged."""
        return not self.cache.nodes and not self.transfers.exports and not self.transfers.imports

    def parent(self, h: int) -> int | None:
        """The hash of the block below block `h` in the cache (None at a root)."""
        parent = self.cache.nodes[h].parent
        return None if parent is None else parent.hash

    def sync(self) -> None:
        """Apply the cache's changes to the memory's page table and name them as events."""
        stored = False
        for change in self.cache.drain_events():
            if isinstance(change, BlocksRemoved):
                self.memory.remove(change.hashes)
                self._events.append(self.names.removed(change.hashes))
            else:
                self._events.append(self.names.stored(change.hashes, change.parent))
                stored = True
        if stored:
            self.transfers.blocks_stored()

    def checksums(self, pages: Sequence[int]) -> list[int]:
        """The checksums of the blocks in `pages` (the bytes as they are now). Any thread."""
        view = self.memory.chunks.data.cast("B")
        try:
            return list(block_checksums(view, self.memory.layout, pages))
        finally:
            view.release()

    def intact(self, pages: Sequence[int]) -> int:
        """How many of the blocks in `pages`, from the first, still have the checksum they
        committed with (reads no further than the first that has not). Any thread."""
        sums = self.sums
        view = self.memory.chunks.data.cast("B")
        try:
            for i, (page, got) in enumerate(
                zip(pages, block_checksums(view, self.memory.layout, pages), strict=True)
            ):
                if got != int(sums[page]):
                    return i
        finally:
            view.release()
        return len(pages)

    def drop(self, block_hash: int) -> tuple[int, ...]:
        """Remove a block found corrupt and every block below it (unless it is pinned);
        `publish` then announces them removed. Returns the removed hashes."""
        removed = self.cache.drop(block_hash)
        self.sync()
        return removed

    def publish(self) -> None:
        self.sync()
        events, self._events = self._events, []
        if events:
            self._on_events(events)

    def check_integrity(self) -> None:
        self.cache.check_integrity()
        self.memory.check_integrity()
        assert self.memory.page_of.keys() == self.cache.nodes.keys(), "memory != cache"
        self.transfers.check_integrity()
