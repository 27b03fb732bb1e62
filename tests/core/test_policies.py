"""Each policy's defining rule, on hand-made cluster states."""

from __future__ import annotations

from dataclasses import replace
from random import Random

import numpy as np
import pytest

from kvsched.core import recording
from kvsched.core.cluster import ClusterState, Role, SloConfig
from kvsched.core.decision import Completion, Decision, RequestInfo, TransferKind, TransferPlan
from kvsched.core.index import Tier
from kvsched.core.policies import ALL_POLICIES, POLICIES, Policy, make_policy, parse_spec
from kvsched.core.policies.disaggregated import split_roles
from kvsched.core.request_view import request_view
from kvsched.core.sessions import NO_HOST
from tests.conftest import chain, make_cluster, request, set_load

RNG = Random(0)


def place(policy: Policy, req: RequestInfo, now: float) -> Decision:
    """Decide with `policy` and record the placement, as the scheduler does."""
    return recording.place(policy.cluster, policy, req, now, RNG)


def transfer_ended(policy: Policy, plan: TransferPlan, ok: bool, now: float) -> bool:
    return recording.transfer_ended(policy.cluster, policy, plan, ok, now)


def test_every_policy_is_registered_and_documented() -> None:
    assert set(ALL_POLICIES) == {
        "round_robin",
        "least_loaded",
        "cache_aware",
        "lmetric",
        "llmd",
        "dynamo",
        "sglang",
        "continuum",
        "mooncake",
        "sticky",
        "static_pd",
        "ear",
        "elastic",
    }
    for cls in POLICIES.values():
        assert cls.__doc__ and len(cls.__doc__) > 40, cls.name


def test_specs_parse_and_bad_ones_fail_clearly() -> None:
    assert parse_spec("mooncake:colocated=1,balancing_threshold=2.5") == (
        "mooncake",
        {"colocated": 1, "balancing_threshold": 2.5},
    )
    with pytest.raises(ValueError, match="unknown policy"):
        parse_spec("nope")
    with pytest.raises(ValueError, match="key=value"):
        parse_spec("ear:t_hot_tokens")
    with pytest.raises(ValueError, match="no parameter"):
        make_policy("ear:bogus=1", make_cluster(2))


def test_round_robin_cycles_over_live_instances() -> None:
    cluster = make_cluster(3)
    cluster.alive[1] = False
    policy = make_policy("round_robin", cluster)
    picks = [place(policy, request(i, chain(i, 2)), 0.0).instance for i in range(4)]
    assert picks == [0, 2, 0, 2]


def test_least_loaded_ignores_cache() -> None:
    cluster = make_cluster(3)
    hashes = chain(1, 8)
    cluster.index.store(0, hashes, None)
    set_load(cluster, 0, pending=5000)
    set_load(cluster, 1, pending=100)
    set_load(cluster, 2, pending=200)
    d = place(make_policy("least_loaded", cluster), request(1, hashes), 0.0)
    assert d.instance == 1
    assert d.rule == "fewest pending prefill tokens"


def test_a_prefix_in_an_instances_node_pool_counts_as_its_hit() -> None:
    cluster = make_cluster(3)
    hashes = chain(1, 10)
    cluster.index.store(0, hashes[:4], None)
    cluster.index.store(2, hashes, None, Tier.CPU)  # only in its node's KV pool
    cluster.index.store(2, hashes[:2], None)
    policy = make_policy("cache_aware", cluster)
    view = request_view(cluster, request(1, hashes), 0.0)
    assert list(view.hit_blocks) == [4, 0, 10]  # slot 2: its CPU tier's longer match
    assert place(policy, request(1, hashes), 0.0).instance == 2


def test_cache_aware_follows_the_longest_match_unless_imbalanced() -> None:
    cluster = make_cluster(3)
    hashes = chain(1, 10)
    cluster.index.store(2, hashes, None)
    policy = make_policy("cache_aware", cluster)
    assert place(policy, request(1, hashes), 0.0).instance == 2
    # 70 requests in flight on the holder: imbalance rule → shortest queue.
    for _ in range(70):
        cluster.load.charge(2, 0, 0.0, 0)
    d = place(policy, request(2, hashes), 0.0)
    assert d.instance != 2
    assert d.rule.startswith("imbalanced")
    # A low match sends the request to the emptiest cache.
    cluster2 = make_cluster(3)
    cluster2.index.store(0, chain(7, 10), None)
    cluster2.index.store(1, chain(8, 3), None)
    assert place(make_policy("cache_aware", cluster2), request(3, chain(9, 10)), 0.0).instance == 2


def test_lmetric_minimises_new_tokens_times_batch() -> None:
    cluster = make_cluster(2)
    hashes = chain(1, 20)
    cluster.index.store(0, hashes[:15], None)
    set_load(cluster, 0, running=3)  # 81 new tokens × 3 = 243
    set_load(cluster, 1, running=1)  # 321 new tokens × 1
    d = place(make_policy("lmetric", cluster), request(1, hashes), 0.0)
    assert d.instance == 0
    assert d.terms["score"][0] == pytest.approx(81 * 3)
    fresh = make_cluster(2)
    fresh.index.store(0, hashes[:15], None)
    set_load(fresh, 0, running=5)  # 405 > 321
    set_load(fresh, 1, running=1)
    assert place(make_policy("lmetric", fresh), request(2, hashes), 0.0).instance == 1


def test_mooncake_fetches_a_remote_prefix_only_past_the_threshold() -> None:
    roles = split_roles(4, 0.5)
    assert roles == (Role.PREFILL, Role.PREFILL, Role.DECODE, Role.DECODE)
    hashes = chain(1, 400)  # a 6.4K-token prompt
    for local, expect_fetch in ((100, True), (300, False)):
        cluster = make_cluster(4, roles=roles, slo=SloConfig(ttft_s=100))
        cluster.index.store(0, hashes[:390], None)
        cluster.index.store(1, hashes[:local], None)
        set_load(cluster, 0, pending=200_000)  # the best holder is busy
        policy = make_policy("mooncake:balancing_threshold=1.5", cluster)
        d = place(policy, request(1, hashes), 0.0)
        assert d.instance == 1
        kinds = {t.kind for t in d.transfers}
        # 390 > 100 × 1.5: fetch; 390 < 300 × 1.5: recompute the difference locally.
        assert (TransferKind.FETCH_PREFIX in kinds) is expect_fetch
        assert TransferKind.HANDOFF in kinds and d.decode_instance in (2, 3)
        assert d.cached_tokens == local * 16
        assert d.fetched_tokens == (390 - local) * 16 * expect_fetch


def test_mooncake_rejects_what_misses_the_slo_but_not_what_never_could() -> None:
    cluster = make_cluster(2, roles=(Role.BOTH, Role.BOTH), slo=SloConfig(ttft_s=0.5, tpot_s=0.1))
    for slot in (0, 1):
        set_load(cluster, slot, pending=60_000)  # ~1.5 s of queued prompts everywhere
    policy = make_policy("mooncake:colocated=1", cluster)
    d = place(policy, request(1, chain(1, 10)), 0.0)
    assert d.rejected and d.retry_after_s > 0 and d.instance == -1
    huge = request(2, chain(2, 3000))  # 48K tokens: > 0.5 s even on an idle instance
    assert not place(policy, huge, 0.0).rejected


def test_sticky_pins_sessions() -> None:
    cluster = make_cluster(3)
    policy = make_policy("sticky", cluster)
    first = place(policy, request(1, chain(1, 4), session="s"), 0.0).instance
    set_load(cluster, first, pending=10**6)
    assert place(policy, request(2, chain(1, 6), session="s"), 1.0).instance == first


def test_static_pd_uses_fixed_pools() -> None:
    cluster = make_cluster(4, roles=split_roles(4, 0.5))
    d = place(make_policy("static_pd", cluster), request(1, chain(1, 4)), 0.0)
    assert d.instance in (0, 1) and d.decode_instance in (2, 3)
    assert [t.kind for t in d.transfers] == [TransferKind.HANDOFF]


def _ear_setup(params: str = "") -> tuple[ClusterState, Policy, tuple[int, ...], int]:
    cluster = make_cluster(3)
    policy = make_policy("ear" + params, cluster)
    hashes = chain(1, 40)
    d = place(policy, request(1, hashes[:20], session="s"), 0.0)
    host = d.instance
    cluster.index.store(host, hashes[:20], None)
    return cluster, policy, hashes, host


def test_ear_migrates_a_hot_host_to_the_least_pending_instance_with_room() -> None:
    cluster, policy, hashes, host = _ear_setup()
    others = [s for s in range(3) if s != host]
    set_load(cluster, host, pending=20_000)
    set_load(cluster, others[0], pending=5_000)
    set_load(cluster, others[1], pending=1_000)
    d = place(policy, request(2, hashes, session="s"), 10.0)
    assert d.instance == others[1]
    (plan,) = d.transfers
    assert plan.kind is TransferKind.MIGRATE_SESSION and plan.on_critical_path
    assert (plan.source, plan.target, plan.tokens) == (host, others[1], 20 * 16)
    # Bound to the target only once the copy landed verified.
    session = cluster.sessions.get("s")
    assert session is not None and session.host == host
    assert session.pending_target == others[1] and session.pending_on_path
    assert transfer_ended(policy, plan, True, 10.5)
    assert session.host == others[1] and session.migrations == 1
    # Within T_cool the session stays put even though its new host is now hot.
    set_load(cluster, others[1], pending=50_000)
    assert place(policy, request(3, hashes, session="s"), 20.0).instance == others[1]


def test_ear_leaves_the_session_on_its_host_when_the_copy_fails() -> None:
    cluster, policy, hashes, host = _ear_setup()
    others = [s for s in range(3) if s != host]
    set_load(cluster, host, pending=20_000)
    for slot in others:
        set_load(cluster, slot, pending=1_000)
    d = place(policy, request(2, hashes, session="s"), 10.0)
    (plan,) = d.transfers
    # While the copy is in flight a second turn stays on the host: no second move.
    second = place(policy, request(3, hashes, session="s"), 10.1)
    assert second.instance == host and not second.transfers
    assert "in flight" in second.rule
    assert not transfer_ended(policy, plan, False, 10.5)
    session = cluster.sessions.get("s")
    assert session is not None and session.host == host and session.migrations == 0
    assert session.pending_target == NO_HOST


def test_ear_never_migrates_to_a_busier_or_too_small_instance() -> None:
    cluster, policy, hashes, host = _ear_setup()
    others = [s for s in range(3) if s != host]
    set_load(cluster, host, pending=20_000)
    set_load(cluster, others[0], pending=30_000)  # busier
    set_load(cluster, others[1], pending=100, free=2)  # cooler but no room
    d = place(policy, request(2, hashes, session="s"), 10.0)
    assert d.instance == host and not d.transfers
    assert "stay" in d.rule


def _finish(
    policy: Policy, req: RequestInfo, slot: int, now: float, *, ok: bool = True
) -> list[TransferPlan]:
    done = Completion(
        req.request_id,
        req.session_id,
        slot,
        slot,
        req.prompt_tokens,
        req.output_tokens,
        0,
        req.block_hashes,
        now - 1.0,
        now - 0.5,
        now,
        ok,
    )
    return recording.finish(policy.cluster, policy, done, now)


def _elastic_after_a_first_turn() -> tuple[ClusterState, Policy, tuple[int, ...], int]:
    """`elastic` on 3 instances, session "s"'s first turn (100 of 200 chained blocks) placed
    at 0 s, stored on its host and ended at 1 s (the host cool: nothing planned)."""
    cluster = make_cluster(3)
    policy = make_policy("elastic:admission=0", cluster)
    hashes = chain(1, 200)
    req = request(1, hashes[:100], session="s")
    host = place(policy, req, 0.0).instance
    cluster.index.store(host, hashes[:100], None)
    assert _finish(policy, req, host, 1.0) == []
    return cluster, policy, hashes, host


def test_elastic_migrates_during_the_idle_gap_and_rebinds_only_when_the_kv_lands() -> None:
    cluster, policy, hashes, host = _elastic_after_a_first_turn()
    req2 = request(2, hashes[:120], session="s")
    assert place(policy, req2, 5.0).instance == host  # affinity
    # The host turns hot while the agent works: ~20 s of queued prompts, longer than the gap.
    set_load(cluster, host, pending=400_000)
    (plan,) = _finish(policy, req2, host, 6.0)
    assert plan.kind is TransferKind.MIGRATE_SESSION and not plan.on_critical_path
    assert plan.source == host and plan.target != host
    session = cluster.sessions.get("s")
    assert session is not None
    assert session.host == host and session.pending_target == plan.target
    transfer_ended(policy, plan, True, 6.5)
    assert session.host == plan.target and session.migrations == 1
    # A second hot finish inside T_cool does not move it again.
    set_load(cluster, plan.target, pending=400_000)
    assert _finish(policy, request(3, hashes[:130], session="s"), plan.target, 10.0) == []


def test_elastic_keeps_the_session_on_its_source_when_a_turn_overtakes_the_copy() -> None:
    cluster, policy, hashes, host = _elastic_after_a_first_turn()
    req2 = request(2, hashes[:110], session="s")
    place(policy, req2, 2.0)
    set_load(cluster, host, pending=400_000)
    (plan,) = _finish(policy, req2, host, 3.0)
    place(policy, request(3, hashes[:120], session="s"), 3.1)  # arrives mid-copy
    transfer_ended(policy, plan, True, 3.5)
    session = cluster.sessions.get("s")
    assert session is not None and session.host == host


def test_elastic_plans_no_gap_move_after_a_failed_turn_or_one_the_next_turn_overtook() -> None:
    cluster, policy, hashes, host = _elastic_after_a_first_turn()
    req2, req3 = request(2, hashes[:110], session="s"), request(3, hashes[:120], session="s")
    place(policy, req2, 2.0)
    # Turn 2's end is reported after turn 3 arrived (the agent called at once): the session
    # is not idle, its KV is in use on its host, now hot.
    assert place(policy, req3, 3.0).instance == host
    set_load(cluster, host, pending=400_000)
    assert _finish(policy, req2, host, 3.1) == []
    assert _finish(policy, req3, host, 4.0, ok=False) == []  # failed: it may come again now
    set_load(cluster, host, pending=0)
    req4 = request(4, hashes[:120], session="s")
    assert place(policy, req4, 4.1).instance == host
    set_load(cluster, host, pending=400_000)
    (plan,) = _finish(policy, req4, host, 5.0)  # now its agent is away
    assert plan.kind is TransferKind.MIGRATE_SESSION and not plan.on_critical_path


@pytest.mark.parametrize("fanout", [False, True])
def test_elastic_with_fanout_spreads_parallel_calls_and_keeps_the_binding(fanout: bool) -> None:
    cluster = make_cluster(3)
    policy = make_policy(f"elastic:admission=0,fanout={int(fanout)}", cluster)
    hashes = chain(1, 100)
    first = request(1, hashes[:20], session="s")
    host = place(policy, first, 0.0).instance
    cluster.index.store(host, hashes[:20], None)
    _finish(policy, first, host, 1.0)
    turn = place(policy, request(2, hashes[:40], session="s"), 2.0)  # one call: affinity
    assert turn.instance == host and not turn.keeps_binding
    set_load(cluster, host, pending=200_000)  # the host is busy: its queue outlasts a prefill
    parallel = place(policy, request(3, hashes[:40], session="s"), 2.0)  # while turn 2 runs
    session = cluster.sessions.get("s")
    assert session is not None and session.parallel_arrival and parallel.instance != host
    moves = [t for t in parallel.transfers if t.kind is TransferKind.MIGRATE_SESSION]
    if fanout:  # spilled: no move, the session stays bound to its host
        assert parallel.keeps_binding and not moves and session.pending_target == NO_HOST
    else:  # the whole session moves with it (and its cooldown pins the next calls there)
        assert not parallel.keeps_binding and session.pending_target == parallel.instance
    assert session.host == host
    _finish(policy, request(3, hashes[:40], session="s"), parallel.instance, 3.0)
    _finish(policy, request(2, hashes[:40], session="s"), host, 3.0)
    later = place(policy, request(4, hashes[:41], session="s"), 9.0)  # after both ended
    assert not later.keeps_binding
    assert not cluster.sessions.get("s").parallel_arrival  # type: ignore[union-attr]


def test_elastic_admission_rejects_queueing_misses_only() -> None:
    cluster = make_cluster(2, slo=SloConfig(ttft_s=0.5))
    for slot in (0, 1):
        set_load(cluster, slot, pending=60_000)
    policy = make_policy("elastic", cluster)
    assert place(policy, request(1, chain(1, 10)), 0.0).rejected
    assert not place(policy, request(2, chain(2, 3000)), 0.0).rejected
    lenient = make_policy("elastic:admission=0", cluster)
    assert not place(lenient, request(3, chain(3, 10)), 0.0).rejected


def test_elastic_admission_counts_the_time_already_waited() -> None:
    cluster = make_cluster(2, slo=SloConfig(ttft_s=0.5))
    policy = make_policy("elastic", cluster)
    fresh = place(policy, request(1, chain(1, 10)), 0.0)
    assert not fresh.rejected and fresh.estimated_ttft_s < 0.5
    waited = replace(request(2, chain(2, 10)), waited_s=0.5 - fresh.estimated_ttft_s / 2)
    assert place(policy, waited, 0.0).rejected  # its wait plus its TTFT miss the SLO


def test_elastic_cold_start_uses_the_global_index_and_fetches_shared_prefixes() -> None:
    cluster = make_cluster(2)
    system = chain(9, 300)  # a 4.8K-token shared system prompt
    cluster.index.store(0, system, None)
    set_load(cluster, 0, pending=100_000)  # its holder is busy
    d = place(make_policy("elastic", cluster), request(1, system + chain(5, 10)), 0.0)
    assert d.instance == 1
    assert [t.kind for t in d.transfers] == [TransferKind.FETCH_PREFIX]
    assert d.fetched_tokens == 300 * 16
    # Without the global index it is a least-pending cold start with no fetch.
    d2 = place(
        make_policy("elastic:global_index=0", cluster), request(2, system + chain(6, 10)), 0.0
    )
    assert d2.instance == 1 and not d2.transfers


def test_decisions_explain_every_candidate() -> None:
    cluster = make_cluster(3)
    cluster.alive[2] = False
    cluster.index.store(1, chain(1, 5), None)
    d = place(make_policy("mooncake:colocated=1", cluster), request(1, chain(1, 8)), 0.0)
    rows = d.explain()
    assert [r["instance"] for r in rows] == sorted(
        [0, 1], key=lambda s: float(d.terms["ttft_s"][s])
    )
    assert sum(r["chosen"] for r in rows) == 1
    for key in ("queue_s", "prefill_s", "transfer_s", "ttft_s", "hit_tokens"):
        assert key in rows[0]
    assert np.isclose(
        rows[0]["ttft_s"], rows[0]["queue_s"] + rows[0]["prefill_s"] + rows[0]["transfer_s"]
    )


def pool_scene(spec: str, prefix_blocks: int, new_blocks: int) -> Decision:
    """Node 0 (slots 0-3) holds a prefix in its pool; slot 2 also in GPU memory, behind a
    queue of 2,000 prompt tokens (48 ms). Where does `spec` send a request reusing it?"""
    name, params = parse_spec(spec)
    cluster = make_cluster(8, roles=POLICIES[name].roles(8, params))
    hashes = chain(1, prefix_blocks)
    for slot in range(4):  # the node's pool is every one of its instances' CPU tier
        cluster.index.store(slot, hashes, None, Tier.CPU)
    cluster.index.store(2, hashes, None)
    set_load(cluster, 2, pending=2000)
    return place(make_policy(spec, cluster), request(1, hashes + chain(2, new_blocks)), 0.0)


@pytest.mark.parametrize("spec", ["mooncake", "elastic"])
def test_tiered_policies_weigh_a_pool_only_prefix_by_its_load(spec: str) -> None:
    # 96K tokens to load (0.25 s at 50 GB/s) for 80 new ones (16 ms of prefill): the load
    # is not hidden, and the GPU holder's queue costs less than it.
    loaded = pool_scene(spec, 6000, 5)
    assert loaded.instance == 2
    assert loaded.terms["load_wait_s"][0] > loaded.terms["queue_s"][2] > 0
    # 3.2K tokens to load (8 ms) under 3.2K new ones (88 ms): the prefill hides the load
    # but for its first layer, so an idle instance of the node beats the busy holder.
    hidden = pool_scene(spec, 200, 200)
    assert hidden.instance == 0
    assert 0 < hidden.terms["load_wait_s"][0] < hidden.terms["load_s"][0] / 16


def test_cache_aware_counts_a_pool_only_prefix_as_a_hit_as_published() -> None:
    # The router's radix tree knows no tiers: the longest match wins, loaded or not.
    decision = pool_scene("cache_aware", 6000, 5)
    assert decision.instance == 0
    assert decision.terms["load_wait_s"][0] > 0  # the terms still say what the load costs
