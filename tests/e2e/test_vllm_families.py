"""kvsched in front of real vLLM for tokenizer families other than Llama-3's: a Qwen2
byte-level BPE saved as `Qwen2Tokenizer` with a ChatML template, and a SentencePiece-style
`LlamaTokenizer` (Mistral, Llama-2) with an `[INST]` template (`tests/data/tokenizers/`, made by
`tools/make_family_tokenizers.py`), each served by its tiny random-weight model
(`out/models/tiny-qwen2`, `out/models/tiny-mistral`: `scripts/setup --vllm`). One cluster
serves both models behind one endpoint: two vLLM engines of each on one node, two Routers.

Marked `vllm`, run by the test command after the default suite."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from services.common.openai_api import ApiError, PromptTokenizer, parse_request
from services.launcher.vllm import DEFAULT_PYTHON
from services.router.api_keys import new_key
from tests.conftest import REPO
from tests.e2e.conftest import LocalCluster, local_cluster

pytestmark = pytest.mark.vllm

FAMILIES = ("qwen2", "mistral")
BLOCK = 32
START_TIMEOUT_S = 900.0  # four vLLM servers starting together on two cores
VECTORS = json.loads((REPO / "tests/data/vllm/prompt_tokens.json").read_text(encoding="utf-8"))


def served_name(family: str) -> str:
    return f"tiny-{family}"  # the model directory's name, as vLLM names it


@pytest.fixture(scope="module")
def key(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    return path, new_key(path, "acme")


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, key: tuple[Path, str]
) -> Iterator[LocalCluster]:
    models = [REPO / "out" / "models" / served_name(family) for family in FAMILIES]
    if not DEFAULT_PYTHON.exists() or not all((m / "config.json").exists() for m in models):
        pytest.skip("vLLM is not set up here: run scripts/setup --vllm")
    flags = ["--engine", "vllm", *(f for m in models for f in ("--model", str(m)))]
    flags += ["--nodes", "1", "--engines-per-node", "2", "--routers", "2", "--dtype", "float32"]
    flags += ["--api-keys", str(key[0])]  # and no --block-size: kvsched up picks one
    # No node pool: an engine's cache is its own (with one, the other engine of the node
    # shares every block, and a session may move to it for free whenever its host is busy).
    flags += ["--kv-pool-bytes", "0"]
    with local_cluster(
        tmp_path_factory.mktemp("up"), *flags, time_scale=1.0, start_timeout_s=START_TIMEOUT_S
    ) as up:
        yield up


def engines_of(cluster: LocalCluster, family: str) -> list[dict[str, Any]]:
    return [e for e in cluster.endpoints["engines"] if e["model"] == served_name(family)]


async def post(
    http: aiohttp.ClientSession, url: str, body: Any, **headers: str
) -> tuple[int, Any, Any]:
    async with http.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json(), resp.headers


@pytest.mark.parametrize("family", FAMILIES)
async def test_our_token_ids_equal_vllms_for_every_reference_request(
    cluster: LocalCluster, http: aiohttp.ClientSession, family: str
) -> None:
    """Every reference request's shape (tests/data/vllm/prompt_tokens.json) sent to a live
    engine of the family, asking for the prompt's token ids back: the ids the Router hashes
    are the ids the engine computed on, and what the engine refuses the Router refuses too,
    with the same status."""
    tokenizer = PromptTokenizer(REPO / "out" / "models" / f"tiny-{family}")
    cases = [c for c in VECTORS["cases"] if c["variant"] == family]
    assert sum("ids" in c["vllm"] for c in cases) >= 50
    engine = engines_of(cluster, family)[0]["url"]
    for case in cases:
        route = "/v1/chat/completions" if case["kind"] == "chat" else "/v1/completions"
        body = {**case["body"], "model": served_name(family), "max_tokens": 1}
        status, answer, _ = await post(http, engine + route, {**body, "return_token_ids": True})
        try:
            ours = tokenizer.prompt_ids(parse_request(case["kind"], case["body"]))
        except ApiError as err:
            assert (err.status, status) == (400, 400), (case["name"], answer)
            continue
        assert status == 200, (case["name"], answer)
        fed = answer.get("prompt_token_ids") or answer["choices"][0].get("prompt_token_ids")
        assert fed == ours, case["name"]


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_chat_through_alternating_routers_stays_on_one_engine_and_its_cache_grows(
    cluster: LocalCluster, http: aiohttp.ClientSession, family: str, key: tuple[Path, str]
) -> None:
    words = " ".join(f"w{i * 7919 % 5000}" for i in range(300))
    # No system message: the [INST] template puts it into the last user turn, so a chat's
    # prefix only grows without one.
    messages: list[dict[str, str]] = []
    served, cached = [], []
    for turn in range(4):
        messages.append({"role": "user", "content": f"turn {turn}: {words[turn * 300 :]}"})
        body = {"model": served_name(family), "messages": messages, "max_tokens": 4}
        status, answer, headers = await post(
            http, cluster.routers[turn % 2] + "/v1/chat/completions", body,
            Authorization=f"Bearer {key[1]}", **{"x-session-id": f"chat-{family}"},
        )  # fmt: skip
        assert status == 200, answer
        served.append(headers["x-kvsched-instance"])
        assert answer["model"] == served_name(family)
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
        reply = answer["choices"][0]["message"]["content"]
        messages.append({"role": "assistant", "content": reply})
    assert len(set(served)) == 1, (served, cached)
    assert served[0] in {e["id"] for e in engines_of(cluster, family)}  # one of its model's
    assert all(b > a for a, b in itertools.pairwise(cached)), cached


async def test_both_models_are_listed_and_each_request_is_answered_by_its_models_engines(
    cluster: LocalCluster, http: aiohttp.ClientSession, key: tuple[Path, str]
) -> None:
    auth = {"Authorization": f"Bearer {key[1]}"}
    async with http.get(cluster.routers[0] + "/v1/models", headers=auth) as resp:
        listed = {card["id"] for card in (await resp.json())["data"]}
    assert listed == {served_name(f) for f in FAMILIES}
    for i in range(8):
        family = FAMILIES[i % 2]
        body = {"model": served_name(family), "prompt": f"request {i}", "max_tokens": 2}
        status, answer, headers = await post(
            http, cluster.routers[i % 2] + "/v1/completions", body, **auth
        )
        assert status == 200, answer
        assert headers["x-kvsched-instance"] in {e["id"] for e in engines_of(cluster, family)}
    status, answer, headers = await post(
        http, cluster.routers[0] + "/v1/completions", {"model": "tiny-other", "prompt": "x"}, **auth
    )
    assert status == 404 and answer["error"]["param"] == "model", answer
    assert cluster.endpoints["block_size"] == 32
