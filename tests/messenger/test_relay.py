"""The Messenger end to end: simulated engines (processes) publishing KV events on real ZMQ
sockets, a Messenger in this process, a real Conductor on a real etcd. What the engine
caches must become what the Conductor's index holds for it, whatever is lost on the way."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from clients.python import ConductorClient
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.common.security.identity import Identity, Role
from services.common.security.tls import ClientTls, ServerTls
from services.common.store.etcd import EtcdStore
from services.conductor import keys
from services.conductor.app import Conductor
from services.messenger.app import Messenger
from services.messenger.relay import DEAD_AFTER_MISSES, engine_gone
from services.messenger.settings import MessengerSettings
from tests.fixtures.etcd import EtcdServer, make_tls
from tests.fixtures.poll import wait_for
from tests.messenger.conftest import (
    BLOCK,
    EngineProcess,
    cached_tokens,
    expected_hashes,
    indexed,
    instance_status,
    lose_next_batches,
    relay_of,
)

Start = Callable[..., Any]
IID = "node-0/e0"


def prompt(seed: int, blocks: int) -> list[int]:
    """Token ids of `blocks` full blocks and a few more, unlike any other seed's."""
    return [1000 + seed * 97 + i for i in range(blocks * BLOCK + 3)]


async def converged(
    http: aiohttp.ClientSession, engine: EngineProcess, conductor: Conductor
) -> set[int]:
    """Wait until the Conductor's index for the engine equals the engine's cache."""
    seen: list[tuple[set[int], set[int] | None]] = []

    async def same() -> bool:
        want = expected_hashes(await engine.snapshot(http))
        have = indexed(conductor, engine.instance_id)
        seen[:] = [(want, have)]
        return have == want

    try:
        await wait_for(same, 10.0, message="the index equals the engine's cache")
    except AssertionError:
        want, have = seen[0]
        missing = len(want - (have or set()))
        extra = len((have or set()) - want)
        raise AssertionError(f"index: {missing} blocks missing, {extra} extra") from None
    held = indexed(conductor, engine.instance_id)
    assert held is not None
    return held


async def setup(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    http: aiohttp.ClientSession,
    *,
    conductor_flags: dict[str, Any] | None = None,
    engine_flags: dict[str, Any] | None = None,
    messenger_flags: dict[str, Any] | None = None,
) -> tuple[Conductor, EngineProcess, Messenger]:
    conductor: Conductor = await start_conductor(**(conductor_flags or {}))
    engine = start_engine(IID, **(engine_flags or {}))
    await engine.ready(http)
    messenger: Messenger = await start_messenger(
        [conductor.url], [engine.url], **(messenger_flags or {})
    )
    await wait_for(lambda: IID in conductor.state.instances, 10.0, message="registered")
    return conductor, engine, messenger


async def test_cached_prompts_reach_the_index_and_evictions_leave_it(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    client_of: Callable[[Sequence[str]], ConductorClient],
    http: aiohttp.ClientSession,
) -> None:
    conductor, engine, messenger = await setup(
        start_conductor, start_engine, start_messenger, http, engine_flags={"capacity_blocks": 24}
    )
    client = client_of([conductor.url])
    spec = (await instance_status(client, IID)) or None
    assert spec is not None
    assert (spec.spec.url, spec.spec.node, spec.spec.messenger_url) == (
        engine.url,
        "node-0",
        messenger.url,
    )

    first = prompt(1, 6)
    await engine.complete(http, first)
    await converged(http, engine, conductor)
    assert await cached_tokens(client, first) == 6 * BLOCK
    # A prompt sharing the first three blocks continues the same chain.
    await engine.complete(http, first[: 3 * BLOCK] + prompt(2, 3))
    held = await converged(http, engine, conductor)
    assert len(held) == 9

    # Fill the cache past its capacity: the engine evicts, the index follows.
    for seed in range(3, 9):
        await engine.complete(http, prompt(seed, 5))
    held = await converged(http, engine, conductor)
    assert len(held) <= 24
    assert set(VllmBlockHasher(BLOCK).hash_prompt(first)) - held, (
        "something of the first was evicted"
    )
    status = await instance_status(client, IID)
    assert status is not None and status.gpu_blocks == len(held)

    # Its load arrives too (free blocks as the engine counts them).
    async def load_relayed() -> bool:
        async with http.get(engine.url + "/kvsched/load") as r:
            load = await r.json()
        status = await instance_status(client, IID)
        return status is not None and status.load.free_blocks == load["free_blocks"]

    await wait_for(load_relayed, 5.0, message="the engine's load reaches the Conductor")
    counts = relay_of(messenger, engine).counts()
    assert counts["malformed_frames"] == counts["unrecoverable_gaps"] == 0
    assert relay_of(messenger, engine).resyncs == {"registered": 1}


async def test_a_tenants_chain_is_salted_as_the_router_hashes_it(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    client_of: Callable[[Sequence[str]], ConductorClient],
    http: aiohttp.ClientSession,
) -> None:
    conductor, engine, _ = await setup(start_conductor, start_engine, start_messenger, http)
    client = client_of([conductor.url])
    tokens = prompt(1, 4)
    await engine.complete(http, tokens, salt="tenant-a")
    await engine.complete(http, tokens, salt="tenant-b")
    held = await converged(http, engine, conductor)
    hasher = VllmBlockHasher(BLOCK)
    a, b = hasher.hash_prompt(tokens, "tenant-a"), hasher.hash_prompt(tokens, "tenant-b")
    assert set(a) | set(b) == held
    assert await cached_tokens(client, tokens, "tenant-a") == 4 * BLOCK
    assert await cached_tokens(client, tokens) == 0  # unsalted: another tenant's prefix


async def test_a_lost_batch_is_replayed_and_a_malformed_frame_skipped(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    http: aiohttp.ClientSession,
) -> None:
    conductor, engine, messenger = await setup(start_conductor, start_engine, start_messenger, http)
    relay = relay_of(messenger, engine)
    await engine.complete(http, prompt(1, 2))
    await converged(http, engine, conductor)

    replayed = relay.counts()["replayed_batches"]
    lost = lose_next_batches(relay, 2)
    for seed in range(2, 6):
        await engine.complete(http, prompt(seed, 2))
    await converged(http, engine, conductor)
    assert len(lost) == 2
    # Recovered from the replay socket, not by a resync (below). Not necessarily both: a lost
    # message the subscriber had already had from a replay (a duplicate) needs none.
    assert relay.counts()["replayed_batches"] > replayed
    assert relay.resyncs == {"registered": 1}  # no resync was needed

    # A frame that is not a KV-event batch, on a socket the subscriber listens to.
    ctx = zmq.asyncio.Context.instance()
    rogue = ctx.socket(zmq.PUB)
    rogue.setsockopt(zmq.LINGER, 0)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    try:
        sub = relay._sub
        assert sub is not None
        sub._sub.connect(f"tcp://127.0.0.1:{port}")

        async def garbage_counted() -> bool:
            await rogue.send_multipart([b"kv-events", b"\x00" * 8, b"\xc1 not msgpack"])
            return relay.counts()["malformed_frames"] > 0

        await wait_for(garbage_counted, 5.0, message="the malformed frame is counted")
    finally:
        rogue.close()
    await engine.complete(http, prompt(9, 3))
    await converged(http, engine, conductor)  # and the relay goes on


async def test_a_gap_replay_cannot_fill_leads_to_a_resync(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    http: aiohttp.ClientSession,
) -> None:
    conductor, engine, messenger = await setup(
        start_conductor, start_engine, start_messenger, http, engine_flags={"replay": False}
    )
    relay = relay_of(messenger, engine)
    await engine.complete(http, prompt(1, 2))
    await converged(http, engine, conductor)
    lose_next_batches(relay, 1)
    for seed in range(2, 5):
        await engine.complete(http, prompt(seed, 2))
    await wait_for(lambda: relay.resyncs["gap"] == 1, 5.0, message="a resync after the gap")
    held = await converged(http, engine, conductor)
    assert len(held) == 8


async def test_a_dead_engine_leaves_routing_at_once_and_comes_back_resynced(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    http: aiohttp.ClientSession,
) -> None:
    conductor, engine, messenger = await setup(start_conductor, start_engine, start_messenger, http)
    await engine.complete(http, prompt(1, 3))
    await converged(http, engine, conductor)
    engine.kill()
    killed = time.monotonic()
    await wait_for(lambda: IID not in conductor.state.instances, 5.0, message="deregistered")
    gone_after = time.monotonic() - killed
    assert gone_after < 2.0, f"left routing {gone_after:.2f} s after the kill (lease: 10 s)"
    relay = relay_of(messenger, engine)
    assert not relay.up and relay.counts()["engine_deaths"] == 1

    engine.start()  # same ports, empty cache, event numbering from 0
    await engine.ready(http)
    await wait_for(lambda: IID in conductor.state.instances, 10.0, message="registered again")
    assert await converged(http, engine, conductor) == set()
    await engine.complete(http, prompt(2, 2))
    assert len(await converged(http, engine, conductor)) == 2


def test_an_engine_is_gone_after_refusals_at_once_after_timeouts_only_when_hung() -> None:
    s = MessengerSettings(engine_dead_after_s=1.0, engine_hung_after_s=10.0)
    # one poll timed out by a stall of our own loop, however long, is not the engine's silence
    assert not engine_gone(50.0, 1, timed_out=False, settings=s)
    assert not engine_gone(0.9, DEAD_AFTER_MISSES, timed_out=False, settings=s)
    assert engine_gone(1.0, DEAD_AFTER_MISSES, timed_out=False, settings=s)  # nothing listens
    assert not engine_gone(9.9, 20, timed_out=True, settings=s)  # busy: it took the connection
    assert engine_gone(10.0, 20, timed_out=True, settings=s)  # hung


async def test_registers_and_relays_over_mutual_tls(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    tls = make_tls(tmp_path, Identity(Role.MESSENGER, "node-0"))  # the Messenger's node
    files = ServerTls(str(tls.server_cert), str(tls.server_key), str(tls.ca_file))
    conductor: Conductor = await start_conductor(tls=files)
    engine = start_engine(IID)
    await engine.ready(http)
    client_tls = ClientTls(str(tls.ca_file), str(tls.client_cert), str(tls.client_key))
    await start_messenger([conductor.url], [engine.url], tls=client_tls)
    await wait_for(lambda: IID in conductor.state.instances, 10.0, message="registered")
    await engine.complete(http, prompt(1, 2))
    assert len(await converged(http, engine, conductor)) == 2


@pytest.mark.slow
async def test_a_lapsed_lease_is_registered_again_and_resynced(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    http: aiohttp.ClientSession,
    etcd: EtcdServer,
) -> None:
    conductor, engine, messenger = await setup(
        start_conductor,
        start_engine,
        start_messenger,
        http,
        messenger_flags={"instance_ttl_s": 1.0},
    )
    await engine.complete(http, prompt(1, 2))
    await converged(http, engine, conductor)
    await conductor.stop(0)  # nobody keeps the lease alive now
    store = EtcdStore(etcd.settings())
    await store.connect()
    try:
        key = keys.instance_key(IID).encode()
        await wait_for(lambda: _gone(store, key), 10.0, message="the lease lapsed")
    finally:
        await store.close()
    await engine.complete(http, prompt(2, 2))  # while no Conductor runs
    again: Conductor = await start_conductor(listen=conductor.url)
    await wait_for(lambda: IID in again.state.instances, 10.0, message="registered again")
    assert len(await converged(http, engine, again)) == 4
    relay = relay_of(messenger, engine)
    assert relay.counts()["registrations"] >= 2 and relay.resyncs["registered"] >= 2


async def _gone(store: EtcdStore, key: bytes) -> bool:
    return await store.get(key) is None
