"""Prefill→decode hand-off on a disaggregated `kvsched up` cluster (`static_pd`: node-0's
engines prefill, node-1's decode): the prompt is prefilled on a prefill instance while its KV
streams to a decode instance, which then serves the whole answer from the handed-off KV."""

from __future__ import annotations

import json
from collections.abc import Iterator

import aiohttp
import pytest

from tests.conftest import MOONCAKE
from tests.e2e.conftest import LocalCluster, local_cluster
from tests.e2e.test_transfers import tokens, transfers

pytestmark = [pytest.mark.slow, MOONCAKE]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(
        tmp_path_factory.mktemp("up-pd"),
        "--policy", "static_pd",
        "--transfer-backend", "mooncake",
        # Small passes: a long prompt's prefill takes several steps, so its KV streams.
        "--engine-flag=--chunk-tokens=1024",
    ) as up:  # fmt: skip
        yield up


@pytest.mark.parametrize("stream", [False, True])
async def test_the_decode_instance_serves_from_the_handed_off_kv(
    cluster: LocalCluster, stream: bool
) -> None:
    roles = {e["id"]: e["node"] for e in cluster.endpoints["engines"]}
    prompt = tokens(6000 + 100 * stream, 40 + stream)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        before = await transfers(http, cluster, "handoff")
        body = {"prompt": prompt, "max_tokens": 6, "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        async with http.post(
            f"{cluster.routers[0]}/v1/completions", json=body, headers=cluster.auth
        ) as resp:
            assert resp.status == 200, await resp.text()
            decoded_on = resp.headers["x-kvsched-instance"]
            raw = await resp.read()
        assert await transfers(http, cluster, "handoff") == before + 1
    assert roles[decoded_on] == "node-1"  # a decode instance answered
    if stream:
        assert raw.rstrip().endswith(b"data: [DONE]")
        usage_line = [e for e in raw.split(b"\n\n") if b'"usage"' in e and b"cached" in e][-1]
        cached = int(usage_line.split(b'"cached_tokens":')[1].split(b"}")[0])
    else:
        cached = json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Every full block of the prompt came over: the decode instance recomputed one partial
    # block at most.
    assert cached == len(prompt) // 16 * 16 or cached == (len(prompt) - 1) // 16 * 16
