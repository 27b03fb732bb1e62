"""One policy on one cluster state with its seeded random source: the object that both the
simulator and the live Conductor drive.

Every input that can change a decision enters through the methods below, each taking `now`
from the caller's clock, so replaying the same calls with the same seed gives the same
decisions wherever they run (the parity test replays a trace through both).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from kvsched.core.cluster import ClusterState
from kvsched.core.decision import Completion, Decision, RequestInfo, TransferPlan
from kvsched.core.index import Tier
from kvsched.core.load import LoadReport
from kvsched.core.policies import Policy, make_policy


class SchedulerPort(Protocol):
    """What a driver (the simulator, the Conductor's RPC layer) calls."""

    def place(self, req: RequestInfo, now: float) -> Decision:
        """Decide where `req` runs and record the placement."""
        ...

    def finish(self, done: Completion, now: float) -> Sequence[TransferPlan]:
        """A request ended; returns transfers to start now."""
        ...

    def transfer_done(self, plan: TransferPlan, ok: bool, now: float) -> bool:
        """A transfer ended; returns whether a session moved."""
        ...

    def blocks_stored(
        self, slot: int, hashes: Sequence[int], parent: int | None, tier: Tier = Tier.GPU
    ) -> None:
        """An instance stored a chain of blocks continuing `parent`."""
        ...

    def blocks_removed(self, slot: int, hashes: Sequence[int], tier: Tier = Tier.GPU) -> None:
        """An instance evicted blocks."""
        ...

    def report_load(self, slot: int, report: LoadReport) -> None:
        """An instance reported its load."""
        ...


class Scheduler:
    """The in-process `SchedulerPort`: a policy over a cluster state and a seeded RNG."""

    def __init__(self, cluster: ClusterState, spec: str, seed: int) -> None:
        self.cluster = cluster
        self.policy: Policy = make_policy(spec, cluster)
        self.spec = spec
        self.rng = random.Random(seed)

    def set_policy(self, spec: str) -> None:
        """Switch policy on the same cluster state (the index, load and sessions stay)."""
        self.policy = make_policy(spec, self.cluster)
        self.spec = spec

    def place(self, req: RequestInfo, now: float) -> Decision:
        return self.policy.place(req, now, self.rng)

    def explain(self, req: RequestInfo, now: float) -> Decision:
        """The decision `place` would make now, changing nothing (not even the RNG)."""
        rng = random.Random()
        rng.setstate(self.rng.getstate())
        return self.policy.decide(self.policy.view(req), now, rng)

    def finish(self, done: Completion, now: float) -> Sequence[TransferPlan]:
        return self.policy.on_finish(done, now, self.rng)

    def transfer_done(self, plan: TransferPlan, ok: bool, now: float) -> bool:
        return self.policy.on_transfer(plan, ok, now)

    def transfer_measured(self, src: int, dst: int, nbytes: int, seconds: float) -> None:
        """A transfer of `nbytes` from `src` to `dst` took `seconds` (policy time); the cost
        model's estimate of their link follows. (Live only: the simulator's transfers take
        exactly what the cost model says.)"""
        cluster = self.cluster
        cluster.cost = cluster.cost.with_measured_transfer(src, dst, nbytes, seconds)

    def blocks_stored(
        self, slot: int, hashes: Sequence[int], parent: int | None, tier: Tier = Tier.GPU
    ) -> None:
        self.cluster.index.store(slot, hashes, parent, tier)

    def blocks_removed(self, slot: int, hashes: Sequence[int], tier: Tier = Tier.GPU) -> None:
        self.cluster.index.remove(slot, hashes, tier)

    def report_load(self, slot: int, report: LoadReport) -> None:
        self.cluster.load.report(slot, report)
