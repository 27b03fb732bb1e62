"""LoRA adapters on a local cluster of simulated engines (`kvsched up --lora`), which serve
adapters as vLLM does (runtime loads, `/v1/models`, adapter-keyed block hashes): a session of
an adapter is placed where its adapter is loaded, its cache grows turn by turn, no engine
holds more adapters than `--max-loras`, and the Routers list every adapter.

The same against real vLLM, with a peft adapter: `tests/e2e/test_vllm_lora.py`."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.api.conductor.v1 import conductor_service_pb2_grpc as pb_grpc
from services.common.security.tls import aio_channel
from tests.e2e.conftest import LocalCluster, local_cluster
from tests.fixtures.poll import wait_for

ADAPTERS = ("support-bot", "sql-bot")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    tmp = tmp_path_factory.mktemp("lora")
    flags = ["--nodes", "1", "--engines-per-node", "2", "--max-loras", "1"]
    for name in ADAPTERS:  # the simulated engines read no weights: a config names an adapter
        adapter = tmp / name
        adapter.mkdir()
        (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "peft_type": "LORA"}))
        flags += ["--lora", f"{name}={adapter}"]
    with local_cluster(tmp, *flags) as up:
        yield up


class Chat:
    """A chat with one model, a turn at a time through the Routers in turn."""

    def __init__(self, model: str, session: str) -> None:
        self.model, self.session = model, session
        self.messages: list[dict[str, Any]] = [  # a prefix of its own
            {"role": "system", "content": f"You are {model} in {session}. " * 40}
        ]
        self.hosts: list[str] = []
        self.cached: list[int] = []
        self.refusals = 0  # 429s: no adapter slot free anywhere

    async def turn(self, cluster: LocalCluster, http: aiohttp.ClientSession) -> None:
        """The next turn; one the Routers refuse with a 429 (every adapter slot in use) is
        sent again after its Retry-After, a few times."""
        n = len(self.hosts)
        self.messages.append({"role": "user", "content": f"Turn {n}: go on. " * 20})
        for _ in range(5):
            async with http.post(
                f"{cluster.routers[n % 2]}/v1/chat/completions",
                json={"model": self.model, "messages": self.messages, "max_tokens": 8},
                headers={**cluster.auth, "x-session-id": self.session},
            ) as resp:
                if resp.status == 429:
                    self.refusals += 1
                    assert "adapter_slots_full" in (await resp.json())["error"]["message"]
                    await asyncio.sleep(float(resp.headers["Retry-After"]))
                    continue
                assert resp.status == 200, await resp.text()
                self.hosts.append(resp.headers["x-kvsched-instance"])
                answer = await resp.json()
                break
        else:
            raise AssertionError(f"{self.model}: refused five times")
        assert answer["model"] == self.model
        self.cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        self.messages.append(answer["choices"][0]["message"])


async def held(cluster: LocalCluster, http: aiohttp.ClientSession, instance: str) -> set[str]:
    """The adapters an engine lists in its `/v1/models`."""
    async with http.get(cluster.engine(instance)["url"] + "/v1/models") as resp:
        cards = (await resp.json())["data"]
    return {c["id"] for c in cards if c.get("parent")}


async def test_the_routers_list_every_adapter_with_its_base(
    cluster: LocalCluster, http: aiohttp.ClientSession
) -> None:
    async with http.get(cluster.routers[0] + "/v1/models", headers=cluster.auth) as resp:
        cards = {c["id"]: c for c in (await resp.json())["data"]}
    base = cluster.endpoints["model"]
    assert base in cards
    for name in ADAPTERS:
        assert cards[name]["parent"] == base


async def test_an_adapter_session_runs_where_its_adapter_is_loaded_and_its_cache_grows(
    cluster: LocalCluster, http: aiohttp.ClientSession
) -> None:
    chat = Chat(ADAPTERS[0], "lora-first")
    for _ in range(4):
        await chat.turn(cluster, http)
    assert len(set(chat.hosts)) == 1, chat.hosts
    assert chat.cached[0] == 0, chat.cached
    assert all(b > a for a, b in itertools.pairwise(chat.cached)), chat.cached
    assert ADAPTERS[0] in await held(cluster, http, chat.hosts[0])


async def test_each_engine_holds_at_most_max_loras_adapters(
    cluster: LocalCluster, http: aiohttp.ClientSession
) -> None:
    """Two adapters' sessions, turn for turn, on engines of one adapter slot each (one
    still holding the first test's adapter): no engine ever lists two adapters; a turn that
    finds no slot free is refused with a Retry-After (an adapter placed moments ago is not
    unloaded), and served once it passes; both sessions' caches grow."""
    sessions = {name: Chat(name, f"lora-{name}") for name in ADAPTERS}
    for _ in range(3):
        for chat in sessions.values():
            await chat.turn(cluster, http)
            for engine in cluster.endpoints["engines"]:
                assert len(await held(cluster, http, engine["id"])) <= 1
    for chat in sessions.values():  # (the first turn may share a block with another chat)
        assert all(b > a for a, b in itertools.pairwise(chat.cached)), chat.cached


async def test_the_conductor_learns_what_each_engine_holds(cluster: LocalCluster) -> None:
    """The Messengers report each engine's adapters with its load (ListInstances)."""

    async def held_per_engine() -> list[str]:
        async with aio_channel(cluster.endpoints["conductors"][0]["url"], cluster.tls()) as ch:
            listed = await pb_grpc.ConductorServiceStub(ch).ListInstances(
                pb.ListInstancesRequest(), timeout=5.0
            )
        return sorted(a for i in listed.instances for a in i.load.adapters.held)

    async def both_loaded() -> bool:
        return await held_per_engine() == sorted(ADAPTERS)

    assert await wait_for(both_loaded, timeout=20.0, interval=0.2)


async def test_an_unknown_adapter_is_vllms_404(
    cluster: LocalCluster, http: aiohttp.ClientSession
) -> None:
    async with http.post(
        cluster.routers[0] + "/v1/completions",
        json={"model": "no-such-bot", "prompt": "hello", "max_tokens": 2},
        headers=cluster.auth,
    ) as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["param"] == "model"
