"""The session table: arrivals learn the idle gap, finishes the prompt's growth, bindings count
sessions per host, and a copy of a session's KV moves it only when it may."""

from __future__ import annotations

import pytest

from kvsched.core.sessions import NO_HOST, Session, SessionTable, tenant_of


def bound_to(table: SessionTable, host: int, session_id: str = "s", now: float = 0.0) -> Session:
    """A session that arrived at `now` and is bound to `host`."""
    table.arrive(session_id, now)
    table.bind(session_id, host, now, migrated=False)
    session = table.get(session_id)
    assert session is not None
    return session


def test_a_first_arrival_creates_the_record_with_nothing_learned_yet() -> None:
    table = SessionTable()
    session = table.arrive("s", 3.0)
    assert table.get("s") is session and len(table) == 1
    assert (session.turns, session.last_arrival_at) == (1, 3.0)
    assert (session.host, session.idle_gap_s, session.growth_tokens) == (NO_HOST, -1.0, -1.0)
    assert table.get("other") is None


def test_arrivals_without_a_finish_between_count_turns_but_learn_no_gap() -> None:
    table = SessionTable()
    table.arrive("s", 1.0)
    session = table.arrive("s", 5.0)
    assert (session.turns, session.last_arrival_at, session.idle_gap_s) == (2, 5.0, -1.0)


@pytest.mark.parametrize(
    ("smoothing", "finish_then_arrive", "gap"),
    [
        (0.5, [(10.0, 14.0)], 4.0),  # the first gap is taken as is
        (0.5, [(10.0, 14.0), (20.0, 30.0)], 0.5 * 10.0 + 0.5 * 4.0),
        (0.25, [(10.0, 14.0), (20.0, 30.0)], 0.25 * 10.0 + 0.75 * 4.0),
        (0.5, [(10.0, 10.0)], 0.0),  # arriving at the very instant of the finish
        (0.5, [(10.0, 8.0)], 0.0),  # an arrival stamped before the finish is no negative gap
    ],
)
def test_the_idle_gap_is_smoothed_over_finish_to_arrival_gaps(
    smoothing: float, finish_then_arrive: list[tuple[float, float]], gap: float
) -> None:
    table = SessionTable(gap_smoothing=smoothing)
    table.arrive("s", 0.0)
    for finished_at, arrived_at in finish_then_arrive:
        table.finish("s", (1, 2), 100, 10, finished_at)
        table.arrive("s", arrived_at)
    session = table.get("s")
    assert session is not None
    assert session.idle_gap_s == pytest.approx(gap)
    assert session.turns == 1 + len(finish_then_arrive)


def test_a_finish_remembers_the_turns_context() -> None:
    table = SessionTable()
    table.arrive("s", 0.0)
    table.finish("s", (7, 8, 9), 40, 12, 2.5)
    session = table.get("s")
    assert session is not None
    assert session.context_hashes == (7, 8, 9)
    assert (session.prompt_tokens, session.context_tokens, session.last_finish_at) == (40, 52, 2.5)
    assert session.growth_tokens == -1.0  # one prompt tells no growth


@pytest.mark.parametrize(
    ("prompts", "growth"),
    [
        ((100,), -1.0),
        ((100, 150), 50.0),
        ((100, 150, 250), 0.5 * 100 + 0.5 * 50),
        ((100, 150, 120), 0.5 * 0 + 0.5 * 50),  # a shorter prompt grew by nothing, not less
        ((100, 90), 0.0),
    ],
)
def test_the_growth_is_smoothed_over_the_new_prompt_tokens_per_turn(
    prompts: tuple[int, ...], growth: float
) -> None:
    table = SessionTable()
    for turn, prompt in enumerate(prompts):
        table.arrive("s", float(turn))
        table.finish("s", (), prompt, 10, turn + 0.5)
    session = table.get("s")
    assert session is not None and session.growth_tokens == pytest.approx(growth)


def test_finishing_an_unknown_session_creates_nothing() -> None:
    table = SessionTable()
    table.finish("ghost", (1,), 10, 1, 0.0)
    assert table.get("ghost") is None and len(table) == 0


def test_binding_counts_sessions_per_host_and_rebinding_moves_the_count() -> None:
    table = SessionTable()
    bound_to(table, 1, "a")
    bound_to(table, 1, "b")
    assert (table.bound_on(1), table.bound_on(2), table.bound_on(7)) == (2, 0, 0)
    table.bind("a", 2, 1.0, migrated=False)
    assert (table.bound_on(1), table.bound_on(2)) == (1, 1)
    table.bind("a", 2, 2.0, migrated=False)  # already there: counted once
    assert (table.bound_on(1), table.bound_on(2)) == (1, 1)


def test_binding_an_unknown_session_creates_its_record() -> None:
    table = SessionTable()
    table.bind("new", 3, 1.0, migrated=False)
    session = table.get("new")
    assert session is not None
    assert (session.host, session.turns, table.bound_on(3)) == (3, 0, 1)


@pytest.mark.parametrize(
    ("to_host", "migrated", "migrations", "last_migration_at"),
    [
        (2, True, 1, 5.0),  # a migration starts the cooldown
        (2, False, 0, float("-inf")),  # a plain rebind (its host died, say) does not
        (1, True, 0, float("-inf")),  # "migrating" to the host it is on is no migration
    ],
)
def test_only_a_migration_to_another_host_counts_and_starts_the_cooldown(
    to_host: int, migrated: bool, migrations: int, last_migration_at: float
) -> None:
    table = SessionTable()
    session = bound_to(table, 1)
    table.bind("s", to_host, 5.0, migrated=migrated)
    assert (session.host, session.migrations) == (to_host, migrations)
    assert session.last_migration_at == last_migration_at


@pytest.mark.parametrize(
    ("now", "in_cooldown"),
    [(10.0, True), (14.9, True), (15.0, False), (20.0, False)],
)
def test_the_cooldown_lasts_until_exactly_its_length_after_the_migration(
    now: float, in_cooldown: bool
) -> None:
    session = Session("s", last_migration_at=10.0)
    assert session.in_cooldown(now, 5.0) is in_cooldown


def test_a_session_never_migrated_is_never_in_cooldown() -> None:
    assert not Session("s").in_cooldown(0.0, 1e9)


def test_binding_cancels_a_pending_copy() -> None:
    table = SessionTable()
    session = bound_to(table, 0)
    table.begin_move("s", 2, 1.0)
    table.bind("s", 1, 2.0, migrated=False)
    assert (session.pending_target, session.pending_since) == (NO_HOST, float("inf"))
    assert table.end_move("s", 2, True, 3.0) is False
    assert session.host == 1


def test_restoring_replaces_the_record_and_moves_the_host_count() -> None:
    table = SessionTable()
    bound_to(table, 0, "a")
    saved = Session("a", host=2, turns=7)
    table.restore(saved)
    assert table.get("a") is saved
    assert (table.bound_on(0), table.bound_on(2), len(table)) == (0, 1, 1)
    table.restore(Session("b", host=2))
    table.restore(Session("c"))  # unbound: counted nowhere
    assert (table.bound_on(2), len(table)) == (2, 3)
    table.restore(Session("a"))  # the saved record is no longer bound
    assert table.bound_on(2) == 1


def test_beginning_a_copy_marks_it_pending_and_keeps_the_host() -> None:
    table = SessionTable()
    session = bound_to(table, 0)
    table.begin_move("s", 3, 4.0, on_path=True)
    assert (session.pending_target, session.pending_since, session.pending_on_path) == (
        3,
        4.0,
        True,
    )
    assert (session.host, table.bound_on(0), table.bound_on(3)) == (0, 1, 0)


def test_beginning_a_copy_of_an_unknown_session_creates_its_record() -> None:
    table = SessionTable()
    table.begin_move("new", 2, 1.0)
    session = table.get("new")
    assert session is not None
    assert (session.host, session.pending_target, session.pending_on_path) == (NO_HOST, 2, False)


# (why, the copy landed, on the turn's path, a turn arrived at this time (copy began at 10),
#  the copy reported ended on, it moved)
END_MOVE = [
    ("an idle-gap copy landed", True, False, None, 2, True),
    ("a copy failed: stays where its KV is", False, False, None, 2, False),
    ("a turn arrived during the copy: its host has newer KV", True, False, 11.0, 2, False),
    ("a turn arrived as the copy began", True, False, 10.0, 2, False),
    ("a turn arrived just before the copy", True, False, 9.0, 2, True),
    ("a copy on the turn's path landed", True, True, 10.0, 2, True),
    ("a copy on the turn's path failed", False, True, 10.0, 2, False),
    ("a copy to another target ended", True, False, None, 3, False),
]


@pytest.mark.parametrize(
    ("landed", "on_path", "arrived_at", "ended_on", "moves"),
    [row[1:] for row in END_MOVE],
    ids=[row[0] for row in END_MOVE],
)
def test_a_copy_moves_the_session_only_if_it_landed_and_no_newer_turn_ran_on_its_host(
    landed: bool, on_path: bool, arrived_at: float | None, ended_on: int, moves: bool
) -> None:
    table = SessionTable()
    session = bound_to(table, 0)
    table.begin_move("s", 2, 10.0, on_path=on_path)
    if arrived_at is not None:
        table.arrive("s", arrived_at)
    assert table.end_move("s", ended_on, landed, 12.0) is moves
    if moves:
        assert (session.host, session.migrations, session.last_migration_at) == (2, 1, 12.0)
        assert (table.bound_on(0), table.bound_on(2)) == (0, 1)
    else:
        assert (session.host, session.migrations, table.bound_on(0)) == (0, 0, 1)
    # The copy is over unless the report was for another one.
    assert session.pending_target == (2 if ended_on != 2 else NO_HOST)


def test_ending_a_copy_of_an_unknown_session_moves_nothing() -> None:
    table = SessionTable()
    assert table.end_move("ghost", 1, True, 0.0) is False
    assert table.get("ghost") is None


def test_ending_a_copy_that_never_began_moves_nothing() -> None:
    table = SessionTable()
    session = bound_to(table, 0)
    assert table.end_move("s", NO_HOST, True, 1.0) is False
    assert session.host == 0


def test_a_dead_host_loses_its_sessions_and_every_copy_from_or_to_it() -> None:
    table = SessionTable()
    on_dead = bound_to(table, 1, "on-dead")
    leaving_dead = bound_to(table, 1, "leaving-dead")
    table.begin_move("leaving-dead", 2, 1.0)
    coming = bound_to(table, 0, "coming")
    table.begin_move("coming", 1, 1.0)
    elsewhere = bound_to(table, 2, "elsewhere")
    table.begin_move("elsewhere", 3, 1.0)
    assert table.unbind_host(1) == 2
    assert (on_dead.host, leaving_dead.host, coming.host, elsewhere.host) == (
        NO_HOST,
        NO_HOST,
        0,
        2,
    )
    assert leaving_dead.pending_target == NO_HOST  # a copy from a dead host cannot land
    assert coming.pending_target == NO_HOST  # nor one to it
    assert elsewhere.pending_target == 3
    assert [table.bound_on(h) for h in range(4)] == [1, 0, 1, 0]
    assert table.end_move("coming", 1, True, 2.0) is False
    # A session of the dead host binds afresh, and the count starts again from zero.
    table.bind("on-dead", 1, 3.0, migrated=False)
    assert table.bound_on(1) == 1


def test_unbinding_a_host_with_no_sessions_changes_nothing() -> None:
    table = SessionTable()
    session = bound_to(table, 0)
    assert table.unbind_host(5) == 0
    assert (session.host, table.bound_on(0), len(table)) == (0, 1, 1)


# ---- lifetime ----------------------------------------------------------------------------


def idle_since(table: SessionTable, session_id: str, at: float, host: int = 0) -> Session:
    """A session whose one turn arrived and ended at `at`, bound to `host`."""
    session = bound_to(table, host, session_id, at)
    table.finish(session_id, (1,), 10, 1, at)
    return session


def test_an_idle_session_is_forgotten_exactly_when_its_ttl_has_passed() -> None:
    table = SessionTable()
    idle_since(table, "s", 10.0, host=2)
    assert table.forget_idle(69.999, 60.0) == []
    assert table.get("s") is not None and table.bound_on(2) == 1
    assert table.forget_idle(70.0, 60.0) == ["s"]
    assert table.get("s") is None and len(table) == 0 and table.bound_on(2) == 0


def test_a_ttl_of_zero_forgets_nothing() -> None:
    table = SessionTable()
    idle_since(table, "s", 0.0)
    assert table.forget_idle(1e9, 0.0) == []
    assert len(table) == 1


def test_a_turn_in_flight_holds_its_session_for_one_more_ttl() -> None:
    table = SessionTable()
    idle_since(table, "s", 0.0)
    table.arrive("s", 50.0)  # a turn arrived and has not ended
    assert table.forget_idle(110.0, 60.0) == []
    assert table.forget_idle(169.0, 60.0) == []
    table.finish("s", (1,), 10, 1, 169.0)
    assert table.forget_idle(228.0, 60.0) == []
    assert table.forget_idle(229.0, 60.0) == ["s"]


def test_a_turn_whose_end_never_came_releases_its_session_after_twice_the_ttl() -> None:
    table = SessionTable()
    table.arrive("s", 0.0)  # rejected, or its Router died: no finish will come
    assert table.forget_idle(119.0, 60.0) == []
    assert table.forget_idle(120.0, 60.0) == ["s"]


def test_a_copy_in_flight_holds_its_session_until_it_ends() -> None:
    table = SessionTable()
    idle_since(table, "s", 0.0, host=0)
    table.begin_move("s", 1, 1.0)
    assert table.forget_idle(1e6, 60.0) == []
    assert table.end_move("s", 1, True, 1e6)
    assert table.forget_idle(1e6 + 59.0, 60.0) == []  # the move counts as activity
    assert table.forget_idle(1e6 + 60.0, 60.0) == ["s"]
    assert table.bound_on(1) == 0


def test_the_cap_forgets_the_least_recently_active_idle_sessions_ties_by_id() -> None:
    table = SessionTable()
    idle_since(table, "c", 5.0)
    idle_since(table, "b", 1.0)
    idle_since(table, "a", 1.0)
    idle_since(table, "d", 3.0)
    table.arrive("old-busy", 0.0)  # a turn in flight: never capped
    assert table.forget_idle(6.0, 0.0, max_sessions=2) == ["a", "b", "d"]
    assert sorted(table._sessions) == ["c", "old-busy"]
    assert table.forget_idle(6.0, 0.0, max_sessions=2) == []


def test_the_cap_applies_after_the_ttl() -> None:
    table = SessionTable()
    for i, sid in enumerate(["x", "y", "z"]):
        idle_since(table, sid, float(i))
    assert table.forget_idle(60.5, 60.0, max_sessions=1) == ["x", "y"]
    assert [sid for sid in "xyz" if table.get(sid)] == ["z"]


def test_a_forgotten_session_starts_afresh_on_its_next_turn() -> None:
    table = SessionTable()
    idle_since(table, "s", 0.0, host=3)
    table.forget_idle(100.0, 60.0)
    session = table.arrive("s", 100.0)
    assert (session.turns, session.host, session.idle_gap_s) == (1, NO_HOST, -1.0)


# ---- the cap per tenant ------------------------------------------------------------------


def test_a_sessions_tenant_is_what_precedes_its_first_slash() -> None:
    assert tenant_of("acme/s1") == "acme"
    assert tenant_of("acme/a/b") == "acme"
    assert tenant_of("/s") == ""
    assert tenant_of("no-tenant") == ""


def test_a_tenant_at_its_cap_makes_room_by_its_least_recently_touched_idle_session() -> None:
    table = SessionTable(max_per_tenant=3)
    for i, sid in enumerate(["acme/a", "acme/b", "acme/c", "globex/x"]):
        bound_to(table, host=i % 2, session_id=sid, now=float(i))
        table.finish(sid, (), 10, 1, float(i) + 0.5)
    table.arrive("acme/a", 10.0)  # a busy again, and the most recently touched
    table.finish("acme/b", (), 10, 1, 11.0)  # b touched after c: c is the least recent idle
    table.arrive("acme/d", 12.0)
    assert table.take_evicted() == ["acme/c"] and table.take_evicted() == []
    assert table.get("acme/c") is None and table.get("acme/d") is not None
    assert table.per_tenant("acme") == 3 and table.per_tenant("globex") == 1
    assert table.bound == {0: 1, 1: 2}  # c's binding (host 0) went with it
    # Another tenant is untouched by acme's churn, and a known session makes no room.
    table.arrive("acme/b", 13.0)
    table.arrive("globex/y", 13.0)
    assert table.take_evicted() == [] and len(table) == 5


def test_a_tenant_whose_sessions_are_all_busy_goes_over_its_cap_until_the_sweep() -> None:
    table = SessionTable(max_per_tenant=2)
    table.arrive("t/a", 0.0)
    table.arrive("t/b", 1.0)
    table.arrive("t/c", 2.0)  # a and b have turns in flight: nothing may go
    assert table.take_evicted() == [] and table.per_tenant("t") == 3
    for sid in ("t/a", "t/b", "t/c"):
        table.finish(sid, (), 10, 1, 5.0)
    table.arrive("t/b", 6.0)
    # The sweep trims the tenant back to its cap: the least recently touched idle one goes.
    assert table.forget_idle(7.0, 0.0) == ["t/a"]
    assert table.per_tenant("t") == 2 and table.forget_idle(7.0, 0.0) == []


def test_without_a_cap_per_tenant_nothing_is_evicted() -> None:
    table = SessionTable()
    for i in range(50):
        table.arrive(f"t/{i}", float(i))
    assert table.take_evicted() == [] and table.per_tenant("t") == 50
    with pytest.raises(ValueError, match="per tenant"):
        SessionTable(max_per_tenant=-1)


def test_restored_and_forgotten_sessions_keep_the_tenant_counts() -> None:
    table = SessionTable(max_per_tenant=2)
    table.restore(Session("t/a", host=1))
    table.restore(Session("t/a", host=2))  # replaced, not counted twice
    table.restore(Session("t/b"))
    assert table.per_tenant("t") == 2 and table.bound == {1: 0, 2: 1}
    assert table.forget("t/a") and table.per_tenant("t") == 1
    table.arrive("t/c", 0.0)
    assert table.take_evicted() == [] and table.per_tenant("t") == 2
