"""The connector in vLLM's scheduler: which of a request's blocks the node's pool can supply
(pinned there until a worker has copied them), and which blocks each step completes that the
pool should keep.

- A new request: the pool is asked for the prompt's blocks after vLLM's own prefix-cache hit
  (`load`), all but the block of the prompt's last token, which vLLM must compute. What it
  holds is pinned and reported as tokens vLLM need not compute; the blocks vLLM allocates
  for them are then filled by the workers before the forward pass (synchronous loading).
- Every step: the blocks of a request that are whole once the step has run (their tokens
  known, their KV computed) and the pool does not hold are staged in the pool (`save`); the
  workers copy them after each layer and commit them at the end of the step.

Asking the pool never fails a request: a pool that is down or refuses is a miss (no load)
or a skipped save. A LoRA adapter's requests are saved with the adapter's name and path, which
the pool hashes their blocks' tokens with to check them, as vLLM names them. Multimodal
requests are left alone (their blocks' names carry extra keys the pool does not check)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvsched.core.vllm_hashing import event_hash
from services.vllm_connector.metadata import LoadJob, SaveJob, StepJobs
from services.vllm_connector.pool_client import PoolClient, PoolRefusal, PoolUnavailable

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)
WARN_EVERY_S = 30.0  # a pool that stays unreachable is logged this often


@dataclass(frozen=True, slots=True)
class _Pinned:
    """Blocks the pool pinned for a request, from block `start` on."""

    pool: str
    export_id: str
    start: int
    pages: tuple[int, ...]


class SchedulerSide:
    """State of the scheduler's connector; `block_ids(request_id)` gives a request's vLLM
    block ids (the first KV cache group's)."""

    def __init__(
        self,
        client: PoolClient,
        block_size: int,
        block_ids: Callable[[str], Sequence[int]],
        *,
        hold_s: float,
    ) -> None:
        self.client = client
        self.block_size = block_size
        self.block_ids = block_ids
        self.hold_s = hold_s
        self._pinned: dict[str, _Pinned] = {}  # asked, not yet allocated
        self._loads: list[LoadJob] = []  # allocated, for the next step
        self._requests: dict[str, Request] = {}  # scheduled and not finished
        self._saved: dict[str, int] = {}  # leading blocks of each request the pool has
        self._warned_at = -WARN_EVERY_S

    def matched_tokens(self, request: Request, computed_tokens: int) -> int:
        """Tokens after `computed_tokens` the pool holds (their blocks pinned)."""
        self._unpin(request.request_id)  # asked again: the earlier pin is void
        if not _eligible(request):
            return 0
        bs = self.block_size
        start = computed_tokens // bs
        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        if end <= start:
            return 0
        hashes = [event_hash(h) for h in request.block_hashes[:end]]
        answer = self._call("load", block_hashes=hashes, start=start, end=end, hold_s=self.hold_s)
        if answer is None or not answer["blocks"]:
            return 0
        pages = tuple(answer["pages"])
        self._pinned[request.request_id] = _Pinned(
            answer["path"], answer["export_id"], start, pages
        )
        return len(pages) * bs

    def allocated(self, request: Request, blocks: KVCacheBlocks, external_tokens: int) -> None:
        """vLLM allocated `blocks` for `request`, `external_tokens` of them to load."""
        rid = request.request_id
        self._requests[rid] = request
        pinned = self._pinned.pop(rid, None)
        if pinned is None:
            return
        n = external_tokens // self.block_size
        if n == 0:
            self._release(pinned.export_id)
            return
        ids = blocks.get_block_ids()[0][pinned.start : pinned.start + n]
        job = LoadJob(rid, pinned.pool, pinned.export_id, pinned.pages[:n], tuple(ids))
        self._loads.append(job)
        self._saved[rid] = pinned.start + n

    def step_jobs(self, out: SchedulerOutput) -> StepJobs:
        """This step's loads, and saves of the blocks it completes."""
        jobs = StepJobs(loads=self._loads)
        self._loads = []
        cached = out.scheduled_cached_reqs
        scheduled = [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs]
        scheduled += zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        for rid, computed in scheduled:
            save = self._save(rid, computed + out.num_scheduled_tokens.get(rid, 0))
            if save is not None:
                jobs.saves.append(save)
        return jobs

    def finished(self, request: Request) -> None:
        rid = request.request_id
        self._unpin(rid)
        self._requests.pop(rid, None)
        self._saved.pop(rid, None)

    def _save(self, rid: str, computed_after: int) -> SaveJob | None:
        request = self._requests.get(rid)
        if request is None or not _eligible(request):
            return None
        bs = self.block_size
        upto = min(computed_after // bs, len(request.block_hashes))
        if upto <= self._saved.get(rid, 0):
            return None
        self._saved[rid] = upto
        hashes = [event_hash(h) for h in request.block_hashes[:upto]]
        answer = self._call("save", block_hashes=hashes, upto=upto, hold_s=self.hold_s)
        if answer is None or not answer["import_id"]:
            return None
        have = answer["have"]
        ids = tuple(self.block_ids(rid)[have:upto])
        tokens = tuple(request.all_token_ids[have * bs : upto * bs])
        salt = request.cache_salt or None
        pages = tuple(answer["pages"])
        lora = request.lora_request
        adapter = None if lora is None else (lora.lora_name, lora.lora_path)
        return SaveJob(rid, answer["path"], answer["import_id"], pages, ids, tokens, salt, adapter)

    def _unpin(self, rid: str) -> None:
        pinned = self._pinned.pop(rid, None)
        if pinned is not None:
            self._release(pinned.export_id)

    def _release(self, export_id: str) -> None:
        self._call("release", export_id=export_id)

    def _call(self, op: str, **arguments: Any) -> dict[str, Any] | None:
        try:
            return self.client.call(op, **arguments)
        except PoolRefusal as exc:
            log.warning("the KV pool refused %s: %s", op, exc)
        except PoolUnavailable as exc:
            now = time.monotonic()
            if now - self._warned_at >= WARN_EVERY_S:
                self._warned_at = now
                log.warning("going on without the KV pool: %s", exc)
        return None


def _eligible(request: Request) -> bool:
    return not request.mm_features
