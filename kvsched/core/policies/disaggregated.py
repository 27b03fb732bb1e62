"""Prefill/decode disaggregation: a static split (`static_pd`) and Mooncake's Conductor."""

from __future__ import annotations

import math
from collections.abc import Mapping
from random import Random
from typing import ClassVar

import numpy as np

from kvsched.core import admission
from kvsched.core.cluster import Role
from kvsched.core.cost import (
    fetch_from,
    fetch_plan,
    handoff_plan,
    isolated_floor_s,
    tbt_s,
    ttft_terms,
)
from kvsched.core.decision import Decision, TransferPlan
from kvsched.core.decision_builders import placement, rejection
from kvsched.core.hotness import PrefixHeat
from kvsched.core.pickers import argmin_eligible, least_pending
from kvsched.core.policies.base import ParamValue, Policy
from kvsched.core.replication import hot_prefix_copy
from kvsched.core.request_view import FloatVec, RequestView


def split_roles(n: int, prefill_share: float) -> tuple[Role, ...]:
    """The first ⌈n × share⌉ slots prefill (at least one of each when n ≥ 2), the rest decode."""
    if n == 1:
        return (Role.BOTH,)
    n_prefill = min(max(math.ceil(n * prefill_share), 1), n - 1)
    return (Role.PREFILL,) * n_prefill + (Role.DECODE,) * (n - n_prefill)


class _Disaggregated(Policy):
    defaults: ClassVar[Mapping[str, ParamValue]] = {"prefill_share": 0.5}

    @classmethod
    def roles(cls, n: int, params: Mapping[str, ParamValue] | None = None) -> tuple[Role, ...]:
        share = float((params or {}).get("prefill_share", cls.defaults["prefill_share"]))
        return split_roles(n, share)

    def decode_terms(self, view: RequestView, pool: np.ndarray) -> tuple[int, FloatVec]:
        """Pick the decode instance with the lowest estimated inter-token time that has room
        for the request's KV (the lowest TBT overall when none has room). Returns it with the
        TBT vector."""
        cluster = self.cluster
        load = cluster.load
        need = view.req.prompt_tokens + view.req.output_tokens
        tbt = tbt_s(cluster.cost, load, view)
        room = pool & (load.free_blocks * cluster.block_size >= need)
        candidates = room if room.any() else pool
        slot = argmin_eligible(
            tbt, candidates, load.decode_tokens, load.running, kernels=view.kernels
        )
        return slot, np.where(pool, tbt, np.nan)


class StaticPD(_Disaggregated):
    """Rules: a fixed prefill pool (the first ⌈n × prefill_share⌉ instances) and decode pool.
    Prefill goes to the prefill instance with the fewest pending prefill tokens; decode to the
    decode instance with the lowest estimated TBT that has room for the KV, which is handed
    from prefill to decode after the first token."""

    name = "static_pd"

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        cluster = self.cluster
        slot = least_pending(cluster, view.eligible)
        decode, tbt = self.decode_terms(view, view.decode_pool(cluster))
        terms = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens)
        terms["tbt_s"] = tbt
        return placement(
            view,
            slot,
            "fewest pending prefill tokens; decode by TBT",
            terms,
            decode_slot=decode,
            transfers=(handoff_plan(cluster.cost, view, slot, decode),),
        )


class Mooncake(_Disaggregated):
    """Mooncake's KV-cache-centric scheduling (Algorithm 1 of the paper, seeds 002/004/000).

    - For every prefill instance p: if the best prefix held anywhere (`best`) exceeds p's own
      prefix × `balancing_threshold`, estimate TTFT = queue + transfer of the missing prefix
      from the best holder + prefill of the rest; otherwise queue + prefill on p's own prefix.
      Pick the minimum. When the chosen instance fetches, the fetch is a transfer on the
      critical path (which also replicates the prefix there).
    - A prefix held in an instance's node pool (the DRAM tier, Mooncake's distributed KV
      cache) beyond its GPU memory is loaded from there, layer by layer, overlapped with the
      prefill of the rest (the paper's layer-wise prefill): its estimate adds the part of
      that load the prefill does not hide (`load_wait_s`, `cost.pool_load`), so a pool-only
      prefix ranks between a GPU hit of the same length and recomputing it.
    - Decode instance: the lowest estimated TBT with room for the KV (colocated: the same).
    - Early rejection: when the TTFT or TBT estimate misses its SLO, reject (429) with a
      retry delay. A request whose own isolated prefill already exceeds the TTFT SLO is not
      rejected for it: it could never meet it.
    - Hot-block replication (seed 000): every prefix that a request reuses keeps a frequency
      score hits / sqrt(age). When a prefix was reused at least `min_hits` times, its score
      exceeds `hot_score`, and the predicted benefit,
      score × `horizon_s` future requests × the transfer time each would otherwise need,
      exceeds 1.5 × the replication cost, the prefix is copied to the least-loaded prefill
      instance that lacks it (off the critical path).
    """

    name = "mooncake"
    defaults: ClassVar[Mapping[str, ParamValue]] = {
        "prefill_share": 0.5,
        "colocated": False,
        "balancing_threshold": 1.5,
        "hot_score": 1.0,
        "min_hits": 3,
        "horizon_s": 60.0,
    }

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._heat = PrefixHeat()

    @classmethod
    def roles(cls, n: int, params: Mapping[str, ParamValue] | None = None) -> tuple[Role, ...]:
        if bool((params or {}).get("colocated", False)):
            return (Role.BOTH,) * n
        return super().roles(n, params)

    def decide(self, view: RequestView, now: float, rng: Random) -> Decision:
        cluster = self.cluster
        best = view.best_slot
        best_tokens = float(view.hit_tokens[best]) if best >= 0 else 0.0
        fetch = view.eligible & (best_tokens > view.hit_tokens * self.param("balancing_threshold"))
        if best >= 0:
            fetch[best] = False
            prefix = fetch_from(cluster.cost, best, view.hit_tokens, fetch)
            cached, transfer = prefix.cached, prefix.transfer_s
        else:  # nothing held anywhere: nothing to fetch
            cached, transfer = view.hit_tokens.copy(), np.zeros(cluster.n)
        terms = ttft_terms(cluster.cost, cluster.load, view, cached, transfer)
        slot = argmin_eligible(
            terms["ttft_s"], view.eligible, cluster.load.in_flight, kernels=view.kernels
        )
        if self.param("colocated"):
            decode = slot
            tbt = np.where(view.eligible, tbt_s(cluster.cost, cluster.load, view), np.nan)
        else:
            decode, tbt = self.decode_terms(view, view.decode_pool(cluster))
        terms["tbt_s"] = tbt
        refusal = admission.check(
            float(terms["ttft_s"][slot]),
            isolated_floor_s(view, terms),
            cluster.config.slo,
            tbt_s=float(tbt[decode]),
            min_retry_s=1.0,
            waited_s=view.req.waited_s,
        )
        if refusal is not None:
            return rejection(view, refusal.rule, refusal.retry_after_s, terms)
        transfers: list[TransferPlan] = []
        fetched = 0
        if fetch[slot]:
            plan = fetch_plan(cluster.cost, view, best, slot)
            if plan is not None:
                fetched = plan.tokens
                transfers.append(plan)
        if not self.param("colocated") and decode != slot:
            transfers.append(handoff_plan(cluster.cost, view, slot, decode))
        if best >= 0:
            replica = hot_prefix_copy(
                cluster,
                view,
                self._heat,
                holder=best,
                chosen=slot,
                now=now,
                min_hits=self.param("min_hits"),
                hot_score=self.param("hot_score"),
                # Seed 000: requests expected in the horizon × the transfer each would need.
                benefit_s=lambda plan, score: score * self.param("horizon_s") * plan.est_seconds,
            )
            if replica is not None:
                transfers.append(replica)
        rule = "min estimated TTFT" + (" (fetching best prefix)" if fetched else "")
        return placement(
            view,
            slot,
            rule,
            terms,
            decode_slot=decode,
            cached_tokens=view.hit_tokens[slot],
            fetched_tokens=fetched,
            transfers=tuple(transfers),
        )
