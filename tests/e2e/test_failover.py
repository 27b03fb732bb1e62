"""Leader failover under steady streaming load, end to end through `kvsched up --conductors 2`
(`tests/e2e/failover_drill.py`): an engine is killed and leaves, then the leader is SIGKILLed
twice in a row. Each takeover takes at most 2 s; no session binding changes, in etcd or in the
new leader; no instance is registered again or resynced, no event cursor goes back and no KV
event batch is sent again (the standby applies the dead leader's unflushed tail from the
Messengers' mirror); no client request fails, and
turns the Routers place alone while no Conductor answers go to the sessions' hosts.
Instance leases are the e2e cluster's short ones (`INSTANCE_TTL_S`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import LocalCluster, local_cluster
from tests.e2e.failover_drill import drill

pytestmark = pytest.mark.slow

TAKEOVER_GOAL_S = 2.0


@pytest.fixture
def up(tmp_path: Path) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path, "--conductors", "2", "--policy", "sticky") as cluster:
        yield cluster


async def test_leader_killed_twice_under_load_loses_no_binding_and_no_registration(
    up: LocalCluster, tmp_path: Path
) -> None:
    results = await drill(up, rounds=2, workdir=tmp_path)
    assert len(results) == 2
    for n, result in enumerate(results, 1):
        line = result.line(n)
        print(line)
        assert result.takeover_s <= TAKEOVER_GOAL_S, line
        assert result.bindings >= 4, line  # the sessions the drill's clients keep bound
        assert not result.changed, f"bindings changed in etcd: {result.changed}"
        assert not result.adopted_otherwise, f"the new leader differs: {result.adopted_otherwise}"
        assert not result.cursors_behind, f"event cursors went back: {result.cursors_behind}"
        for counter in (
            "resyncs",
            "registrations",
            "engine_registered",
            "resent_batches",
            "resent_blocks",
        ):
            assert result.counts[counter] == 0, line
        assert not result.failures, result.failures[:5]
        assert result.moved == 0, line  # the Routers' own placements kept the bindings too
