"""Speculative placements ("claims") as a radix tree over block-hash chains.

A claim says a slot will hold a chain of chained block hashes (from the root). A prompt's
claimed match on a slot is the longest common prefix of the prompt with any live claim of that
slot. Scanning every claim makes that cost grow with the placement rate (rate × time to
live); the tree makes it grow with the number of places where live claims part along the
prompt's path instead, a handful in practice (shared system prompt, session, turn).

Edges are spans of a claim's own chain (no copies). Every claim passing through a node covers
the node's whole edge, so a node keeps, per slot, how many live claims pass through it.
Because hashes are chained, two chains agree at position i exactly when they agree on every
position up to i: where an edge and a prompt part is found by galloping, in O(log L).
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two chains of chained hashes (equal at i ⇒ equal
    before i): gallop from the start, where chains usually part, then bisect."""
    n = min(len(a), len(b))
    if n == 0 or a[0] != b[0]:
        return 0
    if a[n - 1] == b[n - 1]:
        return n
    lo, step = 1, 1  # a[:lo] == b[:lo]
    hi = n - 1  # a[hi] != b[hi]
    while lo + step < hi and a[lo + step] == b[lo + step]:
        lo += step + 1
        step <<= 1
    return _first_difference(a, b, lo, min(hi, lo + step))


def _agree_until(a: Sequence[int], b: Sequence[int], lo: int, hi: int) -> int:
    """First position in [lo, hi) where the chains differ, or `hi`; they agree before `lo`.
    One lookup when they agree to the end (the common case along a shared path)."""
    if a[hi - 1] == b[hi - 1]:
        return hi
    return _first_difference(a, b, lo, hi - 1)


def _first_difference(a: Sequence[int], b: Sequence[int], lo: int, hi: int) -> int:
    """Bisect for the first differing position, given a[:lo] == b[:lo] and a[hi] != b[hi]."""
    while lo < hi:
        mid = (lo + hi) >> 1
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo


class _Node:
    """An edge `chain[start:end]`, the live claims through it per slot (and as a bitmask),
    and the nodes below it keyed by their first hash."""

    __slots__ = ("chain", "children", "end", "mask", "slots", "start")

    def __init__(self, chain: Sequence[int], start: int, end: int) -> None:
        self.chain = chain
        self.start = start
        self.end = end
        self.slots: dict[int, int] = {}
        self.mask = 0
        self.children: dict[int, _Node] = {}

    def count(self, slot: int, delta: int) -> None:
        left = self.slots.get(slot, 0) + delta
        if left:
            self.slots[slot] = left
            self.mask |= 1 << slot
        else:
            del self.slots[slot]
            self.mask &= ~(1 << slot)


class ClaimTree:
    """Live claims of every slot; see the module docstring."""

    def __init__(self) -> None:
        self._root = _Node((), 0, 0)

    def add(self, slot: int, chain: Sequence[int]) -> None:
        """Record a claim of `slot` on `chain` (non-empty, from the root)."""
        node, pos, n = self._root, 0, len(chain)
        while pos < n:
            child = node.children.get(chain[pos])
            if child is None:
                leaf = node.children[chain[pos]] = _Node(chain, pos, n)
                leaf.count(slot, 1)
                return
            end = _agree_until(child.chain, chain, pos + 1, min(child.end, n))
            if end < child.end:  # the claim parts (or ends) inside the edge: split it there
                child = self._split(node, child, end)
            child.count(slot, 1)
            node, pos = child, end

    def remove(self, slot: int, chain: Sequence[int]) -> None:
        """Drop one claim of `slot` on `chain` (one that `add` recorded)."""
        node, pos, n = self._root, 0, len(chain)
        while pos < n:
            child = node.children[chain[pos]]
            child.count(slot, -1)
            if not child.slots:  # no claim passes here, so none below either
                del node.children[chain[pos]]
                return
            node, pos = child, child.end

    def match(self, hashes: Sequence[int], into: dict[int, int], limit: int | None = None) -> None:
        """Raise `into[slot]` to the prompt's (its first `limit` blocks') longest common prefix
        with any claim of the slot (slots with no claim along the prompt are left alone)."""
        path: list[tuple[int, int]] = []  # (slots through the node, prompt blocks matched)
        n = len(hashes) if limit is None else max(min(len(hashes), limit), 0)
        node, pos = self._root, 0
        while pos < n:
            child = node.children.get(hashes[pos])
            if child is None:
                break
            end = _agree_until(child.chain, hashes, pos + 1, min(child.end, n))
            path.append((child.mask, end))
            if end < child.end:
                break
            node, pos = child, end
        # Claims through a node pass through its parent too: a slot's match is the deepest
        # node it appears in, so walk up and settle each slot once.
        settled = 0
        for mask, end in reversed(path):
            new = mask & ~settled
            if new:
                settled |= new
                while new:
                    low = new & -new
                    slot = low.bit_length() - 1
                    if end > into.get(slot, 0):
                        into[slot] = end
                    new ^= low

    def claims_through(self) -> dict[tuple[int, ...], dict[int, int]]:
        """Every node's path from the root (as a tuple) and its per-slot claim counts (for
        integrity checks)."""
        out: dict[tuple[int, ...], dict[int, int]] = {}
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            assert node.mask == sum(1 << slot for slot in node.slots), "claim mask out of step"
            out[tuple(node.chain[: node.end])] = dict(node.slots)
            stack.extend(node.children.values())
        return out

    @staticmethod
    def _split(parent: _Node, child: _Node, at: int) -> _Node:
        """Cut `child`'s edge at position `at`; returns the new upper part."""
        upper = _Node(child.chain, child.start, at)
        upper.slots = dict(child.slots)
        upper.mask = child.mask
        upper.children[child.chain[at]] = child
        parent.children[child.chain[child.start]] = upper
        child.start = at
        return upper
