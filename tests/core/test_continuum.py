"""`continuum`: Eq. 2's time-to-live, pinned on its paper's rule (and on the optimum it
takes while few durations are known), and the pin order after a tool call."""

from __future__ import annotations

import math
from random import Random

import pytest

from kvsched.core import recording
from kvsched.core.cluster import ClusterConfig, Role
from kvsched.core.decision import Completion, TransferKind, TransferPlan
from kvsched.core.policies import make_policy
from kvsched.core.policies.continuum import COLD_START_SAMPLES, Continuum, retention_s
from kvsched.core.scheduler import Scheduler
from tests.conftest import chain, make_cluster, request


def test_eq2_picks_the_duration_that_best_trades_reload_against_holding() -> None:
    """Durations 0.5, 1, 3 and 10 s alike often, benefit 4 s: P(τ)·4 − τ is 0.5, 1.0, 0 and
    −6 (and 0 at τ = 0): τ* = 1 s. A benefit of 0.2 s pins nothing."""
    durations = [0.5, 1.0, 3.0, 10.0] * 30
    assert len(durations) > COLD_START_SAMPLES
    assert retention_s(durations, 4.0) == 1.0
    assert retention_s(durations, 0.2) == 0.0
    assert retention_s(durations, 100.0) == 10.0  # worth holding past the longest


def test_with_few_durations_the_exponential_optimum_holds() -> None:
    assert retention_s([5.0] * COLD_START_SAMPLES, 4.0) == pytest.approx(math.log(4.0))
    assert retention_s([], 0.9) == 0.0


def finish(
    policy: Continuum, rid: int, hashes: tuple[int, ...], *, tool: bool
) -> list[TransferPlan]:
    done = Completion(
        rid, "s", 0, 0, len(hashes) * 16, 16, 0, hashes, 0.0, 0.5, 1.0, tool_call=tool
    )
    return list(recording.finish(policy.cluster, policy, done, 1.0))


def test_a_tool_call_turn_orders_its_context_kept_and_an_answer_does_not() -> None:
    cluster = make_cluster(2)
    policy = make_policy("continuum", cluster)
    assert isinstance(policy, Continuum)
    hashes = chain(1, 4_000)  # 64K tokens: recomputing it takes seconds, worth holding
    first = recording.place(cluster, policy, request(1, hashes, session="s"), 0.0, Random(0))
    plans = finish(policy, 1, hashes, tool=True)
    assert [p.kind for p in plans] == [TransferKind.RETAIN]
    assert plans[0].source == plans[0].target == first.instance
    assert plans[0].est_seconds == pytest.approx(math.log(cluster.cost.prefill_one(64_016, 0)))
    again = recording.place(cluster, policy, request(2, hashes, session="s"), 30.0, Random(0))
    assert again.instance == first.instance  # affinity
    assert list(policy.durations) == [29.0]  # 30 s arrival after the 1 s finish
    assert finish(policy, 2, hashes, tool=False) == []


def test_a_live_conductor_runs_it_as_affinity_alone() -> None:
    """Stock vLLM cannot pin blocks: a scheduler without an engine that can hands no RETAIN
    order out (the simulator's does)."""
    for runs, kinds in ((False, []), (True, [TransferKind.RETAIN])):
        core = Scheduler(
            ClusterConfig(n_instances=2), "continuum", seed=0, max_prompt_tokens=131_072,
            runs_engine_orders=runs,
        )  # fmt: skip
        for slot in range(2):
            core.add_instance(slot, Role.BOTH)
        hashes = chain(1, 4_000)
        slot = core.place(request(1, hashes, session="s"), 0.0).instance
        done = Completion(1, "s", slot, slot, 64_000, 16, 0, hashes, 0.0, 0.5, 1.0, tool_call=True)
        assert [p.kind for p in core.finish(done, 1.0)] == kinds
