"""The policy interface and the bookkeeping every policy shares.

A policy turns a request into a `Decision`. `place` is a template: the subclass's `decide`
picks the instance from the cluster view; `place` then records the placement at once
(speculative index entries, load charge, session binding) so the next request sees it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from random import Random
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from kvsched.core.cluster import ClusterState, Role
from kvsched.core.decision import Completion, Decision, RequestInfo, TransferKind, TransferPlan
from kvsched.core.index import Tier
from kvsched.core.transfers import plan_copy

FloatVec = npt.NDArray[np.float64]
BoolVec = npt.NDArray[np.bool_]
ParamValue = float | int | bool | str


@dataclass(slots=True)
class View:
    """Per-request vectors over instance slots, computed once and shared by the scoring code."""

    req: RequestInfo
    eligible: BoolVec  # live instances of the role this request needs
    hit_blocks: FloatVec  # leading prompt blocks held (GPU or its node pool; speculative too)
    hit_tokens: FloatVec  # the same in tokens, capped so one prompt token is always computed
    max_blocks: int  # most blocks any placement can reuse (prompt − 1 tokens, whole blocks)

    @property
    def best_slot(self) -> int:
        """Slot with the longest hit among eligible ones (lowest slot on ties), -1 if none."""
        hits = np.where(self.eligible, self.hit_blocks, -1.0)
        best = int(np.argmax(hits))
        return best if hits[best] > 0 else -1


class Policy(ABC):
    """Base class of every placement policy. Subclasses set `name`, document their rules in
    the class docstring and implement `decide`."""

    name: ClassVar[str]
    defaults: ClassVar[Mapping[str, ParamValue]] = {}
    # Whether placements follow session bindings (the Conductor then makes a changed binding
    # durable before it answers; for other policies a binding is only bookkeeping).
    affinity: ClassVar[bool] = False

    def __init__(self, cluster: ClusterState, params: Mapping[str, ParamValue] | None = None):
        unknown = set(params or {}) - set(self.defaults)
        if unknown:
            raise ValueError(
                f"policy {self.name!r} has no parameter(s) {sorted(unknown)}; "
                f"known: {sorted(self.defaults)}"
            )
        merged: dict[str, ParamValue] = dict(self.defaults)
        for key, value in (params or {}).items():
            merged[key] = type(self.defaults[key])(value)
        self.params: Mapping[str, ParamValue] = merged
        self.cluster = cluster

    # ---- configuration -------------------------------------------------------------------

    @classmethod
    def roles(cls, n: int, params: Mapping[str, ParamValue] | None = None) -> tuple[Role, ...]:
        """Instance roles this policy wants on an n-instance cluster (all BOTH by default)."""
        return (Role.BOTH,) * n

    def param(self, key: str) -> Any:
        return self.params[key]

    # ---- decisions -----------------------------------------------------------------------

    def place(self, req: RequestInfo, now: float, rng: Random) -> Decision:
        """Decide where `req` goes and record that decision in the cluster state."""
        cluster = self.cluster
        cluster.index.expire(now)
        if req.session_id is not None:
            cluster.sessions.arrive(req.session_id, now)
        decision = self.decide(self.view(req), now, rng)
        if not decision.rejected:
            self.record(req, decision, now)
        return decision

    @abstractmethod
    def decide(self, view: View, now: float, rng: Random) -> Decision:
        """Pick an instance for `view.req`; must not change cluster state (`place` records)."""

    def on_finish(self, done: Completion, now: float, rng: Random) -> Sequence[TransferPlan]:
        """A request ended. Returns transfers to start now (none by default)."""
        if done.session_id is not None:
            self.cluster.sessions.finish(
                done.session_id, done.block_hashes, done.prompt_tokens, done.output_tokens, now
            )
        self.cluster.load.finish(done.instance)
        return ()

    def on_transfer(self, plan: TransferPlan, ok: bool, now: float) -> bool:
        """A transfer this policy ordered ended. A migration rebinds its session if the KV
        landed (an idle-gap one only if no turn ran meanwhile). Returns whether a session
        moved."""
        if plan.kind is not TransferKind.MIGRATE_SESSION or plan.session_id is None:
            return False
        return self.cluster.sessions.end_move(plan.session_id, plan.target, ok, now)

    # ---- shared helpers ------------------------------------------------------------------

    def least_pending(self, mask: BoolVec) -> int:
        """The slot in `mask` with the fewest pending prefill tokens. Ties (common: most
        instants have no prompt work queued anywhere) go to the fewest requests in flight,
        then the fewest sessions bound, then the lowest slot."""
        cluster = self.cluster
        load = cluster.load
        bound = np.array([cluster.sessions.bound_on(s) for s in range(cluster.n)], dtype=float)
        return argmin_eligible(load.pending_prefill_tokens, mask, load.in_flight, bound)

    def fetch_plan(self, view: View, holder: int, target: int) -> TransferPlan | None:
        """Order copying the prefix `holder` has beyond `target`'s to `target`, on the
        request's critical path (Mooncake's remote-prefix fetch)."""
        return plan_copy(
            self.cluster.cost,
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

    def view(self, req: RequestInfo) -> View:
        """The request's hits on every instance; the candidates are the live instances that
        take prompt work. A hit is the longer of what an instance holds in its own memory
        (GPU tier) and in its node's KV pool (CPU tier), which the engine loads before its
        prefill; the load's time is not modelled yet (a memcpy, against a recompute)."""
        cluster = self.cluster
        bs = cluster.block_size
        eligible = cluster.slots_with(Role.BOTH, Role.PREFILL)
        max_blocks = max(req.prompt_tokens - 1, 0) // bs
        hashes = req.block_hashes[:max_blocks]
        blocks = np.zeros(cluster.n)
        for tier in (Tier.CPU, Tier.GPU):
            for slot, n in cluster.index.match(hashes, tier).items():
                blocks[slot] = max(blocks[slot], n)
        tokens = np.minimum(blocks * bs, max(req.prompt_tokens - 1, 0))
        return View(req, eligible, blocks, tokens, max_blocks)

    def ttft_terms(
        self, view: View, cached: FloatVec, transfer_s: FloatVec | float = 0.0
    ) -> dict[str, FloatVec]:
        """Estimated TTFT per slot: queue + prefill of the uncached tokens (with the decode
        passes it shares) + KV transfer on the critical path. Computed for every slot; the
        view's `eligible` mask says which were candidates."""
        cluster = self.cluster
        cost, load = cluster.cost, cluster.load
        n_new = float(view.req.prompt_tokens) - cached
        lat = cost.latency
        # Every pass also carries the instance's running decodes.
        per_pass = (
            lat.step_s + lat.decode_seq_s * load.running + lat.decode_ctx_s * load.decode_tokens
        )
        prefill = cost.passes(n_new) * per_pass + n_new * (
            lat.prefill_token_s + lat.attn_pair_s * (cached + n_new * 0.5)
        )
        queue = load.pending_prefill_s
        transfer = (
            transfer_s if isinstance(transfer_s, np.ndarray) else np.full(cluster.n, transfer_s)
        )
        return {
            "hit_tokens": view.hit_tokens,
            "cached_tokens": cached,
            "queue_s": queue,
            "prefill_s": prefill,
            "transfer_s": transfer,
            "ttft_s": queue + prefill + transfer,
        }

    @staticmethod
    def isolated_floor(view: View, terms: dict[str, FloatVec]) -> float:
        """The best TTFT any eligible instance could give with an empty queue."""
        return float(np.min((terms["prefill_s"] + terms["transfer_s"])[view.eligible]))

    def decision(
        self,
        view: View,
        slot: int,
        rule: str,
        terms: dict[str, FloatVec],
        *,
        decode_slot: int | None = None,
        cached_tokens: float | None = None,
        fetched_tokens: int = 0,
        transfers: tuple[TransferPlan, ...] = (),
    ) -> Decision:
        """Build the decision for `slot` from the terms computed for it."""
        ttft = terms.get("ttft_s")
        return Decision(
            request_id=view.req.request_id,
            instance=slot,
            decode_instance=slot if decode_slot is None else decode_slot,
            cached_tokens=int(view.hit_tokens[slot] if cached_tokens is None else cached_tokens),
            fetched_tokens=fetched_tokens,
            estimated_ttft_s=float(ttft[slot]) if ttft is not None else float("nan"),
            rule=rule,
            transfers=transfers,
            terms=terms,
            candidates=view.eligible,
        )

    def reject(
        self, view: View, rule: str, retry_after_s: float, terms: dict[str, FloatVec]
    ) -> Decision:
        return Decision(
            request_id=view.req.request_id,
            instance=-1,
            decode_instance=-1,
            cached_tokens=0,
            fetched_tokens=0,
            estimated_ttft_s=float(np.min(terms["ttft_s"][view.eligible]))
            if "ttft_s" in terms
            else float("nan"),
            rule=rule,
            terms=terms,
            candidates=view.eligible,
            rejected=True,
            retry_after_s=retry_after_s,
        )

    def record(self, req: RequestInfo, decision: Decision, now: float) -> None:
        """Charge the chosen instance and add speculative index entries for the prompt."""
        cluster = self.cluster
        slot = decision.instance
        bs = cluster.block_size
        cached = decision.cached_tokens + decision.fetched_tokens
        n_new = req.prompt_tokens - cached
        prefill_s = cluster.cost.prefill_one(n_new, cached)
        blocks = -(-(req.prompt_tokens + req.output_tokens) // bs) - cached // bs
        cluster.load.charge(slot, n_new, prefill_s, blocks)
        cluster.index.speculate(slot, req.block_hashes, now + cluster.config.speculative_ttl_s)
        if req.session_id is not None:
            session = cluster.sessions.get(req.session_id)
            if session is not None and session.host != slot:
                if any(t.kind is TransferKind.MIGRATE_SESSION for t in decision.transfers):
                    # The turn runs on `slot` while its KV moves there; the session is rebound
                    # only once the copy landed verified (a failed copy leaves it on its host).
                    cluster.sessions.begin_move(req.session_id, slot, now, on_path=True)
                else:
                    cluster.sessions.bind(req.session_id, slot, now, migrated=False)


def argmin_eligible(values: FloatVec, eligible: BoolVec, *tiebreaks: FloatVec) -> int:
    """Index of the smallest value among eligible slots; ties go to the later keys, then the
    lowest slot. Deterministic: no random tie-break."""
    if not eligible.any():
        raise ValueError("no eligible instance")
    masked = np.where(eligible, values, np.inf)
    best = int(np.argmin(masked))
    if not tiebreaks or np.count_nonzero(masked == masked[best]) == 1:
        return best  # the common case: a unique minimum
    keys = [np.where(eligible, v, np.inf) for v in reversed(tiebreaks)]
    return int(np.lexsort([*keys, masked])[0])
