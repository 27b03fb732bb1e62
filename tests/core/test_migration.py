"""The migration planner: which instances may take a session, whether its turn stays or moves
(EAR's hot-host rule or the TTFT rule), the order moving it writes, and whether to move it
during its idle gap. It reads the cluster and changes nothing in it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvsched.core.cluster import ClusterState, Role
from kvsched.core.cost import moving_terms, ttft_terms
from kvsched.core.decision import Decision, TransferKind, TransferPlan
from kvsched.core.decision_builders import rejection
from kvsched.core.index import Tier
from kvsched.core.migration import MigrationPlanner
from kvsched.core.request_view import FloatVec, RequestView, request_view
from kvsched.core.sessions import Session
from tests.conftest import chain, make_cluster, request, set_load

HOST = 0
CONTEXT = chain(1, 40)  # the session's context: 40 blocks, held by its host
PROMPT = CONTEXT + chain(2, 2)  # its next turn: the context and two new blocks
HOT = 8192.0  # EAR's threshold of pending prefill tokens


def hosted(pending: dict[int, int], n: int = 4) -> ClusterState:
    """A cluster whose host holds the session's context, with these pending prefill tokens."""
    cluster = make_cluster(n)
    cluster.index.store(HOST, CONTEXT, None)
    cluster.sessions.arrive("s", 0.0)
    cluster.sessions.finish("s", CONTEXT, len(CONTEXT) * 16 + 1, 16, 0.5)
    cluster.sessions.bind("s", HOST, 0.5, migrated=False)
    for slot, tokens in pending.items():
        set_load(cluster, slot, pending=tokens)
    return cluster


def planner(cluster: ClusterState, *, by_ttft: bool, min_gain_s: float = 0.0) -> MigrationPlanner:
    return MigrationPlanner(cluster, by_ttft=by_ttft, t_hot_tokens=HOT, min_gain_s=min_gain_s)


def arrive(cluster: ClusterState, *, by_ttft: bool, min_gain_s: float = 0.0) -> Decision:
    view = request_view(cluster, request(1, PROMPT, session="s"), 0.0)
    terms = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens)
    return planner(cluster, by_ttft=by_ttft, min_gain_s=min_gain_s).on_arrival(view, HOST, terms)


def session(cluster: ClusterState) -> Session:
    found = cluster.sessions.get("s")
    assert found is not None
    return found


def state(cluster: ClusterState) -> tuple[object, ...]:
    load = cluster.load
    held = tuple(cluster.index.block_count(s, tier) for s in range(cluster.n) for tier in Tier)
    found = session(cluster)
    return (
        tuple(load.pending_prefill_tokens),
        tuple(load.in_flight),
        tuple(load.free_blocks),
        held,
        cluster.index.pending_count(),
        (found.host, found.pending_target, found.migrations),
    )


# ---- candidates --------------------------------------------------------------------------


def test_candidates_are_live_cooler_instances_with_room_other_than_the_host() -> None:
    cluster = make_cluster(6, roles=(Role.BOTH,) * 5 + (Role.DECODE,))
    for slot, pending in enumerate((1000, 0, 1000, 999, 0, 0)):
        set_load(cluster, slot, pending=pending)
    set_load(cluster, 4, free=10)  # 160 tokens of room
    eligible = cluster.slots_with(Role.BOTH, Role.PREFILL)
    got = planner(cluster, by_ttft=False).candidates(eligible, HOST, 500)
    # host | idle | as busy as the host | one token cooler | no room | not eligible
    assert list(got) == [False, True, False, True, False, False]
    assert list(eligible) == [True] * 5 + [False]  # the mask given is left alone


@pytest.mark.parametrize(("context", "fits"), [(160, True), (161, False), (0, True)])
def test_a_candidate_needs_room_for_the_whole_context(context: int, fits: bool) -> None:
    cluster = make_cluster(2)
    set_load(cluster, HOST, pending=100)
    set_load(cluster, 1, free=10)
    got = planner(cluster, by_ttft=False).candidates(cluster.slots_with(Role.BOTH), HOST, context)
    assert list(got) == [False, fits]


def test_a_removed_instance_is_no_candidate() -> None:
    cluster = hosted({HOST: 20_000})
    cluster.remove_instance(1)
    got = planner(cluster, by_ttft=False).candidates(
        cluster.slots_with(Role.BOTH), HOST, session(cluster).context_tokens
    )
    assert list(got) == [False, False, True, True]


# ---- a turn arrives ----------------------------------------------------------------------


# (why, pending prefill tokens per slot, the rule, where the turn runs)
EAR_ARRIVALS = [
    ("a host at the threshold is not hot", {HOST: 8192}, "affinity", HOST),
    (
        "a hot host's turn moves to the least pending",
        {HOST: 8193, 1: 100, 2: 50, 3: 9000},
        "host hot: migrate to least pending",
        2,
    ),
    (
        "ties go to the lowest slot",
        {HOST: 9000},
        "host hot: migrate to least pending",
        1,
    ),
    (
        "no cooler instance: stay",
        {HOST: 9000, 1: 9000, 2: 9500, 3: 9000},
        "host busy, no cooler instance with room: stay",
        HOST,
    ),
]


@pytest.mark.parametrize(
    ("pending", "rule", "runs_on"),
    [row[1:] for row in EAR_ARRIVALS],
    ids=[row[0] for row in EAR_ARRIVALS],
)
def test_ear_moves_a_turn_only_off_a_hot_host_to_the_least_pending_cooler_one(
    pending: dict[int, int], rule: str, runs_on: int
) -> None:
    cluster = hosted(pending)
    decision = arrive(cluster, by_ttft=False)
    assert (decision.rule, decision.instance, decision.decode_instance) == (rule, runs_on, runs_on)
    assert len(decision.transfers) == (runs_on != HOST)


# (why, pending prefill tokens per slot, min gain, the rule, where the turn runs)
TTFT_ARRIVALS = [
    ("an idle host", {}, 0.0, "affinity", HOST),
    ("a host queue no longer than the gain asked", {HOST: 20_000}, 0.7, "affinity", HOST),
    (
        "moving saves the queue",
        {HOST: 20_000},
        0.1,
        "host busy: migrate now, min TTFT incl. transfer",
        1,
    ),
    (
        "the least TTFT including the transfer wins",
        {HOST: 20_000, 1: 5000, 2: 100, 3: 4000},
        0.1,
        "host busy: migrate now, min TTFT incl. transfer",
        2,
    ),
    (
        "the others are nearly as busy: moving does not pay",
        {HOST: 20_000, 1: 19_000, 2: 19_000, 3: 19_000},
        0.1,
        "host busy, moving does not pay: stay",
        HOST,
    ),
    (
        "no cooler instance",
        {HOST: 20_000, 1: 20_000, 2: 25_000, 3: 20_000},
        0.1,
        "host busy, no cooler instance with room: stay",
        HOST,
    ),
]


@pytest.mark.parametrize(
    ("pending", "min_gain_s", "rule", "runs_on"),
    [row[1:] for row in TTFT_ARRIVALS],
    ids=[row[0] for row in TTFT_ARRIVALS],
)
def test_by_ttft_a_turn_moves_only_when_that_beats_staying_by_the_gain_asked(
    pending: dict[int, int], min_gain_s: float, rule: str, runs_on: int
) -> None:
    cluster = hosted(pending)
    decision = arrive(cluster, by_ttft=True, min_gain_s=min_gain_s)
    assert (decision.rule, decision.instance) == (rule, runs_on)
    if runs_on != HOST:
        view = request_view(cluster, request(1, PROMPT, session="s"), 0.0)
        stay = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens)["ttft_s"][HOST]
        assert decision.estimated_ttft_s + min_gain_s < stay


# ---- moving on the turn's path -----------------------------------------------------------


def moved_to(cluster: ClusterState, target: int) -> tuple[RequestView, Decision]:
    view = request_view(cluster, request(1, PROMPT, session="s"), 0.0)
    return view, planner(cluster, by_ttft=False).move_now(view, HOST, target, "moved")


@pytest.mark.parametrize(
    ("target_holds", "copied_blocks"),
    [(0, 40), (10, 30), (39, 1)],
    ids=["nothing", "a part", "all but one block"],
)
def test_moving_now_copies_what_the_target_lacks_on_the_turns_path(
    target_holds: int, copied_blocks: int
) -> None:
    cluster = hosted({HOST: 20_000})
    if target_holds:
        cluster.index.store(2, CONTEXT[:target_holds], None)
    view, decision = moved_to(cluster, 2)
    (plan,) = decision.transfers
    assert (plan.kind, plan.source, plan.target) == (TransferKind.MIGRATE_SESSION, HOST, 2)
    assert (plan.block_hashes, plan.skip_blocks, plan.n_blocks) == (
        CONTEXT,
        target_holds,
        copied_blocks,
    )
    assert plan.on_critical_path and (plan.session_id, plan.request_id) == ("s", 1)
    assert plan.tokens == copied_blocks * 16
    assert plan.est_seconds == cluster.cost.transfer_s(HOST, 2, copied_blocks * 16)
    assert (decision.instance, decision.rule) == (2, "moved")
    assert (decision.cached_tokens, decision.fetched_tokens) == (
        target_holds * 16,
        copied_blocks * 16,
    )
    terms = decision.terms
    assert terms["cached_tokens"][2] == 40 * 16  # prefill starts after the whole context
    assert terms["transfer_s"][2] == plan.est_seconds
    assert list(terms["transfer_s"][[0, 1, 3]]) == [0.0, 0.0, 0.0]
    expected: FloatVec = terms["queue_s"] + terms["prefill_s"] + terms["transfer_s"]
    assert decision.estimated_ttft_s == expected[2]
    assert view.hit_tokens[2] == target_holds * 16  # the view is not changed


def test_moving_to_a_target_that_holds_the_hosts_part_copies_nothing() -> None:
    cluster = hosted({HOST: 20_000})
    cluster.index.store(3, PROMPT, None)
    _, decision = moved_to(cluster, 3)
    assert decision.transfers == ()
    assert (decision.fetched_tokens, decision.cached_tokens) == (0, len(PROMPT) * 16)
    assert decision.terms["transfer_s"][3] == 0.0


def test_moving_a_prompt_of_whole_blocks_leaves_its_last_token_to_compute() -> None:
    cluster = hosted({HOST: 20_000})
    view = request_view(cluster, request(1, CONTEXT, prompt=len(CONTEXT) * 16, session="s"), 0.0)
    decision = planner(cluster, by_ttft=False).move_now(view, HOST, 1, "moved")
    (plan,) = decision.transfers
    assert (plan.n_blocks, decision.fetched_tokens) == (39, 39 * 16)  # not the last block
    assert decision.terms["cached_tokens"][1] == 39 * 16


def test_a_refused_move_is_priced_as_the_move_and_comes_back_as_the_refusal() -> None:
    # Admission is asked before the order is built: with the move's own estimate and terms.
    cluster = hosted({HOST: 20_000})
    cluster.index.store(2, CONTEXT[:10], None)
    view, moved = moved_to(cluster, 2)
    asked: list[tuple[float, dict[str, FloatVec]]] = []
    refusal = rejection(view, "refused", 1.0, moved.terms)  # type: ignore[arg-type]

    def refuse(
        estimated_ttft_s: float, terms: dict[str, FloatVec], moving: dict[str, FloatVec] | None
    ) -> Decision | None:
        asked.append((estimated_ttft_s, terms))
        assert moving is None  # the caller computed no moving terms
        return refusal

    decision = planner(cluster, by_ttft=False).move_now(view, HOST, 2, "moved", refuse=refuse)
    assert decision is refusal
    ((estimate, terms),) = asked
    assert estimate == moved.estimated_ttft_s
    assert set(terms) == set(moved.terms)
    for name, values in terms.items():
        assert list(values) == list(moved.terms[name]), name


@pytest.mark.parametrize("pending", [20_000, 0], ids=["moves", "stays"])
def test_a_placement_admission_lets_stand_is_the_one_without_admission(pending: int) -> None:
    cluster = hosted({HOST: pending})
    view = request_view(cluster, request(1, PROMPT, session="s"), 0.0)
    terms = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens)
    asked: list[float] = []

    def let_stand(
        estimated_ttft_s: float, _terms: dict[str, FloatVec], _moving: dict[str, FloatVec] | None
    ) -> Decision | None:
        asked.append(estimated_ttft_s)
        return None

    plain = planner(cluster, by_ttft=False).on_arrival(view, HOST, terms)
    admitted = planner(cluster, by_ttft=False).on_arrival(view, HOST, terms, let_stand)
    assert asked == [plain.estimated_ttft_s]
    assert (admitted.instance, admitted.rule, admitted.transfers) == (
        plain.instance,
        plain.rule,
        plain.transfers,
    )
    assert (admitted.cached_tokens, admitted.fetched_tokens, admitted.estimated_ttft_s) == (
        plain.cached_tokens,
        plain.fetched_tokens,
        plain.estimated_ttft_s,
    )
    assert (plain.instance != HOST) == (pending > HOT)


def test_a_move_by_ttft_hands_admission_the_moving_terms_it_chose_the_target_by() -> None:
    cluster = hosted({HOST: 20_000})
    view = request_view(cluster, request(1, PROMPT, session="s"), 0.0)
    terms = ttft_terms(cluster.cost, cluster.load, view, view.hit_tokens)
    handed: list[dict[str, FloatVec] | None] = []

    def let_stand(
        _estimate: float, _terms: dict[str, FloatVec], moving: dict[str, FloatVec] | None
    ) -> Decision | None:
        handed.append(moving)
        return None

    decision = planner(cluster, by_ttft=True).on_arrival(view, HOST, terms, let_stand)
    assert decision.instance != HOST
    ((moving,),) = [handed]
    assert moving is not None
    expected = moving_terms(cluster.cost, cluster.load, view, HOST)
    assert set(moving) == set(expected)
    for name, values in expected.items():
        assert list(moving[name]) == list(values), name


# ---- moving during the idle gap ----------------------------------------------------------


def gap_plan(
    cluster: ClusterState,
    *,
    by_ttft: bool = False,
    gap_s: float = 0.0,
    room: list[bool] | None = None,
    penalty_s: float = 0.0,
    min_gain_s: float = 0.0,
) -> TransferPlan | None:
    return planner(cluster, by_ttft=by_ttft, min_gain_s=min_gain_s).during_gap(
        session(cluster),
        gap_s,
        cluster.slots_with(Role.BOTH, Role.PREFILL),
        np.array(room if room is not None else [True] * cluster.n),
        penalty_s,
    )


def test_a_gap_move_copies_the_context_off_the_critical_path() -> None:
    cluster = hosted({HOST: 20_000, 1: 500, 2: 100, 3: 900})
    cluster.index.store(2, CONTEXT[:5], None)
    plan = planner(cluster, by_ttft=False).during_gap(
        session(cluster), 0.1, cluster.slots_with(Role.BOTH), np.ones(4, dtype=bool), 0.0
    )
    assert plan is not None
    assert (plan.kind, plan.source, plan.target) == (TransferKind.MIGRATE_SESSION, HOST, 2)
    assert (plan.block_hashes, plan.skip_blocks, plan.tokens) == (CONTEXT, 5, 35 * 16)
    assert not plan.on_critical_path
    assert (plan.session_id, plan.request_id) == ("s", None)


# (why, pending prefill tokens per slot, keyword arguments of the planning, the target or None)
GAP_MOVES: list[tuple[str, dict[int, int], dict[str, Any], int | None]] = [
    ("a busy host, by EAR's rule: the least pending", {HOST: 20_000, 1: 50}, {}, 2),
    ("a busy host, by TTFT: the lowest estimate", {HOST: 20_000, 1: 50}, {"by_ttft": True}, 2),
    ("only where there is room", {HOST: 20_000}, {"room": [True, False, False, True]}, 3),
    ("nowhere with room", {HOST: 20_000}, {"room": [True, False, False, False]}, None),
    ("no cooler instance", {HOST: 20_000, 1: 20_000, 2: 20_000, 3: 30_000}, {}, None),
    (
        "the others are nearly as busy",
        {HOST: 20_000, 1: 19_000, 2: 19_000, 3: 19_000},
        {"by_ttft": True, "min_gain_s": 0.1},
        None,
    ),
    ("the host's queue drains within the gap", {HOST: 20_000}, {"gap_s": 10.0}, None),
    ("a nearly idle host", {HOST: 100}, {"by_ttft": True, "min_gain_s": 0.05}, None),
    (
        "a nearly idle host about to lose the context",
        {HOST: 100},
        {"by_ttft": True, "min_gain_s": 0.05, "penalty_s": 1.0},
        1,
    ),
]


@pytest.mark.parametrize(
    ("pending", "how", "target"),
    [row[1:] for row in GAP_MOVES],
    ids=[row[0] for row in GAP_MOVES],
)
def test_a_gap_move_goes_where_the_next_turn_would_start_sooner(
    pending: dict[int, int], how: dict[str, Any], target: int | None
) -> None:
    plan = gap_plan(hosted(pending), **how)
    assert (plan.target if plan is not None else None) == target


def test_no_gap_move_when_the_host_holds_none_of_the_context() -> None:
    cluster = hosted({HOST: 20_000})
    cluster.index.clear_instance(HOST)
    assert gap_plan(cluster) is None


def test_planning_changes_nothing_in_the_cluster() -> None:
    cluster = hosted({HOST: 20_000})
    before = state(cluster)
    for by_ttft in (False, True):
        assert arrive(cluster, by_ttft=by_ttft).instance != HOST
        assert gap_plan(cluster, by_ttft=by_ttft) is not None
    assert state(cluster) == before
