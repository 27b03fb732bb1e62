"""Check 4 of the deployment: every metric name the Grafana dashboard and the alerts use is
exported by the service whose /metrics the monitoring component scrapes for it. A small
`kvsched up` cluster (one Router, two nodes of one engine each) serves a session's turns,
one of them migrated to the other node (its host flooded behind the Router's back, as the
e2e transfer tests do), then every /metrics is scraped: the Conductor's HTTP port, the
Router's, each Messenger's and each engine's."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.metrics_core import Metric

from tests.deploy.exposition import component_of, families, sample_names, total, unknown_labels
from tests.deploy.monitoring import alert_queries, dashboard_queries, used_metrics
from tests.e2e.conftest import LocalCluster, local_cluster
from tests.e2e.test_transfers import nodes, tokens, transfers, turn
from tests.fixtures.poll import wait_for

pytestmark = pytest.mark.slow

T_HOT = 10_000  # pending prefill tokens beyond which a session's host is hot (ear)
POOL_BYTES = 768 << 20  # a node's KV pool: the session's context and the flood's prompts
FLOOD_PROMPTS, FLOOD_TOKENS = 12, 12_000  # about 4 s of the modelled GPU's prefill
_FLOODS = itertools.count(2000)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(
        tmp_path_factory.mktemp("up-metrics"),
        "--routers", "1", "--nodes", "2", "--engines-per-node", "1",
        "--policy", f"ear:t_hot_tokens={T_HOT},t_cool_s=300",
        "--transfer-backend", "tcp",
        "--kv-pool-bytes", str(POOL_BYTES),
        time_scale=1.0,  # the flood stays queued long enough to place the next turn under it
    ) as up:  # fmt: skip
        yield up


async def scrape(http: aiohttp.ClientSession, url: str) -> list[Metric]:
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200, url
        return families(await resp.text())


async def scrape_all(http: aiohttp.ClientSession, cluster: LocalCluster) -> dict[str, list[Metric]]:
    """Each component's metric families, over all its processes."""
    targets = {
        "conductor": [c["http_url"] for c in cluster.endpoints["conductors"]],
        "router": cluster.routers,
        "messenger": [m["http_url"] for m in cluster.endpoints["messengers"]],
        "engine": [e["url"] for e in cluster.endpoints["engines"]],
    }
    scraped: dict[str, list[Metric]] = {}
    for component, urls in targets.items():
        assert urls, component
        scraped[component] = [f for url in urls for f in await scrape(http, url)]
    return scraped


async def flood(http: aiohttp.ClientSession, cluster: LocalCluster, instance: str) -> list[Any]:
    """Queue prompts on `instance`'s engine directly and wait until the Conductor sees it
    hot; returns the requests to await."""
    url = cluster.engine(instance)["url"]

    async def one() -> None:
        body = {"prompt": tokens(FLOOD_TOKENS, next(_FLOODS)), "max_tokens": 1}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            await resp.read()

    requests = [asyncio.create_task(one()) for _ in range(FLOOD_PROMPTS)]

    async def hot() -> bool:
        row = (await nodes(http, cluster))[instance]
        return bool(row["pending_prefill_tokens"] > 4 * T_HOT)

    await wait_for(hot, 20.0, interval=0.02, message=f"{instance} is hot")
    return requests


async def test_every_metric_the_dashboard_and_the_alerts_use_is_exported(
    cluster: LocalCluster,
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        context = tokens(3000, 41)
        host, _ = await turn(http, cluster, "observed", context)
        context += tokens(100, 42)
        ran_on, cached = await turn(http, cluster, "observed", context)
        assert ran_on == host and cached >= 3000 // 16 * 16  # the first turn's KV was reused

        migrated = await transfers(http, cluster, "migrate_session")
        busy = await flood(http, cluster, host)
        ran_on, _ = await turn(http, cluster, "observed", [*context, *tokens(100, 43)])
        assert ran_on != host, "the hot host's session did not migrate"
        assert await transfers(http, cluster, "migrate_session") == migrated + 1
        await asyncio.gather(*busy)

        scraped = await scrape_all(http, cluster)

    exported = {component: sample_names(found) for component, found in scraped.items()}
    used = used_metrics()
    missing = {
        name: where for name, where in used.items() if name not in exported[component_of(name)]
    }
    assert not missing, f"used by the dashboard or the alerts, exported by no service: {missing}"
    everything = [family for component in scraped.values() for family in component]
    unknown = unknown_labels(everything, alert_queries() + dashboard_queries())
    assert not unknown, f"labels a query names that its metrics do not have: {unknown}"
    # The traffic above shows in what the dashboard plots, not only in declared families.
    moved = total(scraped["conductor"], "kvsched_conductor_transfer_bytes_total")
    assert moved >= 3000 * 2048  # the migrated context, in the mini model's KV bytes
    assert total(scraped["engine"], "vllm:prefix_cache_hits_total") >= 3000 // 16 * 16
    assert total(scraped["conductor"], "kvsched_conductor_is_leader") == 1
