"""The DRAM tier live on a whole `kvsched up` cluster (issue 17, acceptance 6): a session's
turn is computed in an engine's GPU memory and written through to its node's KV pool (the
Conductor's index shows its blocks in both tiers); a flood of other prompts evicts them from
the engine's GPU memory (the index: the GPU hit gone, the pool hit kept, on every engine of
the node); the session's next turn loads them from the pool instead of computing them, and
its `cached_tokens` count them as vLLM counts a KV connector's loads.

One node of two simulated engines with a small GPU KV memory (256 blocks of 16 tokens),
so that a few prompts evict a session's context; `sticky` keeps the session on its host.
No timing is asserted: every wait polls the state with a generous deadline."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from kvsched.core.vllm_hashing import VllmBlockHasher
from services.common.inference_api.openai_api import PromptTokenizer
from services.engine.text import Words
from tests.e2e.conftest import LocalCluster, local_cluster
from tests.fixtures.poll import wait_for
from tests.fixtures.vllm_metrics import prompt_sources

pytestmark = pytest.mark.slow

BS = 16
CAPACITY_BLOCKS = 256  # the engines' GPU KV memory: 4,096 tokens
CONTEXT = 100 * BS  # the session's first prompt: 100 whole blocks
FLOOD = 2000  # tokens of each flooding prompt; four of them outgrow the GPU memory twice
DEADLINE_S = 60.0  # a loaded two-core machine: generous, never part of what is asserted


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(
        tmp_path_factory.mktemp("up"),
        "--policy", "sticky",
        "--nodes", "1",
        "--engines-per-node", "2",
        "--routers", "1",
        f"--engine-flag=--capacity-blocks={CAPACITY_BLOCKS}",
    ) as up:  # fmt: skip
        yield up


def tokens(n: int, seed: int) -> list[int]:
    """`n` in-vocabulary token ids of their own (the demo tokenizer has 4,096)."""
    return [100 + (seed * 797 + i * 13) % 3900 for i in range(n)]


async def session_turn(
    http: aiohttp.ClientSession, cluster: LocalCluster, prompt: list[int], max_tokens: int
) -> tuple[str, int, str]:
    """One turn of the session through the Router: where it ran, its cached tokens, its text."""
    async with http.post(
        f"{cluster.routers[0]}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens},
        headers={**cluster.auth, "x-session-id": "tiered"},
    ) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        instance = resp.headers["x-kvsched-instance"]
    details = answer["usage"]["prompt_tokens_details"]
    return instance, int(details["cached_tokens"]), str(answer["choices"][0]["text"])


async def tiers(
    http: aiohttp.ClientSession, cluster: LocalCluster, prompt: list[int]
) -> dict[str, dict[str, int]]:
    """Each instance's hit on `prompt`'s blocks by tier, by the Conductor's index (the admin
    explain): `gpu_hit_tokens`, `pool_hit_tokens`, `pool_tokens` (only in the pool)."""
    hashes = VllmBlockHasher(BS).hash_prompt(prompt, cluster.salt)
    keys = ("hit_tokens", "gpu_hit_tokens", "pool_hit_tokens", "pool_tokens")
    rows = await cluster.explain(http, hashes)
    return {row["instance"]: {k: int(row[k]) for k in keys} for row in rows}


async def loaded_tokens(http: aiohttp.ClientSession, cluster: LocalCluster, instance: str) -> float:
    """Prompt tokens `instance`'s engine loaded from its node's pool (vLLM's metric)."""
    sources = await prompt_sources(http, cluster.engine(instance)["url"])
    return sources.get("external_kv_transfer", 0.0)


async def flood(http: aiohttp.ClientSession, cluster: LocalCluster, instance: str) -> None:
    """Other prompts straight to `instance`'s engine, one after another, until the
    least recently used blocks (the session's) have been evicted to make room for them."""
    url = cluster.engine(instance)["url"]
    for k in range(4):
        body = {"prompt": tokens(FLOOD, 500 + k), "max_tokens": 1}
        async with http.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()


def expected_text(prompt: list[int], max_tokens: int) -> str:
    """What a simulated engine (seed 0, the demo tokenizer) answers to `prompt`."""
    words = Words(PromptTokenizer(), 0)
    return words.text(words.start(prompt), 0, max_tokens)


async def test_a_sessions_kv_evicted_to_the_pool_is_loaded_for_its_next_turn(
    cluster: LocalCluster, http: aiohttp.ClientSession
) -> None:
    context = tokens(CONTEXT, 1)
    host, cached, _ = await session_turn(http, cluster, context, 4)
    assert cached == 0
    other = next(e["id"] for e in cluster.endpoints["engines"] if e["id"] != host)
    held = CONTEXT - BS  # the prompt's last block is never a hit: its last token is computed

    # Computed in the host's GPU memory and written through to the node's pool, which both
    # engines of the node share.
    async def in_both_tiers() -> dict[str, dict[str, int]] | None:
        now = await tiers(http, cluster, context)
        h = now[host]
        both = h["gpu_hit_tokens"] >= held and h["pool_hit_tokens"] >= held
        return now if both and now[other]["pool_hit_tokens"] >= held else None

    before = await wait_for(in_both_tiers, DEADLINE_S, interval=0.1, message="GPU and pool")
    assert before is not None
    assert before[host]["pool_tokens"] == 0  # nothing the pool adds beyond the GPU hit
    assert before[other]["gpu_hit_tokens"] == 0
    assert before[other]["pool_tokens"] == before[other]["pool_hit_tokens"]

    # The flood evicts the session's blocks from the host's GPU memory: the tier move. The
    # index shows it once the engine's removals are in and the first turn's speculative
    # placement has expired (`ClusterConfig.speculative_ttl_s`).
    await flood(http, cluster, host)

    async def moved_to_the_pool() -> dict[str, dict[str, int]] | None:
        now = await tiers(http, cluster, context)
        h = now[host]
        return now if h["gpu_hit_tokens"] == 0 and h["pool_hit_tokens"] >= held else None

    after = await wait_for(moved_to_the_pool, DEADLINE_S, interval=0.1, message="evicted")
    assert after is not None
    assert after[host]["pool_tokens"] == after[host]["hit_tokens"] >= held

    # The next turn loads the evicted context from the pool instead of computing it.
    loaded_before = await loaded_tokens(http, cluster, host)
    follow_up = [*context, *tokens(40, 2)]
    ran_on, cached, text = await session_turn(http, cluster, follow_up, 6)
    assert ran_on == host
    assert cached >= held
    loaded = await loaded_tokens(http, cluster, host) - loaded_before
    assert loaded >= held
    assert cached >= loaded  # the loaded tokens are among the cached ones
    assert text == expected_text(follow_up, 6)
    # Loaded into GPU memory, the context is in both tiers again.
    await wait_for(in_both_tiers, DEADLINE_S, interval=0.1, message="back in GPU memory")
