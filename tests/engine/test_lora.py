"""The simulated engine's LoRA adapters, served as vLLM serves them: runtime loads and unloads
with vLLM's answers, adapters in `/v1/models`, vLLM's 404 for an adapter not loaded, blocks
hashed and published with the adapter's keys; and the Router's `AdapterLoader` driving that
API as it drives vLLM's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from kvsched.core.adapters import AdapterChange
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.common.inference_api.openai_api import ApiError
from services.router.lora import AdapterLoader, LoraModule
from tests.engine.conftest import RunningEngine

Start = Callable[..., Any]


@pytest.fixture
async def engine(start_engine: Start, monkeypatch: pytest.MonkeyPatch) -> RunningEngine:
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    running: RunningEngine = await start_engine(enable_lora=True, max_loras=2)
    return running


async def post(engine: RunningEngine, path: str, body: Any) -> tuple[int, str]:
    async with engine.http.post(engine.url + path, json=body) as resp:
        return resp.status, await resp.text()


async def adapters(engine: RunningEngine) -> dict[str, str]:
    async with engine.http.get(engine.url + "/v1/models") as resp:
        cards = (await resp.json())["data"]
    return {c["id"]: c["root"] for c in cards if c["parent"]}


async def test_runtime_loads_and_unloads_answer_as_vllms_do(engine: RunningEngine) -> None:
    body = {"lora_name": "a", "lora_path": "/adapters/a"}
    assert (await post(engine, "/v1/load_lora_adapter", body))[0] == 200
    status, text = await post(engine, "/v1/load_lora_adapter", body)
    assert status == 400 and "already been loaded" in text
    assert (await post(engine, "/v1/load_lora_adapter", {"lora_name": "a"}))[0] == 400
    assert await adapters(engine) == {"a": "/adapters/a"}
    assert (await post(engine, "/v1/unload_lora_adapter", {"lora_name": "a"}))[0] == 200
    assert (await post(engine, "/v1/unload_lora_adapter", {"lora_name": "a"}))[0] == 404
    assert await adapters(engine) == {}


async def test_an_adapters_blocks_hash_with_its_name_and_path(engine: RunningEngine) -> None:
    await post(engine, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/adapters/a"})
    prompt = list(range(100, 100 + 16 * 3))
    status, text = await post(engine, "/v1/completions",
                              {"model": "a", "prompt": prompt, "max_tokens": 1})  # fmt: skip
    assert status == 200, text
    cached = set(engine.api.live.names.blocks)
    hasher = VllmBlockHasher(16)
    assert set(hasher.hash_prompt(prompt, None, ("a", "/adapters/a"))) <= cached
    assert not set(hasher.hash_prompt(prompt)) & cached
    status, _ = await post(engine, "/v1/completions",
                           {"model": "b", "prompt": prompt, "max_tokens": 1})  # fmt: skip
    assert status == 404  # not loaded: vLLM's "does not exist"


async def test_the_loader_loads_unloads_and_takes_already_loaded_as_done(
    engine: RunningEngine,
) -> None:
    loader = AdapterLoader([LoraModule("a", "/adapters/a", "m"), LoraModule("b", "/b", "m")])
    http: aiohttp.ClientSession = engine.http
    await loader.change(http, engine.url, AdapterChange("a"))
    await loader.change(http, engine.url, AdapterChange("a"))  # "already been loaded": done
    await loader.change(http, engine.url, AdapterChange("b", unload="a"))
    await loader.change(http, engine.url, AdapterChange(unload="gone"))  # nothing to unload: fine
    assert await adapters(engine) == {"b": "/b"}
    with pytest.raises(ApiError) as refused:
        await loader.change(http, "http://127.0.0.1:9", AdapterChange("a"))  # no engine there
    assert refused.value.status == 503
    with pytest.raises(ApiError, match="does not know it"):
        await loader.change(http, engine.url, AdapterChange("c"))
