"""The Messenger in front of an engine through vLLM's own API only (`kind=vllm`: `/v1/models`,
`/metrics`, `/kv_event_sources`, `/load`, ZMQ events and replay; no snapshot), played by the
simulated engine, which serves those routes as vLLM does. The index must follow the engine's
cache from its events alone, survive a Messenger restart through the replay buffer, and lose
no more than a lost batch's own blocks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from kvsched.core.vllm_hashing import VllmBlockHasher
from services.conductor.app import Conductor
from services.messenger.app import Messenger
from services.messenger.vllm_engine import VllmEngine
from tests.fixtures.poll import wait_for
from tests.messenger.conftest import (
    BLOCK,
    EngineProcess,
    expected_hashes,
    indexed,
    lose_next_batches,
    relay_of,
)
from tests.messenger.test_relay import converged, prompt

Start = Callable[..., Any]
IID = "node-0/v0"


async def start_relayed(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    http: aiohttp.ClientSession,
    **engine_flags: Any,
) -> tuple[Conductor, EngineProcess, Messenger]:
    conductor: Conductor = await start_conductor()
    engine = start_engine(IID, **engine_flags)
    await engine.ready(http)
    messenger = await start_messenger([conductor.url], [f"{engine.url},kind=vllm,id={IID}"])
    await wait_for(lambda: IID in conductor.state.instances, 10.0, message="registered")
    return conductor, engine, messenger


async def test_the_engine_is_known_and_indexed_through_vllms_api_alone(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    http: aiohttp.ClientSession,
) -> None:
    conductor, engine, messenger = await start_relayed(
        start_conductor, start_engine, start_messenger, http, capacity_blocks=24
    )
    relay = relay_of(messenger, engine)
    assert isinstance(relay.api, VllmEngine) and not relay.uses_pool
    assert relay.info is not None
    assert (relay.info.block_size, relay.info.capacity_blocks) == (BLOCK, 24)
    async with http.get(engine.url + "/v1/models") as resp:  # its context, as vLLM says it
        context = (await resp.json())["data"][0]["max_model_len"]
    assert relay.info.max_model_len == context > 0
    assert conductor.state.instances[IID].spec.max_model_len == context
    for seed in range(5):  # 30 blocks into 24 pages: evictions too
        await engine.complete(http, prompt(seed, 6))
    held = await converged(http, engine, conductor)
    assert 0 < len(held) <= 24
    load = await relay.api.load()  # from /load and /metrics: nothing runs now
    assert (load.running, load.waiting) == (0, 0) and 0 <= load.free_blocks <= 24
    assert relay.resyncs == {"registered": 1}


async def test_a_restarted_messenger_rebuilds_the_index_from_the_replay_buffer(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    http: aiohttp.ClientSession,
) -> None:
    conductor, engine, messenger = await start_relayed(
        start_conductor, start_engine, start_messenger, http
    )
    await engine.complete(http, prompt(1, 4))
    await converged(http, engine, conductor)
    await messenger.stop(0)  # the instance leaves, and its index with it
    assert IID not in conductor.state.instances
    await engine.complete(http, prompt(2, 3))  # cached while no Messenger listens
    again = await start_messenger([conductor.url], [f"{engine.url},kind=vllm,id={IID}"])
    held = await converged(http, engine, conductor)
    assert len(held) == 7  # both prompts' blocks, the second's from the replay buffer
    assert relay_of(again, engine).counts()["replayed_batches"] >= 2


async def test_a_batch_lost_for_good_costs_its_own_blocks_and_nothing_else(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    http: aiohttp.ClientSession,
) -> None:
    """Without a replay socket a lost batch cannot come back: its blocks stay unknown, but
    the blocks stored after it, even those continuing its chain, are indexed."""
    conductor, engine, messenger = await start_relayed(
        start_conductor, start_engine, start_messenger, http, replay=False
    )
    relay = relay_of(messenger, engine)
    base = prompt(3, 2)
    await engine.complete(http, base)
    await converged(http, engine, conductor)
    lost = lose_next_batches(relay, 1)
    extended = base[: 2 * BLOCK] + prompt(4, 2)
    await engine.complete(http, extended)  # stores 2 blocks continuing the first prompt's
    await wait_for(lambda: lost, 10.0, message="a batch was lost")
    longer = extended[: 4 * BLOCK] + prompt(5, 1)
    await engine.complete(http, longer)  # one more block, a child of a lost one

    def short_by_the_lost_blocks() -> bool:
        want = indexed(conductor, IID)
        return want is not None and len(want) == 3

    await wait_for(short_by_the_lost_blocks, 10.0, message="the later block was indexed")
    cached = expected_hashes(await engine.snapshot(http))
    held = indexed(conductor, IID)
    assert held is not None and held < cached and len(cached - held) == 2


async def test_an_engine_whose_blocks_are_not_the_clusters_size_is_refused_in_one_line(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    conductor: Conductor = await start_conductor()
    engine = start_engine(IID)
    await engine.ready(http)
    target = [f"{engine.url},kind=vllm,id={IID}"]
    messenger = await start_messenger([conductor.url], target, block_size=2 * BLOCK)
    relay = relay_of(messenger, engine)
    said = f"the engine's KV blocks hold {BLOCK} tokens, this cluster's {2 * BLOCK} (--block-size)"
    await wait_for(lambda: said in caplog.text, 10.0, message="the refusal logged")
    assert relay.totals["malformed_answers"] >= 1 and IID not in conductor.state.instances
    await wait_for(lambda: relay.totals["malformed_answers"] >= 3, 10.0, message="probed again")
    assert caplog.text.count(said) == 1  # said once, not at every probe
    assert IID not in conductor.state.instances


async def test_an_engines_adapters_and_their_blocks_reach_the_conductor_through_vllms_api(
    start_conductor: Start,
    start_engine: Callable[..., EngineProcess],
    start_messenger: Start,
    http: aiohttp.ClientSession,
) -> None:
    """An engine serving LoRA adapters: its `--max-loras` and the adapters it holds, from
    `/metrics` and `/v1/models`, are the Conductor's; an adapter's blocks are indexed under
    the hashes a Router computes with the adapter's name and path, none counted foreign."""
    adapter = ("sql-bot", "/adapters/sql-bot")
    flags = ["--enable-lora", "--max-loras", "3", "--lora-modules", "=".join(adapter)]
    conductor, engine, messenger = await start_relayed(
        start_conductor, start_engine, start_messenger, http, flags=flags
    )
    tokens = prompt(7, 4)
    body = {"model": adapter[0], "prompt": tokens, "max_tokens": 1}
    async with http.post(engine.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
    slot = conductor.state.instances[IID].slot
    adapters = conductor.state.cluster.adapters

    def reported() -> bool:
        report = adapters.reported(slot)
        return report.capacity == 3 and report.held == {adapter[0]}

    await wait_for(reported, 10.0, message="the adapters reported")
    ours = set(VllmBlockHasher(BLOCK).hash_prompt(tokens, None, adapter))
    await wait_for(lambda: ours <= (indexed(conductor, IID) or set()), 10.0, message="indexed")
    relay = relay_of(messenger, engine)
    assert relay.counts()["foreign_hashes"] == 0
