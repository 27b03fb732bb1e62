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
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.model_executor.models.utils import extract_layer_index

from services.vllm_connector.metadata import LoadJob, SaveJob, StepJobs
from services.vllm_connector.pool_client import PoolClient, PoolRefusal, PoolUnavailable

log = logging.getLogger(__name__)
ATTACH_RETRY_S = 1.0


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
        self.format: dict[str, object] = {}
        self.chunk_bytes = 0
        self.attached = False  # the pool took our format (once is enough: it remembers)
        self._pool: tuple[str, torch.Tensor] | None = None  # its file, (layers, pages, chunk)
        self._jobs = StepJobs()
        self._loaded: list[threading.Event] = []
        self._load_thread: threading.Thread | None = None
        self._saved_layers: set[int] = set()
        self._failed_saves: set[str] = set()  # import ids of the step's saves gone wrong
        self._load_errors: set[int] = set()

    # ---- set-up --------------------------------------------------------------------------

    def register(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        """Take vLLM's per-layer KV tensors and tell the pool their format."""
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
        self.chunk_bytes = chunk_bytes
        self.format = {
            "kind": f"vllm/{self.platform}/{kind}",
            "layers": len(names),
            "chunk_bytes": chunk_bytes,
            "block_size": self.block_size,
        }
        self._attach()

    def _attach(self) -> None:
        """Tell the pool our format, now or, while its Messenger is not up yet (vLLM may
        start first), from a thread trying every `ATTACH_RETRY_S`."""
        if self._try_attach():
            return
        thread = threading.Thread(target=self._keep_attaching, name="kvsched-attach", daemon=True)
        thread.start()

    def _keep_attaching(self) -> None:
        while True:
            time.sleep(ATTACH_RETRY_S)
            if self._try_attach():
                return

    def _try_attach(self) -> bool:
        """True once the pool took our format, or refused it for good."""
        try:
            answer = self.client.call("attach", format=self.format)
        except PoolRefusal as exc:
            log.error("the KV pool refuses this engine: nothing is loaded or saved (%s)", exc)
            return True
        except PoolUnavailable as exc:
            log.warning("no KV pool yet (%s); trying again", exc)
            return False
        self.attached = True
        log.info("attached to the KV pool (%d pages of %s)", answer["pages"], self.format)
        return True

    def _memory(self, path: str) -> torch.Tensor | None:
        """The pool memory file `path` mapped (a new file replaces the old mapping); None
        when it cannot be mapped."""
        if self._pool is not None and self._pool[0] == path:
            return self._pool[1]
        layers, chunk = len(self.layers), self.chunk_bytes
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                mapped = mmap.mmap(fd, size, mmap.MAP_SHARED)
            finally:
                os.close(fd)
        except OSError as exc:
            log.error("cannot map the KV pool's memory %s: %s", path, exc)
            return None
        pages = size // (layers * chunk)
        memory = torch.frombuffer(mapped, dtype=torch.uint8)[: layers * pages * chunk]
        self._pool = (path, memory.view(layers, pages, chunk))
        log.info("mapped the KV pool's memory %s (%d pages)", path, pages)
        return self._pool[1]

    # ---- a step --------------------------------------------------------------------------

    def begin_step(self, jobs: StepJobs) -> None:
        """Start the step's loads (a thread, layer by layer)."""
        self._jobs = jobs
        self._saved_layers = set()
        self._loaded = []
        if not jobs.loads:
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
        for i in range(len(self.layers)):
            if i not in self._saved_layers:
                self._copy_saves(i, saves)
        for job in saves:
            self._end_save(job)
        self._failed_saves.clear()

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- copies --------------------------------------------------------------------------

    def _load(self, jobs: Sequence[LoadJob]) -> None:
        try:
            plans = []
            for job in jobs:
                pool = self._memory(job.pool)
                if pool is None:
                    self._load_errors.update(job.block_ids)
                    continue
                plans.append((pool, torch.tensor(job.pages), torch.tensor(job.block_ids)))
            for i, layer in enumerate(self.layers):
                for pool, pages, ids in plans:
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
        layer = self.layers[i]
        for job in saves:
            pool = None if job.import_id in self._failed_saves else self._memory(job.pool)
            if pool is None:
                self._failed_saves.add(job.import_id)
                continue
            dst = pool[i]
            pages, ids = torch.tensor(job.pages), torch.tensor(job.block_ids)
            at = 0
            try:
                for part in layer.parts:
                    width = part.shape[1]
                    dst[:, at : at + width].index_copy_(0, pages, part.index_select(0, ids))
                    at += width
            except (RuntimeError, IndexError):
                log.exception("saving to the KV pool failed")
                self._failed_saves.add(job.import_id)

    def _end_save(self, job: SaveJob) -> None:
        """Commit a save whose every layer was copied; abort one that was not (its staged
        pages were never all written: they must not become blocks)."""
        try:
            if job.import_id in self._failed_saves:
                self.client.call("abort", import_id=job.import_id)
                return
            self.client.call(
                "commit",
                import_id=job.import_id,
                token_ids=list(job.token_ids),
                cache_salt=job.cache_salt,
            )
        except (PoolRefusal, PoolUnavailable) as exc:
            log.warning("the KV pool did not take %d blocks: %s", len(job.block_ids), exc)
