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
- Saves copy each layer right after its attention ran (`save_kv_layer`), the rest at the end
  of the step (`wait_for_save`), and are committed (the pool checks and names the blocks)
  by a thread of their own, in order, so the step does not wait for the pool's checks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from vllm.model_executor.models.utils import extract_layer_index

from services.dataplane.pool_wire import map_pool_file
from services.vllm_connector.metadata import LoadJob, SaveJob, StepJobs
from services.vllm_connector.pool_client import PoolClient, PoolRefusal, PoolUnavailable

log = logging.getLogger(__name__)
ATTACH_RETRY_S = 1.0
SCATTERED = 4  # blocks a stretch must average for slice-by-slice copies


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


def runs(pages: Sequence[int], blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first page, first block, count) of each stretch where both pool pages and vLLM block
    ids go up one by one: each is one contiguous copy a layer (pages are handed out lowest
    first and a request's blocks are mostly consecutive, so there are few)."""
    out: list[tuple[int, int, int]] = []
    for page, block in zip(pages, blocks, strict=True):
        if out:
            first_page, first_block, n = out[-1]
            if page == first_page + n and block == first_block + n:
                out[-1] = (first_page, first_block, n + 1)
                continue
        out.append((page, block, 1))
    return out


def copy_blocks(
    pool: torch.Tensor,
    pages: Sequence[int],
    parts: Sequence[torch.Tensor],
    blocks: Sequence[int],
    *,
    into_pool: bool,
) -> None:
    """Copy one layer of blocks between the pool's pages `pages` (`pool`: that layer,
    (pages, chunk bytes)) and vLLM's blocks `blocks` (`parts`, each (blocks, part bytes)),
    either way (on a GPU, across the bus). Few long stretches are copied slice by slice,
    straight; scattered blocks by one gather and one scatter a part."""
    pieces = runs(pages, blocks)
    at = 0
    for part in parts:
        width = part.shape[1]
        pool_part = pool[:, at : at + width]
        if len(pieces) * SCATTERED <= len(pages):
            for page, block, n in pieces:
                if into_pool:
                    pool_part[page : page + n].copy_(part[block : block + n])
                else:
                    part[block : block + n].copy_(pool_part[page : page + n])
        else:
            on_pool = torch.tensor(pages)
            on_part = torch.tensor(blocks, device=part.device)
            if into_pool:
                pool_part.index_copy_(0, on_pool, part.index_select(0, on_part).to(pool.device))
            else:
                part.index_copy_(0, on_part, pool_part.index_select(0, on_pool).to(part.device))
        at += width


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
        self._pool: tuple[str, torch.Tensor] | None = None  # its file, (layers, pages, chunk)
        self._jobs = StepJobs()
        self._loaded: list[threading.Event] = []
        self._load_thread: threading.Thread | None = None
        self._saved_layers: set[int] = set()
        self._failed_saves: set[str] = set()  # import ids of the step's saves gone wrong
        self._save_s: dict[str, float] = {}  # import id -> seconds its copies took
        # (save, copy seconds, failed) to commit or abort, in order, off the step.
        self._commits: queue.SimpleQueue[tuple[SaveJob, float, bool]] = queue.SimpleQueue()
        threading.Thread(target=self._commit_saves, name="kvsched-commit", daemon=True).start()
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
        log.info("attached to the KV pool (%d pages of %s)", answer["pages"], self.format)
        return True

    def _memory(self, path: str) -> torch.Tensor | None:
        """The pool memory file `path` mapped (a new file replaces the old mapping); None
        when it cannot be mapped."""
        if self._pool is not None and self._pool[0] == path:
            return self._pool[1]
        layers, chunk = len(self.layers), self.chunk_bytes
        try:
            mapped = map_pool_file(path)
        except (OSError, ValueError) as exc:
            log.error("cannot map the KV pool's memory %s: %s", path, exc)
            return None
        pages = len(mapped) // (layers * chunk)
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
        for job in saves:  # committed off the step: the copies are done, vLLM goes on
            failed = job.import_id in self._failed_saves
            self._commits.put((job, self._save_s.pop(job.import_id, 0.0), failed))
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
                plans.append((pool, job))
            started = time.perf_counter()
            for i, layer in enumerate(self.layers):
                for pool, job in plans:
                    copy_blocks(pool[i], job.pages, layer.parts, job.block_ids, into_pool=False)
                self._loaded[i].set()
            took = time.perf_counter() - started
        except Exception:
            log.exception("loading from the KV pool failed: the blocks will be recomputed")
            self._load_errors.update(b for job in jobs for b in job.block_ids)
            took = 0.0
        finally:
            for event in self._loaded:
                event.set()
        blocks = sum(len(job.pages) for job in jobs) or 1
        for job in jobs:  # the step's copy time shared by the blocks each load moved
            copied = 0 if not took else len(job.pages)
            self._release(job, copied * self.block_bytes, took * len(job.pages) / blocks)

    @property
    def block_bytes(self) -> int:
        """One block's KV over every layer."""
        return len(self.layers) * self.chunk_bytes

    def _release(self, job: LoadJob, copied_bytes: int = 0, copy_s: float = 0.0) -> None:
        """End a load's export (saying how long its copy took); one that had ended already
        may have lost its pages."""
        try:
            released = self.client.call(
                "release", export_id=job.export_id, copied_bytes=copied_bytes, copy_s=copy_s
            )["released"]
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
            started = time.perf_counter()
            try:
                copy_blocks(pool[i], job.pages, layer.parts, job.block_ids, into_pool=True)
            except (RuntimeError, IndexError):
                log.exception("saving to the KV pool failed")
                self._failed_saves.add(job.import_id)
            self._save_s[job.import_id] = (
                self._save_s.get(job.import_id, 0.0) + time.perf_counter() - started
            )

    def _commit_saves(self) -> None:
        """The committer thread: ends each step's saves, in order."""
        while True:
            self._end_save(*self._commits.get())

    def _end_save(self, job: SaveJob, copy_s: float, failed: bool) -> None:
        """Commit a save whose every layer was copied; abort one that was not (its staged
        pages were never all written: they must not become blocks)."""
        try:
            if failed:
                self.client.call("abort", import_id=job.import_id)
                return
            self.client.call(
                "commit",
                import_id=job.import_id,
                token_ids=list(job.token_ids),
                cache_salt=job.cache_salt,
                lora=None if job.adapter is None else list(job.adapter),
                copied_bytes=len(job.pages) * self.block_bytes,
                copy_s=copy_s,
            )
        except (PoolRefusal, PoolUnavailable) as exc:
            log.warning("the KV pool did not take %d blocks: %s", len(job.block_ids), exc)
