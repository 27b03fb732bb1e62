"""`bench.sim_checkouts`: a round of replays run by a checkout's own code in a child process,
so the bench cannot rot."""

from __future__ import annotations

import pytest

from bench.common import REPO
from bench.sim_checkouts import run_round


@pytest.mark.slow
def test_a_round_in_this_checkout_replays_each_policy_once() -> None:
    trace = REPO / "data" / "traces" / "mooncake_conversation_head.jsonl"
    first = run_round(REPO, trace, 4, ("round_robin", "least_loaded"))
    again = run_round(REPO, trace, 4, ("round_robin",))
    assert set(first) == {"round_robin", "least_loaded"}
    simulated, wall, cpu = first["round_robin"]
    assert simulated > 0 and wall > 0 and cpu > 0
    assert again["round_robin"][0] == simulated  # the same code simulates the same span
