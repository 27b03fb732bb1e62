"""LoRA adapters in front of real vLLM: two random peft adapters of the tiny model
(`out/models/tiny-llama-lora-a` and `-b`, `scripts/setup --vllm`), served by two vLLM engines
of one adapter slot each (`--max-loras 1`), loaded at run time where the Conductor places
their requests. The Routers hash an adapter's prompts as vLLM does (the adapter's name and path
in every block's extra keys), so a session's cache grows turn by turn where its adapter is
loaded; no engine holds more adapters than its slots. The same cluster serves embeddings from
a third engine, vLLM's pooling runner over the tiny model (`--embedding-model`).

Marked `vllm`, run by the test command after the default suite."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from services.launcher.vllm import DEFAULT_PYTHON
from services.router.api_keys import new_key
from tests.conftest import REPO
from tests.e2e.conftest import LocalCluster, local_cluster
from tests.fixtures.vllm_metrics import prompt_sources

pytestmark = pytest.mark.vllm

MODEL = REPO / "out" / "models" / "tiny-llama"
ADAPTERS = {"lora-a": MODEL.with_name("tiny-llama-lora-a"),
            "lora-b": MODEL.with_name("tiny-llama-lora-b")}  # fmt: skip
START_TIMEOUT_S = 900.0  # two vLLM servers starting together on two cores
BLOCK = 32  # kvsched up's block size for vLLM
EMBEDDER = "tiny-embed"


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    return path, new_key(path, "acme")


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, key: tuple[Path, str]
) -> Iterator[LocalCluster]:
    paths = [MODEL, *ADAPTERS.values()]
    if not DEFAULT_PYTHON.exists() or not all(p.exists() for p in paths):
        pytest.skip("vLLM is not set up here: run scripts/setup --vllm")
    flags = ["--engine", "vllm", "--model", str(MODEL), "--nodes", "1", "--engines-per-node"]
    flags += ["2", "--routers", "2", "--dtype", "float32", "--api-keys", str(key[0])]
    flags += ["--max-loras", "1", *(f"--lora={name}={path}" for name, path in ADAPTERS.items())]
    flags += [f"--embedding-model={EMBEDDER}={MODEL}"]
    with local_cluster(
        tmp_path_factory.mktemp("up"), *flags, time_scale=1.0, start_timeout_s=START_TIMEOUT_S
    ) as up:
        yield up


async def held(http: aiohttp.ClientSession, engine: dict[str, Any]) -> dict[str, str]:
    """The adapters a vLLM engine lists in its /v1/models, by name: their paths."""
    async with http.get(engine["url"] + "/v1/models") as resp:
        cards = (await resp.json())["data"]
    return {c["id"]: c["root"] for c in cards if c.get("parent")}


async def chat(
    cluster: LocalCluster, http: aiohttp.ClientSession, key: str, model: str, turns: int
) -> tuple[list[str], list[int]]:
    """A session of `turns` turns with `model` through the Routers in turn (a refused turn,
    429, is sent again after its Retry-After); each turn's engine and cached tokens."""
    words = " ".join(f"w{i * 7919 % 5000}" for i in range(300))
    messages: list[dict[str, Any]] = []
    hosts, cached = [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{model} turn {turn}: {words[turn * 300 :]}"})
        for _ in range(5):
            async with http.post(
                cluster.routers[turn % 2] + "/v1/chat/completions",
                json={"model": model, "messages": messages, "max_tokens": 4},
                headers={"Authorization": f"Bearer {key}", "x-session-id": f"s-{model}"},
            ) as resp:
                if resp.status == 429:
                    await asyncio.sleep(float(resp.headers["Retry-After"]))
                    continue
                answer = await resp.json()
                assert resp.status == 200, answer
                hosts.append(resp.headers["x-kvsched-instance"])
                break
        else:
            raise AssertionError(f"{model}: refused five times")
        assert answer["model"] == model
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        messages.append(answer["choices"][0]["message"])
    return hosts, cached


async def test_a_lora_sessions_cache_grows_where_its_adapter_is_loaded(
    cluster: LocalCluster, http: aiohttp.ClientSession, key: tuple[Path, str]
) -> None:
    hosts, cached = await chat(cluster, http, key[1], "lora-a", turns=4)
    assert len(set(hosts)) == 1, hosts
    assert not hosts[0].startswith("node-0-embed")  # an embedding engine takes no chat
    assert cached[0] == 0 and all(b > a for a, b in itertools.pairwise(cached)), cached
    # The Router loaded it there, from the path its blocks' hashes name.
    assert await held(http, cluster.engine(hosts[0])) == {"lora-a": str(ADAPTERS["lora-a"])}


async def test_a_second_adapter_finds_a_slot_and_no_engine_holds_more_than_max_loras(
    cluster: LocalCluster, http: aiohttp.ClientSession, key: tuple[Path, str]
) -> None:
    hosts, cached = await chat(cluster, http, key[1], "lora-b", turns=2)
    assert cached[1] > 0, cached
    assert "lora-b" in await held(http, cluster.engine(hosts[-1]))
    for engine in cluster.endpoints["engines"]:
        assert len(await held(http, engine)) <= 1  # (the embedding engine holds none)


async def test_the_adapter_is_applied_and_the_routers_list_every_adapter(
    cluster: LocalCluster, key: tuple[Path, str]
) -> None:
    """Greedy decoding of one prompt with the base model and with an adapter: vLLM applied
    the adapter (its random weights change the output). The OpenAI SDK lists both adapters
    with their base."""
    client = openai.AsyncOpenAI(base_url=cluster.routers[0] + "/v1", api_key=key[1])
    prompt = "the same prompt for the base model and for an adapter of it, " * 4
    texts = {}
    for model in ("tiny-llama", "lora-a"):
        done = await client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0.0
        )
        texts[model] = done.choices[0].text
    assert texts["tiny-llama"] != texts["lora-a"]
    listed = {m.id: m for m in (await client.models.list()).data}
    for name in ADAPTERS:
        assert getattr(listed[name], "parent", None) == "tiny-llama"
    await client.close()


async def test_embeddings_come_from_the_embedding_engine_through_the_openai_sdk(
    cluster: LocalCluster, key: tuple[Path, str]
) -> None:
    client = openai.AsyncOpenAI(base_url=cluster.routers[1] + "/v1", api_key=key[1])
    done = await client.embeddings.with_raw_response.create(
        model=EMBEDDER, input=["the KV cache", "a session's prefix"]
    )
    assert done.headers["x-kvsched-instance"].startswith("node-0-embed")
    vectors = done.parse().data
    assert [v.index for v in vectors] == [0, 1]
    assert len(vectors[0].embedding) == len(vectors[1].embedding) == 64  # the hidden size
    assert vectors[0].embedding != vectors[1].embedding
    assert EMBEDDER in {m.id for m in (await client.models.list()).data}
    await client.close()


async def test_the_connector_saves_an_adapters_blocks_and_another_engine_loads_them(
    cluster: LocalCluster, http: aiohttp.ClientSession, key: tuple[Path, str]
) -> None:
    """An adapter's prompt computed on one engine (placed by a Router) is saved into the
    node's pool by kvsched's connector, with the adapter's keys the pool checks; the other
    engine of the node, given the adapter and the same prompt, loads those blocks from the
    pool instead of computing them (vLLM's own count: `external_kv_transfer`)."""
    prompt = [10 + (i * 104729) % 4000 for i in range(8 * BLOCK + 5)]
    body = {"model": "lora-a", "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    async with http.post(
        cluster.routers[0] + "/v1/completions", json=body,
        headers={"Authorization": f"Bearer {key[1]}"},
    ) as resp:  # fmt: skip
        assert resp.status == 200, await resp.text()
        computed_on = resp.headers["x-kvsched-instance"]
        first = await resp.json()
    other = next(
        e for e in cluster.endpoints["engines"]
        if e["id"] != computed_on and e["model"] != EMBEDDER
    )  # fmt: skip
    # The Router salted the blocks with the tenant's salt: so does this request (unsalted, it
    # would be other blocks).
    tenants = json.loads(key[0].read_text(encoding="utf-8"))["tenants"]
    body["cache_salt"] = next(iter(tenants.values()))["salt"]
    load = {"lora_name": "lora-a", "lora_path": str(ADAPTERS["lora-a"])}
    async with http.post(other["url"] + "/v1/load_lora_adapter", json=load) as resp:
        assert resp.status in (200, 400), await resp.text()  # 400: it holds it already
    before = await prompt_sources(http, other["url"])
    async with http.post(other["url"] + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        second = await resp.json()
    grew = {
        k: v - before.get(k, 0.0) for k, v in (await prompt_sources(http, other["url"])).items()
    }
    assert grew.get("external_kv_transfer", 0) >= 8 * BLOCK, grew
    assert second["choices"][0]["text"] == first["choices"][0]["text"]  # the same KV, float32
