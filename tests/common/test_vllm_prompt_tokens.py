"""Prompt token ids equal to vLLM's: every request of tests/data/vllm/prompt_tokens.json (made
by tools/make_vllm_prompt_vectors.py with vLLM's own front end) gives the ids vLLM fed its
engine, or a 400 where vLLM refused it, for the demo tokenizer and its variants and for the
other tokenizer families (Qwen2's ChatML, Mistral's [INST]: `tests/data/tokenizers/`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from services.common.inference_api.openai_api import ApiError, PromptTokenizer, parse_request
from tools.make_vllm_prompt_vectors import write_tokenizer_variant

REPO = Path(__file__).resolve().parents[2]
VECTORS = json.loads((REPO / "tests/data/vllm/prompt_tokens.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PromptTokenizer]:
    tmp = tmp_path_factory.mktemp("variants")
    out = {"demo": PromptTokenizer()}  # the shipped one, read from the package
    for name, files in VECTORS["variants"].items():
        if files:
            out[name] = PromptTokenizer(write_tokenizer_variant(tmp / name, files))
    for family, path in VECTORS["bases"].items():  # other tokenizer families, as they are
        out[family] = PromptTokenizer(REPO / path)
    return out


def test_vectors_cover_the_cases_asked_for() -> None:
    cases = VECTORS["cases"]
    assert len(cases) >= 50
    assert {c["kind"] for c in cases} == {"chat", "completion"}
    assert sum("ids" in c["vllm"] for c in cases) >= 50
    # Where vLLM's preprocessing differs from transformers' plain call, vLLM is the reference.
    assert any(c["vllm"].get("transformers") == "differs" for c in cases)
    # Every request shape again for each other tokenizer family, most of them with ids.
    shapes = {c["name"] for c in cases if c["variant"] == "demo"}
    for family in VECTORS["bases"]:
        named = {c["name"].removeprefix(f"{family}: ") for c in cases if c["variant"] == family}
        assert named == shapes
        assert sum("ids" in c["vllm"] for c in cases if c["variant"] == family) >= 50


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda case: case["name"])
def test_prompt_ids_are_vllms(case: dict[str, Any], tokenizers: dict[str, PromptTokenizer]) -> None:
    tok = tokenizers[case["variant"]]
    expected = case["vllm"]
    if "ids" in expected:
        assert tok.prompt_ids(parse_request(case["kind"], case["body"])) == expected["ids"]
        return
    with pytest.raises(ApiError) as err:
        tok.prompt_ids(parse_request(case["kind"], case["body"]))
    assert err.value.status == expected["status"] == 400
    assert err.value.body()["error"]["message"]
