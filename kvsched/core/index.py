"""Global prefix index: which instance holds which block, in which tier.

Each tier maps a block hash to a bitmask of instance slots. Blocks arrive in chain order
(`store`), leave one by one (`remove`) or all at once (`clear_instance`). Because our hashes are
chained, an instance's reachable prefix ends at its first missing block: when a block leaves an
instance, its descendants on that instance leave with it (they can no longer be matched there).
That keeps every instance's holdings prefix-closed, which is what makes `match` cheap: along a
request's hash list the set of holders only shrinks, so the boundaries where it shrinks are found
by galloping binary search in O(k log L) lookups (k = distinct holder sets, L = blocks), never
O(instances × L).

Speculative entries record a placement the moment it is decided, before the engine's events
arrive, so the next request sharing the prefix does not herd elsewhere. They are kept as whole
chains in a radix tree (`claims.py`), and `match` extends an instance's GPU match by its
longest common prefix with any live chain placed there; they expire after their time-to-live,
by which point the engine's own events describe the blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum

from kvsched.core.claims import ClaimTree, common_prefix


class Tier(IntEnum):
    """Where a block lives on an instance."""

    GPU = 0
    CPU = 1
    DISK = 2


@dataclass(slots=True)
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


def iter_bits(mask: int) -> Iterator[int]:
    """Slots of the set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class PrefixIndex:
    """Block holdings per (instance slot, tier); see the module docstring for the invariants."""

    def __init__(self, n_slots: int) -> None:
        if n_slots <= 0:
            raise ValueError("an index needs at least one instance slot")
        self.n_slots = n_slots
        self._masks: tuple[dict[int, int], ...] = tuple({} for _ in Tier)
        self._counts: tuple[list[int], ...] = tuple([0] * n_slots for _ in Tier)
        self._parent: dict[int, int | None] = {}
        self._children: dict[int, list[int]] = {}
        self._claims = ClaimTree()
        self._pending_queue: deque[_Claim] = deque()  # oldest first
        self._pending_blocks = [0] * n_slots
        self.counters = IndexCounters()

    # ---- reads -------------------------------------------------------------------------

    def holders(self, block: int, tier: Tier = Tier.GPU) -> int:
        """Bitmask of the slots whose engines reported holding `block` in `tier`."""
        return self._masks[tier].get(block, 0)

    def block_count(self, slot: int, tier: Tier = Tier.GPU) -> int:
        """Blocks `slot` holds in `tier`; on the GPU tier the blocks of its live speculative
        placements count too (as a router's own approximate tree would grow at once)."""
        count = self._counts[tier][slot]
        return count + self._pending_blocks[slot] if tier is Tier.GPU else count

    def reported_count(self, slot: int, tier: Tier = Tier.GPU) -> int:
        """Blocks `slot` holds in `tier` by its own events alone (no speculative claims)."""
        return self._counts[tier][slot]

    def pending_count(self) -> int:
        """Speculative placements still live."""
        return len(self._pending_queue)

    def __len__(self) -> int:
        """Distinct blocks held anywhere."""
        return len(self._parent)

    def match(self, hashes: Sequence[int], tier: Tier = Tier.GPU) -> dict[int, int]:
        """Matched leading blocks per slot (slots with no match are absent); on the GPU tier
        speculative placements count too. Changes nothing."""
        get = self._masks[tier].get
        n = len(hashes)
        result: dict[int, int] = {}
        if n == 0:
            return result
        alive = get(hashes[0], 0)
        pos = 0  # every slot in `alive` holds blocks [0, pos]
        while alive:
            # Gallop then bisect for the last position still held by all of `alive`.
            lo, step = pos, 1
            hi = n
            while lo + step < hi:
                if get(hashes[lo + step], 0) & alive == alive:
                    lo += step
                    step <<= 1
                else:
                    hi = lo + step
                    break
            while hi - lo > 1:
                mid = (lo + hi) >> 1
                if get(hashes[mid], 0) & alive == alive:
                    lo = mid
                else:
                    hi = mid
            nxt = get(hashes[lo + 1], 0) & alive if lo + 1 < n else 0
            for slot in iter_bits(alive & ~nxt):
                result[slot] = lo + 1
            alive, pos = nxt, lo + 1
        if tier is Tier.GPU:
            self._claims.match(hashes, result)
        return result

    # ---- writes ------------------------------------------------------------------------

    def store(
        self, slot: int, hashes: Sequence[int], parent: int | None, tier: Tier = Tier.GPU
    ) -> None:
        """Record that `slot` now holds the chain `hashes` (parent of the first is `parent`,
        None for a chain starting at the root) in `tier`."""
        bit = 1 << slot
        masks, counts = self._masks[tier], self._counts[tier]
        if parent is not None and not masks.get(parent, 0) & bit:
            self.counters.unknown_parents += 1
        parents, children = self._parent, self._children
        for h in hashes:
            if h not in parents:
                parents[h] = parent
                if parent is not None:
                    children.setdefault(parent, []).append(h)
            mask = masks.get(h, 0)
            if mask & bit:
                self.counters.duplicate_stores += 1
            else:
                masks[h] = mask | bit
                counts[slot] += 1
            parent = h

    def remove(self, slot: int, hashes: Sequence[int], tier: Tier = Tier.GPU) -> None:
        """Record that `slot` no longer holds `hashes` in `tier`; their descendants on `slot`
        in that tier leave too."""
        bit = 1 << slot
        masks, counts = self._masks[tier], self._counts[tier]
        children = self._children
        for h in hashes:
            mask = masks.get(h, 0)
            if not mask & bit:
                self.counters.absent_removals += 1
            elif h in children:
                self._drop_subtree(slot, h, tier)
            else:  # a leaf, the common case (engines evict leaves first): inline `_unset`
                counts[slot] -= 1
                mask &= ~bit
                if mask:
                    masks[h] = mask
                else:
                    del masks[h]
                    self._unlink_if_unheld(h)

    def parent_of(self, block: int) -> int | None:
        """The block `block` continues (None at the root or when unknown)."""
        return self._parent.get(block)

    def blocks_of(self, slot: int, tier: Tier = Tier.GPU) -> list[int]:
        """Every block `slot` holds in `tier` (a full scan: for resyncs and removals)."""
        bit = 1 << slot
        return [h for h, mask in self._masks[tier].items() if mask & bit]

    def subtree_of(self, slot: int, hashes: Sequence[int], tier: Tier = Tier.GPU) -> list[int]:
        """The blocks `remove(slot, hashes, tier)` would drop: those of `hashes` that `slot`
        holds and their descendants on `slot`."""
        bit = 1 << slot
        masks, children = self._masks[tier], self._children
        out: list[int] = []
        stack = [h for h in hashes if masks.get(h, 0) & bit]
        seen: set[int] = set()
        while stack:
            h = stack.pop()
            if h in seen:
                continue
            seen.add(h)
            out.append(h)
            stack.extend(c for c in children.get(h, ()) if masks.get(c, 0) & bit)
        return out

    def clear_instance(self, slot: int) -> None:
        """Forget everything `slot` holds, in every tier, and its speculative placements
        (AllBlocksCleared, instance removal)."""
        bit = 1 << slot
        for tier in Tier:
            masks = self._masks[tier]
            mine = self.blocks_of(slot, tier)  # rare: a full scan is fine
            for h in mine:
                self._unset(masks, h, masks[h] & ~bit)
            self._counts[tier][slot] = 0
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
        self.counters.speculative_added += 1

    def expire(self, now: float) -> None:
        """Drop speculative placements whose time is up (callers use one time-to-live, so
        claims expire in the order they were made)."""
        queue = self._pending_queue
        while queue and queue[0].expires_at <= now:
            claim = queue.popleft()
            self._pending_blocks[claim.slot] -= len(claim.chain)
            self._claims.remove(claim.slot, claim.chain)
            self.counters.speculative_expired += 1

    # ---- internals ---------------------------------------------------------------------

    def _drop_subtree(self, slot: int, root: int, tier: Tier) -> None:
        bit = 1 << slot
        masks, counts = self._masks[tier], self._counts[tier]
        children = self._children
        stack = [root]
        while stack:
            h = stack.pop()
            mask = masks.get(h, 0)
            if not mask & bit:
                continue
            if h != root:
                self.counters.cascaded_removals += 1
            counts[slot] -= 1
            kids = children.get(h)
            if kids:
                stack.extend(kids)
            self._unset(masks, h, mask & ~bit)

    def _unset(self, masks: dict[int, int], h: int, remaining: int) -> None:
        """Store block `h`'s holder mask after a slot left it; forget the block when none is
        left."""
        if remaining:
            masks[h] = remaining
        else:
            del masks[h]
            self._unlink_if_unheld(h)

    def _unlink_if_unheld(self, h: int) -> None:
        gpu, cpu, disk = self._masks
        if h in gpu or h in cpu or h in disk:
            return
        parent = self._parent.pop(h, None)
        if parent is not None:
            siblings = self._children.get(parent)
            if siblings is not None:
                if len(siblings) == 1:
                    del self._children[parent]
                else:
                    siblings.remove(h)

    def check_integrity(self) -> None:
        """Raise AssertionError if the internal views disagree or a slot's holdings are not
        prefix-closed."""
        for tier in Tier:
            masks = self._masks[tier]
            counts = [0] * self.n_slots
            for h, mask in masks.items():
                assert mask, "zero mask stored"
                assert h in self._parent, "held block missing from the parent map"
                parent = self._parent[h]
                for slot in iter_bits(mask):
                    counts[slot] += 1
                    # Only a lost event (counted as an unknown parent) may leave a gap.
                    assert (
                        parent is None
                        or masks.get(parent, 0) & (1 << slot)
                        or (self.counters.unknown_parents)
                    ), f"slot {slot} holds {h:#x} but not its parent (tier {tier.name})"
            assert counts == self._counts[tier], f"block counts out of step (tier {tier.name})"
        live = {h for masks in self._masks for h in masks}
        assert live == set(self._parent), "parent map out of step with holdings"
        for parent, kids in self._children.items():
            for kid in kids:
                assert self._parent.get(kid) == parent, "children map out of step"
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
