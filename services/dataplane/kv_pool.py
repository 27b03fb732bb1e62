"""The node's KV pool (`NodePool`): blocks kept in this node's host memory, owned by its
Messenger, where KV leaving or arriving at the node is staged (Mooncake's idea: the serving
nodes' DRAM as one KV cache pool the Conductor places blocks in).

An engine on the node saves the blocks it computes into the pool and loads the blocks it
lacks from it (vLLM through kvsched's KV connector, `services.vllm_connector`); a transfer
between nodes moves blocks pool to pool. The pool is a KV store of the same make as a
simulated engine's memory: one shared-memory file laid out layer by layer
(`services.dataplane.kv_layout`), a prefix cache over its pages (LRU, leaves first, pinned
blocks kept), the blocks' names (token ids and vLLM digests), and exports and imports
(`services.dataplane.kv_transfer`: an import's token ids must hash to its blocks before they
become visible). Its blocks are announced as vLLM KV events with medium `CPU`.

The pool keeps a checksum of every block it holds (XXH3-64 of its bytes, 8 bytes a page),
computed when its save or import commits (the writer is done: the bytes are final), and
checks the blocks it hands out against it before a load is answered or an export granted:
a block whose bytes changed at rest (memory gone bad, a stray write into the shared file)
ends the answer there, the rest being a miss the engine recomputes, and it and every block
below it leave the pool (announced as removed). The KV of a real engine cannot be derived
from its block's name, so this is the only check between a save and a load into vLLM; a
transfer's chunk checksums, computed from the pool's bytes, would pass bad bytes on.
Hashing more than `INLINE_CHECK_BYTES` runs in a thread, off the event loop (xxhash lets go
of the GIL for inputs over 64 KiB; for smaller chunks the thread and the loop share it); it
costs a fraction of the engine's copy of the same blocks (`bench.load_check`).

The pool's geometry is not known until an engine says what one block of its KV is: the first
engine to `attach` fixes it (and sizes the pool to `capacity_bytes`); an engine whose blocks
are laid out otherwise is refused while the pool holds anything. The format is remembered in
`format_file`, so a Messenger that restarts has its pool ready before the engines' connectors
call again (they find the new pool's file named in every answer and map it). Everything here
runs on the Messenger's event loop.

Its parts: the block format and the file remembering it (`pool_format`), the memory with its
cache, names, checksums and transfers (`pool_store`), what it answers and counts
(`pool_records`) and its errors (`errors`: `PoolError`, `PoolFull`, `PoolRefused`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from kvsched.core.vllm_hashing import AdapterKey, VllmBlockHasher
from services.dataplane.errors import PoolError, PoolFull, PoolRefused
from services.dataplane.kv_layout import KvLayout
from services.dataplane.kv_memory import DEFAULT_DIR, KvMemory
from services.dataplane.kv_transfer import ExportGrant, NoRoom, TransferError
from services.dataplane.pool_format import BlockFormat, read_format, write_format
from services.dataplane.pool_records import (
    CheckTotals,
    CopyTotals,
    Exported,
    ImportSlots,
    PoolUsage,
)
from services.dataplane.pool_store import PoolStore
from services.kv_events.vllm_wire import Event

log = logging.getLogger(__name__)
LANDING_WAIT_S = 1.0  # an export waits this long at most for blocks being committed
# Checksums of fewer bytes than this are computed on the event loop: a hop to a thread and
# back costs about as much as hashing them (a fraction of a millisecond).
INLINE_CHECK_BYTES = 256 << 10
_T = TypeVar("_T")


class NodePool:
    """The pool of one node; `attach` before anything else."""

    def __init__(
        self,
        capacity_bytes: int,
        *,
        node: str,
        hasher_for: Callable[[int], VllmBlockHasher],
        on_events: Callable[[list[Event]], None],
        directory: str | os.PathLike[str] = DEFAULT_DIR,
        format_file: Path | None = None,
    ) -> None:
        """`hasher_for(block_size)` names blocks as the node's engines do; `on_events`
        receives the pool's KV events (stored and removed, medium CPU), in order. A
        `format_file` left by an earlier Messenger of the node attaches its format now."""
        self.capacity_bytes = capacity_bytes
        self.node = node
        self.directory = directory
        self.format_file = format_file
        self._hasher_for = hasher_for
        self._on_events = on_events
        self.format: BlockFormat | None = None
        self.copies = CopyTotals.empty()
        self.checks = CheckTotals.empty()
        self._store: PoolStore | None = None
        remembered = read_format(format_file)
        if remembered is not None:
            try:
                self.attach(remembered)
            except (PoolRefused, OSError) as exc:
                log.warning("ignoring the remembered KV pool format: %s", exc)

    # ---- engines -------------------------------------------------------------------------

    def attach(self, fmt: BlockFormat) -> KvMemory:
        """An engine whose blocks are `fmt` will save into and load from the pool: the first
        one creates the pool's memory. Returns the memory (its file is what the engine maps).
        Raises `PoolRefused` for another format or a pool too small for one block."""
        if self._store is not None and fmt == self.format:
            return self._store.memory
        if self._store is not None and not self._store.empty:
            raise PoolRefused(
                f"this node's KV pool holds blocks of {self.format}, not {fmt}: engines of "
                "one node must share a model, dtype, block size and attention backend"
            )
        layout = self._layout(fmt)  # checked before an empty pool of another format goes
        if self._store is not None:
            log.info("KV pool: %s replaces %s (the pool held nothing)", fmt, self.format)
            self.close()
            self._store = None
        memory = KvMemory(layout, f"pool-{self.node}", self.directory)
        # A pool is memory set aside: fault it in now, off the event loop, not block by block
        # on the engines' copies.
        threading.Thread(target=memory.populate, name="kv-pool-populate", daemon=True).start()
        self._store = PoolStore(memory, self._hasher_for(fmt.block_size), self._on_events)
        self.format = fmt
        write_format(self.format_file, fmt)
        log.info("KV pool of %d blocks (%d bytes) for %s", layout.pages, layout.size, fmt)
        return memory

    def _layout(self, fmt: BlockFormat) -> KvLayout:
        """The pool's memory for blocks of `fmt`; raises `PoolRefused`."""
        pages = self.capacity_bytes // (fmt.layers * fmt.chunk_bytes)
        if pages < 1:
            raise PoolRefused(
                f"a KV pool of {self.capacity_bytes} bytes cannot hold one block of "
                f"{fmt.layers * fmt.chunk_bytes} bytes: raise --kv-pool-bytes"
            )
        try:
            return fmt.layout(pages)
        except ValueError as exc:
            raise PoolRefused(f"no pool can hold blocks of {fmt}: {exc}") from None

    @property
    def attached(self) -> bool:
        return self._store is not None

    @property
    def memory(self) -> KvMemory:
        return self._live().memory

    def _live(self) -> PoolStore:
        if self._store is None:
            raise PoolError("no engine of this node has attached to its KV pool yet")
        return self._store

    # ---- a transfer's end (EngineApi's shape) --------------------------------------------

    async def export_blocks(
        self,
        hashes: Sequence[int],
        start: int,
        end: int,
        *,
        wait_s: float,
        hold_s: float,
        landing_s: float = LANDING_WAIT_S,
    ) -> Exported:
        """Pin the pool's blocks `hashes[start:end]` from `start` on (waiting up to `wait_s`
        for block `start`, and up to `landing_s` for blocks an engine is committing), for
        `hold_s` at most unless released."""
        store = self._live()
        if landing_s > 0:
            await store.transfers.until_landed(hashes[start : end or None], landing_s)
        try:
            grant = await store.transfers.export(hashes, start, end, wait_s=wait_s, hold_s=hold_s)
            if grant.blocks:
                grant = await self._intact(store, hashes, start, grant, hold_s)
        except TransferError as exc:
            raise PoolError(str(exc)) from None
        finally:
            store.publish()
        return Exported(
            grant.export_id or "",
            grant.blocks,
            grant.pages,
            grant.token_ids,
            grant.cache_salt,
            grant.adapter,
        )

    async def _intact(
        self, store: PoolStore, hashes: Sequence[int], start: int, grant: ExportGrant, hold_s: float
    ) -> ExportGrant:
        """`grant` (pinned, so its pages keep their blocks) cut at its first block whose
        bytes no longer have the checksum they were saved with; that block and those below
        it leave the pool (unless another holder has it pinned: a later check finds it)."""
        started = time.perf_counter()
        intact = await _hashing(store, store.intact, grant.pages)
        took = time.perf_counter() - started
        block_bytes = store.memory.layout.block_bytes
        self.checks.record("export", min(intact + 1, grant.blocks) * block_bytes, took)
        if intact == grant.blocks:
            return grant
        assert grant.export_id is not None  # it pinned blocks
        pinned = store.transfers.release_export(grant.export_id)  # False: its hold time ran out
        bad = start + intact
        dropped = store.drop(hashes[bad])
        self.checks.corrupt += 1
        self.checks.dropped += len(dropped)
        log.warning(
            "KV pool: block %d of %d asked for (%#x) holds other bytes than were saved: "
            "answering the %d before it, dropping %d blocks",
            bad, len(hashes), hashes[bad], intact, len(dropped),
        )  # fmt: skip
        if not pinned or intact == 0:
            return ExportGrant(None, 0, (), (), grant.cache_salt, grant.adapter)
        # No await between the release and this: the blocks before the bad one are cached.
        return await store.transfers.export(hashes, start, bad, wait_s=0.0, hold_s=hold_s)

    async def release_export(self, export_id: str) -> bool:
        return self.release(export_id)

    def release(self, export_id: str) -> bool:
        """Unpin an export's blocks; False when it had ended."""
        store = self._live()
        released = store.transfers.release_export(export_id)
        store.publish()
        return released

    async def begin_import(self, hashes: Sequence[int], upto: int, *, hold_s: float) -> ImportSlots:
        """Stage pages for the blocks of `hashes[:upto]` the pool lacks (evicting LRU
        blocks); raises `PoolFull` when it cannot."""
        store = self._live()
        try:
            grant = store.transfers.import_begin(hashes, upto, hold_s)
        except NoRoom as exc:
            raise PoolFull(str(exc)) from None
        except TransferError as exc:
            raise PoolError(str(exc)) from None
        finally:
            store.publish()
        return ImportSlots(grant.import_id, grant.have, grant.pages)

    async def commit_import(
        self,
        import_id: str,
        token_ids: Sequence[int],
        cache_salt: str | None,
        adapter: AdapterKey | None = None,
    ) -> int:
        """Make an import's written blocks visible once their token ids hash to them (with
        LoRA `adapter`'s keys, when one is named); returns how many were new. Raises
        `PoolError` (the import is then aborted)."""
        store = self._live()
        await self._checksum(store, import_id, len(token_ids))
        try:
            committed = store.transfers.import_commit(import_id, token_ids, cache_salt, adapter)
        except TransferError as exc:
            raise PoolError(str(exc)) from None
        finally:
            store.publish()
        return committed.stored

    async def _checksum(self, store: PoolStore, import_id: str, tokens: int) -> None:
        """Keep the checksums of the blocks an import about to commit wrote (the first
        `tokens` worth of its staged pages): the writer is done, the bytes are final."""
        staged = store.transfers.staged(import_id)
        if not staged:
            return  # the commit fails, or has nothing to keep
        pages = staged[: tokens // store.memory.layout.block_size]
        started = time.perf_counter()
        sums = await _hashing(store, store.checksums, pages)
        self.checks.record(
            "commit", len(pages) * store.memory.layout.block_bytes, time.perf_counter() - started
        )
        # An import that ended meanwhile may have lost its pages to another: keep nothing.
        if store.transfers.staged(import_id) == staged:
            store.sums[list(pages)] = sums

    async def abort_import(self, import_id: str) -> bool:
        return self.abort(import_id)

    def abort(self, import_id: str) -> bool:
        """Give an import's staged pages back; False when it had ended."""
        store = self._live()
        aborted = store.transfers.import_abort(import_id)
        store.publish()
        return aborted

    # ---- views and life ------------------------------------------------------------------

    def snapshot(self) -> list[Event]:
        """Every block in the pool as stored events (parents first): a resync of an engine's
        index re-announces its node's pool with it. Blocks that continue one another in the
        cache's order share one event, as a stored chain was announced (a full pool is tens of
        thousands of blocks: one message each kept a Messenger's loop busy for seconds)."""
        store = self._store
        if store is None:
            return []
        events: list[Event] = []
        run: list[int] = []
        run_parent: int | None = None
        for h in store.cache.nodes:
            parent = store.parent(h)
            if run and parent == run[-1]:
                run.append(h)
                continue
            if run:
                events.append(store.names.stored(run, run_parent))
            run, run_parent = [h], parent
        if run:
            events.append(store.names.stored(run, run_parent))
        return events

    def usage(self) -> PoolUsage:
        store = self._store
        if store is None:
            return PoolUsage(0, 0, 0, 0, 0, 0)
        return PoolUsage(
            pages=store.memory.layout.pages,
            blocks=len(store.cache.nodes),
            pinned=store.cache.locked_nodes,
            staged=store.memory.staged_pages,
            exports=len(store.transfers.exports),
            imports=len(store.transfers.imports),
        )

    def check_integrity(self) -> None:
        """Assert the cache, the memory and the transfers agree."""
        if self._store is not None:
            self._store.check_integrity()

    def close(self) -> None:
        """Release every export, abort every import, remove the memory file."""
        if self._store is not None:
            self._store.transfers.close()
            self._store.memory.close()


async def _hashing(
    store: PoolStore, check: Callable[[Sequence[int]], _T], pages: Sequence[int]
) -> _T:
    """`check(pages)` (hashing the blocks in `pages`), in a thread when they are many."""
    if len(pages) * store.memory.layout.block_bytes <= INLINE_CHECK_BYTES:
        return check(pages)
    return await asyncio.to_thread(check, pages)
