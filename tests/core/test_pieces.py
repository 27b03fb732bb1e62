"""The small shared pieces: admission, prefix heat, residency, transfer orders."""

from __future__ import annotations

import math

import pytest

from kvsched.core import admission
from kvsched.core.cluster import Role, SloConfig
from kvsched.core.cost import plan_copy
from kvsched.core.decision import TransferKind
from kvsched.core.hotness import PrefixHeat
from kvsched.core.pickers import bound_per_slot
from kvsched.core.residency import ResidentSessions
from kvsched.core.sessions import SessionTable
from kvsched.core.topology import SAME_NODE
from tests.conftest import make_cluster

SLO = SloConfig(ttft_s=2.0, tpot_s=0.1)


def test_admission_refuses_queueing_misses_not_hopeless_requests() -> None:
    assert admission.check(1.9, 0.5, SLO) is None
    refusal = admission.check(3.5, 0.5, SLO, min_retry_s=0.1)
    assert refusal is not None and refusal.retry_after_s == pytest.approx(1.5)
    assert admission.check(9.0, 8.0, SLO) is None  # slower than the SLO even when idle
    assert admission.check(1.0, 0.5, SLO, min_retry_s=2.0) is None
    tbt = admission.check(1.0, 0.5, SLO, tbt_s=0.2)
    assert tbt is not None and "inter-token" in tbt.rule


def test_admission_counts_the_time_a_request_already_waited() -> None:
    assert admission.check(1.5, 0.5, SLO, waited_s=0.4) is None
    late = admission.check(1.5, 0.5, SLO, waited_s=0.6)  # 2.1 s as the client sees it
    assert late is not None and late.retry_after_s == 0.0  # a retry starts afresh: now
    # The floor is taken alone: a retry (nothing waited) could still meet the SLO.
    assert admission.check(1.5, 1.9, SLO, waited_s=0.6) is not None


def test_prefix_heat_is_hits_over_root_age() -> None:
    heat = PrefixHeat()
    assert heat.hit(7, 10.0) == (1, 1.0)
    heat.hit(7, 12.0)
    hits, score = heat.hit(7, 14.0)
    assert hits == 3 and score == pytest.approx(3 / math.sqrt(4.0))
    heat.reset(7, 20.0)
    assert heat.hit(7, 20.5) == (1, 1.0)


def test_residency_moves_and_expires_claims() -> None:
    sessions = SessionTable()
    resident = ResidentSessions(3, window_s=10.0)
    sessions.arrive("a", 0.0)
    resident.claim("a", 1, 1000.0, 0.0)
    resident.claim("a", 2, 1500.0, 1.0)  # moved and grew
    assert list(resident.tokens) == [0.0, 0.0, 1500.0]
    sessions.arrive("a", 8.0)  # active again: the first expiry must not drop it
    resident.expire(10.5, sessions)
    assert resident.tokens[2] == 1500.0
    resident.expire(30.0, sessions)
    assert list(resident.tokens) == [0.0, 0.0, 0.0]


def test_transfer_orders_cover_exactly_the_missing_blocks() -> None:
    cluster = make_cluster(4, block_size=16)
    hashes = tuple(range(1, 11))
    plan = plan_copy(
        cluster.cost,
        TransferKind.MIGRATE_SESSION,
        0,
        3,
        hashes=hashes,
        have=4,
        upto=9,
        on_path=False,
    )
    assert plan is not None
    assert (plan.block_hashes, plan.skip_blocks, plan.n_blocks) == (hashes[:9], 4, 5)
    assert plan.tokens == 80 and plan.nbytes == 80 * cluster.cost.kv_bytes_per_token
    assert plan.est_seconds == pytest.approx(cluster.cost.transfer_s(0, 3, 80))
    assert (
        plan_copy(
            cluster.cost,
            TransferKind.FETCH_PREFIX,
            0,
            1,
            hashes=hashes,
            have=5,
            upto=5,
            on_path=True,
        )
        is None
    )


def test_topology_distances_and_costs() -> None:
    cluster = make_cluster(16)
    topo = cluster.cost.topology
    assert [topo.distance(0, j) for j in (1, 4, 8)] == [0, 1, 2]
    assert topo.transfer_s(0, 0, 10**9) == 0.0
    near, far = topo.transfer_s(0, 1, 10**9), topo.transfer_s(0, 8, 10**9)
    assert 0 < near < far


def test_an_instance_joining_on_another_node_moves_in_the_topology() -> None:
    cluster = make_cluster(4)  # four slots on one node by default
    same_node = cluster.cost.transfer_s(0, 3, 16_384)
    cluster.add_instance(3, Role.BOTH, node=9)
    assert cluster.cost.topology.distance(0, 3) != SAME_NODE
    assert cluster.cost.transfer_s(0, 3, 16_384) > same_node
    assert cluster.cost.transfer_s(0, 1, 16_384) == same_node  # the others did not move


def test_distance_matrix_agrees_with_pairwise_distances() -> None:
    topo = make_cluster(40).cost.topology
    matrix = topo.distances()
    assert all(matrix[a, b] == topo.distance(a, b) for a in range(40) for b in range(40) if a != b)
    assert set(matrix[0].tolist()) == {0, 1, 2, 3}


def test_a_measured_transfer_moves_its_link_estimate_only() -> None:
    cluster = make_cluster(16)
    cost = cluster.cost
    rack_link = cost.topology.link(0, 4)
    nbytes = 10**9
    # Measured at a tenth of the configured rate: the estimate moves part of the way there.
    seconds = rack_link.setup_s + 10 * nbytes / rack_link.bandwidth_bytes_per_s
    slower = cost.with_measured_transfer(0, 4, nbytes, seconds)
    before, after = cost.transfer_s(0, 4, 4096), slower.transfer_s(0, 4, 4096)
    assert before < after < cost.transfer_s(0, 4, 4096 * 10)
    assert slower.transfer_s(1, 5, 4096) == after  # every pair at that distance
    assert slower.transfer_s(0, 1, 4096) == cost.transfer_s(0, 1, 4096)  # other distances not
    # Nothing to learn from a transfer faster than the link's setup, or one of no bytes.
    assert cost.with_measured_transfer(0, 4, nbytes, rack_link.setup_s / 2) is cost
    assert cost.with_measured_transfer(0, 4, 0, 1.0) is cost
    cluster.cost = slower
    cluster.add_instance(8, Role.BOTH, node=1)  # the learned rate survives a topology change
    assert cluster.cost.transfer_s(0, 8, 4096) == after


def test_sessions_bound_per_slot_count_every_binding_and_move() -> None:
    cluster = make_cluster(n=6)
    sessions = cluster.sessions
    for k, host in enumerate([1, 1, 4, 5, 1]):
        sessions.arrive(f"s{k}", 0.0)
        sessions.bind(f"s{k}", host, 0.0, migrated=False)
    sessions.bind("s0", 4, 1.0, migrated=True)  # moved: one fewer on 1, one more on 4
    assert list(bound_per_slot(cluster)) == [0, 2, 0, 0, 2, 1]
    assert list(bound_per_slot(cluster)) == [sessions.bound_on(s) for s in range(6)]
