"""The records of a replay: how to run it, each trace call's fate, and what a report reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsched.core.cluster import ClusterConfig, ClusterState
from kvsched.core.decision import Decision
from kvsched.sim.engine import Engine
from kvsched.sim.meters import GapHistogram, HotspotMeter
from kvsched.sim.migrations import MigrationLog
from kvsched.sim.tiers import TierConfig


@dataclass(frozen=True)
class ReplayConfig:
    """How to replay: cluster, seed, load and loop mode (recorded in the report)."""

    cluster: ClusterConfig
    seed: int = 0
    load: float = 1.0
    closed_loop: bool = False
    warmup_fraction: float = 0.05
    max_model_len: int = 0  # the longest prompt an engine takes; 0: the model config's
    # Closed loop: a rejected turn comes back after its retry delay (an agent retries a 429),
    # up to this many times; its TTFT counts from its first arrival.
    max_retries: int = 20
    tier: TierConfig = field(default_factory=TierConfig)  # the node KV pool (off by default)
    check_integrity: bool = False  # assert engine invariants after every step (tests)
    # The references of every compiled part, the core's pure-Python index and numpy scoring
    # (`build_cluster`) and the engines' Python prefix cache, rather than the compiled ones:
    # the same decisions, slower.
    pure: bool = False
    keep_decisions: bool = False


@dataclass(slots=True, eq=False)
class Req:
    """One trace call's fate in this replay."""

    call: int
    arrival: float = -1.0
    attempts: int = 0
    slot: int = -1
    decode_slot: int = -1
    first_token_at: float = -1.0
    finished_at: float = -1.0
    local_hit: int = 0
    transfer_hit: int = 0
    tier_hit: int = 0  # prompt tokens loaded from the node's DRAM/SSD tier
    rejected: bool = False
    done: bool = False
    decision: Decision | None = None


@dataclass
class ReplayResult:
    """Everything a report needs from one policy's run."""

    reqs: list[Req]
    cluster: ClusterState
    engines: list[Engine]
    hotspot: HotspotMeter
    gaps: GapHistogram
    migrations: MigrationLog
    transfers: dict[str, list[float]]  # kind -> [count, bytes, seconds]
    group_start: dict[str, float]
    end_time: float
    events: int
    tiers: dict[str, int] | None = None  # the node tiers' counters, summed; None when off
    wall_s: float = 0.0
    # Set when the run stopped with its attainment target out of reach: the most it could
    # still have attained then (`SloVerdict`).
    attainment_bound: float | None = None
