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
import anthropic
import openai
import pytest
from anthropic.types import MessageParam, MetadataParam

from services.common.inference_api.openai_api import ApiError, PromptTokenizer, parse_request
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


# ---- the API surface through the Router, with the vendors' own SDKs as clients --------------


async def test_openai_sdk_completions_chat_and_responses_streamed_and_not(
    cluster: LocalCluster, key: tuple[Path, str]
) -> None:
    model = served_name("qwen2")
    ids = {e["id"] for e in engines_of(cluster, "qwen2")}
    async with openai.AsyncOpenAI(base_url=cluster.routers[0] + "/v1", api_key=key[1]) as client:
        raw = await client.completions.with_raw_response.create(
            model=model, prompt=["one prompt", "and another"], max_tokens=2, n=2
        )
        assert raw.headers["x-kvsched-instance"] in ids
        assert len(raw.parse().choices) == 4  # every prompt, n choices each
        chat = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.usage is not None and chat.usage.prompt_tokens > 0
        chunks = [c async for c in await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True,
            stream_options={"include_usage": True},
        )]  # fmt: skip
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
        text = [c async for c in await client.completions.create(
            model=model, prompt="count", max_tokens=2, stream=True
        )]  # fmt: skip
        assert text
        response = await client.responses.create(model=model, input="hi", max_output_tokens=4)
        assert response.usage is not None and response.usage.input_tokens > 0
        events = [e.type async for e in await client.responses.create(
            model=model, input="hi", max_output_tokens=4, stream=True
        )]  # fmt: skip
        assert events[-1] == "response.completed"
        assert (await client.models.retrieve(model)).id == model
        with pytest.raises(openai.NotFoundError):
            await client.models.retrieve("none-such")


async def test_anthropic_sdk_messages_streamed_and_not_stay_on_one_engine_cache_growing(
    cluster: LocalCluster, key: tuple[Path, str]
) -> None:
    model = served_name("qwen2")
    words = " ".join(f"m{i * 7907 % 5000}" for i in range(200))  # no other test's prefix
    # The session as Claude Code names it, in metadata.user_id.
    metadata: MetadataParam = {"user_id": "user_1_account_2_session_messages-1"}
    messages: list[MessageParam] = []
    served, cached = [], []
    async with anthropic.AsyncAnthropic(base_url=cluster.routers[0], api_key=key[1]) as client:
        for turn in range(3):
            messages.append({"role": "user", "content": f"turn {turn}: {words[turn * 200 :]}"})
            raw = await client.messages.with_raw_response.create(
                model=model,
                max_tokens=4,
                messages=messages,
                metadata=metadata,
            )
            answer = await raw.parse()
            served.append(raw.headers["x-kvsched-instance"])
            cached.append(answer.usage.cache_read_input_tokens or 0)
            reply = "".join(b.text for b in answer.content if b.type == "text")
            messages.append({"role": "assistant", "content": reply or "ok"})
        async with client.messages.stream(
            model=model,
            max_tokens=4,
            messages=messages[:1],
            metadata=metadata,
        ) as stream:
            final = await stream.get_final_message()
        assert final.usage.output_tokens > 0
    assert len(set(served)) == 1, (served, cached)
    assert all(b > a for a, b in itertools.pairwise(cached)), cached


async def test_tokenize_detokenize_pass_through_and_embeddings_get_vllms_own_answer(
    cluster: LocalCluster, http: aiohttp.ClientSession, key: tuple[Path, str]
) -> None:
    auth = {"Authorization": f"Bearer {key[1]}"}
    model = served_name("mistral")
    router = cluster.routers[1]
    status, answer, headers = await post(
        http, router + "/tokenize", {"model": model, "prompt": "The KV cache"}, **auth
    )
    assert status == 200 and headers["x-kvsched-instance"] in {
        e["id"] for e in engines_of(cluster, "mistral")
    }
    expected = PromptTokenizer(REPO / "out" / "models" / model).encode("The KV cache", True)
    assert answer["tokens"] == expected
    status, answer, _ = await post(
        http, router + "/detokenize", {"model": model, "tokens": expected}, **auth
    )
    assert status == 200 and "The KV cache" in answer["prompt"], answer
    # A generative engine serves no embeddings: vLLM's own answer passes through.
    status, answer, headers = await post(
        http, router + "/v1/embeddings", {"model": model, "input": "x"}, **auth
    )
    assert 400 <= status < 500 and "x-kvsched-instance" in headers, (status, answer)
