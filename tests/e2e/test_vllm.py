"""kvsched in front of stock vLLM: `kvsched up --engine vllm` with two real vLLM servers (the
CPU build, the tiny model `scripts/setup --vllm` makes, in float32) on two nodes, each with its
Messenger and KV pool, a Conductor, two Routers. The vLLM processes are shared by the whole
module: they take a minute or two to start.

Needs `.venv-vllm/` and `out/models/tiny-llama/` (`scripts/setup --vllm`, which the test
command runs); marked `vllm`, run by the test command after the default suite."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.messenger.v1 import messenger_service_pb2 as pb
from kvsched.api.messenger.v1 import messenger_service_pb2_grpc as pb_grpc
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.common.inference_api.openai_api import PromptTokenizer, parse_request
from services.common.security.identity import Identity, Role
from services.common.security.tls import aio_channel
from services.common.serving.durations import duration
from services.launcher.vllm import DEFAULT_PYTHON
from services.router.api_keys import new_key
from tests.conftest import REPO
from tests.e2e.conftest import LocalCluster, local_cluster
from tests.e2e.test_transfers import set_policy, transfers
from tests.fixtures.poll import wait_for
from tests.fixtures.vllm_metrics import prompt_sources as vllm_prompt_sources

pytestmark = pytest.mark.vllm

MODEL_DIR = REPO / "out" / "models" / "tiny-llama"
MODEL = "tiny-llama"
BLOCK = 32
HASHER = VllmBlockHasher(BLOCK)
START_TIMEOUT_S = 900.0  # two vLLM servers starting together on two cores
VECTORS = json.loads((REPO / "tests/data/vllm/prompt_tokens.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    return path, {name: new_key(path, name) for name in ("acme", "globex")}


@pytest.fixture(scope="module")
def restarted() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test started again in place of the cluster's (stopped with it)."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
    tenants: tuple[Path, dict[str, str]],
    restarted: list[subprocess.Popen[bytes]],
) -> Iterator[LocalCluster]:
    if not DEFAULT_PYTHON.exists() or not (MODEL_DIR / "config.json").exists():
        pytest.skip("vLLM is not set up here: run scripts/setup --vllm")
    flags = ["--engine", "vllm", "--model", str(MODEL_DIR), "--served-model-name", MODEL]
    flags += ["--nodes", "2", "--engines-per-node", "1", "--routers", "2", "--dtype", "float32"]
    flags += ["--block-size", str(BLOCK), "--api-keys", str(tenants[0])]
    with local_cluster(
        tmp_path_factory.mktemp("up"), *flags, time_scale=1.0, start_timeout_s=START_TIMEOUT_S
    ) as up:
        yield up


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


def engines(cluster: LocalCluster) -> list[dict[str, Any]]:
    return list(cluster.endpoints["engines"])


def messenger_of(cluster: LocalCluster, engine: dict[str, Any]) -> dict[str, Any]:
    return next(m for m in cluster.endpoints["messengers"] if m["node"] == engine["node"])


async def post(http: aiohttp.ClientSession, url: str, body: Any, **headers: str) -> Any:
    async with http.post(url, json=body, headers=headers) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        return answer, resp.headers


async def tokens_of(http: aiohttp.ClientSession, engine: dict[str, Any], prompt: str) -> list[int]:
    answer, _ = await post(http, engine["url"] + "/tokenize", {"model": MODEL, "prompt": prompt})
    return list(answer["tokens"])


async def held_tokens(
    http: aiohttp.ClientSession, cluster: LocalCluster, hashes: list[int]
) -> dict[str, int]:
    """Each instance's cached tokens of the chain `hashes`, by the Conductor's index."""
    return {row["instance"]: row["hit_tokens"] for row in await cluster.explain(http, hashes)}


async def instances(http: aiohttp.ClientSession, cluster: LocalCluster) -> set[str]:
    url = cluster.conductor_http + "/api/nodes/stats"
    async with http.get(url, headers=cluster.admin_headers) as resp:
        body = await resp.json()
    rows = body.get("instances", body) if isinstance(body, dict) else body
    return {row["instance_id"] for row in rows}


def text(seed: int, words: int = 120) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 5000}" for i in range(words))


async def cached_directly(
    http: aiohttp.ClientSession, cluster: LocalCluster, engine: dict[str, Any], seed: int
) -> list[int]:
    """Send a prompt straight to `engine` (no Router, no salt); its block hashes."""
    prompt = text(seed)
    await post(http, engine["url"] + "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                          "max_tokens": 1})  # fmt: skip
    return HASHER.hash_prompt(await tokens_of(http, engine, prompt))


async def indexed_on(
    http: aiohttp.ClientSession, cluster: LocalCluster, hashes: list[int], engine: str
) -> bool:
    held = await held_tokens(http, cluster, hashes)
    return held.get(engine) == len(hashes) * BLOCK and all(
        n == 0 for iid, n in held.items() if iid != engine
    )


async def test_both_engines_register_and_a_direct_prompt_is_indexed_exactly(
    cluster: LocalCluster, http: aiohttp.ClientSession
) -> None:
    assert await instances(http, cluster) == {e["id"] for e in engines(cluster)}
    for seed, engine in enumerate(engines(cluster)):
        hashes = await cached_directly(http, cluster, engine, seed)
        assert len(hashes) >= 3

        async def exact(hashes: list[int] = hashes, iid: str = engine["id"]) -> bool:
            return await indexed_on(http, cluster, hashes, iid)

        await wait_for(exact, 10.0, message=f"{engine['id']} holds exactly the prompt's blocks")


async def test_a_chat_session_stays_on_one_engine_and_its_cache_grows(
    cluster: LocalCluster, http: aiohttp.ClientSession, tenants: tuple[Path, dict[str, str]]
) -> None:
    keys = tenants[1]
    messages: list[dict[str, str]] = [{"role": "system", "content": text(100, 60)}]
    served, cached = [], []
    for turn in range(4):
        messages.append({"role": "user", "content": text(200 + turn, 80)})
        router = cluster.routers[turn % 2]
        body = {"model": MODEL, "messages": messages, "max_tokens": 4}
        answer, headers = await post(
            http, router + "/v1/chat/completions", body,
            Authorization=f"Bearer {keys['acme']}", **{"x-session-id": "chat-1"},
        )  # fmt: skip
        served.append(headers["x-kvsched-instance"])
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        reply = answer["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": reply})
    assert len(set(served)) == 1, served
    assert all(b > a for a, b in itertools.pairwise(cached)), cached
    # Another tenant's identical first turn finds nothing: its salt starts another chain.
    first = {"model": MODEL, "messages": messages[:2], "max_tokens": 4}
    answer, _ = await post(
        http, cluster.routers[0] + "/v1/chat/completions", first,
        Authorization=f"Bearer {keys['globex']}",
    )  # fmt: skip
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def _restartable(pid: int) -> tuple[list[str], dict[str, str]]:
    """A running process's command line and environment, to start it again."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    env = dict(
        item.split("=", 1)
        for item in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
        if "=" in item
    )
    return [a.decode() for a in argv], env


def _start_again(
    argv: list[str], env: dict[str, str], log: Path, started: list[subprocess.Popen[bytes]]
) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    started.append(process)
    return process


async def test_a_restarted_messenger_and_lost_events_leave_the_index_correct(
    cluster: LocalCluster,
    http: aiohttp.ClientSession,
    tmp_path: Path,
    restarted: list[subprocess.Popen[bytes]],
) -> None:
    engine = engines(cluster)[0]
    messenger = messenger_of(cluster, engine)
    argv, env = _restartable(messenger["pid"])
    before = await cached_directly(http, cluster, engine, 300)
    os.killpg(messenger["pid"], signal.SIGKILL)
    during = await cached_directly(http, cluster, engine, 301)  # no Messenger listens
    # The new Messenger also loses the first two KV-event messages of each engine.
    again = _start_again(
        [*argv, "--fault-drop-batches", "2"], env, tmp_path / "messenger.log", restarted
    )
    messenger["pid"] = again.pid
    after = [await cached_directly(http, cluster, engine, 302 + i) for i in range(3)]
    for hashes in (before, during, *after):

        async def exact(hashes: list[int] = hashes) -> bool:
            return await indexed_on(http, cluster, hashes, engine["id"])

        await wait_for(exact, 15.0, message="the index holds every prompt's blocks")


async def test_an_engine_killed_mid_stream_fails_cleanly_leaves_and_comes_back(
    cluster: LocalCluster,
    http: aiohttp.ClientSession,
    tenants: tuple[Path, dict[str, str]],
    restarted: list[subprocess.Popen[bytes]],
) -> None:
    keys = tenants[1]
    body = {"model": MODEL, "messages": [{"role": "user", "content": text(400)}],
            "max_tokens": 400, "stream": True, "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {keys['acme']}", "x-session-id": "doomed"}
    async with http.post(cluster.routers[0] + "/v1/chat/completions", json=body,
                         headers=headers) as resp:  # fmt: skip
        assert resp.status == 200
        victim = next(e for e in engines(cluster) if e["id"] == resp.headers["x-kvsched-instance"])
        argv, env = _restartable(victim["pid"])
        await resp.content.readline()  # the first chunk came
        os.killpg(victim["pid"], signal.SIGKILL)
        rest = await asyncio.wait_for(resp.content.read(), 30.0)
    assert b'"error"' in rest and b"Traceback" not in rest
    await wait_for(
        lambda: _without(http, cluster, victim["id"]), 10.0, message="the dead engine left"
    )
    # Served by the other engine meanwhile.
    short = {**body, "max_tokens": 2, "stream": False}
    _, served = await post(http, cluster.routers[1] + "/v1/chat/completions", short, **headers)
    assert served["x-kvsched-instance"] != victim["id"]
    log = cluster.run_dir / "logs" / f"engine-{victim['id']}.again.log"
    victim["pid"] = _start_again(argv, env, log, restarted).pid

    async def back() -> bool:
        return victim["id"] in await instances(http, cluster)

    await wait_for(back, 600.0, interval=1.0, message="the restarted engine registered again")


async def _without(http: aiohttp.ClientSession, cluster: LocalCluster, iid: str) -> bool:
    return iid not in await instances(http, cluster)


async def test_our_token_ids_equal_the_ids_vllm_feeds_its_model(
    cluster: LocalCluster, http: aiohttp.ClientSession
) -> None:
    """Every reference request for the served tokenizer (tests/data/vllm/prompt_tokens.json,
    made with vLLM's own front end), sent to a live engine asking for the prompt's token ids
    back: the ids the Router hashes are the ids the engine computed on."""
    tokenizer = PromptTokenizer(MODEL_DIR)
    cases = [c for c in VECTORS["cases"] if c["variant"] == "demo" and "ids" in c["vllm"]]
    assert len(cases) >= 50
    engine = engines(cluster)[0]
    for case in cases:
        ours = tokenizer.prompt_ids(parse_request(case["kind"], case["body"]))
        route = "/v1/chat/completions" if case["kind"] == "chat" else "/v1/completions"
        body = {**case["body"], "model": MODEL, "max_tokens": 1, "return_token_ids": True}
        answer, _ = await post(http, engine["url"] + route, body)
        fed = answer.get("prompt_token_ids") or answer["choices"][0].get("prompt_token_ids")
        assert fed == ours, case["name"]


def test_endpoints_file_names_the_vllm_engines(cluster: LocalCluster) -> None:
    assert cluster.endpoints["engine"] == "vllm" and cluster.endpoints["model"] == MODEL
    assert json.dumps(cluster.endpoints)  # plain JSON


# ---- KV moved between the vLLM engines (kvsched's KV connector and the nodes' pools) --------


async def complete(
    http: aiohttp.ClientSession, engine: dict[str, Any], prompt: list[int], max_tokens: int
) -> tuple[list[int], int]:
    """Greedy completion of token ids straight on `engine`: its output ids and the prompt
    tokens it reported cached."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    answer, _ = await post(http, engine["url"] + "/v1/completions", body)
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    return list(answer["choices"][0]["token_ids"]), cached


async def move(
    cluster: LocalCluster,
    kind: common.TransferKind.ValueType,
    source: dict[str, Any],
    target: dict[str, Any],
    hashes: list[int],
) -> pb.WatchTransferResponse:
    """Order the transfer of blocks `hashes` from `source` to `target` from the target's
    Messenger, as the Conductor does, and follow it to its end."""
    plan = common.TransferPlan(
        transfer_id=f"t-{hashes[-1]:x}",
        kind=kind,
        source_instance_id=source["id"],
        target_instance_id=target["id"],
        block_hashes=hashes,
    )
    request = pb.StartTransferRequest(
        plan=plan,
        source_messenger_url=messenger_of(cluster, source)["url"],
        timeout=duration(60.0),
    )
    # Ordering a transfer is the Conductor's right: the test calls with its certificate.
    conductor = Identity(Role.CONDUCTOR, "conductor-0")
    target_url = messenger_of(cluster, target)["url"]
    async with aio_channel(target_url, cluster.tls(conductor)) as channel:
        stub = pb_grpc.MessengerServiceStub(channel)
        await stub.StartTransfer(request, timeout=10.0)
        updates = stub.WatchTransfer(
            pb.WatchTransferRequest(transfer_id=plan.transfer_id), timeout=60.0
        )
        return [update async for update in updates][-1]


async def prompt_sources(http: aiohttp.ClientSession, engine: dict[str, Any]) -> dict[str, float]:
    """vLLM's own count of `engine`'s prompt tokens by where their KV came from."""
    return await vllm_prompt_sources(http, engine["url"])


def grown(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0.0)) for k, v in after.items() if v != before.get(k, 0.0)}


def ids(seed: int, n: int) -> list[int]:
    return [10 + (seed * 7919 + i * 104729) % 4000 for i in range(n)]


@pytest.mark.parametrize(
    ("kind", "seed"),
    [(common.TRANSFER_KIND_MIGRATE_SESSION, 600), (common.TRANSFER_KIND_FETCH_PREFIX, 650)],
    ids=["migrated-session", "fetched-prefix"],
)
async def test_moved_kv_is_loaded_and_answers_as_the_source_would(
    cluster: LocalCluster,
    http: aiohttp.ClientSession,
    kind: common.TransferKind.ValueType,
    seed: int,
) -> None:
    """A session migrated between two turns, or a prefix fetched before a request: the
    target loads the moved blocks instead of computing them, and answers exactly as the
    source (which has them cached) does."""
    source, target = engines(cluster)
    assert source["node"] != target["node"]
    first = ids(seed, 300)
    reply, _ = await complete(http, source, first, 24)
    second = [*first, *reply, *ids(seed + 1, 40)]
    # Every block the source computed (the reply's last token was sampled, never fed back).
    computed = (len(first) + len(reply) - 1) // BLOCK
    hashes = HASHER.hash_prompt(second)[:computed]
    moved = await move(cluster, kind, source, target, hashes)
    assert moved.state == pb.TRANSFER_STATE_DONE, moved.error
    assert moved.blocks == computed
    before = await prompt_sources(http, target)
    on_target, cached_on_target = await complete(http, target, second, 24)
    on_source, cached_on_source = await complete(http, source, second, 24)
    assert on_target == on_source
    assert cached_on_target == cached_on_source == computed * BLOCK
    # vLLM's own counters: the moved tokens were loaded, only the rest computed.
    loaded = computed * BLOCK
    assert grown(await prompt_sources(http, target), before) == {
        "external_kv_transfer": loaded,
        "local_compute": len(second) - loaded,
    }


# ---- faults while KV moves: the turn is recomputed, right, and nothing stays held ---------


async def pool_usage(http: aiohttp.ClientSession, messenger: dict[str, Any]) -> dict[str, float]:
    async with http.get(messenger["http_url"] + "/metrics") as resp:
        text = await resp.text()
    prefix = "kvsched_messenger_pool_"
    return {
        line.split(" ")[0].removeprefix(prefix): float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def idle(usage: dict[str, float]) -> bool:
    return usage["staged"] == usage["exports"] == usage["imports"] == usage["pinned"] == 0


@pytest.fixture(scope="module")
def faulty_target(
    cluster: LocalCluster,
    restarted: list[subprocess.Popen[bytes]],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:
    """The second engine, its node's Messenger started again to damage the first chunk it
    receives, with no second read: the first transfer into it fails."""
    target = engines(cluster)[1]
    messenger = messenger_of(cluster, target)
    argv, env = _restartable(messenger["pid"])
    os.killpg(messenger["pid"], signal.SIGKILL)
    faults = ["--fault-corrupt-chunks", "1", "--chunk-retries", "0"]
    log = tmp_path_factory.mktemp("faulty") / "messenger.log"
    messenger["pid"] = _start_again([*argv, *faults], env, log, restarted).pid
    asyncio.run(_until_ready(messenger))
    return target


async def _until_ready(messenger: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as http:

        async def ready() -> bool:
            try:
                async with http.get(messenger["http_url"] + "/ready") as resp:
                    return resp.status == 200
            except aiohttp.ClientError:
                return False

        await wait_for(ready, 30.0, interval=0.2, message="the Messenger is ready again")


async def session(
    http: aiohttp.ClientSession, source: dict[str, Any], seed: int
) -> tuple[list[int], list[int], list[int]]:
    """A session's first turn on `source`; its second turn's prompt, the chain of blocks the
    source computed, and the second turn's answer there (from its cache)."""
    first = ids(seed, 300)
    reply, _ = await complete(http, source, first, 24)
    second = [*first, *reply, *ids(seed + 1, 40)]
    hashes = HASHER.hash_prompt(second)[: (len(first) + len(reply) - 1) // BLOCK]
    expected, cached = await complete(http, source, second, 24)
    assert cached == len(hashes) * BLOCK
    return second, hashes, expected


async def stalled_move(
    http: aiohttp.ClientSession,
    cluster: LocalCluster,
    source: dict[str, Any],
    target: dict[str, Any],
    hashes: list[int],
) -> asyncio.Task[pb.WatchTransferResponse]:
    """A move from `source` to `target` caught in the middle: the source's Messenger is
    stopped (SIGSTOP), the target has reserved the pages and waits for the export."""
    os.kill(messenger_of(cluster, source)["pid"], signal.SIGSTOP)
    moving = asyncio.create_task(
        move(cluster, common.TRANSFER_KIND_MIGRATE_SESSION, source, target, hashes)
    )
    pool = messenger_of(cluster, target)

    async def importing() -> bool:
        return moving.done() or (await pool_usage(http, pool))["imports"] == 1

    await wait_for(importing, 10.0, interval=0.05, message="the target waits for the export")
    assert not moving.done(), moving.result()
    return moving


async def recomputed_right(
    http: aiohttp.ClientSession, target: dict[str, Any], prompt: list[int], expected: list[int]
) -> None:
    """The turn on `target` found nothing to load, computed its prompt and answered
    `expected`."""
    before = await prompt_sources(http, target)
    answer, cached = await complete(http, target, prompt, 24)
    assert (answer, cached) == (expected, 0)
    assert grown(await prompt_sources(http, target), before) == {"local_compute": len(prompt)}


async def test_a_corrupted_chunk_fails_the_move_and_the_turn_is_recomputed_right(
    cluster: LocalCluster, http: aiohttp.ClientSession, faulty_target: dict[str, Any]
) -> None:
    source, target = engines(cluster)[0], faulty_target
    pool = messenger_of(cluster, target)
    held = (await pool_usage(http, pool))["blocks"]
    second, hashes, expected = await session(http, source, 800)
    moved = await move(cluster, common.TRANSFER_KIND_MIGRATE_SESSION, source, target, hashes)
    assert moved.state == pb.TRANSFER_STATE_FAILED and "checksum" in moved.error, moved.error
    usage = await pool_usage(http, pool)
    assert idle(usage) and usage["blocks"] == held
    await recomputed_right(http, target, second, expected)


async def test_a_source_messenger_killed_mid_move_leaves_the_turn_recomputed_right(
    cluster: LocalCluster,
    http: aiohttp.ClientSession,
    faulty_target: dict[str, Any],
    tmp_path: Path,
    restarted: list[subprocess.Popen[bytes]],
) -> None:
    source, target = engines(cluster)[0], faulty_target
    second, hashes, expected = await session(http, source, 900)
    source_messenger = messenger_of(cluster, source)
    argv, env = _restartable(source_messenger["pid"])
    moving = await stalled_move(http, cluster, source, target, hashes)
    os.killpg(source_messenger["pid"], signal.SIGKILL)
    moved = await moving
    pool = messenger_of(cluster, target)
    assert moved.state == pb.TRANSFER_STATE_FAILED, moved
    assert idle(await pool_usage(http, pool))
    await recomputed_right(http, target, second, expected)
    again = _start_again(argv, env, tmp_path / "messenger.log", restarted)
    source_messenger["pid"] = again.pid
    await _until_ready(source_messenger)


async def test_a_source_engine_killed_mid_move_does_not_stop_it_its_kv_is_in_the_pool(
    cluster: LocalCluster,
    http: aiohttp.ClientSession,
    faulty_target: dict[str, Any],
    restarted: list[subprocess.Popen[bytes]],
) -> None:
    source, target = engines(cluster)[0], faulty_target
    second, hashes, expected = await session(http, source, 1000)
    argv, env = _restartable(source["pid"])
    moving = await stalled_move(http, cluster, source, target, hashes)
    os.killpg(source["pid"], signal.SIGKILL)
    os.kill(messenger_of(cluster, source)["pid"], signal.SIGCONT)
    moved = await moving
    pool = messenger_of(cluster, target)
    assert moved.state == pb.TRANSFER_STATE_DONE, moved.error
    assert idle(await pool_usage(http, pool))
    answer, cached = await complete(http, target, second, 24)
    assert (answer, cached) == (expected, len(hashes) * BLOCK)
    await wait_for(
        lambda: _without(http, cluster, source["id"]), 10.0, message="the dead engine left"
    )
    log = cluster.run_dir / "logs" / f"engine-{source['id']}.again.log"
    source["pid"] = _start_again(argv, env, log, restarted).pid

    async def back() -> bool:
        return source["id"] in await instances(http, cluster)

    await wait_for(back, 600.0, interval=1.0, message="the restarted engine registered again")


# ---- a prefix fetched by the Conductor's own decision ---------------------------------------


async def test_with_its_holder_busy_a_prefix_is_fetched_and_answers_as_recomputed(
    cluster: LocalCluster, http: aiohttp.ClientSession, tenants: tuple[Path, dict[str, str]]
) -> None:
    """`mooncake` (colocated): requests sharing a long prefix pile up on its holder until
    the other engine, fetching the prefix, is the faster start; that engine loads it from
    its pool (the requests placed there while it lands wait for it) and answers as
    recomputing would."""
    await set_policy(cluster, "mooncake:colocated=1,min_hits=1000000")  # fetches, no replicas
    try:
        auth = {"Authorization": f"Bearer {tenants[1]['acme']}"}
        prefix = ids(1100, 3000)

        async def one(k: int, suffix: int) -> tuple[dict[str, Any], str, dict[str, Any]]:
            body = {"model": MODEL, "prompt": [*prefix, *ids(1200 + k, suffix)],
                    "max_tokens": 8, "temperature": 0, "ignore_eos": True}  # fmt: skip
            answer, headers = await post(http, cluster.routers[0] + "/v1/completions", body, **auth)
            return body, headers["x-kvsched-instance"], answer

        _, holder, _ = await one(0, 100)
        other = next(e for e in engines(cluster) if e["id"] != holder)
        fetched = await transfers(http, cluster, "fetch_prefix")
        before = await prompt_sources(http, other)
        ran = await asyncio.gather(*(one(k, 3000) for k in range(1, 9)))
        assert await transfers(http, cluster, "fetch_prefix") > fetched
        # The prefix's blocks were loaded on the other engine, never computed there.
        counts = grown(await prompt_sources(http, other), before)
        served = sum(1 for r in ran if r[1] == other["id"])
        whole = len(prefix) // BLOCK * BLOCK
        assert counts.get("external_kv_transfer", 0) >= whole
        assert counts.get("local_compute", 0) == served * (len(prefix) - whole + 3000)
        body, _, answer = next(r for r in ran if r[1] == other["id"])
        alone, _ = await post(http, other["url"] + "/v1/completions", body)  # unsalted: computed
        assert answer["choices"][0]["text"] == alone["choices"][0]["text"]
    finally:
        await set_policy(cluster, "elastic")
