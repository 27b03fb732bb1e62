"""The replay's decisions and report rows, pinned: three policies on two bundled traces, as
`python -m tools.decision_digest` prints them. A refactor must leave these digests unchanged;
a change meant to alter decisions updates them in the same commit, saying why.

The rows' digests last moved when `hotspot_index` became the queued-prefill excess and the
old max/mean figure moved to `hotspot_pmr`: the decisions' digests stayed, and each new row,
with `hotspot_pmr` put back under `hotspot_index`, digests as the row pinned before; and again,
on the closed-loop trace, when the rows gained `steady_inflight_sessions` (without it, each
new row digests as the row pinned before)."""

from __future__ import annotations

import pytest

from tools.decision_digest import POLICIES, SLICES, TRACES, digests

PINNED = {
    "mooncake_conversation_head.jsonl": {
        "cache_aware": ("5ddc1dc1a01153c0", "b321da7b4dc24645"),
        "mooncake": ("39b6520630a7f5be", "23c4052f65f1c844"),
        "elastic": ("ab447078e0daf942", "49d246bfbf47d399"),
    },
    "weka_cc_agentic_sample.jsonl.xz": {
        "cache_aware": ("3125db83c2fae6c2", "d5b881a5f716033b"),
        "mooncake": ("7a77724bd7a4c0b5", "589449cfedf40f51"),
        "elastic": ("550ce43dc44d712d", "8ffe6b6bf3cd0bfa"),
    },
}


@pytest.mark.parametrize(
    "pure",
    [True, False],
    ids=["pure index, scoring and cache", "compiled index, scoring and cache"],
)
def test_the_replay_decides_and_reports_as_pinned(pure: bool) -> None:
    # The compiled index, scoring and engine cache must decide as the references do.
    assert set(PINNED) == set(TRACES)
    for name in TRACES:
        got = {
            spec: (pair["decisions"], pair["policies_row"])
            for spec, pair in digests(SLICES / name, POLICIES, pure=pure).items()
        }
        assert got == PINNED[name], name
