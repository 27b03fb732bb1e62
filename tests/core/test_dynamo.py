"""`dynamo`: Dynamo's KV-router cost, pinned to its docs and code (the worked example of
docs/architecture/kv_cache_routing.md, the router's own in-flight block tally, the host-tier
credit of 0.75, temperature 0's ties)."""

from __future__ import annotations

from random import Random

import pytest

from kvsched.core import recording
from kvsched.core.decision import Completion, RequestInfo
from kvsched.core.index import Tier
from kvsched.core.policies import make_policy
from kvsched.core.policies.dynamo import Dynamo
from tests.conftest import chain, make_cluster, request

BS = 16


def place(policy: Dynamo, req: RequestInfo, seed: int = 0) -> int:
    return recording.place(policy.cluster, policy, req, 0.0, Random(seed)).instance


def done(policy: Dynamo, req: RequestInfo, slot: int) -> None:
    recording.finish(
        policy.cluster,
        policy,
        Completion(
            req.request_id, None, slot, slot, req.prompt_tokens, 1, 0, req.block_hashes, 0, 0, 0
        ),
        0.0,
    )


def test_the_docs_worked_example_picks_the_cheapest_sum_not_the_longest_prefix() -> None:
    """The docs' three workers hold 2, 5 and 8 of a 10-block prompt (prefill blocks 8, 5, 2)
    with decode tallies 10, 5 and 9: costs 18, 10 and 11, worker 2 chosen. Our decode term
    also counts the request's own 10 blocks, as `sequence.rs` does (the docs' table leaves
    them out; the same 10 everywhere changes no choice)."""
    cluster = make_cluster(3)
    prompt = chain(1, 10)
    policy = make_policy("dynamo", cluster)
    assert isinstance(policy, Dynamo)
    for slot, cached in enumerate((2, 5, 8)):
        cluster.index.store(slot, prompt[:cached], None)
    for slot, decoding in enumerate((10, 5, 9)):
        policy.active.add(slot, f"busy{slot}", chain(10 + slot, decoding), 0.0, subsume=False)
    req = RequestInfo(1, 10 * BS, 16, prompt)
    decision = recording.place(cluster, policy, req, 0.0, Random(0))
    assert decision.instance == 1
    assert decision.terms["prefill_blocks"].tolist() == [8.0, 5.0, 2.0]
    assert decision.terms["cost"].tolist() == [28.0, 20.0, 21.0]


def test_decode_blocks_are_the_routers_own_in_flight_tally() -> None:
    """Two requests of one conversation on slot 0 hold their shared prefix once; the tally
    drops each request's own blocks when it finishes, whatever the engine reported."""
    cluster = make_cluster(2)
    policy = make_policy("dynamo", cluster)
    assert isinstance(policy, Dynamo)
    first = request(1, chain(1, 20))
    assert place(policy, first) in (0, 1)
    slot = policy.routed[1][0]
    assert policy.active.size(slot) == 20
    branch = request(2, chain(1, 20)[:15] + chain(2, 5))
    decision = recording.place(cluster, policy, branch, 0.0, Random(0))
    # The branch shares 15 blocks with the first request on its slot: 5 new blocks there.
    assert decision.terms["decode_blocks"][slot] == pytest.approx(20 + 5)
    assert decision.terms["decode_blocks"][1 - slot] == pytest.approx(0 + 20)
    done(policy, first, slot)
    assert policy.active.size(slot) == (20 if decision.instance == slot else 0)
    assert 1 not in policy.routed


def test_a_prefix_in_the_host_tier_earns_three_quarters_of_a_device_hit() -> None:
    cluster = make_cluster(2)
    prompt = chain(1, 8)
    cluster.index.store(1, prompt, None, Tier.CPU)  # slot 1's node pool holds all 8 blocks
    policy = make_policy("dynamo", cluster)
    req = RequestInfo(1, 8 * BS + 1, 16, prompt)
    decision = recording.place(cluster, policy, req, 0.0, Random(0))
    prefill = decision.terms["prefill_blocks"]
    assert prefill[0] == pytest.approx((8 * BS + 1) / BS)
    # hit capped at prompt - 1 tokens (8 blocks), all pool-only: credit 8 - 0.25 * 8 = 6
    assert prefill[1] == pytest.approx((8 * BS + 1) / BS - 6.0)


def test_ties_go_to_the_smallest_cache_then_at_random() -> None:
    def pick(seed: int) -> int:
        cluster = make_cluster(3)
        cluster.index.store(0, chain(5, 4), None)  # slot 0's cache is larger: never on a tie
        policy = make_policy("dynamo", cluster)
        assert isinstance(policy, Dynamo)
        return place(policy, request(1, chain(1, 4)), seed)

    assert {pick(seed) for seed in range(16)} == {1, 2}
