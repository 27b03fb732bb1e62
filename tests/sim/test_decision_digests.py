"""The replay's decisions and report rows, pinned: three policies on two bundled traces, as
`python -m tools.decision_digest` prints them. A refactor must leave these digests unchanged;
a change meant to alter decisions updates them in the same commit, saying why."""

from __future__ import annotations

import pytest

from kvsched.core import scoring
from kvsched.core.holdings import PURE_ENV
from kvsched.sim import cache
from tools.decision_digest import POLICIES, SLICES, TRACES, digests

PINNED = {
    "mooncake_conversation_head.jsonl": {
        "cache_aware": ("5ddc1dc1a01153c0", "bb28b0aa10b98924"),
        "mooncake": ("39b6520630a7f5be", "3cb62475b5aed62f"),
        "elastic": ("ab447078e0daf942", "4e22fc2c6baebf8c"),
    },
    "weka_cc_agentic_sample.jsonl.xz": {
        "cache_aware": ("3125db83c2fae6c2", "fdc16fc7b19436e7"),
        "mooncake": ("7a77724bd7a4c0b5", "04e81dbe3711719e"),
        "elastic": ("550ce43dc44d712d", "6294322f8091662e"),
    },
}


@pytest.mark.parametrize(
    "pure",
    ["1", "0"],
    ids=["pure index, scoring and cache", "compiled index, scoring and cache"],
)
def test_the_replay_decides_and_reports_as_pinned(
    pure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The compiled index, scoring and simulator cache must decide as the references do.
    monkeypatch.setenv(PURE_ENV, pure)
    monkeypatch.setenv(cache.PURE_ENV, pure)
    monkeypatch.setattr(scoring, "active", scoring.load_kernels(pure == "1"))
    assert set(PINNED) == set(TRACES)
    for name in TRACES:
        got = {
            spec: (pair["decisions"], pair["policies_row"])
            for spec, pair in digests(SLICES / name, POLICIES).items()
        }
        assert got == PINNED[name], name
