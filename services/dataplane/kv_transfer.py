"""Exports and imports of cached blocks over a KV store (a prefix cache, its KV memory and
vLLM's names of its blocks): the bookkeeping of both ends of a KV transfer. A node's KV pool
(`services.dataplane.kv_pool`) is such a store, exported from and imported into by its
Messenger and by its engines; a simulated engine imports what it loads from its pool
(`services.dataplane.pool_link`).

An export pins blocks a reader copies out of the KV memory: they stay cached and on their
pages (locked in the prefix cache, without counting as a use) until released, or until their
hold time passes (a reader that died must leave nothing pinned). An export may wait for its
first block: a block still being saved arrives soon.

An import is two calls around a writer's copy. `import_begin` holds the chain's cached prefix,
reserves pages in the prefix cache for the missing blocks and stages as many KV memory pages
for the writer. `import_commit` checks the blocks' token ids really hash to the chain, then
makes them cached blocks as the simulator does for a copy nobody waits on
(`kvsched.sim.transfers`): committed, then unlocked, so they are evictable and most recently used,
and the store names them like blocks computed there. `import_abort`, or the hold time passing,
gives everything back.

Pure bookkeeping on the event loop.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsched.cache.prefix_cache import PrefixCache
from kvsched.core.vllm_hashing import AdapterKey, VllmBlockHasher, event_hash
from services.dataplane.errors import DataPlaneError
from services.dataplane.kv_memory import KvMemory
from services.dataplane.kv_names import EngineNames


class TransferError(DataPlaneError):
    """An export or import the engine refuses."""


class Stopped(TransferError):
    """The engine is stopping: it pins and stages nothing more."""


class NoRoom(TransferError):
    """Not enough pages for an import, even after evicting every evictable block."""


class UnknownImport(TransferError):
    """No such import (never begun, committed, aborted or expired)."""


class WrongBlocks(TransferError):
    """An import's token ids are not those of its blocks (the import was aborted)."""


@dataclass(frozen=True, slots=True)
class ExportGrant:
    """Blocks pinned for reading: `blocks` of them from the asked start on, in order."""

    export_id: str | None  # None when nothing was exported (nothing to release)
    blocks: int
    pages: tuple[int, ...]  # the page of each exported block
    token_ids: tuple[int, ...]  # blocks × block_size
    cache_salt: str | None  # the chain's salt (on its first block), None for none
    adapter: AdapterKey | None = None  # the LoRA adapter its blocks were computed with


@dataclass(frozen=True, slots=True)
class ImportGrant:
    """Pages staged for an import of blocks `have`…upto of a chain."""

    import_id: str | None  # None when every block asked for is cached already
    have: int  # leading blocks of the chain already cached (held until the import ends)
    pages: tuple[int, ...]  # where to write block have + i


@dataclass(frozen=True, slots=True)
class ImportCommitted:
    """An import's blocks are cached."""

    stored: int  # blocks that became cached (the others the engine cached meanwhile)
    blocks: int  # blocks the import carried


@dataclass(slots=True, eq=False)
class _Export:
    hashes: tuple[int, ...]
    pinned: int  # leading blocks of `hashes` locked in the cache
    timer: asyncio.TimerHandle


@dataclass(slots=True, eq=False)
class _Import:
    hashes: tuple[int, ...]
    have: int
    upto: int
    pages: list[int]  # staged in the KV memory, one per block have…upto
    timer: asyncio.TimerHandle


class KvTransfers:
    """The exports and imports in progress on one engine.

    `sync` must apply the cache's pending events to the KV memory and the names (the live
    engine's `CacheMirror.sync`): it runs after every change here that stores or evicts blocks, and
    the caller then publishes the queued events. `freed` runs whenever pages may have come
    free (an export released, an import ended): a request waiting for memory may fit now.
    `clock` is the cache's clock (model seconds)."""

    def __init__(
        self,
        cache: PrefixCache,
        *,
        memory: KvMemory,
        names: EngineNames,
        hasher: VllmBlockHasher,
        clock: Callable[[], float],
        sync: Callable[[], None],
        freed: Callable[[], None] = lambda: None,
    ) -> None:
        self.cache = cache
        self.memory = memory
        self.names = names
        self.hasher = hasher
        self.clock = clock
        self.sync = sync
        self.freed = freed
        self.exports: dict[str, _Export] = {}
        self.imports: dict[str, _Import] = {}
        self._stored_waiters: set[asyncio.Future[None]] = set()
        self.closed = False

    @property
    def waiting_exports(self) -> int:
        """Exports waiting for their first block to be stored."""
        return len(self._stored_waiters)

    # ---- exports -----------------------------------------------------------------------

    async def export(
        self, hashes: Sequence[int], start: int, end: int, *, wait_s: float, hold_s: float
    ) -> ExportGrant:
        """Pin the cached blocks of `hashes[start:end]` (end 0: the whole chain) from `start`
        on, for `hold_s` wall seconds at most. When block `start` is not cached, wait up to
        `wait_s` seconds for the engine to store it, then export what there is (maybe
        nothing, then nothing is pinned). Raises `Stopped` once the engine stops."""
        end = end or len(hashes)
        if not 0 <= start <= end <= len(hashes):
            raise ValueError(f"blocks {start}:{end} are not within a chain of {len(hashes)}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            n = max(self.cache.chain_match(hashes, end) - start, 0)
            left = deadline - loop.time()
            if n or left <= 0 or self.closed:
                break
            await self._until_stored(left)
        if self.closed:
            raise Stopped("the engine is stopping")
        return self._pin(tuple(hashes), start, n, hold_s)

    def release_export(self, export_id: str) -> bool:
        """Unpin an export's blocks. False when it already ended (released or expired)."""
        record = self.exports.pop(export_id, None)
        if record is None:
            return False
        record.timer.cancel()
        self.cache.unlock_prefix(record.hashes, record.pinned, self.clock(), touch=False)
        self.freed()
        return True

    async def until_landed(self, hashes: Sequence[int], timeout_s: float) -> None:
        """Wait (up to `timeout_s`) while an import in progress stages one of `hashes`: an
        export of a chain whose next blocks are landing is worth the wait (a connector
        commits a step's blocks just after the step)."""
        wanted = frozenset(hashes)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while any(not wanted.isdisjoint(r.hashes[r.have : r.upto]) for r in self.imports.values()):
            left = deadline - loop.time()
            if left <= 0:
                return
            await self._until_stored(left)

    def blocks_stored(self) -> None:
        """The cache gained blocks (or an import ended): wake whoever waits for blocks."""
        waiters, self._stored_waiters = self._stored_waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _pin(self, hashes: tuple[int, ...], start: int, n: int, hold_s: float) -> ExportGrant:
        first = self.names.blocks.get(hashes[0]) if hashes else None
        salt = (first.salt or None) if first is not None else None
        adapter = first.adapter if first is not None else None
        if n == 0:
            return ExportGrant(None, 0, (), (), salt, adapter)
        upto = start + n
        # Reading is not a use: the blocks keep their place in the LRU order.
        self.cache.lock_prefix(hashes, upto, self.clock(), touch=False)
        export_id = "x-" + secrets.token_hex(8)
        timer = asyncio.get_running_loop().call_later(hold_s, self.release_export, export_id)
        self.exports[export_id] = _Export(hashes, upto, timer)
        chain = hashes[start:upto]
        page_of, blocks = self.memory.page_of, self.names.blocks
        pages = tuple(page_of[h] for h in chain)
        tokens = tuple(t for h in chain for t in blocks[h].tokens)
        return ExportGrant(export_id, n, pages, tokens, salt, adapter)

    async def _until_stored(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._stored_waiters.add(waiter)
        handle = loop.call_later(timeout, _resolve, waiter)
        try:
            await waiter
        finally:
            handle.cancel()
            self._stored_waiters.discard(waiter)

    # ---- imports -----------------------------------------------------------------------

    def import_begin(self, hashes: Sequence[int], upto: int, hold_s: float) -> ImportGrant:
        """Stage pages for blocks `hashes[have:upto]`, `have` being how many leading blocks
        are cached: holds those, reserves `upto − have` pages in the cache (evicting LRU
        blocks) and allocates as many staged KV memory pages. The import is aborted unless
        committed within `hold_s` wall seconds. Raises `NoRoom` (and changes nothing) when
        the cache cannot make room, `Stopped` once the engine stops."""
        if self.closed:
            raise Stopped("the engine is stopping")
        if not 0 <= upto <= len(hashes):
            raise ValueError(f"upto {upto} is not within a chain of {len(hashes)}")
        cache, chain = self.cache, tuple(hashes)
        have = cache.chain_match(chain, upto)
        if have >= upto:
            return ImportGrant(None, have, ())
        now, n = self.clock(), upto - have
        # Not a use until the blocks arrive (an import that fails leaves the LRU order as is).
        cache.lock_prefix(chain, have, now, touch=False)
        if not cache.reserve(n):
            cache.unlock_prefix(chain, have, now, touch=False)
            raise NoRoom(f"no room for {n} blocks: {cache.available} pages could be freed")
        self.sync()  # evicted blocks give their pages back before we take ours
        pages = self.memory.allocate(n)
        import_id = "i-" + secrets.token_hex(8)
        timer = asyncio.get_running_loop().call_later(hold_s, self.import_abort, import_id)
        self.imports[import_id] = _Import(chain, have, upto, pages, timer)
        return ImportGrant(import_id, have, tuple(pages))

    def import_commit(
        self,
        import_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None,
        adapter: AdapterKey | None = None,
    ) -> ImportCommitted:
        """The Messenger wrote the import's pages: check `token_ids` are its blocks' (they
        chain from the held prefix, or from the root of `cache_salt` when none is held, to
        each block's hash, for LoRA `adapter`'s requests when one is named) and make the
        blocks cached, evictable and most recently used;
        `sync` then names them as stored. `token_ids` may cover only the first blocks of the
        import (a source that held fewer): the pages of the rest go back. Blocks the engine
        cached meanwhile are shared and their staged pages freed. Raises `UnknownImport`, or
        `WrongBlocks` after aborting."""
        record = self.imports.get(import_id)
        if record is None:
            raise UnknownImport(f"no import {import_id!r} (ended, expired or never begun)")
        hashes, have, reserved = record.hashes, record.have, record.upto
        salt = cache_salt if have == 0 else None
        bs = self.hasher.block_size
        upto = have + len(token_ids) // bs
        try:
            if not token_ids or len(token_ids) % bs or upto > reserved:
                raise WrongBlocks(
                    f"expected the token ids of 1 to {reserved - have} whole blocks of {bs}, "
                    f"got {len(token_ids)}"
                )
            digests = self._check_tokens(hashes, have, upto, token_ids, salt, adapter=adapter)
        except WrongBlocks:
            self.import_abort(import_id)
            raise
        del self.imports[import_id]
        record.timer.cancel()
        cache, memory, names = self.cache, self.memory, self.names
        new = [h not in cache.nodes for h in hashes[have:upto]]
        # Token ids must be known before the stored event is named, and are let go after.
        names.hold(hashes[have:upto], digests, token_ids, salt, adapter=adapter)
        now = self.clock()
        cache.commit(hashes, have, upto, have, now)
        cache.unlock_prefix(hashes, upto, now)
        cache.release(reserved - upto)
        duplicates = list(record.pages[upto - have :])
        for h, page, is_new in zip(hashes[have:upto], record.pages, new, strict=False):
            if is_new:
                memory.adopt(h, page)
            else:
                duplicates.append(page)
        memory.free(duplicates)
        self.sync()
        names.release(hashes[have:upto])
        self.freed()
        return ImportCommitted(sum(new), upto - have)

    def staged(self, import_id: str) -> tuple[int, ...] | None:
        """The pages an import in progress staged (where blocks have… are written, in
        order); None when it has ended. Changes nothing."""
        record = self.imports.get(import_id)
        return None if record is None else tuple(record.pages)

    def import_abort(self, import_id: str) -> bool:
        """Give back an import's held prefix, reserved pages and staged pages. False when it
        already ended (committed, aborted or expired)."""
        record = self.imports.pop(import_id, None)
        if record is None:
            return False
        record.timer.cancel()
        self.cache.unlock_prefix(record.hashes, record.have, self.clock(), touch=False)
        self.cache.release(record.upto - record.have)
        self.memory.free(record.pages)
        self.freed()
        self.blocks_stored()  # what waited for these blocks waits no more
        return True

    def _check_tokens(
        self,
        hashes: tuple[int, ...],
        have: int,
        upto: int,
        token_ids: Sequence[int],
        salt: str | None,
        *,
        adapter: AdapterKey | None,
    ) -> list[bytes]:
        """The digests of blocks `have..upto` from their `token_ids`; raises `WrongBlocks`
        unless they hash to `hashes`."""
        bs = self.hasher.block_size
        parent = self.names.digest(hashes[have - 1]) if have else None
        digests: list[bytes] = []
        for i in range(have, upto):
            block = token_ids[(i - have) * bs : (i - have + 1) * bs]
            if not all(isinstance(t, int) and 0 <= t < 1 << 32 for t in block):
                raise WrongBlocks(f"the token ids of block {i} are not all u32")
            parent = self.hasher.next_digest(parent, block, salt, adapter)
            if event_hash(parent) != hashes[i]:
                raise WrongBlocks(f"the token ids of block {i} do not hash to its hash")
            digests.append(parent)
        return digests

    # ---- life --------------------------------------------------------------------------

    def close(self) -> None:
        """Release every export, abort every import, wake every waiting export (the engine
        stops)."""
        self.closed = True
        for export_id in list(self.exports):
            self.release_export(export_id)
        for import_id in list(self.imports):
            self.import_abort(import_id)
        self.blocks_stored()

    def check_integrity(self) -> None:
        """Assert the staged pages are exactly the imports' and their reservations fit in
        the cache's private pages."""
        staged = sum(len(r.pages) for r in self.imports.values())
        assert staged == self.memory.staged_pages, "staged pages not owned by an import"
        assert staged <= self.cache.private, "an import's pages are not reserved"
        for record in self.exports.values():
            assert self.cache.match(record.hashes, record.pinned) == record.pinned


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
