"""The cost model of one cluster: prefill, decode and transfer times, the load of KV from a
node's pool (host DRAM) into an engine's GPU memory, and the bandwidth of each link as
measured transfers correct it. Immutable and vectorised over instance slots."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import numpy.typing as npt

from kvsched.core.latency import LatencyModel
from kvsched.core.models import ModelConfig
from kvsched.core.scoring import Kernels
from kvsched.core.topology import LinkClass, Topology

FloatVec = npt.NDArray[np.float64]
# How far one measured transfer moves a link's bandwidth estimate (an exponential average).
MEASURED_WEIGHT = 0.3


def default_pool_link() -> LinkClass:
    """The host link an engine loads its node pool's KV over (host DRAM to GPU memory).

    PCIe Gen5 x16 carries 63 GB/s each way (32 GT/s x 16 lanes, 128b/130b); host-to-device
    copies measured on H100 reach 52.8-57 GB/s (NVIDIA/nvbandwidth issues #6 and #24), so
    50 GB/s is an achieved rate with headroom for the pool's page gathering. The setup is an
    assumption: the order of a few copy launches and a PCIe round trip (docs/latency-model.md,
    "Loading from the node pool")."""
    return LinkClass(50e9, 20e-6)


@dataclass(frozen=True)
class CostModel:
    """Latency, KV size and network terms of one cluster. Immutable; vectorised where a policy
    scores all instances at once."""

    latency: LatencyModel
    model: ModelConfig
    topology: Topology
    block_size: int
    chunk_tokens: int
    # What a load from the node's pool (the CPU tier) into GPU memory costs.
    pool_link: LinkClass = field(default_factory=default_pool_link)
    # The compiled scoring kernels every scoring function given this model runs, or None for
    # the numpy reference (`scoring.load_kernels`): the same floats either way.
    kernels: Kernels | None = field(default=None, compare=False, repr=False)
    # [src, dst] link setup seconds and seconds per byte (0 on the diagonal).
    setup_s: FloatVec = field(init=False, repr=False)
    s_per_byte: FloatVec = field(init=False, repr=False)

    def __post_init__(self) -> None:
        links = self.topology.config.links
        distance = self.topology.distances()
        setup = np.array([link.setup_s for link in links])[distance]
        per_byte = np.array([1.0 / link.bandwidth_bytes_per_s for link in links])[distance]
        np.fill_diagonal(setup, 0.0)
        np.fill_diagonal(per_byte, 0.0)
        object.__setattr__(self, "setup_s", setup)
        object.__setattr__(self, "s_per_byte", per_byte)

    def with_measured_transfer(
        self, src: int, dst: int, nbytes: int, seconds: float, weight: float = MEASURED_WEIGHT
    ) -> CostModel:
        """The cost model after a transfer of `nbytes` from `src` to `dst` took `seconds`:
        the bandwidth of their link class moves `weight` of the way to the one measured (the
        setup time stays; a transfer too small to measure a rate changes nothing)."""
        if src == dst or nbytes <= 0:
            return self
        topology = self.topology
        distance = topology.distance(src, dst)
        link = topology.config.links[distance]
        moving_s = seconds - link.setup_s
        if moving_s <= 0:
            return self
        measured = nbytes / moving_s
        bandwidth = (1 - weight) * link.bandwidth_bytes_per_s + weight * measured
        updated = LinkClass(bandwidth, link.setup_s)
        return replace(self, topology=topology.with_link(distance, updated))

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @cached_property
    def kernel_constants(self) -> tuple[float, float, float, float, float, float, float, float]:
        """The constants the compiled scoring reads (`kvsched.core.scoring.Constants`), made
        once per cost model (a cost model never changes; a measured transfer makes a new one)."""
        lat = self.latency
        return (
            lat.step_s,
            lat.decode_seq_s,
            lat.decode_ctx_s,
            lat.prefill_token_s,
            lat.attn_pair_s,
            float(self.chunk_tokens),
            float(self.kv_bytes_per_token),
            lat.prefill_ctx_s,
        )

    @cached_property
    def pool_constants(self) -> tuple[float, float, float, float]:
        """What the compiled pool-load kernel reads (`kvsched.core.scoring.PoolConstants`):
        the pool link's setup seconds and seconds per byte, KV bytes per token, and layers."""
        link = self.pool_link
        return (
            link.setup_s,
            1.0 / link.bandwidth_bytes_per_s,
            float(self.kv_bytes_per_token),
            float(self.model.layers),
        )

    @cached_property
    def no_load(self) -> FloatVec:
        """Zero seconds (or tokens) on every slot, read-only: the pool-load terms of a decision
        with nothing to load, shared by all of them rather than allocated per decision (terms
        are only read)."""
        zeros = np.zeros(len(self.setup_s))
        zeros.flags.writeable = False
        return zeros

    def prefill_s(self, n_new: FloatVec, n_cached: FloatVec) -> FloatVec:
        """Isolated chunked prefill time per candidate (arrays of equal shape)."""
        return self.latency.prefill(n_new, n_cached, self.chunk_tokens)

    def prefill_one(self, n_new: int, n_cached: int) -> float:
        return self.latency.prefill_scalar(n_new, n_cached, self.chunk_tokens)

    def passes(self, n_new: FloatVec) -> FloatVec:
        """Forward passes a prompt of `n_new` uncached tokens takes under chunking."""
        return np.maximum(np.ceil(n_new / self.chunk_tokens), 1.0)

    def transfer_s(self, src: int, dst: int, tokens: int) -> float:
        """Seconds to move `tokens` of KV from `src` to `dst` on idle links."""
        if src == dst or tokens <= 0:
            return 0.0
        nbytes = tokens * self.kv_bytes_per_token
        return float(self.setup_s[src, dst] + nbytes * self.s_per_byte[src, dst])

    def transfer_from(self, src: int, tokens: FloatVec) -> FloatVec:
        """Seconds to move `tokens[j]` tokens of KV from `src` to every instance j."""
        nbytes = tokens * self.kv_bytes_per_token
        moving = tokens > 0
        return np.where(moving, self.setup_s[src] + nbytes * self.s_per_byte[src], 0.0)
