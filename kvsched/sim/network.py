"""Links between simulated instances: transfers queue FIFO on the NICs they cross.

Inside a node a transfer uses the GPUs' own links (NVLink); between nodes it crosses the source
node's egress NIC and the target node's ingress NIC, which every transfer of those nodes shares.
"""

from __future__ import annotations

from kvsched.core.topology import SAME_NODE, Topology


class Network:
    """When each link resource is next free, on the virtual clock."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._free: dict[tuple[str, int], float] = {}

    def schedule(self, src: int, dst: int, nbytes: int, now: float) -> tuple[float, float]:
        """Book a transfer of `nbytes` from `src` to `dst` starting no earlier than `now`;
        returns (start, end)."""
        topo = self.topology
        link = topo.link(src, dst)
        if topo.distance(src, dst) == SAME_NODE:
            keys = [("gpu_out", src), ("gpu_in", dst)]
        else:
            keys = [("nic_out", topo.node_of[src]), ("nic_in", topo.node_of[dst])]
        start = max([now, *(self._free.get(k, 0.0) for k in keys)])
        end = start + link.seconds(nbytes)
        for k in keys:
            self._free[k] = end
        return start, end
