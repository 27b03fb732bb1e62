"""A simulated engine's side of its node's KV pool: the socket and the calls kvsched's vLLM
connector makes (`services.dataplane.pool_wire`), made from the event loop.

- **Save**: once a prompt's blocks are computed, the blocks the pool lacks are copied into
  pages it staged for them and committed with their token ids (the pool checks they hash to
  the blocks' names).
- **Load**: before a request is queued, the blocks beyond the engine's own cache hit that the
  pool holds are pinned there, imported into the engine's cache (`KvTransfers.import_begin`,
  the same reservation a Messenger's import makes), copied page by page and committed; the
  engine then finds them cached. Blocks whose bytes are not the content their hash implies
  (`kv_layout.intact_prefix`) are not taken: the engine computes them. The copy over the host
  link is charged in model time by the engine (`EngineModel.pool_load_s`,
  `LiveEngine.submit`'s `load_s`), not here.

The pool is an optimisation: a pool that cannot be reached, refuses, or has nothing is a miss,
never an error of the request, and the next call connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvsched.core.vllm_hashing import AdapterKey
from services.dataplane.kv_layout import SIM_FORMAT, Bytes, intact_prefix
from services.dataplane.kv_memory import KvMemory
from services.dataplane.kv_transfer import KvTransfers, TransferError
from services.dataplane.pool_wire import WireError, body_length, decode, encode, map_pool_file

log = logging.getLogger("kvsched.engine")
HOLD_S = 30.0  # longest the pool keeps a load pinned or a save staged for us
CALL_TIMEOUT_S = 5.0
ATTACH_RETRY_S = 1.0  # the Messenger (and its pool) may start after the engine


class PoolLink:
    """The engine's calls to the pool at the Unix socket `path` (one at a time)."""

    def __init__(self, path: str, memory: KvMemory, transfers: KvTransfers) -> None:
        self.path = path
        self.memory = memory
        self.transfers = transfers
        self.loaded_blocks = 0
        self.saved_blocks = 0
        self.refused_blocks = 0  # loaded with other bytes than their hash implies
        self._stream: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()
        self._maps: dict[str, tuple[mmap.mmap, Bytes]] = {}  # pool file -> its chunks
        self._attached = False  # told the pool our format (again after any failed call)
        self._warned = False

    @property
    def attached(self) -> bool:
        """Whether the pool knows this engine's block format (until a call fails)."""
        return self._attached

    @property
    def format(self) -> dict[str, Any]:
        layout = self.memory.layout
        return {"kind": SIM_FORMAT, "layers": layout.layers,
                "chunk_bytes": layout.chunk_bytes, "block_size": layout.block_size}  # fmt: skip

    # ---- the two operations ------------------------------------------------------------

    async def save(
        self,
        hashes: Sequence[int],
        token_ids: Sequence[int],
        salt: str | None,
        adapter: AdapterKey | None = None,
    ) -> int:
        """Copy the cached blocks of the chain `hashes` (the prompt `token_ids`, of LoRA
        `adapter`'s request) the pool lacks into it; returns how many it took. Blocks the
        engine no longer holds end the save there."""
        page_of = self.memory.page_of
        upto = next((i for i, h in enumerate(hashes) if h not in page_of), len(hashes))
        if upto == 0 or not await self._attach():
            return 0
        answer = await self._call("save", block_hashes=list(hashes), upto=upto, hold_s=HOLD_S)
        if answer is None or answer.get("import_id") is None:
            return 0
        have, pages = int(answer["have"]), answer["pages"]
        import_id = answer["import_id"]
        bs = self.memory.layout.block_size
        pool = self._chunks(answer["path"])
        ours = [page_of.get(h) for h in hashes[have:upto]]
        if pool is None or None in ours:  # evicted while the pool answered
            await self._call("abort", import_id=import_id)
            return 0
        started = time.perf_counter()
        copied = _copy(self.memory.chunks, [p for p in ours if p is not None], pool, pages)
        answer = await self._call(
            "commit",
            import_id=import_id,
            token_ids=list(token_ids[have * bs : upto * bs]),
            cache_salt=salt if have == 0 else None,
            lora=None if adapter is None else list(adapter),
            copied_bytes=copied,
            copy_s=time.perf_counter() - started,
        )
        if answer is None:
            return 0
        self.saved_blocks += upto - have
        return upto - have

    async def load(
        self,
        hashes: Sequence[int],
        token_ids: Sequence[int],
        salt: str | None,
        adapter: AdapterKey | None = None,
    ) -> int:
        """Import into the engine's cache the blocks of the chain `hashes` (the prompt
        `token_ids`, of LoRA `adapter`'s request) beyond its own hit that the pool holds;
        returns how many."""
        have = self.transfers.cache.chain_match(tuple(hashes), len(hashes))
        if have >= len(hashes) or not await self._attach():
            return 0
        answer = await self._call(
            "load", block_hashes=list(hashes), start=have, end=len(hashes), hold_s=HOLD_S
        )
        if answer is None or answer.get("export_id") is None:
            return 0
        export_id, pages = answer["export_id"], answer["pages"]
        try:
            return self._import(
                hashes, have, pages, token_ids, salt, adapter=adapter, path=answer["path"]
            )
        finally:
            await self._call("release", export_id=export_id)

    def _import(
        self,
        hashes: Sequence[int],
        have: int,
        pool_pages: Sequence[int],
        token_ids: Sequence[int],
        salt: str | None,
        *,
        adapter: AdapterKey | None,
        path: str,
    ) -> int:
        """Import the pool's pinned pages as blocks `have..` (no await: the cache cannot
        change under it)."""
        pool = self._chunks(path)
        upto = have + len(pool_pages)
        if pool is None or self.transfers.cache.chain_match(tuple(hashes), upto) != have:
            return 0  # the pool moved to a new file, or the engine's hit changed meanwhile
        try:
            grant = self.transfers.import_begin(hashes, upto, HOLD_S)
        except TransferError as exc:
            log.info("no room to load %d blocks from the pool: %s", len(pool_pages), exc)
            return 0
        if grant.import_id is None:
            return 0
        _copy(pool, pool_pages[grant.have - have :], self.memory.chunks, grant.pages)
        # The pool's bytes are checked nowhere between its save and this copy (a page written
        # over in the pool, or a source pool's, arrives with a matching transfer checksum):
        # only the blocks holding the content their hash implies are taken, the rest is
        # recomputed.
        intact = intact_prefix(self.memory.chunks, grant.pages, hashes[grant.have : upto])
        if intact < upto - grant.have:
            self.refused_blocks += upto - grant.have - intact
            log.warning(
                "block %d of %d loaded from the pool holds other bytes than its hash implies: "
                "loading %d, recomputing the rest",
                grant.have + intact, upto, intact,
            )  # fmt: skip
            upto = grant.have + intact
            if intact == 0:
                self.transfers.import_abort(grant.import_id)
                return 0
        bs = self.memory.layout.block_size
        try:
            committed = self.transfers.import_commit(
                grant.import_id,
                token_ids[grant.have * bs : upto * bs],
                salt if grant.have == 0 else None,
                adapter,
            )
        except TransferError as exc:  # aborted: the pool's blocks are not this prompt's
            log.warning("blocks loaded from the pool were refused: %s", exc)
            return 0
        self.loaded_blocks += committed.blocks
        return committed.blocks

    # ---- the socket ----------------------------------------------------------------------

    async def keep_attaching(self) -> None:
        """Attach now, or every `ATTACH_RETRY_S` until the pool answers: the node's
        Messenger is ready only once its engines attached."""
        while not await self._attach():
            await asyncio.sleep(ATTACH_RETRY_S)
        log.info("attached to the KV pool at %s", self.path)

    async def _attach(self) -> bool:
        if not self._attached:
            answer = await self._call("attach", format=self.format)
            self._attached = answer is not None and self._chunks(answer["path"]) is not None
        return self._attached

    def _chunks(self, path: str) -> Bytes | None:
        """The pool's memory file `path` mapped; None when it cannot be (logged)."""
        mapped = self._maps.get(path)
        if mapped is None:
            layout = self.memory.layout
            try:
                buffer = map_pool_file(path)
            except (OSError, ValueError) as exc:
                log.warning("cannot map the KV pool's memory %s: %s", path, exc)
                return None
            page_bytes = layout.layers * layout.chunk_bytes
            size = len(buffer) // page_bytes * page_bytes
            chunks = np.frombuffer(buffer, dtype=np.uint8)[:size]
            chunks = chunks.reshape(layout.layers, -1, layout.chunk_bytes)
            for old, _ in self._maps.values():  # a restarted Messenger's new file
                with contextlib.suppress(BufferError):
                    old.close()
            self._maps = {path: (buffer, chunks)}
            mapped = self._maps[path]
        return mapped[1]

    async def _call(self, op: str, **arguments: Any) -> dict[str, Any] | None:
        """One call's answer; None when the pool could not be asked or said no (logged
        once until a call succeeds again). A call on a connection kept from earlier calls
        that breaks (the Messenger restarted) is made once more, on a new connection."""
        message = {"op": op, **arguments}
        async with self._lock:
            for last_try in (self._stream is None, True):
                try:
                    async with asyncio.timeout(CALL_TIMEOUT_S):
                        answer = await self._exchange(message)
                    break
                except (OSError, WireError, TimeoutError, asyncio.IncompleteReadError) as exc:
                    self._drop()
                    if last_try:
                        self._miss(f"the KV pool at {self.path}: {exc}")
                        return None
        if answer.get("ok") is not True:
            self._miss(f"the KV pool refused {op}: {answer.get('error')}")
            return None
        self._warned = False
        return answer

    async def _exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._stream is None:
            self._stream = await asyncio.open_unix_connection(self.path)
            if message["op"] != "attach":  # a new connection may reach a new pool
                attached = await self._roundtrip({"op": "attach", "format": self.format})
                if attached.get("ok") is not True:
                    return attached
        return await self._roundtrip(message)

    async def _roundtrip(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self._stream is not None
        reader, writer = self._stream
        writer.write(encode(message))
        await writer.drain()
        header = await reader.readexactly(4)
        return decode(await reader.readexactly(body_length(header)))

    def _miss(self, why: str) -> None:
        self._attached = False  # a restarted Messenger may not know our format
        if not self._warned:
            log.warning("%s (the engine goes on without it)", why)
            self._warned = True

    def _drop(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream[1].close()

    async def close(self) -> None:
        async with self._lock:
            self._drop()
        for buffer, _ in self._maps.values():
            with contextlib.suppress(BufferError):
                buffer.close()
        self._maps.clear()


def _copy(
    source: Bytes, source_pages: Sequence[int], target: Bytes, target_pages: Sequence[int]
) -> int:
    """Copy each block's chunks, every layer, from `source_pages` to `target_pages` (paired
    in order); returns the bytes copied."""
    n = min(len(source_pages), len(target_pages))
    if n == 0:
        return 0
    target[:, list(target_pages[:n]), :] = source[:, list(source_pages[:n]), :]
    return int(n * source.shape[0] * source.shape[2])
