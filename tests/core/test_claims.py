"""The claim tree: a slot's claimed match is its longest common prefix with the prompt, adding
and removing claims keeps one count per slot on each edge, and the common prefix of two chains
is found without scanning them."""

from __future__ import annotations

import random

import pytest

from kvsched.core.claims import ClaimTree, common_prefix


def chained(prefix: int, n: int) -> tuple[int, ...]:
    """`n` hashes of their own (they part from every other prefix's at the first)."""
    return tuple(prefix * 1000 + i for i in range(n))


def parting(base: tuple[int, ...], at: int, prefix: int, n: int) -> tuple[int, ...]:
    """A chain agreeing with `base` on its first `at` blocks, then of its own to length `n`
    (chained hashes differ everywhere after they first differ)."""
    return base[:at] + tuple(prefix * 1000 + i for i in range(at, n))


A = chained(1, 8)


def brute_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize(
    ("a", "b", "common"),
    [
        ((), (), 0),
        ((), A, 0),
        (A, (), 0),
        (A, chained(2, 8), 0),  # part at the first block
        (A, A, 8),
        (A, A[:3], 3),  # one is a prefix of the other
        (A[:3], A, 3),
        (A, parting(A, 1, 2, 8), 1),
        (A, parting(A, 5, 2, 8), 5),
        (A, parting(A, 7, 2, 8), 7),  # part at the last block
        (A, parting(A, 4, 2, 20), 4),
    ],
)
def test_common_prefix_of_chained_hashes(
    a: tuple[int, ...], b: tuple[int, ...], common: int
) -> None:
    assert common_prefix(a, b) == common_prefix(b, a) == common


def test_common_prefix_agrees_with_a_scan_at_every_length_and_parting_point() -> None:
    for n in range(1, 40):
        base = chained(1, n)
        for at in range(n + 1):
            for other_n in (at, n, n + 3):
                other = parting(base, at, 2, other_n)
                assert common_prefix(base, other) == brute_prefix(base, other), (n, at, other_n)


def matched(
    tree: ClaimTree, hashes: tuple[int, ...], into: dict[int, int] | None = None
) -> dict[int, int]:
    out = {} if into is None else dict(into)
    tree.match(hashes, out)
    return out


def test_an_empty_tree_matches_nothing_and_leaves_what_it_is_given() -> None:
    tree = ClaimTree()
    assert matched(tree, A) == {}
    assert matched(tree, A, {3: 5}) == {3: 5}
    assert matched(tree, ()) == {}
    assert tree.claims_through() == {}


@pytest.mark.parametrize(
    ("prompt", "blocks"),
    [
        (A[:6], 6),  # the whole claim
        (A, 6),  # a prompt longer than the claim matches the claim
        (A[:4], 4),  # a shorter one, itself
        (parting(A, 3, 2, 8), 3),  # one parting inside the claim, up to where it parts
        (chained(2, 6), 0),  # nothing in common
        ((), 0),
    ],
)
def test_a_claim_matches_the_prompts_common_prefix(prompt: tuple[int, ...], blocks: int) -> None:
    tree = ClaimTree()
    tree.add(2, A[:6])
    assert matched(tree, prompt) == ({2: blocks} if blocks else {})


@pytest.mark.parametrize(
    ("already", "after"), [(2, 6), (6, 6), (7, 7)], ids=["raised", "equal", "never lowered"]
)
def test_a_match_raises_the_slots_blocks_and_never_lowers_them(already: int, after: int) -> None:
    tree = ClaimTree()
    tree.add(0, A[:6])
    assert matched(tree, A, {0: already, 1: 4}) == {0: after, 1: 4}


def test_every_slot_gets_its_own_deepest_claim_along_the_prompt() -> None:
    tree = ClaimTree()
    tree.add(0, A[:2])
    tree.add(0, A[:7])  # the same slot deeper: the deeper counts
    tree.add(1, parting(A, 4, 2, 8))
    tree.add(2, A[:4])
    tree.add(3, chained(3, 8))  # another path: not matched
    tree.add(63, A)  # far slots too (the tree keeps a bitmask of slots)
    tree.add(64, A[:5])
    assert matched(tree, A) == {0: 7, 1: 4, 2: 4, 63: 8, 64: 5}
    assert matched(tree, A[:3]) == {0: 3, 1: 3, 2: 3, 63: 3, 64: 3}


def test_a_claim_parting_inside_an_edge_splits_it_and_counts_both_parts() -> None:
    tree = ClaimTree()
    other = parting(A, 3, 2, 6)
    tree.add(0, A[:6])
    tree.add(1, other)
    assert tree.claims_through() == {A[:3]: {0: 1, 1: 1}, A[:6]: {0: 1}, other: {1: 1}}
    tree.add(0, A[:3])  # ends where the edge was split
    tree.add(0, A[:2])  # ends inside an edge: split again
    assert tree.claims_through() == {
        A[:2]: {0: 3, 1: 1},
        A[:3]: {0: 2, 1: 1},
        A[:6]: {0: 1},
        other: {1: 1},
    }


def test_removing_a_claim_uncounts_it_and_prunes_what_no_claim_passes() -> None:
    tree = ClaimTree()
    other = parting(A, 3, 2, 6)
    tree.add(0, A[:6])
    tree.add(1, other)
    tree.remove(0, A[:6])
    assert tree.claims_through() == {A[:3]: {1: 1}, other: {1: 1}}
    assert matched(tree, A) == {1: 3}
    tree.remove(1, other)
    assert tree.claims_through() == {}
    assert matched(tree, other) == {}


def test_removing_one_of_two_equal_claims_keeps_the_other() -> None:
    tree = ClaimTree()
    tree.add(0, A[:4])
    tree.add(0, A[:4])
    tree.remove(0, A[:4])
    assert tree.claims_through() == {A[:4]: {0: 1}}
    assert matched(tree, A) == {0: 4}


def test_removing_a_shorter_claim_keeps_the_longer_one_through_it() -> None:
    tree = ClaimTree()
    tree.add(0, A[:6])
    tree.add(0, A[:3])
    tree.remove(0, A[:3])
    assert tree.claims_through() == {A[:3]: {0: 1}, A[:6]: {0: 1}}
    assert matched(tree, A) == {0: 6}
    tree.remove(0, A[:6])
    assert tree.claims_through() == {}


def test_matches_agree_with_a_scan_of_the_live_claims() -> None:
    """Random adds and removes over a few shared paths, checked against the obvious scan."""
    rng = random.Random(13)
    paths = [chained(1, 12), parting(chained(1, 12), 4, 2, 12), parting(chained(1, 12), 7, 3, 10)]
    tree = ClaimTree()
    live: list[tuple[int, tuple[int, ...]]] = []
    for _ in range(400):
        if live and rng.random() < 0.4:
            slot, claim = live.pop(rng.randrange(len(live)))
            tree.remove(slot, claim)
        else:
            path = rng.choice(paths)
            claim = path[: rng.randint(1, len(path))]
            slot = rng.randrange(4)
            tree.add(slot, claim)
            live.append((slot, claim))
        prompt = rng.choice(paths)[: rng.randint(0, 12)]
        expected: dict[int, int] = {}
        for slot, claim in live:
            n = brute_prefix(prompt, claim)
            if n:
                expected[slot] = max(expected.get(slot, 0), n)
        assert matched(tree, prompt) == expected
