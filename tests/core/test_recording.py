"""Deciding changes no shared state; recording a placement, a completion and a transfer does."""

from __future__ import annotations

from random import Random

import numpy as np
import pytest

from kvsched.core import recording
from kvsched.core.cluster import ClusterState
from kvsched.core.decision import Completion
from kvsched.core.index import Tier
from kvsched.core.policies import ALL_POLICIES, POLICIES, make_policy
from kvsched.core.request_view import request_view
from tests.conftest import chain, make_cluster, request, set_load

LOAD_FIELDS = ("pending_prefill_tokens", "pending_prefill_s", "running", "free_blocks", "in_flight")


def snapshot(cluster: ClusterState) -> tuple[object, ...]:
    load = tuple(tuple(getattr(cluster.load, name)) for name in LOAD_FIELDS)
    held = tuple(cluster.index.block_count(s, tier) for s in range(cluster.n) for tier in Tier)
    session = cluster.sessions.get("s")
    assert session is not None
    speculated = cluster.index.pending_count()
    return load, held, speculated, session.host, session.pending_target, session.turns


@pytest.mark.parametrize("spec", ALL_POLICIES)
def test_deciding_changes_no_shared_state_and_recording_does(spec: str) -> None:
    cluster = make_cluster(4, roles=POLICIES[spec].roles(4))
    policy = make_policy(spec, cluster)
    hashes = chain(1, 40)
    first = recording.place(cluster, policy, request(1, hashes[:20], session="s"), 0.0, Random(0))
    cluster.index.store(first.instance, hashes[:20], None)
    set_load(cluster, first.instance, pending=20_000)
    req = request(2, hashes, session="s")
    before = snapshot(cluster)
    policy.decide(request_view(cluster, req, 0.0), 1.0, Random(0))
    assert snapshot(cluster) == before
    decision = recording.place(cluster, policy, req, 1.0, Random(0))
    assert not decision.rejected
    assert cluster.load.in_flight[decision.instance] == 1 + (decision.instance == first.instance)
    assert cluster.index.pending_count() > 0  # the prompt is speculated where it runs
    session = cluster.sessions.get("s")
    assert session is not None and decision.instance in (session.host, session.pending_target)


def test_a_rejection_records_only_the_session_arrival() -> None:
    cluster = make_cluster(2)
    policy = make_policy("elastic", cluster)
    for slot in (0, 1):
        set_load(cluster, slot, pending=600_000)
    in_flight = cluster.load.in_flight.copy()
    decision = recording.place(
        cluster, policy, request(1, chain(1, 10), session="s"), 0.0, Random(0)
    )
    assert decision.rejected
    assert np.array_equal(cluster.load.in_flight, in_flight)
    assert cluster.index.pending_count() == 0
    session = cluster.sessions.get("s")
    assert session is not None and session.last_arrival_at == 0.0


def test_finishing_releases_the_load_and_remembers_the_turn() -> None:
    cluster = make_cluster(2)
    policy = make_policy("least_loaded", cluster)
    req = request(1, chain(1, 10), session="s")
    slot = recording.place(cluster, policy, req, 0.0, Random(0)).instance
    assert cluster.load.in_flight[slot] == 1
    done = Completion(1, "s", slot, slot, req.prompt_tokens, 16, 0, req.block_hashes, 0, 0.5, 1)
    assert recording.finish(cluster, policy, done, 1.0) == []
    assert cluster.load.in_flight[slot] == 0
    session = cluster.sessions.get("s")
    assert session is not None and session.context_hashes == req.block_hashes
