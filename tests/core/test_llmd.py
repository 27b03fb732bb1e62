"""`llmd`: llm-d's default profile, pinned to what its code says (defaults.go's weights 3, 2
and 2; the queue scorer's min-max normalisation; the precise prefix scorer's matched / total
blocks; the max-score picker's random tie-break)."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.core.cluster import ClusterConfig, Role
from kvsched.core.events import BlocksStored
from kvsched.core.load import LoadReport
from kvsched.core.policies.llmd import queue_scores
from kvsched.core.scheduler import Scheduler
from tests.conftest import chain, request

FREE = 1000  # free KV blocks of every instance (the same usage everywhere) unless said


def cluster(waiting: tuple[int, ...], seed: int = 3) -> Scheduler:
    core = Scheduler(
        ClusterConfig(n_instances=len(waiting)), "llmd", seed=seed, max_prompt_tokens=131_072
    )
    for slot, queued in enumerate(waiting):
        core.add_instance(slot, Role.BOTH)
        core.apply(slot, [LoadReport(0, 0.0, queued, 0, 0, FREE)])
    return core


def test_the_queue_scorer_normalises_between_the_shortest_and_longest_queue() -> None:
    eligible = np.array([True, True, True, False])
    scores = queue_scores(np.array([2.0, 6.0, 4.0, 0.0]), eligible)
    assert scores[:3].tolist() == [1.0, 0.0, 0.5]
    assert queue_scores(np.array([3.0, 3.0]), np.array([True, True])).tolist() == [1.0, 1.0]


@pytest.mark.parametrize(("held", "winner"), [(8, 0), (4, 1)])
def test_a_whole_prefix_outweighs_the_longest_queue_half_of_one_does_not(
    held: int, winner: int
) -> None:
    """Slot 0 holds `held` of the prompt's 8 blocks and has the longest queue (queue score 0);
    slot 1 holds none and the shortest (1). Prefix weight 3 against queue weight 2: the whole
    prefix (3 > 2) wins, half of it (1.5 < 2) loses."""
    core = cluster((5, 0))
    hashes = chain(1, 8)
    core.apply(0, [BlocksStored(hashes[:held])])
    decision = core.place(request(1, hashes, prompt=8 * 16 + 5), 0.0)
    assert decision.instance == winner
    score = decision.terms["score"]
    kv = decision.terms["kv_score"]
    assert score[0] == pytest.approx(3.0 * held / 8 + 2.0 * 0.0 + 2.0 * kv[0])
    assert score[1] == pytest.approx(3.0 * 0.0 + 2.0 * 1.0 + 2.0 * kv[1])
    assert decision.terms["queue_score"].tolist() == [0.0, 1.0]


def test_kv_usage_weighs_as_much_as_the_queue() -> None:
    core = cluster((0, 0))
    core.apply(1, [LoadReport(0, 0.0, 0, 0, 0, core.cluster.capacity_blocks)])  # all free
    decision = core.place(request(1, chain(2, 4)), 0.0)
    assert decision.instance == 1
    kv = decision.terms["kv_score"]
    assert kv[1] == 1.0 and kv[0] == pytest.approx(FREE / core.cluster.capacity_blocks)


def test_ties_go_to_any_of_the_best_at_random_as_the_seed_draws() -> None:
    chosen = {cluster((0, 0, 0), seed).place(request(1, chain(3, 4)), 0.0).instance
              for seed in range(12)}  # fmt: skip
    assert chosen == {0, 1, 2}
    again = [cluster((0, 0, 0), 5).place(request(1, chain(3, 4)), 0.0).instance for _ in range(3)]
    assert len(set(again)) == 1  # the same seed, the same draw
