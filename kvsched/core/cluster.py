"""The cluster state every policy reads, and the one constructor that builds it.

The simulator and the live Conductor both call `build_cluster`, so they run identical objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

import numpy as np
import numpy.typing as npt

from kvsched.core.adapters import AdapterSlots
from kvsched.core.cost_model import CostModel, default_pool_link
from kvsched.core.index import PrefixIndex
from kvsched.core.latency import DEFAULT_LATENCY, load_latency
from kvsched.core.load import LoadTracker
from kvsched.core.models import DEFAULT_MODEL, model_config
from kvsched.core.scoring import load_kernels
from kvsched.core.sessions import SessionTable
from kvsched.core.topology import LinkClass, Topology, TopologyConfig


class Role(Enum):
    """What an instance serves."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class SloConfig:
    """Latency objectives a request must meet (seconds)."""

    ttft_s: float = 2.0
    tpot_s: float = 0.1


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """Everything needed to build a cluster's state; recorded in every report."""

    n_instances: int
    latency_profile: str = DEFAULT_LATENCY
    model: str = DEFAULT_MODEL
    block_size: int = 16
    chunk_tokens: int = 8192  # engine token budget per forward pass
    max_running: int = 256  # engine cap on admitted requests
    kv_capacity_tokens: int = 0  # 0: the latency profile's measured capacity
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    # The host link an engine loads its node pool's KV over (host DRAM to GPU memory).
    pool_link: LinkClass = field(default_factory=default_pool_link)
    roles: tuple[Role, ...] = ()  # empty: every instance does both
    slo: SloConfig = field(default_factory=SloConfig)
    speculative_ttl_s: float = 5.0

    def __post_init__(self) -> None:
        if self.n_instances <= 0:
            raise ValueError("a cluster needs at least one instance")
        if self.roles and len(self.roles) != self.n_instances:
            raise ValueError("roles must name one role per instance")
        if self.block_size <= 0 or self.chunk_tokens < self.block_size:
            raise ValueError("block size must be positive and the chunk at least one block")
        link = self.pool_link
        if not (link.bandwidth_bytes_per_s > 0 and link.setup_s >= 0):
            raise ValueError(
                "the pool link needs a positive bandwidth and a non-negative setup time, "
                f"not {link.bandwidth_bytes_per_s} B/s and {link.setup_s} s"
            )


@dataclass
class ClusterState:
    """Shared mutable view of the cluster. Policies read it and change it only through the
    objects' own methods (index, load, sessions)."""

    config: ClusterConfig
    cost: CostModel
    roles: tuple[Role, ...]
    capacity_blocks: int
    index: PrefixIndex
    load: LoadTracker
    sessions: SessionTable
    alive: npt.NDArray[np.bool_]  # per slot
    adapters: AdapterSlots  # the LoRA adapters each slot holds and may hold
    # The served model of each slot's instance ("": not said, taken to serve any).
    models: list[str] = field(default_factory=list)
    _role_masks: dict[frozenset[Role], npt.NDArray[np.bool_]] = field(
        default_factory=dict, repr=False
    )
    _model_masks: dict[str, npt.NDArray[np.bool_]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.models:
            self.models = [""] * self.n

    @property
    def n(self) -> int:
        return self.config.n_instances

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def slots_with(self, *roles: Role, model: str = "") -> npt.NDArray[np.bool_]:
        """Boolean mask of live slots whose role is one of `roles` and that serve `model`
        ("": any; see `serving`), a fresh array."""
        key = frozenset(roles)
        mask = self._role_masks.get(key)
        if mask is None:
            mask = self._role_masks[key] = np.array([r in roles for r in self.roles], dtype=bool)
        out = np.logical_and(mask, self.alive)
        serving = self.serving(model)
        return out if serving is None else np.logical_and(out, serving)

    def serving(self, model: str) -> npt.NDArray[np.bool_] | None:
        """Boolean mask of the slots whose instance serves `model` (or said no model); None
        where that is every slot (no model asked for, or one model in the cluster), so that
        callers change nothing then."""
        if not model or all(m in ("", model) for m in self.models):
            return None
        mask = self._model_masks.get(model)
        if mask is None:
            mask = self._model_masks[model] = np.array([m in ("", model) for m in self.models])
        return mask

    def add_instance(self, slot: int, role: Role, node: int | None = None, model: str = "") -> None:
        """An instance joined (or came back) in `slot` with `role`, on `node` (None: where the
        topology put the slot), serving `model` ("": not said): it starts empty and idle."""
        if node is not None and self.cost.topology.node_of[slot] != node:
            self.cost = replace(self.cost, topology=self.cost.topology.on_node(slot, node))
        if self.roles[slot] is not role:
            self.roles = (*self.roles[:slot], role, *self.roles[slot + 1 :])
            self._role_masks.clear()
        if self.models[slot] != model:
            self.models[slot] = model
            self._model_masks.clear()
        self.index.clear_instance(slot)
        self.load.reset(slot, self.capacity_blocks)
        self.adapters.reset(slot)
        self.alive[slot] = True

    def remove_instance(self, slot: int) -> None:
        """An instance died or left: forget its blocks, load and session bindings."""
        self.alive[slot] = False
        self.index.clear_instance(slot)
        self.load.reset(slot, self.capacity_blocks)
        self.adapters.reset(slot)
        self.sessions.unbind_host(slot)


def build_cluster(config: ClusterConfig, *, pure: bool = False) -> ClusterState:
    """The one constructor of cluster state (simulator and services alike): its prefix index
    and scoring compiled, or their references when `pure` (the same decisions, slower)."""
    latency = load_latency(config.latency_profile)
    model = model_config(config.model)
    topology = Topology.build(config.n_instances, config.topology)
    cost = CostModel(
        latency,
        model,
        topology,
        config.block_size,
        config.chunk_tokens,
        config.pool_link,
        kernels=load_kernels(pure),
    )
    capacity_tokens = config.kv_capacity_tokens or latency.kv_capacity_tokens
    capacity_blocks = capacity_tokens // config.block_size
    roles = config.roles or (Role.BOTH,) * config.n_instances
    return ClusterState(
        config=config,
        cost=cost,
        roles=roles,
        capacity_blocks=capacity_blocks,
        index=PrefixIndex(config.n_instances, pure=pure),
        load=LoadTracker(config.n_instances, capacity_blocks),
        sessions=SessionTable(),
        alive=np.ones(config.n_instances, dtype=bool),
        adapters=AdapterSlots(config.n_instances),
    )
