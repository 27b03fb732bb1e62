"""The whole loop: a Router's block hashes are the ones a Messenger derives from the engine's
KV events, tenant salt included, so a tenant's cached prefix is found again and no other
tenant's request can find it."""

from __future__ import annotations

from pathlib import Path

from clients.python import ConductorClient, unpack_hashes
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from services.messenger.app import Messenger
from services.messenger.engines import EngineTarget
from services.messenger.settings import MessengerSettings
from tests.fixtures.poll import wait_for
from tests.router.conftest import Stack, chat
from tests.router.test_router import spy_on_finish

SYSTEM = "You are a careful assistant who answers in short sentences. " * 12


async def test_a_tenants_prefix_is_found_again_and_only_by_that_tenant(
    stack: Stack, keys_file: tuple[Path, dict[str, str]]
) -> None:
    path, keys = keys_file
    c = await stack.start_conductor()
    (engine,) = await stack.start_engines(1)
    messenger = Messenger(
        MessengerSettings(
            listen="127.0.0.1:0",
            http_listen="127.0.0.1:0",
            conductors=(c.url,),
            engines=(EngineTarget(engine.url, "sim"),),
            node="node-0",
            load_interval_s=0.02,
        )
    )
    await messenger.start()
    try:
        router = await stack.start_router(c.url, no_auth=False, api_keys=str(path))
        await wait_for(lambda: router.placer.instances, 10.0, message="the Messenger registered")
        reported = spy_on_finish(router.placer)
        url = router.url + "/v1/chat/completions"

        async def ask(tenant: str, question: str) -> pb.FinishRequest:
            body = chat(max_tokens=4)
            body["messages"] = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ]
            status, _, data = await stack.post(url, body, Authorization=f"Bearer {keys[tenant]}")
            assert status == 200, data
            return reported[-1]

        first = await ask("acme", "What is a fox?")
        first_hashes = unpack_hashes(first.packed_block_hashes)
        assert first.cached_tokens == 0 and len(first_hashes) >= 10
        async with ConductorClient([c.url]) as client:

            async def indexed() -> int:
                answer = await client.explain(
                    pb.ExplainRequest(
                        packed_block_hashes=first.packed_block_hashes,
                        prompt_tokens=first.prompt_tokens,
                    )
                )
                return int(answer.decision.cached_tokens)

            # The engine's KV events, translated by the Messenger, hold the Router's hashes.
            full = len(first_hashes) * 16

            async def all_indexed() -> bool:
                return await indexed() >= full - 16

            await wait_for(all_indexed, 10.0, message="the prefix indexed")
        again = await ask("acme", "What is a wolf?")  # the same system prompt
        common = 0
        again_hashes = unpack_hashes(again.packed_block_hashes)
        for a, b in zip(first_hashes, again_hashes, strict=False):
            if a != b:
                break
            common += 1
        assert common >= 8  # the system prompt's blocks
        assert again.cached_tokens >= (common - 1) * 16  # as the engine counted them
        other = await ask("globex", "What is a fox?")  # the same prompt, another tenant
        assert other.cached_tokens == 0
        assert not set(unpack_hashes(other.packed_block_hashes)) & set(first_hashes)
    finally:
        await messenger.stop(0)
