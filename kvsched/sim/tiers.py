"""The node KV pool in the engine model: a DRAM tier per node, shared by the node's instances,
and an optional SSD tier below it (Mooncake's DRAM/SSD pool, vLLM's CPU offloading).

A block evicted from an instance's GPU cache is written back to its node's DRAM instead of
being dropped: the copy books the instance's host link (PCIe) from the moment of the eviction,
off the critical path, so it can delay the loads that follow it on that link. DRAM evicts LRU,
to the SSD tier when there is one (booking the node's SSD), else the block is gone.

Each tier is a prefix cache of its own (`make_cache`: an LRU of prefix-closed chains keyed by
block hash), so it holds whole chains from the root, as vLLM's CPU tier and the index's CPU
holdings do. The GPU evicts leaves first, so a block leaves while its ancestors are still on
the GPU: the write-back copies the ancestors the tier lacks too (once; afterwards they are
there). The chain of an evicted block comes from the `ChainBook` (hash → a chain it ends).

A prompt whose prefix, beyond its GPU hit, lies in a tier loads it over PCIe layer by layer
(the engine's `ready_at`/`kv_done_at`/`fetched` machinery for KV arriving by transfer), and
the loaded tokens count as cached. Every tier move is announced as vLLM announces it, a
`BlocksStored`/`BlocksRemoved` with medium CPU (DISK for the SSD), to every instance of the
node (`NodeTier.drain_events`), as the live Messenger does for its node's pool.

Nothing here reads a clock: callers pass `now`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvsched.cache.prefix_cache import CacheEvent, EngineCache, make_cache
from kvsched.core.events import BlocksRemoved, BlocksStored
from kvsched.core.index import Tier
from kvsched.core.topology import LinkClass

# Public figures behind the defaults (docs/evaluation.md, "Node KV pool"): an H100's host link
# is PCIe Gen5 x16, 63 GB/s a direction in theory (NVIDIA H100 datasheet: 128 GB/s both ways;
# PCI-SIG: 32 GT/s a lane); host-to-device copies measured on H100 reach 52.8-57 GB/s
# (NVIDIA/nvbandwidth issues #6 and #24), so 50 GB/s, as `default_pool_link` prices it. An
# NVMe Gen4 SSD reads about 7 GB/s (vendor data sheets, e.g. Samsung 990 PRO: 7.45 GB/s).
PCIE_GEN5_ACHIEVED = 50e9
PCIE_LATENCY_S = 20e-6  # a few copy launches and a PCIe round trip: the cost model's pool link
NVME_GEN4_READ = 7e9
NVME_LATENCY_S = 100e-6


@dataclass(frozen=True, slots=True)
class TierSize:
    """A tier's size per node: `factor` times the node's GPU KV capacity (the sum of its
    instances'), or `tokens` when that is set. Zero both: no tier."""

    factor: float = 0.0
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.factor < 0 or self.tokens < 0:
            raise ValueError("a tier size cannot be negative")
        if self.factor and self.tokens:
            raise ValueError("a tier is sized by a factor or in tokens, not both")

    @property
    def on(self) -> bool:
        return bool(self.factor or self.tokens)

    def pages(self, node_gpu_pages: int, block_size: int) -> int:
        if self.tokens:
            return self.tokens // block_size
        return int(self.factor * node_gpu_pages)

    def describe(self) -> str:
        if not self.on:
            return "0"
        if self.tokens:
            return f"{self.tokens}t"
        return f"{self.factor:g}x"

    @classmethod
    def parse(cls, text: str) -> TierSize:
        """`4` or `4x`: 4 times the node's GPU KV; `2000000t`: that many tokens per node."""
        raw = text.strip().lower()
        try:
            if raw.endswith("t"):
                return cls(tokens=int(raw[:-1]))
            return cls(factor=float(raw.removesuffix("x")))
        except ValueError:
            raise ValueError(
                f"a tier size is a multiple of the node's GPU KV capacity (4, 4x) or tokens "
                f"per node (2000000t), got {text!r}"
            ) from None


@dataclass(frozen=True, slots=True)
class TierConfig:
    """The node KV pool: sizes, bandwidths (bytes/s) and latencies (s). Off by default."""

    dram: TierSize = TierSize()
    ssd: TierSize = TierSize()
    pcie_bandwidth: float = PCIE_GEN5_ACHIEVED  # a GPU's host link, each way
    pcie_latency_s: float = PCIE_LATENCY_S
    ssd_bandwidth: float = NVME_GEN4_READ  # the node's SSD, reads and writes
    ssd_latency_s: float = NVME_LATENCY_S

    def __post_init__(self) -> None:
        if self.pcie_bandwidth <= 0 or self.ssd_bandwidth <= 0:
            raise ValueError("tier bandwidths must be positive")
        if self.pcie_latency_s < 0 or self.ssd_latency_s < 0:
            raise ValueError("tier latencies cannot be negative")
        if self.ssd.on and not self.dram.on:
            raise ValueError("an SSD tier needs a DRAM tier above it")

    @property
    def on(self) -> bool:
        return self.dram.on

    def pool_link(self) -> LinkClass:
        """The host link as the scheduler's cost model prices a load from the pool."""
        return LinkClass(self.pcie_bandwidth, self.pcie_latency_s)

    def record(self) -> dict[str, object]:
        """As report.json's config records it."""
        return {
            "dram": self.dram.describe(),
            "ssd": self.ssd.describe(),
            "pcie_bandwidth_gb_per_s": self.pcie_bandwidth / 1e9,
            "pcie_latency_us": self.pcie_latency_s * 1e6,
            "ssd_bandwidth_gb_per_s": self.ssd_bandwidth / 1e9,
            "ssd_latency_us": self.ssd_latency_s * 1e6,
        }


class ChainBook:
    """Where each block hash sits: one chain of the trace ending at it (chained hashes: every
    chain through a hash has the same blocks before it)."""

    def __init__(self, chains: Sequence[Sequence[int]]) -> None:
        self._at: dict[int, tuple[int, int]] = {}
        at = self._at
        for i, chain in enumerate(chains):
            for pos, h in enumerate(chain):
                at.setdefault(h, (i, pos))
        self._chains = chains

    def chain(self, block: int) -> tuple[Sequence[int], int]:
        """A chain through `block` and its length up to it: the blocks from the root up to and
        including `block` are its first n (not sliced: the chains run to thousands of blocks,
        and the tiers take a prefix length)."""
        i, pos = self._at[block]
        return self._chains[i], pos + 1


@dataclass(slots=True)
class Load:
    """Blocks a prompt loads from its node's tiers, and when they arrive on the GPU."""

    blocks: int
    start: float  # the link starts moving them (later than asked when it is busy)
    ready_at: float  # the first layer is in
    done_at: float  # the last layer is in


class _Level:
    """One tier of one node: its store and the resource its writes book."""

    def __init__(self, pages: int, tier: Tier, pure: bool) -> None:
        self.store: EngineCache = make_cache(pages, pure)
        self.tier = tier
        self.written_blocks = 0
        self.loaded_blocks = 0

    def write(self, chain: Sequence[int], n: int, now: float) -> int:
        """Keep `chain[:n]` (every block of it, ancestors first); returns the blocks it copied
        (0 when it holds them all already, or cannot make room)."""
        store = self.store
        have = store.match(chain, n)
        if have == n:  # a use: the chain is most recently used again
            store.touch_prefix(chain, n, now)
            return 0
        store.lock_prefix(chain, have, now)  # its ancestors must survive the eviction
        if not store.reserve(n - have):
            store.unlock_prefix(chain, have, now)
            return 0
        store.commit(chain, have, n, have, now)
        store.unlock_prefix(chain, n, now)
        self.written_blocks += n - have
        return n - have

    def events(self) -> list[CacheEvent]:
        """The store's moves since the last call, in this tier's medium."""
        out: list[CacheEvent] = []
        for e in self.store.drain_events():
            if isinstance(e, BlocksStored):
                out.append(BlocksStored(e.hashes, e.parent, self.tier))
            else:
                out.append(BlocksRemoved(e.hashes, self.tier))
        return out


class NodeTier:
    """The DRAM (and SSD) tier of one node, and the host links of its instances."""

    def __init__(
        self,
        config: TierConfig,
        slots: Sequence[int],
        *,
        gpu_pages: int,
        block_size: int,
        kv_bytes_per_token: int,
        layers: int,
        book: ChainBook,
        pure: bool = False,
    ) -> None:
        """`slots`: the node's instances; `gpu_pages`: one instance's KV capacity in pages;
        `pure`: the tiers' stores are the reference prefix cache."""
        node_pages = gpu_pages * len(slots)
        dram_pages = config.dram.pages(node_pages, block_size)
        if dram_pages <= 0:
            raise ValueError("a DRAM tier needs at least one block")
        self.config = config
        self.slots = tuple(slots)
        self.dram = _Level(dram_pages, Tier.CPU, pure)
        ssd_pages = config.ssd.pages(node_pages, block_size) if config.ssd.on else 0
        self.ssd = _Level(ssd_pages, Tier.DISK, pure) if ssd_pages > 0 else None
        self._block_bytes = block_size * kv_bytes_per_token
        self._layers = layers
        self._book = book
        self._pcie_free = dict.fromkeys(self.slots, 0.0)  # each instance's host link
        self._ssd_free = 0.0
        self._pending: list[CacheEvent] = []

    # ---- write-back --------------------------------------------------------------------

    def evicted(self, slot: int, hashes: Sequence[int], now: float) -> None:
        """`slot`'s GPU evicted `hashes`: write each back to DRAM (with the ancestors DRAM
        lacks, read from the same GPU), booking the slot's host link from `now`. DRAM's own
        evictions go down to the SSD, or are dropped. Queues the tier events."""
        dram, book = self.dram, self._book
        copied = 0
        for h in hashes:
            copied += dram.write(*book.chain(h), now)
        if copied:
            self._book_pcie(slot, copied, now)
        moves = dram.events()
        if self.ssd is not None:
            self._spill(moves, now)
        self._pending.extend(moves)

    def _spill(self, dram_moves: list[CacheEvent], now: float) -> None:
        assert self.ssd is not None
        copied = 0
        for e in dram_moves:
            if isinstance(e, BlocksRemoved):
                for h in e.hashes:
                    copied += self.ssd.write(*self._book.chain(h), now)
        if copied:
            self._ssd_free = self._book_ssd(copied, now)[1]
        self._pending.extend(self.ssd.events())

    # ---- loads -------------------------------------------------------------------------

    def match(self, hashes: Sequence[int], limit: int) -> int:
        """Leading blocks of `hashes[:limit]` some tier of the node holds. Changes nothing."""
        hit = self.in_dram(hashes, limit)
        if self.ssd is not None:
            hit = max(hit, self.ssd.store.match(hashes, limit))
        return hit

    def in_dram(self, hashes: Sequence[int], limit: int) -> int:
        """Leading blocks of `hashes[:limit]` the node's DRAM holds (what a reader on another
        node can take at once). Changes nothing."""
        return self.dram.store.match(hashes, limit)

    def load(self, slot: int, hashes: Sequence[int], start: int, end: int, now: float) -> Load:
        """`slot` loads blocks `hashes[start:end]` (held by `match`) into its reserved pages:
        from DRAM where it has them, else from the SSD through DRAM's link, layer by layer.
        Books the links and marks the blocks used."""
        dram_hit = min(self.in_dram(hashes, end), end)
        self.dram.store.touch_prefix(hashes, dram_hit, now)
        from_dram = max(dram_hit - start, 0)
        from_ssd = end - max(dram_hit, start)
        self.dram.loaded_blocks += from_dram
        ssd_done = now
        if from_ssd > 0:
            assert self.ssd is not None
            self.ssd.store.touch_prefix(hashes, end, now)
            self.ssd.loaded_blocks += from_ssd
            _, ssd_done = self._book_ssd(from_ssd, now)
        first, last = self._book_pcie(slot, end - start, now)
        last = max(last, ssd_done + (last - first) / self._layers)
        return Load(end - start, first, first + (last - first) / self._layers, last)

    def drain_events(self) -> list[CacheEvent]:
        """The tier moves since the last drain, for every instance of the node."""
        events, self._pending = self._pending, []
        return events

    # ---- links -------------------------------------------------------------------------

    def _book_pcie(self, slot: int, blocks: int, now: float) -> tuple[float, float]:
        """One FIFO resource per host link for both directions: a write-back queues the loads
        behind it (conservative: PCIe is full duplex, but the copies share the GPU's copy
        engines and memory bandwidth)."""
        start = max(now, self._pcie_free[slot])
        end = (
            start
            + self.config.pcie_latency_s
            + blocks * self._block_bytes / self.config.pcie_bandwidth
        )
        self._pcie_free[slot] = end
        return start, end

    def _book_ssd(self, blocks: int, now: float) -> tuple[float, float]:
        start = max(now, self._ssd_free)
        end = (
            start
            + self.config.ssd_latency_s
            + blocks * self._block_bytes / self.config.ssd_bandwidth
        )
        self._ssd_free = end
        return start, end

    def stats(self) -> dict[str, int]:
        out = {
            "dram_blocks": len(self.dram.store),
            "dram_written_blocks": self.dram.written_blocks,
            "dram_loaded_blocks": self.dram.loaded_blocks,
            "dram_evicted_blocks": self.dram.store.evicted_total,
        }
        if self.ssd is not None:
            out |= {
                "ssd_blocks": len(self.ssd.store),
                "ssd_written_blocks": self.ssd.written_blocks,
                "ssd_loaded_blocks": self.ssd.loaded_blocks,
                "ssd_evicted_blocks": self.ssd.store.evicted_total,
            }
        return out


def build_tiers(
    config: TierConfig,
    node_of: Sequence[int],
    *,
    gpu_pages: int,
    block_size: int,
    kv_bytes_per_token: int,
    layers: int,
    chains: Sequence[Sequence[int]],
    pure: bool = False,
) -> list[NodeTier | None]:
    """Each instance's node tier (shared by the instances of a node), or all None when the
    tier is off; `pure`: their stores are the reference prefix cache."""
    if not config.on:
        return [None] * len(node_of)
    book = ChainBook(chains)
    by_node: dict[int, list[int]] = {}
    for slot, node in enumerate(node_of):
        by_node.setdefault(node, []).append(slot)
    tiers = {
        node: NodeTier(
            config,
            slots,
            gpu_pages=gpu_pages,
            block_size=block_size,
            kv_bytes_per_token=kv_bytes_per_token,
            layers=layers,
            book=book,
            pure=pure,
        )
        for node, slots in by_node.items()
    }
    return [tiers[node] for node in node_of]
