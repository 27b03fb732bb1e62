"""What every policy scores a request on: its hits over instance slots, computed once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvsched.core.cluster import ClusterState, Role
from kvsched.core.decision import RequestInfo
from kvsched.core.index import Tier
from kvsched.core.scoring import Kernels

FloatVec = npt.NDArray[np.float64]
BoolVec = npt.NDArray[np.bool_]


@dataclass(slots=True)
class RequestView:
    """Per-request vectors over instance slots, computed once and shared by the scoring code."""

    req: RequestInfo
    eligible: BoolVec  # live instances of the role this request needs
    hit_blocks: FloatVec  # leading prompt blocks held (GPU or its node pool; speculative too)
    hit_tokens: FloatVec  # the same in tokens, capped so one prompt token is always computed
    max_blocks: int  # most blocks any placement can reuse (prompt − 1 tokens, whole blocks)
    kernels: Kernels | None  # the cluster's scoring kernels (`CostModel.kernels`)
    # Of `hit_tokens`, those beyond the GPU hit that only the node's pool holds: loaded over
    # the host link before they are used (`cost.pool_load`). None when no slot has any.
    pool_tokens: FloatVec | None = None
    # Seconds loading the request's LoRA adapter adds on each slot (0 where it is held), and
    # the slots that can hold it now. None for a request without one.
    adapter_s: FloatVec | None = None
    adapter_able: BoolVec | None = None

    def decode_pool(self, cluster: ClusterState) -> BoolVec:
        """The live decode instances that can take this request: of its model, and able to
        hold its adapter (a decode runs with the adapter its prefill ran with)."""
        pool = cluster.slots_with(Role.DECODE, model=self.req.model)
        return pool if self.adapter_able is None else pool & self.adapter_able

    @property
    def best_slot(self) -> int:
        """Slot with the longest hit among eligible ones (lowest slot on ties), -1 if none."""
        kernels = self.kernels
        if kernels is not None:
            best_ = kernels.best_slot(self.hit_blocks, self.eligible)
            if best_ is not NotImplemented:
                return best_
        hits = np.where(self.eligible, self.hit_blocks, -1.0)
        best = int(np.argmax(hits))
        return best if hits[best] > 0 else -1


def request_view(cluster: ClusterState, req: RequestInfo, now: float) -> RequestView:
    """The request's hits on every instance; the candidates are the live instances that take
    prompt work and serve the request's model (another model's instances hold no hit) and,
    for a LoRA adapter's request, hold the adapter or can load it now (`AdapterSlots.costs`;
    the load's seconds are `adapter_s`: its weights over the host link). A hit
    is the longer of what an instance holds in its own memory (GPU tier, speculative
    placements included) and in its node's KV pool (CPU tier); the blocks the pool adds
    beyond the GPU hit are the pool-only ones, which the engine loads over the host link
    before its prefill uses them (`cost.pool_load` prices that; policies that count only hits
    read `hit_blocks` and `hit_tokens` alone). Changes nothing."""
    bs = cluster.block_size
    serving = cluster.serving(req.model)
    eligible = cluster.slots_with(Role.BOTH, Role.PREFILL, model=req.model)
    cap = max(req.prompt_tokens - 1, 0)
    max_blocks = cap // bs
    index = cluster.index
    pooled = index.match(req.block_hashes, Tier.CPU, max_blocks)
    in_gpu = index.match(req.block_hashes, Tier.GPU, max_blocks)
    kernels = cluster.cost.kernels
    if kernels is not None:
        blocks, tokens, pool = kernels.hit_vectors(cluster.n, (pooled, in_gpu), bs, cap)
    else:
        blocks, tokens, pool = hit_vectors(cluster.n, (pooled, in_gpu), bs, cap)
    if serving is not None:
        # What another model's instances hold is no hit: a policy must not copy KV from them.
        blocks, tokens = np.where(serving, blocks, 0.0), np.where(serving, tokens, 0.0)
        pool = None if pool is None else np.where(serving, pool, 0.0)
    adapter_s = able = None
    if req.adapter:
        load_s = cluster.cost.pool_link.seconds(req.adapter_bytes)
        able, adapter_s = cluster.adapters.costs(req.adapter, load_s, now)
        eligible &= able
    # No pool-only tokens (every trace without a node pool): None, which keeps those
    # decisions' floats exactly what they were before the tier was priced.
    return RequestView(req, eligible, blocks, tokens, max_blocks, kernels, pool, adapter_s, able)


def tier_terms(cluster: ClusterState, view: RequestView) -> dict[str, FloatVec]:
    """Each slot's hit by tier, as terms an explanation shows beside the policy's own:
    `hit_tokens` (either tier), `gpu_hit_tokens` (in the instance's own memory),
    `pool_hit_tokens` (in its node's KV pool, whatever the GPU holds too) and `pool_tokens`
    (of the hit, those only the pool holds: loaded before they are used). An operator sees
    from them which tier a holder has a prefix in, and a block's move between tiers. Reads
    the index again (explanations only, never the placement path). Pure."""
    hits = view.hit_tokens
    pool = np.zeros(len(hits)) if view.pool_tokens is None else view.pool_tokens
    pooled = cluster.index.match(view.req.block_hashes, Tier.CPU, view.max_blocks)
    pool_hits = np.zeros(len(hits))
    for slot, blocks in pooled.items():
        pool_hits[slot] = blocks * cluster.block_size
    pool_hits = np.minimum(pool_hits, max(view.req.prompt_tokens - 1, 0))
    serving = cluster.serving(view.req.model)
    if serving is not None:
        pool_hits = np.where(serving, pool_hits, 0.0)
    return {
        "hit_tokens": hits,
        "gpu_hit_tokens": hits - pool,
        "pool_hit_tokens": pool_hits,
        "pool_tokens": pool,
    }


def hit_vectors(
    n: int, matches: tuple[dict[int, int], ...], block_size: int, cap_tokens: int
) -> tuple[FloatVec, FloatVec, FloatVec | None]:
    """(blocks, tokens, pool_tokens) over `n` slots: the most leading blocks any of `matches`
    ({slot: blocks}) gives each slot, those in tokens capped at `cap_tokens`, and the tokens
    of them beyond the last match's (the GPU tier's, capped alike), None when no slot has any.
    The reference of the compiled `hit_vectors`. Pure."""
    blocks = np.zeros(n)
    last = np.zeros(n)
    for match in matches:
        last = np.zeros(n)
        if match:  # a shared prefix has every instance in it: no Python loop over them
            slots = np.fromiter(match.keys(), dtype=np.intp, count=len(match))
            matched = np.fromiter(match.values(), dtype=np.float64, count=len(match))
            last[slots] = matched
            blocks[slots] = np.maximum(blocks[slots], matched)  # slots are distinct
    tokens = np.minimum(blocks * block_size, cap_tokens)
    pool = tokens - np.minimum(last * block_size, cap_tokens)
    return blocks, tokens, pool if pool.any() else None
