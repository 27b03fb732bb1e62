"""The control core's front door: `explain` answers what `place` would do and changes
nothing, a policy's own bookkeeping included."""

from __future__ import annotations

import pytest

from kvsched.core.cluster import ClusterConfig, Role
from kvsched.core.decision import Decision
from kvsched.core.events import BlocksStored
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
