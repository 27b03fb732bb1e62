"""The control core's front door: `explain` answers what `place` would do and changes
nothing, a policy's own bookkeeping included."""

from __future__ import annotations

import pytest

from kvsched.core.cluster import ClusterConfig, Role
from kvsched.core.decision import Completion, Decision
from kvsched.core.events import BlocksStored
from kvsched.core.index import Tier
from kvsched.core.policies import ALL_POLICIES, POLICIES
from kvsched.core.scheduler import Scheduler
from tests.conftest import chain, request

N = 4


def scheduler(spec: str) -> Scheduler:
    core = Scheduler(ClusterConfig(n_instances=N), spec, seed=3, max_prompt_tokens=131_072)
    for slot, role in enumerate(POLICIES[spec].roles(N)):
        core.add_instance(slot, Role(role))
    # One instance holds a shared prefix, so placements have something to weigh.
    core.apply(0, [BlocksStored(chain(9, 30))])
    return core


def placements(core: Scheduler, *, explain_first: bool) -> list[Decision]:
    made = []
    for i in range(12):
        hashes = chain(9, 30)[: 10 + i] if i % 2 else chain(100 + i, 12)
        req = request(i + 1, hashes, session=f"s{i % 3}")
        if explain_first:
            explained = core.explain(req, float(i))
            assert explained.rejected or explained.instance >= 0
        made.append(core.place(req, float(i)))
    return made


def _key(d: Decision) -> tuple[object, ...]:
    return d.instance, d.decode_instance, d.rule, d.rejected, d.cached_tokens, d.transfers


@pytest.mark.parametrize("spec", ALL_POLICIES)
def test_explaining_before_each_placement_changes_no_placement(spec: str) -> None:
    plain = [_key(d) for d in placements(scheduler(spec), explain_first=False)]
    explained = [_key(d) for d in placements(scheduler(spec), explain_first=True)]
    assert explained == plain


def test_explain_answers_what_place_then_does() -> None:
    core = scheduler("round_robin")
    req = request(1, chain(5, 8))
    first = core.explain(req, 0.0)
    assert core.explain(req, 0.0).instance == first.instance  # the cursor did not move
    assert core.place(req, 0.0).instance == first.instance


@pytest.mark.parametrize("spec", ["round_robin", "cache_aware", "elastic"])
def test_explain_splits_each_candidates_hit_by_tier(spec: str) -> None:
    core = scheduler(spec)
    hashes = chain(40, 20)
    core.apply(1, [BlocksStored(hashes, tier=Tier.CPU)])  # slot 1's node pool holds 20
    core.apply(1, [BlocksStored(hashes[:5])])  # of which its GPU memory keeps the first 5
    core.apply(2, [BlocksStored(hashes[:8])])  # slot 2 holds 8 in GPU memory only
    rows = {row["instance"]: row for row in core.explain(request(1, hashes), 0.0).explain()}
    bs = 16
    split = ("hit_tokens", "gpu_hit_tokens", "pool_hit_tokens", "pool_tokens")
    assert [rows[1][k] for k in split] == [20 * bs, 5 * bs, 20 * bs, 15 * bs]
    assert [rows[2][k] for k in split] == [8 * bs, 8 * bs, 0, 0]
    assert [rows[3][k] for k in split] == [0, 0, 0, 0]


def test_explain_shows_no_speculative_placement_past_its_time() -> None:
    core = scheduler("cache_aware")
    hashes = chain(60, 10)
    slot = core.place(request(1, hashes), 0.0).instance
    # At once the placement's claim counts as a GPU hit there (the engine's events lag).
    rows = {row["instance"]: row for row in core.explain(request(2, hashes), 0.0).explain()}
    assert rows[slot]["gpu_hit_tokens"] == 10 * 16
    # Past its time-to-live, with no event saying the engine holds the blocks, it does not:
    # the hits shown are those a placement then would see.
    later = core.cluster.config.speculative_ttl_s + 1.0
    rows = {row["instance"]: row for row in core.explain(request(3, hashes), later).explain()}
    assert rows[slot]["gpu_hit_tokens"] == 0


class Told:
    """An observer that keeps what it was told about sessions."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []
        self.changed: list[str] = []

    def stored(self, slot: int, event: BlocksStored) -> None:
        pass

    def removed(self, slot: int, tier: object, hashes: object) -> None:
        pass

    def session_changed(self, session: object) -> None:
        self.changed.append(getattr(session, "session_id", ""))

    def session_forgotten(self, session_id: str) -> None:
        self.forgotten.append(session_id)


def turn(core: Scheduler, rid: int, session: str, at: float) -> Decision:
    """A turn of `session` placed at `at` and ended a second later."""
    req = request(rid, chain(200 + rid, 8), session=session)
    d = core.place(req, at)
    assert not d.rejected and d.instance >= 0
    done = Completion(
        rid, session, d.instance, d.decode_instance, req.prompt_tokens, 16, 0,
        req.block_hashes, at, at + 0.5, at + 1.0,
    )  # fmt: skip
    core.finish(done, at + 1.0)
    return d


@pytest.mark.parametrize("spec", ["elastic", "sticky", "ear"])
def test_forgetting_idle_sessions_tells_the_observer_and_placement_goes_on(spec: str) -> None:
    told = Told()
    core = scheduler(spec)
    core.observer = told
    for i in range(3):
        turn(core, i + 1, f"s{i}", float(i))
    assert core.forget_idle_sessions(61.5, 60.0) == ["s0"]
    assert told.forgotten == ["s0"]
    assert core.cluster.sessions.get("s0") is None and len(core.cluster.sessions) == 2
    # The policy holds no stale reference: the forgotten session and the others place again.
    for i in range(3):
        turn(core, 10 + i, f"s{i}", 62.0 + i)
    assert core.cluster.sessions.get("s0") is not None
    assert core.forget_idle_sessions(1e6, 0.0, max_sessions=1) == ["s0", "s1"]
    assert told.forgotten == ["s0", "s0", "s1"]
    assert core.forget_idle_sessions(1e6, 0.0) == []  # no TTL, no cap: nothing


def test_a_new_session_past_its_tenants_cap_forgets_that_tenants_idle_one() -> None:
    told = Told()
    core = Scheduler(
        ClusterConfig(n_instances=N), "sticky", seed=3, max_prompt_tokens=131_072,
        max_sessions_per_tenant=2,
    )  # fmt: skip
    for slot in range(N):
        core.add_instance(slot, Role.BOTH)
    core.observer = told
    for i, sid in enumerate(["acme/a", "acme/b", "globex/a", "acme/c"]):
        turn(core, i + 1, sid, float(i))
    assert told.forgotten == ["acme/a"] and core.sessions_evicted == 1
    sessions = core.cluster.sessions
    assert sessions.get("acme/a") is None and sessions.get("globex/a") is not None
    assert sessions.per_tenant("acme") == 2
    with pytest.raises(ValueError, match="per_tenant"):
        Scheduler(ClusterConfig(n_instances=N), "sticky", seed=3, max_prompt_tokens=1,
                  max_sessions_per_tenant=-1)  # fmt: skip
