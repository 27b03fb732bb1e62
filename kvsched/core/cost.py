"""What placements cost, on the cluster's cost model (`cost_model.CostModel`): the TTFT terms
a placement is scored by, what fetching a prefix from its holder saves, and the transfer
orders it prices. All pure: nothing here changes cluster state."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import numpy.typing as npt

from kvsched.core.cost_model import CostModel
from kvsched.core.decision import RequestId, TransferKind, TransferPlan
from kvsched.core.latency import context_read
from kvsched.core.pickers import masked_min

if TYPE_CHECKING:
    from kvsched.core.load import LoadTracker
    from kvsched.core.request_view import RequestView
    from kvsched.core.sessions import Session

FloatVec = npt.NDArray[np.float64]
BoolVec = npt.NDArray[np.bool_]


# ---- TTFT terms ------------------------------------------------------------------------------


def ttft_terms(
    cost: CostModel,
    load: LoadTracker,
    view: RequestView,
    cached: FloatVec,
    transfer_s: FloatVec | None = None,
) -> dict[str, FloatVec]:
    """Estimated TTFT per slot, term by term: queue + prefill of the uncached tokens (with the
    decode passes it shares) + KV transfer on the critical path (`transfer_s`, none when
    omitted) + the part of the load from the node's pool that the prefill does not hide
    (`pool_load`: the slot's pool-only tokens, `view.pool_tokens`; none without any) + the
    load of the request's LoRA adapter where it is not held (`adapter_load_s`). Computed
    for every slot; the view's `eligible` mask says which were candidates. The numpy below is
    the reference; the compiled kernels compute the same floats."""
    queue = load.pending_prefill_s
    kernels = cost.kernels
    out = (
        NotImplemented
        if kernels is None
        else kernels.ttft(
            float(view.req.prompt_tokens),
            cached,
            load.running,
            load.decode_tokens,
            queue,
            transfer_s,
            cost.kernel_constants,
        )
    )
    if out is not NotImplemented:
        prefill, transfer, ttft = out
    else:
        n_new = float(view.req.prompt_tokens) - cached
        lat = cost.latency
        # Every pass also carries the instance's running decodes.
        per_pass = (
            lat.step_s + lat.decode_seq_s * load.running + lat.decode_ctx_s * load.decode_tokens
        )
        passes = cost.passes(n_new)
        prefill = (
            passes * per_pass
            + n_new * (lat.prefill_token_s + lat.attn_pair_s * (cached + n_new * 0.5))
            + lat.prefill_ctx_s * context_read(passes, cached, cost.chunk_tokens)
        )
        transfer = np.zeros(len(queue)) if transfer_s is None else transfer_s
        ttft = queue + prefill + transfer
    pool = view.pool_tokens
    if pool is None:  # nothing to load anywhere: the terms (and floats) of a GPU-only index
        pool = load_s = wait_s = cost.no_load
    else:
        load_s, wait_s = pool_load(cost, pool, prefill)
        ttft = ttft + wait_s
    if view.adapter_s is not None:  # the request's adapter is loaded before its prefill
        ttft = ttft + view.adapter_s
    terms = {
        "hit_tokens": view.hit_tokens,
        "cached_tokens": cached,
        "queue_s": queue,
        "prefill_s": prefill,
        "transfer_s": transfer,
        "pool_tokens": pool,
        "load_s": load_s,
        "load_wait_s": wait_s,
        "ttft_s": ttft,
    }
    if view.adapter_s is not None:
        terms["adapter_load_s"] = view.adapter_s
    return terms


def pool_load(
    cost: CostModel, pool_tokens: FloatVec, prefill_s: FloatVec
) -> tuple[FloatVec, FloatVec]:
    """(load_s, load_wait_s) per slot: the time to load its `pool_tokens` from the node's pool
    over the host link (`CostModel.pool_link`: setup + bytes / bandwidth; 0 with nothing to
    load), and how much of it the prefill of the rest (`prefill_s`) does not hide.

    The load runs layer by layer ahead of the prefill, which computes layer l once layer l's
    KV is in (Mooncake's layer-wise prefill; vLLM's connector waits per layer the same way):
    over L layers of equal shares the two finish after max(load, prefill) + min(load,
    prefill) / L, so the TTFT grows by max(load − prefill, 0) + min(load, prefill) / L over
    the prefill alone. A pool-only prefix thus costs more than the same prefix in GPU memory
    and, while its load is faster than recomputing it, less than a cold start. Pure."""
    kernels = cost.kernels
    if kernels is not None:
        out = kernels.pool_load(pool_tokens, prefill_s, cost.pool_constants)
        if out is not NotImplemented:
            return out
    setup, per_byte, kv, layers = cost.pool_constants
    loading = pool_tokens > 0
    load = np.where(loading, setup + (pool_tokens * kv) * per_byte, 0.0)
    hidden = np.minimum(load, prefill_s) / layers
    wait = np.where(loading, np.clip(load - prefill_s, 0.0, None) + hidden, 0.0)
    return load, wait


def moving_terms(
    cost: CostModel, load: LoadTracker, view: RequestView, host: int
) -> dict[str, FloatVec]:
    """Estimated TTFT on every slot if the host's part of the prompt moved there first, on the
    critical path (a session's migration on its turn)."""
    hits = view.hit_tokens
    kernels = cost.kernels
    if kernels is not None:
        out = kernels.moving(host, hits, cost.setup_s, cost.s_per_byte, cost.kernel_constants[6])
        if out is not NotImplemented:
            return ttft_terms(cost, load, view, *out)
    moved = np.clip(hits[host] - hits, 0.0, None)
    return ttft_terms(
        cost, load, view, np.maximum(hits, hits[host]), cost.transfer_from(host, moved)
    )


def next_turn_ttft_s(
    cost: CostModel,
    load: LoadTracker,
    session: Session,
    held: FloatVec,
    *,
    host: int,
    gap_s: float,
) -> FloatVec:
    """Estimated TTFT of `session`'s next turn on every slot if it arrives `gap_s` from now and
    the host's context (`held[host]` tokens) moved there meanwhile: the queue left by then,
    the transfer the gap does not hide, and the prefill of its new tokens on the context it
    would find there."""
    growth = max(session.growth_tokens, float(cost.block_size))
    prompt = session.prompt_tokens + growth
    moved = np.clip(held[host] - held, 0.0, None)
    cached = np.maximum(held, held[host])
    transfer = cost.transfer_from(host, moved)
    queue = np.maximum(load.pending_prefill_s - gap_s, 0.0)
    est: FloatVec = queue + cost.prefill_s(prompt - cached, cached)
    est += np.maximum(transfer - gap_s, 0.0)
    est[host] = queue[host] + cost.prefill_one(int(prompt - held[host]), int(held[host]))
    return est


def tbt_s(cost: CostModel, load: LoadTracker, view: RequestView) -> FloatVec:
    """Estimated inter-token time on every slot once this request joins its decodes."""
    lat = cost.latency
    return (
        lat.step_s
        + lat.decode_seq_s * (load.running + 1)
        + lat.decode_ctx_s * (load.decode_tokens + view.req.prompt_tokens)
    )


def isolated_floor_s(view: RequestView, terms: dict[str, FloatVec]) -> float:
    """The best TTFT any eligible instance could give with an empty queue."""
    alone = terms["prefill_s"] + terms["transfer_s"]
    if view.pool_tokens is not None:
        alone = alone + terms["load_wait_s"]
    return masked_min(alone, view.eligible, kernels=view.kernels)


# ---- fetching a prefix from its holder -------------------------------------------------------


class PrefixFetch(NamedTuple):
    """Where each slot's prefill would start if the slots in `fetch` first copied the holder's
    longer prefix on the critical path."""

    fetch: BoolVec  # slots that fetch
    cached: FloatVec  # prompt tokens each slot would start its prefill on
    transfer_s: FloatVec  # seconds of copy on the critical path (0 where nothing moves)


def fetch_from(cost: CostModel, holder: int, hits: FloatVec, fetch: BoolVec) -> PrefixFetch:
    """The slots in `fetch` copy `holder`'s prefix (of `hits[holder]` tokens) first."""
    kernels = cost.kernels
    if kernels is not None:
        out = kernels.fetch_from(
            holder, hits, fetch, cost.setup_s, cost.s_per_byte, cost.kernel_constants[6]
        )
        if out is not NotImplemented:
            return PrefixFetch(fetch, *out)
    transfer = np.where(fetch, cost.transfer_from(holder, hits[holder] - hits), 0.0)
    return PrefixFetch(fetch, np.where(fetch, hits[holder], hits), transfer)


def fetch_when_cheaper(
    cost: CostModel, holder: int, prompt_tokens: int, hits: FloatVec, eligible: BoolVec
) -> PrefixFetch:
    """Every eligible slot holding less than `holder` fetches the rest of its prefix where
    copying it takes less time than recomputing it there would add over the holder's own
    prefill."""
    n = float(prompt_tokens)
    own_s = cost.prefill_one(int(n - hits[holder]), int(hits[holder]))
    kernels = cost.kernels
    if kernels is not None:
        out = kernels.fetch_when_cheaper(
            holder, n, hits, eligible, cost.setup_s, cost.s_per_byte, cost.kernel_constants, own_s
        )
        if out is not NotImplemented:
            return PrefixFetch(*out)
    extra = np.clip(hits[holder] - hits, 0.0, None)
    fetch_s = cost.transfer_from(holder, extra)
    saved = cost.prefill_s(n - hits, hits) - own_s
    fetch = eligible & (extra > 0) & (fetch_s < saved)
    return PrefixFetch(fetch, np.where(fetch, hits[holder], hits), np.where(fetch, fetch_s, 0.0))


# ---- transfer orders -------------------------------------------------------------------------


def plan_copy(
    cost: CostModel,
    kind: TransferKind,
    source: int,
    target: int,
    *,
    hashes: tuple[int, ...],
    have: int,
    upto: int,
    on_path: bool,
    session_id: str | None = None,
    request_id: RequestId | None = None,
) -> TransferPlan | None:
    """Order copying blocks `hashes[have:upto]` from `source` to `target`, which already holds
    the first `have`; None when there is nothing to copy. The one place a copy's order is
    assembled and priced (a hand-off, which ships a whole prompt, is `handoff_plan`)."""
    if upto <= have:
        return None
    tokens, est_seconds = copy_price(cost, source, target, have=have, upto=upto)
    return TransferPlan(
        kind=kind,
        source=source,
        target=target,
        block_hashes=hashes[:upto],
        skip_blocks=have,
        tokens=tokens,
        nbytes=tokens * cost.kv_bytes_per_token,
        est_seconds=est_seconds,
        on_critical_path=on_path,
        session_id=session_id,
        request_id=request_id,
    )


def copy_price(
    cost: CostModel, source: int, target: int, *, have: int, upto: int
) -> tuple[int, float]:
    """Tokens and idle-link seconds of copying blocks `have:upto` from `source` to `target`
    (nothing when `upto <= have`): what `plan_copy` prices its order at, for a caller that
    needs the price before it knows whether the order will be given."""
    if upto <= have:
        return 0, 0.0
    tokens = (upto - have) * cost.block_size
    return tokens, cost.transfer_s(source, target, tokens)


def handoff_plan(cost: CostModel, view: RequestView, prefill: int, decode: int) -> TransferPlan:
    """Order shipping the whole prompt's KV from the prefill to the decode instance after
    prefill (disaggregated serving), off the critical path."""
    tokens = view.req.prompt_tokens
    return TransferPlan(
        kind=TransferKind.HANDOFF,
        source=prefill,
        target=decode,
        block_hashes=view.req.block_hashes,
        skip_blocks=0,
        tokens=tokens,
        nbytes=tokens * cost.kv_bytes_per_token,
        est_seconds=cost.transfer_s(prefill, decode, tokens),
        on_critical_path=False,
        session_id=view.req.session_id,
        request_id=view.req.request_id,
    )


def fetch_plan(cost: CostModel, view: RequestView, holder: int, target: int) -> TransferPlan | None:
    """Order copying the prefix `holder` has beyond `target`'s to `target`, on the request's
    critical path (Mooncake's remote-prefix fetch)."""
    return plan_copy(
        cost,
        TransferKind.FETCH_PREFIX,
        holder,
        target,
        hashes=view.req.block_hashes,
        have=int(view.hit_blocks[target]),
        upto=int(min(view.hit_blocks[holder], view.max_blocks)),
        on_path=True,
        session_id=view.req.session_id,
        request_id=view.req.request_id,
    )
