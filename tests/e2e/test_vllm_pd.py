"""Prefill→decode hand-off between two real vLLM engines (`static_pd` on `kvsched up
--engine vllm`: node-0's engine prefills, node-1's decodes): the prompt's KV, saved by
kvsched's KV connector into node-0's pool while the prefill runs, is moved to node-1's pool
and loaded by the decode engine, which then answers exactly as one engine computing the whole
request would. Marked `vllm` (run by the test command)."""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from services.launcher.vllm import DEFAULT_PYTHON
from tests.e2e.conftest import LocalCluster, local_cluster
from tests.e2e.test_transfers import transfers
from tests.e2e.test_vllm import (
    BLOCK,
    MODEL,
    MODEL_DIR,
    START_TIMEOUT_S,
    engines,
    grown,
    ids,
    post,
    prompt_sources,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    if not DEFAULT_PYTHON.exists() or not (MODEL_DIR / "config.json").exists():
        pytest.skip("vLLM is not set up here: run scripts/setup --vllm")
    flags = ["--engine", "vllm", "--model", str(MODEL_DIR), "--served-model-name", MODEL]
    flags += ["--nodes", "2", "--engines-per-node", "1", "--routers", "1"]
    flags += ["--block-size", str(BLOCK), "--dtype", "float32", "--policy", "static_pd"]
    with local_cluster(
        tmp_path_factory.mktemp("up-pd"), *flags, time_scale=1.0, start_timeout_s=START_TIMEOUT_S
    ) as up:
        yield up


async def test_the_decode_engine_answers_from_the_handed_off_kv_as_one_engine_would(
    cluster: LocalCluster, http: aiohttp.ClientSession
) -> None:
    prefill, decode = sorted(engines(cluster), key=lambda e: str(e["node"]))
    prompt = ids(700, 10 * BLOCK + 1)  # ten whole blocks move; vLLM computes the last token
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    handoffs = await transfers(http, cluster, "handoff")
    before = {e["id"]: await prompt_sources(http, e) for e in (prefill, decode)}
    answer, headers = await post(http, cluster.routers[0] + "/v1/completions", body,
                                 **cluster.auth)  # fmt: skip
    assert headers["x-kvsched-instance"] == decode["id"]
    assert await transfers(http, cluster, "handoff") == handoffs + 1
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 10 * BLOCK
    # The prompt was computed once, on the prefill engine; the decode engine loaded it.
    assert grown(await prompt_sources(http, prefill), before[prefill["id"]]) == {
        "local_compute": len(prompt)
    }
    assert grown(await prompt_sources(http, decode), before[decode["id"]]) == {
        "external_kv_transfer": 10 * BLOCK,
        "local_compute": 1,
    }
    # One engine computing the whole request (unsalted, so nothing of it is cached anywhere).
    alone, _ = await post(http, prefill["url"] + "/v1/completions", body)
    assert answer["choices"][0]["text"] == alone["choices"][0]["text"]
