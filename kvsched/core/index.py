"""Global prefix index: which instance holds which block, in which tier.

Each tier maps a block hash to a bitmask of instance slots. Blocks arrive in chain order
(`store`), leave one by one (`remove`) or all at once (`clear_instance`). Because our hashes are
chained, an instance's reachable prefix ends at its first missing block: when a block leaves an
instance, its descendants on that instance leave with it (they can no longer be matched there).
That keeps every instance's holdings prefix-closed, which is what makes `match` cheap: along a
request's hash list the set of holders only shrinks, so the boundaries where it shrinks are found
by galloping binary search in O(k log L) lookups (k = distinct holder sets, L = blocks), never
O(instances × L). The block store itself (`holdings.py`) is compiled C by default, with the
pure-Python reference beside it.

Speculative entries record a placement the moment it is decided, before the engine's events
arrive, so the next request sharing the prefix does not herd elsewhere. They are kept as whole
chains in a radix tree (`claims.py`), and `match` extends an instance's GPU match by its
longest common prefix with any live chain placed there; they expire after their time-to-live,
by which point the engine's own events describe the blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from operator import add

from kvsched.core.claims import ClaimTree, common_prefix
from kvsched.core.holdings import PyHoldings, iter_bits, make_holdings
from kvsched.core.packed import PackedHashes


class Tier(IntEnum):
    """Where a block lives on an instance."""

    GPU = 0
    CPU = 1
    DISK = 2


@dataclass(frozen=True, slots=True)
class IndexCounters:
    """Anomalies counted instead of raised (events can be lost, reordered or duplicated)."""

    unknown_parents: int = 0  # stored block whose parent the instance does not hold
    duplicate_stores: int = 0  # stored block the instance already held
    absent_removals: int = 0  # removed block the instance did not hold
    cascaded_removals: int = 0  # descendants dropped because an ancestor left
    speculative_added: int = 0  # placements recorded
    speculative_expired: int = 0


@dataclass(frozen=True, slots=True)
class _Claim:
    """A placement's speculative claim: `slot` will hold `chain` until `expires_at`."""

    expires_at: float
    slot: int
    chain: tuple[int, ...]


class PrefixIndex:
    """Block holdings per (instance slot, tier) and speculative placements; see the module
    docstring for the invariants. `pure` picks the reference block store over the compiled
    one (`holdings.py`)."""

    def __init__(self, n_slots: int, *, pure: bool = False) -> None:
        if n_slots <= 0:
            raise ValueError("an index needs at least one instance slot")
        self.n_slots = n_slots
        self._blocks = make_holdings(n_slots, pure)
        self._claims = ClaimTree()
        self._pending_queue: deque[_Claim] = deque()  # oldest first
        self._pending_blocks = [0] * n_slots
        self._speculative_added = 0
        self._speculative_expired = 0

    @property
    def counters(self) -> IndexCounters:
        """Anomalies and speculative placements counted so far (a snapshot)."""
        unknown, duplicate, absent, cascaded = self._blocks.counters()
        return IndexCounters(
            unknown, duplicate, absent, cascaded, self._speculative_added, self._speculative_expired
        )

    @property
    def compiled(self) -> bool:
        """Whether the block store is the compiled one."""
        return not isinstance(self._blocks, PyHoldings)

    # ---- reads -------------------------------------------------------------------------

    def holders(self, block: int, tier: Tier = Tier.GPU) -> int:
        """Bitmask of the slots whose engines reported holding `block` in `tier`."""
        return self._blocks.holders(block, tier)

    def block_count(self, slot: int, tier: Tier = Tier.GPU) -> int:
        """Blocks `slot` holds in `tier`; on the GPU tier the blocks of its live speculative
        placements count too (as a router's own approximate tree would grow at once)."""
        count = self._blocks.count(slot, tier)
        return count + self._pending_blocks[slot] if tier is Tier.GPU else count

    def block_counts(self, tier: Tier = Tier.GPU) -> list[int]:
        """`block_count` of every slot, in slot order (one call, not one a slot)."""
        counts = self._blocks.counts(tier)
        return list(map(add, counts, self._pending_blocks)) if tier is Tier.GPU else counts

    def reported_count(self, slot: int, tier: Tier = Tier.GPU) -> int:
        """Blocks `slot` holds in `tier` by its own events alone (no speculative claims)."""
        return self._blocks.count(slot, tier)

    def pending_count(self) -> int:
        """Speculative placements still live."""
        return len(self._pending_queue)

    def __len__(self) -> int:
        """Distinct blocks held anywhere."""
        return len(self._blocks)

    def match(
        self, hashes: Sequence[int], tier: Tier = Tier.GPU, limit: int | None = None
    ) -> dict[int, int]:
        """Matched leading blocks per slot (slots with no match are absent) of `hashes`, or of
        its first `limit` (no copy is made); on the GPU tier speculative placements count too.
        Changes nothing."""
        result = self._blocks.match(hashes, tier, limit)
        if tier is Tier.GPU and len(hashes) and limit != 0:
            self._claims.match(hashes, result, limit)
        return result

    # ---- writes ------------------------------------------------------------------------

    def store(
        self, slot: int, hashes: Sequence[int], parent: int | None, tier: Tier = Tier.GPU
    ) -> None:
        """Record that `slot` now holds the chain `hashes` (parent of the first is `parent`,
        None for a chain starting at the root) in `tier`. `PackedHashes` go to the block
        store as their bytes, with no Python int made per hash."""
        if type(hashes) is PackedHashes:
            self._blocks.store_packed(slot, hashes.data, parent, tier)
        else:
            self._blocks.store(slot, hashes, parent, tier)

    def remove(self, slot: int, hashes: Sequence[int], tier: Tier = Tier.GPU) -> None:
        """Record that `slot` no longer holds `hashes` in `tier`; their descendants on `slot`
        in that tier leave too (`PackedHashes` go as their bytes, as in `store`)."""
        if type(hashes) is PackedHashes:
            self._blocks.remove_packed(slot, hashes.data, tier)
        else:
            self._blocks.remove(slot, hashes, tier)

    def parent_of(self, block: int) -> int | None:
        """The block `block` continues (None at the root or when unknown)."""
        return self._blocks.parent_of(block)

    def blocks_of(self, slot: int, tier: Tier = Tier.GPU) -> list[int]:
        """Every block `slot` holds in `tier`, in no particular order (a full scan: for
        resyncs and removals)."""
        return self._blocks.blocks_of(slot, tier)

    def subtree_of(self, slot: int, hashes: Sequence[int], tier: Tier = Tier.GPU) -> list[int]:
        """The blocks `remove(slot, hashes, tier)` would drop, in no particular order: those of
        `hashes` that `slot` holds and their descendants on `slot`."""
        return self._blocks.subtree_of(slot, hashes, tier)

    def clear_instance(self, slot: int) -> None:
        """Forget everything `slot` holds, in every tier, and its speculative placements
        (AllBlocksCleared, instance removal)."""
        self._blocks.clear_slot(slot)
        for claim in self._pending_queue:
            if claim.slot == slot:
                self._claims.remove(slot, claim.chain)
        self._pending_queue = deque(c for c in self._pending_queue if c.slot != slot)
        self._pending_blocks[slot] = 0

    def speculate(self, slot: int, hashes: Sequence[int], expires_at: float) -> None:
        """Claim that `slot` will hold the chain `hashes` (starting at the root) until
        `expires_at`. The chain is kept whole, not block by block."""
        if not hashes:
            return
        claim = _Claim(expires_at, slot, tuple(hashes))
        self._claims.add(slot, claim.chain)
        self._pending_queue.append(claim)
        self._pending_blocks[slot] += len(claim.chain)
        self._speculative_added += 1

    def expire(self, now: float) -> None:
        """Drop speculative placements whose time is up (callers use one time-to-live, so
        claims expire in the order they were made)."""
        queue = self._pending_queue
        while queue and queue[0].expires_at <= now:
            claim = queue.popleft()
            self._pending_blocks[claim.slot] -= len(claim.chain)
            self._claims.remove(claim.slot, claim.chain)
            self._speculative_expired += 1

    # ---- integrity ---------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError if the internal views disagree or a slot's holdings are not
        prefix-closed."""
        all_masks, parents, children, all_counts = self._blocks.snapshot()
        unknown_parents = self._blocks.counters()[0]
        for tier in Tier:
            masks = all_masks[tier]
            counts = [0] * self.n_slots
            for h, mask in masks.items():
                assert mask, "zero mask stored"
                assert h in parents, "held block missing from the parent map"
                parent = parents[h]
                for slot in iter_bits(mask):
                    counts[slot] += 1
                    # Only a lost event (counted as an unknown parent) may leave a gap.
                    assert (
                        parent is None or masks.get(parent, 0) & (1 << slot) or unknown_parents
                    ), f"slot {slot} holds {h:#x} but not its parent (tier {tier.name})"
            assert counts == all_counts[tier], f"block counts out of step (tier {tier.name})"
        live = {h for masks in all_masks for h in masks}
        assert live == set(parents), "parent map out of step with holdings"
        assert len(live) == len(self._blocks), "held block count out of step"
        for parent, kids in children.items():
            assert kids, "empty children list kept"
            for kid in kids:
                assert parents.get(kid) == parent, "children map out of step"
        self._check_claims()
        pending = [0] * self.n_slots
        for claim in self._pending_queue:
            pending[claim.slot] += len(claim.chain)
        assert pending == self._pending_blocks, "pending block counts out of step"

    def _check_claims(self) -> None:
        """The claim tree holds exactly the live claims: recount each edge's claims."""
        for path, slots in self._claims.claims_through().items():
            counted: dict[int, int] = {}
            for claim in self._pending_queue:
                if common_prefix(claim.chain, path) == len(path):
                    counted[claim.slot] = counted.get(claim.slot, 0) + 1
            assert counted == slots, "claim tree out of step with the live claims"
