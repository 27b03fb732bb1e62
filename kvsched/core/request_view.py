"""What every policy scores a request on: its hits over instance slots, computed once."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvsched.core import scoring
from kvsched.core.cluster import ClusterState, Role
from kvsched.core.decision import RequestInfo
from kvsched.core.index import Tier

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

    @property
    def best_slot(self) -> int:
        """Slot with the longest hit among eligible ones (lowest slot on ties), -1 if none."""
        kernels = scoring.active
        if kernels is not None:
            best_ = kernels.best_slot(self.hit_blocks, self.eligible)
            if best_ is not NotImplemented:
                return best_
        hits = np.where(self.eligible, self.hit_blocks, -1.0)
        best = int(np.argmax(hits))
        return best if hits[best] > 0 else -1


def request_view(cluster: ClusterState, req: RequestInfo) -> RequestView:
    """The request's hits on every instance; the candidates are the live instances that take
    prompt work. A hit is the longer of what an instance holds in its own memory (GPU tier)
    and in its node's KV pool (CPU tier), which the engine loads before its prefill; the
    load's time is not modelled yet (a memcpy, against a recompute). Changes nothing."""
    bs = cluster.block_size
    eligible = cluster.slots_with(Role.BOTH, Role.PREFILL)
    cap = max(req.prompt_tokens - 1, 0)
    max_blocks = cap // bs
    index = cluster.index
    kernels = scoring.active
    if kernels is not None:
        matches = (
            index.match(req.block_hashes, Tier.CPU, max_blocks),
            index.match(req.block_hashes, Tier.GPU, max_blocks),
        )
        blocks, tokens = kernels.hit_vectors(cluster.n, matches, bs, cap)
        return RequestView(req, eligible, blocks, tokens, max_blocks)
    blocks = np.zeros(cluster.n)
    for tier in (Tier.CPU, Tier.GPU):
        hits = index.match(req.block_hashes, tier, max_blocks)
        if hits:  # a shared prefix has every instance in it: no Python loop over them
            slots = np.fromiter(hits.keys(), dtype=np.intp, count=len(hits))
            matched = np.fromiter(hits.values(), dtype=np.float64, count=len(hits))
            blocks[slots] = np.maximum(blocks[slots], matched)  # slots are distinct
    tokens = np.minimum(blocks * bs, cap)
    return RequestView(req, eligible, blocks, tokens, max_blocks)
