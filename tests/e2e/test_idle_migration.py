"""`elastic`'s idle-gap migration on a whole `kvsched up` cluster: a session whose host turns
hot while its turn runs has its KV moved while the agent is busy between turns, off every
turn's critical path; its next turn finds it on the new host."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from services.common.store.etcd import EtcdStore
from tests.e2e.conftest import LocalCluster, local_cluster
from tests.e2e.test_transfers import (
    INDEX_S,
    INSTANCE_TTL_S,
    POOL_BYTES,
    bound_in_etcd,
    flood,
    nodes,
    same_node,
    session_view,
    tokens,
    turn,
)
from tests.fixtures.poll import wait_for

pytestmark = pytest.mark.slow

# The modelled GPU at half speed, not the other e2e clusters' ten times its speed: the KV's
# data plane (copies into the node's pool, the move over TCP: about 200 MB) runs on the two
# cores as they are, and at ten times the speed the floods that make the host hot drain
# while the session's turn still saves its KV.
TIME_SCALE = 0.5
# A move's deadline floor (5 s by default): the 200 MB over TCP take seconds on loaded cores.
TRANSFER_TIMEOUT_S = 60
# Room for the floods (16 x 30,000 tokens) beside the session's 103,100-token context. A host
# that evicts the context before the move copies it (the default capacity is 467,280 tokens)
# moves only what it still holds: a move does not yet read the rest from the node's pool.
CAPACITY_BLOCKS = 40_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(
        tmp_path_factory.mktemp("up-idle"),
        "--policy", "elastic:admission=0",
        "--kv-pool-bytes", str(POOL_BYTES),
        f"--engine-flag=--capacity-blocks={CAPACITY_BLOCKS}",
        "--instance-ttl", str(INSTANCE_TTL_S),  # test_transfers' leases: the floods' events
        time_scale=TIME_SCALE,
        extra_env={"KVSCHED_CONDUCTOR_TRANSFER_TIMEOUT": str(TRANSFER_TIMEOUT_S)},
    ) as up:  # fmt: skip
        yield up


async def test_a_session_moves_in_its_idle_gap_off_the_critical_path(
    cluster: LocalCluster, http: aiohttp.ClientSession, etcd_client: EtcdStore
) -> None:
    context = tokens(3000, 21)
    host, _ = await turn(http, cluster, "idle", context)
    # The host's load report shows the turn done (until then its charge stands).
    await wait_for(lambda: _idle(http, cluster, host), 10.0, message="the host reports idle")
    context += tokens(100, 22)
    assert (await turn(http, cluster, "idle", context))[0] == host
    waits = await _router_waits(http, cluster)
    # A turn with a long new prompt: placed on its cool host, it is still prefilling when
    # the host turns hot (its queue then outlasts the session's idle gap), so when it ends
    # the session's KV moves during the gap before the next turn.
    context += tokens(100_000, 23)
    long_turn = asyncio.create_task(turn(http, cluster, "idle", context))
    engine = cluster.engine(host)["url"]
    await wait_for(lambda: _prefilling(http, engine), 20.0, message="the long turn prefills")
    # Its node's other engine, which could take the session from the node's pool with no
    # transfer at all, is busy too: the session must leave the node.
    busy = [r for iid in same_node(cluster, host) for r in await flood(http, cluster, iid)]
    assert (await long_turn)[0] == host
    view = await wait_for(
        lambda: _moved_off(http, cluster, "idle", host), 30.0, message="an idle-gap migration"
    )
    target = view["host_instance_id"]
    assert view["migrations"] == 1
    # The binding's write queues behind the floods' index writes.
    await wait_for(
        lambda: _bound_to(etcd_client, "idle", target), INDEX_S, message="the binding reaches etcd"
    )
    ran_on, cached = await turn(http, cluster, "idle", [*context, *tokens(50, 24)])
    assert ran_on == target and cached >= len(context) // 16 * 16 - 16
    assert await _router_waits(http, cluster) == waits  # no turn waited for the move
    await asyncio.gather(*busy)


async def _bound_to(etcd_client: EtcdStore, sid: str, instance: str) -> bool:
    return await bound_in_etcd(etcd_client, sid) == instance


async def _idle(http: aiohttp.ClientSession, cluster: LocalCluster, instance: str) -> bool:
    return bool((await nodes(http, cluster))[instance]["pending_prefill_tokens"] == 0)


async def _prefilling(http: aiohttp.ClientSession, engine: str) -> bool:
    async with http.get(f"{engine}/kvsched/load") as resp:
        return bool((await resp.json())["pending_prefill_tokens"] > 0)


async def _moved_off(
    http: aiohttp.ClientSession, cluster: LocalCluster, sid: str, host: str
) -> Any:
    view = await session_view(http, cluster, sid)
    return view if view["host_instance_id"] not in ("", host) else None


async def _router_waits(http: aiohttp.ClientSession, cluster: LocalCluster) -> float:
    """How many times the Routers waited for a migration's KV."""
    total = 0.0
    for router in cluster.routers:
        async with http.get(f"{router}/metrics") as resp:
            for line in (await resp.text()).splitlines():
                if line.startswith(
                    'kvsched_router_transfer_wait_seconds_count{kind="migrate_session"}'
                ):
                    total += float(line.rsplit(" ", 1)[1])
    return total
