"""Runs: coalescing block pages into runs, and what a prepared `Runs` knows."""

from __future__ import annotations

import pytest

from services.dataplane.kv_layout import KvLayout
from services.dataplane.transfer.runs import (
    LastRuns,
    Run,
    Runs,
    check_read,
    coalesce,
    merge_spans,
    run_pages,
)

LAYOUT = KvLayout(layers=2, pages=16, chunk_bytes=64, block_size=16)


@pytest.mark.parametrize(
    ("src", "dst", "runs"),
    [
        ([], [], []),
        ([5], [9], [Run(5, 9, 1)]),
        ([0, 1, 2, 3], [4, 5, 6, 7], [Run(0, 4, 4)]),
        # the source consecutive, the destination not: a new run at each break
        ([0, 1, 2, 3], [4, 5, 9, 10], [Run(0, 4, 2), Run(2, 9, 2)]),
        # the destination consecutive, the source not
        ([7, 8, 2, 3], [0, 1, 2, 3], [Run(7, 0, 2), Run(2, 2, 2)]),
        # reversed: every page its own run
        ([3, 2, 1], [0, 1, 2], [Run(3, 0, 1), Run(2, 1, 1), Run(1, 2, 1)]),
        # a repeated page breaks a run
        ([1, 1, 2], [0, 1, 2], [Run(1, 0, 1), Run(1, 1, 2)]),
        ([10, 11, 0, 12], [0, 1, 2, 3], [Run(10, 0, 2), Run(0, 2, 1), Run(12, 3, 1)]),
    ],
)
def test_coalesce(src: list[int], dst: list[int], runs: list[Run]) -> None:
    assert coalesce(src, dst) == runs
    assert run_pages(runs) == len(src)


def test_coalesce_refuses_unpaired_pages() -> None:
    with pytest.raises(ValueError, match="3 source pages but 2"):
        coalesce([1, 2, 3], [1, 2])


def test_run_refuses_empty_or_negative() -> None:
    with pytest.raises(ValueError):
        Run(0, 0, 0)
    with pytest.raises(ValueError):
        Run(-1, 0, 1)


def test_runs_knows_its_extent_and_spans() -> None:
    runs = Runs([Run(2, 10, 2), Run(4, 0, 1), Run(5, 12, 3)])
    assert list(runs) == [Run(2, 10, 2), Run(4, 0, 1), Run(5, 12, 3)]
    assert (runs.pages, runs.src_end, runs.dst_end) == (6, 8, 15)
    # The source side is consecutive from page 2 to 7: one span; the destination three.
    assert runs.spans("src", 64) == [(128, 512)]
    assert runs.spans("dst", 64) == [(640, 768), (0, 64), (768, 960)]
    assert runs.spans("dst", 64) is runs.spans("dst", 64)  # computed once


def test_merge_spans_merges_only_adjacent_stretches() -> None:
    assert merge_spans([(0, 1), (1, 2), (5, 1), (4, 1)], 8) == [(0, 24), (40, 48), (32, 40)]


def test_last_runs_recognises_the_same_list_and_notices_changes() -> None:
    prepare = LastRuns()
    runs = coalesce([0, 1, 5], [3, 4, 8])
    first = prepare(runs)
    assert prepare(runs) is first
    assert prepare(list(runs)) is first  # the same Run objects
    runs[1] = Run(6, 8, 1)  # changed in place
    again = prepare(runs)
    assert again is not first and list(again) == runs
    already = Runs(runs)
    assert prepare(already) is already


def test_check_read_refuses_what_does_not_fit() -> None:
    ok = Runs([Run(0, 15, 1)])
    check_read(1, ok, LAYOUT, LAYOUT)
    with pytest.raises(ValueError, match="layer 2"):
        check_read(2, ok, LAYOUT, LAYOUT)
    with pytest.raises(ValueError, match="destination"):
        check_read(0, Runs([Run(0, 15, 2)]), LAYOUT, LAYOUT)
    with pytest.raises(ValueError, match="at least one run"):
        check_read(0, Runs([]), LAYOUT, LAYOUT)
    with pytest.raises(ValueError, match="one layer"):
        check_read(0, Runs([Run(0, 0, 10), Run(0, 0, 10)]), LAYOUT, LAYOUT)
    other = KvLayout(layers=2, pages=16, chunk_bytes=128, block_size=16)
    with pytest.raises(ValueError, match="same model"):
        check_read(0, ok, LAYOUT, other)
