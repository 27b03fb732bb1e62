"""Network topology between instances and the cost of moving KV cache across it.

Distances follow the Mooncake Conductor reconstruction (seed 000): the same node is 0, the same
rack (one ToR switch) 1, the same cluster (through the spine) 2, across clusters 3. Each distance
has its own link class; a transfer costs `setup_s + bytes / bandwidth`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

SAME_NODE, SAME_RACK, SAME_SPINE, CROSS_CLUSTER = 0, 1, 2, 3
DISTANCE_NAMES = ("node", "rack", "spine", "cluster")


@dataclass(frozen=True, slots=True)
class LinkClass:
    """Per-transfer bandwidth (bytes/s) and fixed setup cost (s) for one distance."""

    bandwidth_bytes_per_s: float
    setup_s: float

    def seconds(self, nbytes: float) -> float:
        return self.setup_s + nbytes / self.bandwidth_bytes_per_s


def _default_links() -> tuple[LinkClass, ...]:
    # Configuration assumptions, not measurements (the report records them): NVLink inside a
    # node; one 200 Gb/s RDMA NIC share per GPU in a rack (the rate the profiles README uses for
    # its 13 GB / 0.5 s example); half of that through an oversubscribed spine; a WAN-class link
    # across clusters. Setup: seed 000's 5 ms transfer overhead, plus path latency.
    return (
        LinkClass(150e9, 0.005),
        LinkClass(25e9, 0.005),
        LinkClass(12.5e9, 0.006),
        LinkClass(3e9, 0.010),
    )


@dataclass(frozen=True, slots=True)
class TopologyConfig:
    """How instances map to nodes, racks and spines (uniform fan-out at every level)."""

    instances_per_node: int = 4
    nodes_per_rack: int = 2
    racks_per_spine: int = 4
    links: tuple[LinkClass, ...] = field(default_factory=_default_links)

    def __post_init__(self) -> None:
        if min(self.instances_per_node, self.nodes_per_rack, self.racks_per_spine) <= 0:
            raise ValueError("topology fan-outs must be positive")
        if len(self.links) != 4:
            raise ValueError("a topology needs one link class per distance 0..3")


@dataclass(frozen=True, slots=True)
class Topology:
    """Placement of `n` instances (slot i) and the link between any two of them."""

    config: TopologyConfig
    node_of: tuple[int, ...]

    @classmethod
    def build(cls, n_instances: int, config: TopologyConfig | None = None) -> Topology:
        cfg = config or TopologyConfig()
        return cls(cfg, tuple(i // cfg.instances_per_node for i in range(n_instances)))

    def on_node(self, slot: int, node: int) -> Topology:
        """The same topology with instance `slot` placed on `node`."""
        node_of = (*self.node_of[:slot], node, *self.node_of[slot + 1 :])
        return Topology(self.config, node_of)

    def distance(self, a: int, b: int) -> int:
        """0 same node, 1 same rack, 2 same spine, 3 across clusters (a ≠ b expected)."""
        cfg = self.config
        na, nb = self.node_of[a], self.node_of[b]
        if na == nb:
            return SAME_NODE
        ra, rb = na // cfg.nodes_per_rack, nb // cfg.nodes_per_rack
        if ra == rb:
            return SAME_RACK
        if ra // cfg.racks_per_spine == rb // cfg.racks_per_spine:
            return SAME_SPINE
        return CROSS_CLUSTER

    def distances(self) -> npt.NDArray[np.int64]:
        """`distance(a, b)` for every pair, as an n × n array (0 on the diagonal)."""
        cfg = self.config
        node = np.asarray(self.node_of, dtype=np.int64)
        rack = node // cfg.nodes_per_rack
        spine = rack // cfg.racks_per_spine
        out = np.full((len(node), len(node)), CROSS_CLUSTER, dtype=np.int64)
        for level, group in ((SAME_SPINE, spine), (SAME_RACK, rack), (SAME_NODE, node)):
            out[np.equal.outer(group, group)] = level
        return out

    def with_link(self, distance: int, link: LinkClass) -> Topology:
        """The same placement with the link class of `distance` replaced."""
        links = (*self.config.links[:distance], link, *self.config.links[distance + 1 :])
        return Topology(replace(self.config, links=links), self.node_of)

    def link(self, a: int, b: int) -> LinkClass:
        return self.config.links[self.distance(a, b)]

    def transfer_s(self, a: int, b: int, nbytes: float) -> float:
        """Seconds to move `nbytes` from instance a to b on an idle link (0 when a == b)."""
        if a == b or nbytes <= 0:
            return 0.0
        return self.link(a, b).seconds(nbytes)
