"""The connector in a vLLM worker: copies between vLLM's paged KV cache and the node's pool.

The pool is a shared-memory file the worker maps (`attach` tells it which); a block in the
pool is, layer by layer, the bytes of that block in vLLM's KV tensor of that layer (a block
whose KV sits in one piece per layer, K and V packed as the attention backend packs them, or
K then V where the backend keeps them apart). The block format names the platform, dtype,
per-block shape and that split; the pool refuses an engine of another format, and so does a
transfer between pools.

- Loads run in a thread, layer by layer in model order, started before the forward pass;
  each layer's attention waits only for its own layer (`wait_for_layer_load`), so the copy
  of the later layers overlaps the compute of the earlier ones. A load's export is released
  once copied; if the pool says it had already ended (its hold time passed, so its pages may
  have been reused) its blocks are reported as load errors and vLLM recomputes them.
- Saves copy each layer right after its attention ran (`save_kv_layer`), and commit at the
  end of the step (`wait_for_save`), when every layer is in the pool.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.model_executor.models.utils import extract_layer_index

from services.vllm_connector.metadata import LoadJob, SaveJob, StepJobs
from services.vllm_connector.pool_client import PoolClient, PoolRefusal, PoolUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LayerBytes:
    """One layer's KV as bytes per block: each part is (blocks, part bytes), a block's chunk
    being its parts one after the other."""

    parts: tuple[torch.Tensor, ...]

    @property
    def chunk_bytes(self) -> int:
        return sum(p.shape[1] for p in self.parts)


def layer_bytes(tensor: torch.Tensor, num_blocks: int) -> tuple[LayerBytes, str]:
    """`tensor` (one layer's KV cache) as blocks of bytes, and how its block is laid out.
    Raises `ValueError` for a layout whose blocks are not each one or two pieces."""
    if tensor.shape[0] == num_blocks:
        parts, split = [tensor], "packed"
    elif tensor.ndim > 2 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks:
        parts, split = [tensor[0], tensor[1]], "k,v"
    else:
        raise ValueError(f"a KV cache of shape {tuple(tensor.shape)} has no block dimension")
    views = []
    for part in parts:
        if not part[0].is_contiguous() or part.stride(0) != part[0].numel():
            raise ValueError(f"a KV block of shape {tuple(part.shape)} is not one piece")
        views.append(part.view(torch.uint8).view(num_blocks, -1))
    shape = "x".join(str(d) for d in parts[0].shape[1:])
    return LayerBytes(tuple(views)), f"{split}/{str(tensor.dtype).removeprefix('torch.')}/{shape}"


class WorkerSide:
    """State of one worker's connector."""

    def __init__(self, client: PoolClient, block_size: int, platform: str) -> None:
        self.client = client
        self.block_size = block_size
        self.platform = platform
        self.layers: list[LayerBytes] = []
        self.index: dict[str, int] = {}  # layer name -> model order
        self._pool: torch.Tensor | None = None  # (layers, pages, chunk bytes)
        self._map: mmap.mmap | None = None
        self._jobs = StepJobs()
        self._loaded: list[threading.Event] = []
        self._load_thread: threading.Thread | None = None
        self._saved_layers: set[int] = set()
        self._load_errors: set[int] = set()

    # ---- set-up --------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Take vLLM's per-layer KV tensors and attach to the pool with their format; a pool
        that cannot be had leaves the connector idle (logged)."""
        names = sorted(kv_caches, key=extract_layer_index)
        kinds = set()
        for name in names:
            layer, kind = layer_bytes(kv_caches[name], num_blocks)
            self.layers.append(layer)
            kinds.add((kind, layer.chunk_bytes))
        if len(kinds) != 1:
            raise ValueError(f"layers of different KV formats are not supported: {kinds}")
        ((kind, chunk_bytes),) = kinds
        self.index = {name: i for i, name in enumerate(names)}
        fmt = {
            "kind": f"vllm/{self.platform}/{kind}",
            "layers": len(names),
            "chunk_bytes": chunk_bytes,
            "block_size": self.block_size,
        }
        try:
            answer = self.client.call("attach", format=fmt)
        except (PoolRefusal, PoolUnavailable) as exc:
            log.error("no KV pool: blocks will be neither loaded nor saved (%s)", exc)
            return
        self._map_pool(answer["path"], answer["pages"], len(names), chunk_bytes)
        log.info("attached to the KV pool (%d pages of %s)", answer["pages"], fmt)

    def _map_pool(self, path: str, pages: int, layers: int, chunk_bytes: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, layers * pages * chunk_bytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        flat = torch.frombuffer(self._map, dtype=torch.uint8)
        self._pool = flat.view(layers, pages, chunk_bytes)

    @property
    def attached(self) -> bool:
        return self._pool is not None

    # ---- a step --------------------------------------------------------------------------

    def begin_step(self, jobs: StepJobs) -> None:
        """Start the step's loads (a thread, layer by layer)."""
        self._jobs = jobs
        self._saved_layers = set()
        self._loaded = []
        if not jobs.loads:
            return
        if self._pool is None:  # scheduled by a scheduler that reached the pool: recompute
            for job in jobs.loads:
                self._load_errors.update(job.block_ids)
                self._release(job)
            return
        self._loaded = [threading.Event() for _ in self.layers]
        self._load_thread = threading.Thread(
            target=self._load, args=(jobs.loads,), name="kvsched-load", daemon=True
        )
        self._load_thread.start()

    def wait_layer(self, name: str) -> None:
        """Block until layer `name`'s loads are in vLLM's cache."""
        if self._loaded:
            i = self.index.get(name)
            if i is not None:
                self._loaded[i].wait()

    def save_layer(self, name: str) -> None:
        """Copy layer `name` of the step's saves into the pool."""
        i = self.index.get(name)
        if i is not None and self._jobs.saves and i not in self._saved_layers:
            self._saved_layers.add(i)
            self._copy_saves(i, self._jobs.saves)

    def end_step(self) -> None:
        """Finish the loads, copy the layers not saved yet and commit every save."""
        if self._load_thread is not None:
            self._load_thread.join()
            self._load_thread = None
        self._loaded = []
        saves, self._jobs = self._jobs.saves, StepJobs()
        if not saves or self._pool is None:
            return
        for i in range(len(self.layers)):
            if i not in self._saved_layers:
                self._copy_saves(i, saves)
        for job in saves:
            self._commit(job)

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- copies --------------------------------------------------------------------------

    def _load(self, jobs: Sequence[LoadJob]) -> None:
        pool = self._pool
        assert pool is not None
        try:
            plans = [(torch.tensor(j.pages), torch.tensor(j.block_ids)) for j in jobs]
            for i, layer in enumerate(self.layers):
                for pages, ids in plans:
                    src = pool[i].index_select(0, pages)
                    at = 0
                    for part in layer.parts:
                        width = part.shape[1]
                        part.index_copy_(0, ids, src[:, at : at + width])
                        at += width
                self._loaded[i].set()
        except Exception:
            log.exception("loading from the KV pool failed: the blocks will be recomputed")
            self._load_errors.update(b for job in jobs for b in job.block_ids)
        finally:
            for event in self._loaded:
                event.set()
            for job in jobs:
                self._release(job)

    def _release(self, job: LoadJob) -> None:
        """End a load's export; one that had ended already may have lost its pages."""
        try:
            released = self.client.call("release", export_id=job.export_id)["released"]
        except (PoolRefusal, PoolUnavailable) as exc:
            log.warning("could not release a KV pool export: %s", exc)
            return  # it ends at its hold time; the copy was made while it was pinned
        if not released:
            log.error("a KV pool export ended before its blocks were copied: recomputing")
            self._load_errors.update(job.block_ids)

    def _copy_saves(self, i: int, saves: Sequence[SaveJob]) -> None:
        pool = self._pool
        assert pool is not None
        layer, dst = self.layers[i], pool[i]
        for job in saves:
            pages, ids = torch.tensor(job.pages), torch.tensor(job.block_ids)
            at = 0
            for part in layer.parts:
                width = part.shape[1]
                dst[:, at : at + width].index_copy_(0, pages, part.index_select(0, ids))
                at += width

    def _commit(self, job: SaveJob) -> None:
        try:
            self.client.call(
                "commit",
                import_id=job.import_id,
                token_ids=list(job.token_ids),
                cache_salt=job.cache_salt,
            )
        except (PoolRefusal, PoolUnavailable) as exc:
            log.warning("the KV pool did not take %d blocks: %s", len(job.block_ids), exc)
