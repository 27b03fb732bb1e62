"""KV transfers on a whole `kvsched up` cluster: a session whose host turns hot migrates with
its next turn (rebound in etcd only once its KV landed verified, then held by its cooldown); a
Messenger killed mid-migration leaves the session on its source, which serves the turn; a hot
prefix is replicated and a busy holder's prefix fetched; a disaggregated cluster hands a
prompt's KV from its prefill instance to its decode instance.

Transfers are paced (`--transfer-rate`) so that a migration is in flight long enough to look
at etcd in the middle of it. The tests of a module share one cluster and run in file order."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from clients.python import ConductorClient
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.common.store.etcd import EtcdStore
from services.conductor import keys
from tests.e2e.conftest import LocalCluster, local_cluster
from tests.fixtures.poll import wait_for
from tests.fixtures.vllm_metrics import prompt_sources

pytestmark = pytest.mark.slow

T_HOT = 20_000
CONTEXT_BYTES = 3200 * 2048  # the migrated context below, in the mini model's KV bytes
RATE = CONTEXT_BYTES // 2  # about two seconds a migration
# A node's pool holds what its two engines compute for a flood (below) and more, so the
# floods do not evict a session's context or a prefix from it before it moves.
POOL_BYTES = 2 << 30
EAR = f"ear:t_hot_tokens={T_HOT},t_cool_s=300"
_FLOODS = itertools.count(1000)  # every flood's prompts are new: nothing cached shortens them
# Leases longer than the other e2e clusters' 2 s: on two cores, the Conductor digesting a
# flood's KV events (about a million tokens' blocks, indexed and persisted) answers
# keep-alives seconds late, and a 2 s lease lapses under a test that is not about leases.
INSTANCE_TTL_S = 6
# How long the Conductor may take to show what the engines and pools did (their KV events
# queue behind the floods'): a bound for a stalled index, not a measure of its speed.
INDEX_S = 30.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(
        tmp_path_factory.mktemp("up"),
        "--policy", EAR,
        "--transfer-backend", "tcp",
        f"--messenger-flag=--transfer-rate={RATE}",
        "--kv-pool-bytes", str(POOL_BYTES),
        "--instance-ttl", str(INSTANCE_TTL_S),
    ) as up:  # fmt: skip
        yield up


def tokens(n: int, seed: int) -> list[int]:
    """`n` in-vocabulary token ids of their own (the demo tokenizer has 4,096)."""
    return [100 + (seed * 797 + i) % 3900 for i in range(n)]


async def turn(
    http: aiohttp.ClientSession,
    cluster: LocalCluster,
    session: str,
    prompt: list[int],
    *,
    max_tokens: int = 4,
) -> tuple[str, int]:
    """One turn through a Router: where it ran and how many prompt tokens were cached."""
    async with http.post(
        f"{cluster.routers[0]}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens},
        headers={**cluster.auth, "x-session-id": session},
    ) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        instance = resp.headers["x-kvsched-instance"]
    return instance, answer["usage"]["prompt_tokens_details"]["cached_tokens"]


async def flood(http: aiohttp.ClientSession, cluster: LocalCluster, instance: str) -> list[Any]:
    """Queue ~480K prompt tokens on an engine directly (behind the Router's back), and wait
    until the Conductor sees it hot. Returns the requests to await."""
    url = cluster.engine(instance)["url"]

    async def one(k: int) -> None:
        body = {"prompt": tokens(30_000, next(_FLOODS)), "max_tokens": 1}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            await resp.read()

    requests = [asyncio.create_task(one(k)) for k in range(16)]

    async def hot() -> bool:
        row = (await nodes(http, cluster))[instance]
        return bool(row["pending_prefill_tokens"] > 4 * T_HOT)

    await wait_for(hot, 20.0, interval=0.02, message=f"{instance} is hot")
    return requests


async def set_policy(cluster: LocalCluster, spec: str) -> None:
    conductors = [c["url"] for c in cluster.endpoints["conductors"]]
    async with ConductorClient(conductors, credentials=cluster.credentials()) as client:
        assert (await client.set_policy(spec)).spec == spec


async def nodes(http: aiohttp.ClientSession, cluster: LocalCluster) -> dict[str, Any]:
    async with http.get(
        f"{cluster.conductor_http}/api/nodes/stats", headers=cluster.admin_headers
    ) as resp:
        body: dict[str, Any] = await resp.json()
    return {row["instance_id"]: row for row in body["instances"]}


async def session_view(http: aiohttp.ClientSession, cluster: LocalCluster, sid: str) -> Any:
    url = f"{cluster.conductor_http}/api/sessions/demo%2F{sid}"
    async with http.get(url, headers=cluster.admin_headers) as resp:
        return await resp.json()


async def bound_in_etcd(etcd_client: EtcdStore, sid: str) -> str:
    kv = await etcd_client.get(keys.session_key(f"demo/{sid}").encode())
    assert kv is not None
    return str(json.loads(kv.value)["host"])


async def transfers(http: aiohttp.ClientSession, cluster: LocalCluster, kind: str) -> float:
    async with http.get(f"{cluster.conductor_http}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(f'kvsched_conductor_transfers_total{{kind="{kind}",outcome="done"}}'):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_a_hot_hosts_session_migrates_rebinding_only_once_its_kv_landed(
    cluster: LocalCluster, http: aiohttp.ClientSession, etcd_client: EtcdStore
) -> None:
    context = tokens(3000, 1) + tokens(200, 2)
    host, _ = await turn(http, cluster, "mig", tokens(3000, 1))
    assert (await turn(http, cluster, "mig", context))[0] == host
    assert await bound_in_etcd(etcd_client, "mig") == host
    before = await transfers(http, cluster, "migrate_session")
    # Its node's other engine could serve the turn from the node's KV pool without a
    # migration: busy too, the session must leave the node.
    busy = [r for iid in same_node(cluster, host) for r in await flood(http, cluster, iid)]

    moving = asyncio.create_task(turn(http, cluster, "mig", [*context, *tokens(100, 3)]))
    view = await wait_for(
        lambda: _moving(http, cluster, "mig"), INDEX_S, interval=0.01, message="a migration"
    )
    target = view["moving_to_instance_id"]
    assert target != host and view["host_instance_id"] == host
    loaded = await loaded_tokens(http, cluster, target)
    # Its KV is on the wire: the binding in etcd is still the source's.
    assert await bound_in_etcd(etcd_client, "mig") == host
    assert not moving.done()  # the turn waits for its KV (critical path)

    ran_on, cached = await moving
    assert ran_on == target
    assert cached >= len(context) // 16 * 16  # the migrated context hit on the target
    # Moved pool to pool: the target engine loaded it from its node's pool, as vLLM counts.
    assert await loaded_tokens(http, cluster, target) - loaded >= len(context) // 16 * 16
    assert await bound_in_etcd(etcd_client, "mig") == target  # rebound once verified
    assert await transfers(http, cluster, "migrate_session") == before + 1

    # Within the cooldown a hot new host keeps the session: no second migration.
    more = await flood(http, cluster, target)
    assert (await turn(http, cluster, "mig", [*context, *tokens(150, 4)]))[0] == target
    assert await transfers(http, cluster, "migrate_session") == before + 1
    await asyncio.gather(*busy, *more)
    spans = {s.name for s in cluster.otlp.spans}
    assert "transfer migrate_session" in spans and "transfer wait" in spans


async def loaded_tokens(http: aiohttp.ClientSession, cluster: LocalCluster, instance: str) -> float:
    """Prompt tokens `instance`'s engine loaded from its node's pool (vLLM's metric)."""
    sources = await prompt_sources(http, cluster.engine(instance)["url"])
    return sources.get("external_kv_transfer", 0.0)


def same_node(cluster: LocalCluster, instance: str) -> list[str]:
    """`instance` and the other engines of its node (they share the node's KV pool)."""
    node = cluster.engine(instance)["node"]
    return [e["id"] for e in cluster.endpoints["engines"] if e["node"] == node]


async def _moving(http: aiohttp.ClientSession, cluster: LocalCluster, sid: str) -> Any:
    view = await session_view(http, cluster, sid)
    return view if view.get("moving_to_instance_id") else None


async def test_a_busy_nodes_prefix_is_fetched_and_a_hot_prefix_replicated(
    cluster: LocalCluster, http: aiohttp.ClientSession
) -> None:
    """`mooncake` (colocated). A prefix one node holds (its engine, and its KV pool for the
    other engine there): with both engines of that node busy, a request runs on the other
    node with the prefix fetched pool to pool, not recomputed; a second request placed while
    the (paced) fetch lands counts on it too and waits for it, rather than reaching the
    engine first and computing it. Then a prefix turned hot is replicated to the other
    node's pool before anyone there asks for it."""
    await set_policy(cluster, "mooncake:colocated=1,min_hits=1000000")  # fetches, no replicas
    system = tokens(4000, 7)  # a shared system prompt
    whole = 4000 // 16 * 16
    holder, _ = await sharing(http, cluster, system, 100)
    near = same_node(cluster, holder)
    far = [e["id"] for e in cluster.endpoints["engines"] if e["id"] not in near]

    async def only_near() -> bool:  # the pool's blocks are announced once saved
        held = await held_tokens(http, cluster, system)
        return all(held[iid] >= whole for iid in near) and not any(held[iid] for iid in far)

    await wait_for(only_near, INDEX_S, message="the prefix held on the holder's node only")
    fetched = await transfers(http, cluster, "fetch_prefix")
    # The holder's node last and at once: the floods' prompts are saved into its pool as
    # they are computed, and soon evict the prefix from it.
    busy = await flood(http, cluster, far[1])
    for requests in await asyncio.gather(*(flood(http, cluster, iid) for iid in near)):
        busy += requests
    first = asyncio.create_task(sharing(http, cluster, system, 200))
    await wait_for(functools.partial(_running, http, cluster), INDEX_S, message="a fetch runs")
    second = asyncio.create_task(sharing(http, cluster, system, 201))
    (ran_on, cached), (second_on, second_cached) = await asyncio.gather(first, second)
    assert ran_on == second_on == far[0]
    assert cached >= whole and second_cached >= whole
    assert await transfers(http, cluster, "fetch_prefix") == fetched + 1
    await asyncio.gather(*busy)

    await set_policy(cluster, "mooncake:colocated=1,min_hits=2,hot_score=0.01")
    hot = tokens(4000, 8)
    replicated = await transfers(http, cluster, "replicate_prefix")
    for k in range(8):  # sessionless requests reusing the prefix make it hot
        await sharing(http, cluster, hot, 300 + k)
        if await _more(http, cluster, "replicate_prefix", replicated, settle_s=1.0):
            break
    else:  # hot by now: its replication may still be queued behind the floods' events
        assert await _more(http, cluster, "replicate_prefix", replicated, INDEX_S), (
            "the prefix was never replicated"
        )

    # Both nodes hold it now: every engine can load it from its node's pool.
    async def everywhere() -> bool:
        return all(n >= whole for n in (await held_tokens(http, cluster, hot)).values())

    await wait_for(everywhere, INDEX_S, message="the hot prefix held on both nodes")


async def sharing(
    http: aiohttp.ClientSession, cluster: LocalCluster, prefix: list[int], seed: int
) -> tuple[str, int]:
    """A sessionless request starting with `prefix`: where it ran, its cached tokens."""
    async with http.post(
        f"{cluster.routers[1]}/v1/completions",
        json={"prompt": [*prefix, *tokens(50, seed)], "max_tokens": 2},
        headers=cluster.auth,
    ) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        return resp.headers["x-kvsched-instance"], cached


async def held_tokens(
    http: aiohttp.ClientSession, cluster: LocalCluster, prompt: list[int]
) -> dict[str, int]:
    """Each instance's cached tokens of `prompt`'s blocks, in its engine or its node's pool,
    by the Conductor's index."""
    hashes = VllmBlockHasher(16).hash_prompt(prompt, cluster.salt)
    return {row["instance"]: int(row["hit_tokens"]) for row in await cluster.explain(http, hashes)}


async def _running(http: aiohttp.ClientSession, cluster: LocalCluster) -> bool:
    async with http.get(f"{cluster.conductor_http}/metrics") as resp:
        text = await resp.text()
    return any(
        line.startswith("kvsched_conductor_transfers_running ") and float(line.split()[1]) > 0
        for line in text.splitlines()
    )


async def _more(
    http: aiohttp.ClientSession, cluster: LocalCluster, kind: str, was: float, settle_s: float
) -> bool:
    """Whether a transfer of `kind` ended (done) since the count was `was`, waiting up to
    `settle_s` for one ordered just now."""
    more = functools.partial(_count_above, http, cluster, kind, was)
    with contextlib.suppress(AssertionError):
        return bool(await wait_for(more, settle_s))
    return False


async def _count_above(
    http: aiohttp.ClientSession, cluster: LocalCluster, kind: str, was: float
) -> bool:
    return await transfers(http, cluster, kind) > was


async def test_a_messenger_killed_mid_migration_leaves_the_session_served_on_its_source(
    cluster: LocalCluster, http: aiohttp.ClientSession, etcd_client: EtcdStore
) -> None:
    await set_policy(cluster, EAR)
    sid, host, context = await first_turn(http, cluster, "kill", 3000)
    node = cluster.engine(host)["node"]
    # The target will be on the other node.
    busy = [r for iid in same_node(cluster, host) for r in await flood(http, cluster, iid)]

    moving = asyncio.create_task(turn(http, cluster, sid, [*context, *tokens(100, 12)]))
    view = await wait_for(
        lambda: _moving(http, cluster, sid), INDEX_S, interval=0.01, message="a migration"
    )
    target = view["moving_to_instance_id"]
    target_node = cluster.engine(target)["node"]
    assert target_node != node
    messenger = next(m for m in cluster.endpoints["messengers"] if m["node"] == target_node)
    os.kill(messenger["pid"], signal.SIGKILL)

    ran_on, _ = await moving
    assert ran_on == host  # the copy failed: the turn ran where the session's KV is
    assert await bound_in_etcd(etcd_client, sid) == host
    after = await session_view(http, cluster, sid)
    assert after["host_instance_id"] == host and not after["moving_to_instance_id"]
    # ... and keeps being served on its node once the dead node's instances left routing:
    # all of them (the Messenger served each; their leases lapse one by one, and one still
    # routable is a cool instance the hot session may move to). Its node's other engine may
    # take it, from the node's pool, if its flood drained first.
    await wait_for(
        lambda: _gone(http, cluster, same_node(cluster, target)),
        INSTANCE_TTL_S + 10.0,
        message="the dead node's instances gone",
    )
    last, _ = await turn(http, cluster, sid, [*context, *tokens(100, 12), *tokens(50, 13)])
    assert last in same_node(cluster, host)

    async def bound_where_it_ran() -> bool:
        return await bound_in_etcd(etcd_client, sid) == last

    await wait_for(bound_where_it_ran, INDEX_S, message=f"the session bound to {last}")
    await asyncio.gather(*busy)


async def first_turn(
    http: aiohttp.ClientSession, cluster: LocalCluster, name: str, n: int
) -> tuple[str, str, list[int]]:
    """A new session's first turn of `n` new tokens, placed by the Conductor: the session's
    id, host and context. A Conductor still digesting the KV events of earlier floods
    (their prompts stored, and saved into the nodes' pools) can answer the Router late,
    which then sheds the turn (429) or, the Conductor unreachable, places it itself: that
    session and its tokens are left, and new ones tried."""
    attempts = itertools.count()

    async def placed() -> tuple[str, str, list[int]] | None:
        k = next(attempts)
        sid, prompt = f"{name}-{k}", tokens(n, 5000 + k)
        async with http.post(
            f"{cluster.routers[0]}/v1/completions",
            json={"prompt": prompt, "max_tokens": 4},
            headers={**cluster.auth, "x-session-id": sid},
        ) as resp:
            if resp.status == 429:  # shed while the Conductor catches up: try another
                return None
            assert resp.status == 200, await resp.text()
            if "x-kvsched-fallback" in resp.headers:
                return None
            return sid, resp.headers["x-kvsched-instance"], prompt

    found = await wait_for(placed, 3 * INDEX_S, interval=0.5, message="a turn the Conductor placed")
    assert found is not None
    return found


async def _gone(http: aiohttp.ClientSession, cluster: LocalCluster, instances: list[str]) -> bool:
    routable = await nodes(http, cluster)
    return not any(instance in routable for instance in instances)
