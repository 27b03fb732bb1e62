"""Block holdings of the prefix index: which slots hold which block in which tier, the chain
links between blocks, and the chain match — in two implementations with one interface.

`PyHoldings` below is the reference: plain dicts, easy to read, the oracle of the property
tests. `kvsched.core._holdings.Holdings` is the same thing compiled from C (built by pip from
`_holdings.c`): an open-addressing table keyed by the u64 hash with one holder word per block
and tier, about 39 bytes a block (8-9 times less than the reference) and 1.5-2.5 times as fast
to match (`bench.index_memory`). `make_holdings` picks one: the compiled one unless asked
for the reference (`pure=True`, which `build_cluster` passes on). The two agree on every
result; the order of the lists `blocks_of` and `subtree_of` return is unspecified (callers
treat them as sets).

Invariants (`kvsched.core.index` relies on them): a block is linked under the parent it was
first stored with while some slot holds it in some tier; `remove` of a block drops its
descendants held by the same slot in the same tier; anomalies (unknown parent, duplicate
store, absent removal, cascaded removal) are counted, never raised.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

from kvsched.core.packed import PackedHashes

# unknown_parents, duplicate_stores, absent_removals, cascaded_removals
Counters = tuple[int, int, int, int]
# masks per tier {hash: holders}, {held hash: parent or None}, {hash: children}, counts per tier
Snapshot = tuple[
    tuple[dict[int, int], ...], dict[int, int | None], dict[int, list[int]], tuple[list[int], ...]
]
N_TIERS = 3


class BlockHoldings(Protocol):
    """What the prefix index needs of its block store; tiers are `Tier` values (0, 1, 2)."""

    def holders(self, block: int, tier: int = 0, /) -> int:
        """Bitmask of the slots holding `block` in `tier` (0 if none). Changes nothing."""

    def count(self, slot: int, tier: int = 0, /) -> int:
        """Blocks `slot` holds in `tier`. Changes nothing."""

    def counts(self, tier: int = 0, /) -> list[int]:
        """Blocks each slot holds in `tier`, in slot order. Changes nothing."""

    def __len__(self) -> int:
        """Distinct blocks held anywhere."""

    def match(
        self, hashes: Sequence[int], tier: int = 0, limit: int | None = None, /
    ) -> dict[int, int]:
        """Leading blocks of `hashes` (of its first `limit` when given) held per slot (slots
        with none absent). Changes nothing."""

    def store(self, slot: int, hashes: Sequence[int], parent: int | None, tier: int = 0, /) -> None:
        """`slot` now holds the chain `hashes` (the first continues `parent`) in `tier`."""

    def remove(self, slot: int, hashes: Sequence[int], tier: int = 0, /) -> None:
        """`slot` no longer holds `hashes` in `tier`, nor their descendants there."""

    def store_packed(self, slot: int, packed: bytes, parent: int | None, tier: int = 0, /) -> None:
        """`store` of the hashes `packed` holds (little-endian u64, 8 bytes each; the
        compiled store reads them without a Python int each). Raises ValueError, changing
        nothing, unless its length is a whole number of hashes."""

    def remove_packed(self, slot: int, packed: bytes, tier: int = 0, /) -> None:
        """`remove` of the hashes `packed` holds; raises ValueError as `store_packed` does."""

    def parent_of(self, block: int, /) -> int | None:
        """The block `block` continues (None at the root or when it is not held)."""

    def blocks_of(self, slot: int, tier: int = 0, /) -> list[int]:
        """Every block `slot` holds in `tier` (a full scan). Changes nothing."""

    def subtree_of(self, slot: int, hashes: Sequence[int], tier: int = 0, /) -> list[int]:
        """The blocks `remove(slot, hashes, tier)` would drop. Changes nothing."""

    def clear_slot(self, slot: int, /) -> None:
        """Forget everything `slot` holds in every tier."""

    def counters(self) -> Counters:
        """Anomalies counted so far (see `Counters`)."""

    def snapshot(self) -> Snapshot:
        """Every mapping as plain dicts, for integrity checks."""


def iter_bits(mask: int) -> Iterator[int]:
    """Slots of the set bits of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def make_holdings(n_slots: int, pure: bool = False) -> BlockHoldings:
    """Block holdings for `n_slots` slots: the compiled ones, or the reference when `pure`."""
    if pure:
        return PyHoldings(n_slots)
    try:
        from kvsched.core._holdings import Holdings  # noqa: PLC0415  (built by pip)
    except ImportError as exc:
        raise ImportError(
            "kvsched's compiled prefix index (kvsched.core._holdings) is not built: reinstall "
            "kvsched with pip (scripts/setup, or pip install -e .), which compiles it with the "
            "machine's C compiler, or run the pure-Python reference (a cluster built with "
            "pure=True: the Conductor's --pure-kernels)"
        ) from exc
    return Holdings(n_slots)


class PyHoldings:
    """The reference implementation (see the module docstring)."""

    def __init__(self, n_slots: int) -> None:
        if n_slots <= 0:
            raise ValueError("an index needs at least one instance slot")
        self.n_slots = n_slots
        self._masks: tuple[dict[int, int], ...] = tuple({} for _ in range(N_TIERS))
        self._counts: tuple[list[int], ...] = tuple([0] * n_slots for _ in range(N_TIERS))
        self._parent: dict[int, int | None] = {}
        self._children: dict[int, list[int]] = {}
        self._unknown_parents = self._duplicate_stores = 0
        self._absent_removals = self._cascaded_removals = 0

    def holders(self, block: int, tier: int = 0, /) -> int:
        return self._masks[tier].get(block, 0)

    def count(self, slot: int, tier: int = 0, /) -> int:
        return self._counts[tier][slot]

    def counts(self, tier: int = 0, /) -> list[int]:
        return list(self._counts[tier])

    def __len__(self) -> int:
        return len(self._parent)

    def match(
        self, hashes: Sequence[int], tier: int = 0, limit: int | None = None, /
    ) -> dict[int, int]:
        # Holdings are prefix-closed per slot, so along the prompt the set of holders only
        # shrinks: gallop then bisect for each place it shrinks.
        get = self._masks[tier].get
        n = len(hashes) if limit is None else max(min(len(hashes), limit), 0)
        result: dict[int, int] = {}
        if n == 0:
            return result
        alive = get(hashes[0], 0)
        pos = 0  # every slot in `alive` holds blocks [0, pos]
        while alive:
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
        return result

    def store(self, slot: int, hashes: Sequence[int], parent: int | None, tier: int = 0, /) -> None:
        bit = 1 << slot
        masks, counts = self._masks[tier], self._counts[tier]
        if parent is not None and not masks.get(parent, 0) & bit:
            self._unknown_parents += 1
        parents, children = self._parent, self._children
        for h in hashes:
            if h not in parents:
                parents[h] = parent
                if parent is not None:
                    children.setdefault(parent, []).append(h)
            mask = masks.get(h, 0)
            if mask & bit:
                self._duplicate_stores += 1
            else:
                masks[h] = mask | bit
                counts[slot] += 1
            parent = h

    def remove(self, slot: int, hashes: Sequence[int], tier: int = 0, /) -> None:
        bit = 1 << slot
        masks, counts = self._masks[tier], self._counts[tier]
        children = self._children
        for h in hashes:
            mask = masks.get(h, 0)
            if not mask & bit:
                self._absent_removals += 1
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

    def store_packed(self, slot: int, packed: bytes, parent: int | None, tier: int = 0, /) -> None:
        self.store(slot, PackedHashes(packed).ints(), parent, tier)

    def remove_packed(self, slot: int, packed: bytes, tier: int = 0, /) -> None:
        self.remove(slot, PackedHashes(packed).ints(), tier)

    def parent_of(self, block: int, /) -> int | None:
        return self._parent.get(block)

    def blocks_of(self, slot: int, tier: int = 0, /) -> list[int]:
        bit = 1 << slot
        return [h for h, mask in self._masks[tier].items() if mask & bit]

    def subtree_of(self, slot: int, hashes: Sequence[int], tier: int = 0, /) -> list[int]:
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

    def clear_slot(self, slot: int, /) -> None:
        bit = 1 << slot
        for tier in range(N_TIERS):
            masks = self._masks[tier]
            for h in self.blocks_of(slot, tier):  # rare: a full scan is fine
                self._unset(masks, h, masks[h] & ~bit)
            self._counts[tier][slot] = 0

    def counters(self) -> Counters:
        return (
            self._unknown_parents,
            self._duplicate_stores,
            self._absent_removals,
            self._cascaded_removals,
        )

    def snapshot(self) -> Snapshot:
        return (
            tuple(dict(m) for m in self._masks),
            dict(self._parent),
            {h: list(kids) for h, kids in self._children.items()},
            tuple(list(c) for c in self._counts),
        )

    def _drop_subtree(self, slot: int, root: int, tier: int) -> None:
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
                self._cascaded_removals += 1
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
