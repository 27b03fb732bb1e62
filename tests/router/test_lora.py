"""The Router's LoRA adapters: vLLM's `--lora-modules` forms, and adapter-keyed hashes on the
incremental path. (Its loads through vLLM's runtime LoRA API: tests/engine/test_lora.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsched.core.vllm_hashing import VllmBlockHasher
from services.router.lora import LoraModule, parse_lora_modules
from services.router.prompt_pieces import PieceTokenizer
from services.router.session_prompts import SessionPrompts
from services.router.tokenizer import RouterTokenizer

BASE = "tiny-llama"


def test_both_of_vllms_forms_and_the_weights_size_where_readable(tmp_path: Path) -> None:
    (tmp_path / "adapter_model.safetensors").write_bytes(b"x" * 1234)
    plain = parse_lora_modules(f"a={tmp_path}, b=/elsewhere/b", BASE)
    assert plain == (LoraModule("a", str(tmp_path), BASE, 1234),
                     LoraModule("b", "/elsewhere/b", BASE, 0))  # fmt: skip
    as_json = json.dumps([{"name": "c", "path": "/c", "base_model_name": "tiny-qwen2"}])
    assert parse_lora_modules(as_json, BASE) == (LoraModule("c", "/c", "tiny-qwen2"),)
    assert parse_lora_modules(" ", BASE) == ()
    assert plain[0].key == ("a", str(tmp_path))


@pytest.mark.parametrize(
    ("text", "error"),
    [("a", "wants NAME=PATH"), ("a=", "wants NAME=PATH"), ("a=/x,a=/y", "given twice"),
     ('{"name": "a"}', '"name" and "path"'), ("[1]", '"name" and "path"'), ("{", "not JSON")],
)  # fmt: skip
def test_malformed_modules_are_refused_with_what_is_wrong(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_lora_modules(text, BASE)


def test_a_sessions_turns_hash_with_their_adapter_as_whole_prompts_do() -> None:
    """The incremental path keys its chain by the adapter: a turn of another adapter (or
    none) on the same session hashes as its own whole prompt."""
    tok = RouterTokenizer()
    prompts = SessionPrompts(PieceTokenizer(tok.model))
    hasher = VllmBlockHasher(16)
    text = "<|begin_of_text|>" + "words of a long turn " * 40
    for adapter in (("a", "/a"), ("a", "/a"), None, ("b", "/b")):
        ids, hashes = prompts.ids_and_hashes("s", text, False, hasher, "salt", adapter=adapter)
        assert list(hashes) == hasher.hash_prompt(ids, "salt", adapter)
