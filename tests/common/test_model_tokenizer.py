"""Tokenizer directories loaded as vLLM loads them (transformers' AutoTokenizer, any class),
and the shipped demo tokenizer's files reproducible by tools/make_tokenizer.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.common.inference_api.model_tokenizer import ModelTokenizer
from services.common.inference_api.openai_api import PromptTokenizer, parse_request

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "kvsched" / "data" / "tokenizer"
HI = {"messages": [{"role": "user", "content": "hi"}]}


def demo_copy(tmp_path: Path, **config: Any) -> Path:
    """The demo tokenizer directory with `config` merged into its tokenizer_config.json."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    for src in DEMO.iterdir():
        shutil.copyfile(src, tmp_path / src.name)
    path = tmp_path / "tokenizer_config.json"
    merged = json.loads(path.read_text(encoding="utf-8")) | config
    path.write_text(json.dumps({k: v for k, v in merged.items() if v is not None}), "utf-8")
    return tmp_path


def test_shipped_files_are_what_make_tokenizer_writes() -> None:
    tool = [sys.executable, str(REPO / "tools" / "make_tokenizer.py"), "--check"]
    done = subprocess.run(tool, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def test_demo_token_ids_are_the_ones_ever_shipped() -> None:
    tok = ModelTokenizer()
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|system|>", "<|user|>", "<|assistant|>"]
    assert tok.hf.convert_tokens_to_ids(special) == [0, 1, 2, 3, 4]
    assert tok.vocab_size == 4096
    assert tok.encode("hello", add_special_tokens=False) == [271, 80, 272]
    assert tok.encode("hello", add_special_tokens=True) == [0, 271, 80, 272]
    assert tok.hf.special_tokens_map == {"bos_token": special[0], "eos_token": special[1]}
    assert isinstance(tok.hf.chat_template, str)


def test_a_directory_or_its_tokenizer_json(tmp_path: Path) -> None:
    copy = demo_copy(tmp_path)
    req = parse_request("chat", HI)
    ids = PromptTokenizer().prompt_ids(req)
    assert PromptTokenizer(copy).prompt_ids(req) == ids
    assert PromptTokenizer(str(copy / "tokenizer.json")).prompt_ids(req) == ids


TEXTS = [
    "",
    "hello world",
    " leading space,  two spaces\n\nnew lines\t tab",
    "héllo wörld, 日本語 ✓ 🙂 e\u0301",
    "special <|begin_of_text|> and <|user|> in text",
    "héllo wörld, <|begin_of_text|> ✓ 12345 " * 100,  # long: tokenized without the GIL
]


def with_config(tmp_path: Path, **config: Any) -> ModelTokenizer:
    return ModelTokenizer(demo_copy(tmp_path, **config))


@pytest.mark.parametrize(
    "config",
    [{}, {"tokenizer_class": "LlamaTokenizer"}, {"split_special_tokens": True}],
    ids=["as is", "rebuilt by its class", "special tokens split"],
)
def test_ids_are_transformers_own(tmp_path: Path, config: dict[str, Any]) -> None:
    tok = with_config(tmp_path, **config)
    assert tok.backend is not None
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, special) == tok.hf(text, add_special_tokens=special).input_ids


def test_a_class_transformers_rebuilds_tokenizes_as_transformers_does(tmp_path: Path) -> None:
    # LlamaTokenizer over the demo's byte-level tokenizer.json: transformers puts its own
    # pipeline around the vocabulary, and so does vLLM, so `tokenizer.json` alone is wrong.
    rebuilt = with_config(tmp_path, tokenizer_class="LlamaTokenizer")
    assert rebuilt.encode(" hello world", False) != ModelTokenizer().encode(" hello world", False)


def test_a_python_tokenizer_is_served_too(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "ByT5Tokenizer"}')
    tok = ModelTokenizer(tmp_path)
    assert tok.backend is None  # no Rust backend: tokenized by transformers' Python code
    for text in TEXTS:
        assert tok.encode(text, True) == tok.hf(text).input_ids
    assert tok.encode("hé", False) == [107, 198, 172]  # its UTF-8 bytes, offset by 3
    with pytest.raises(TypeError):
        tok.encode("a\ud800b", False)


def test_a_directory_transformers_cannot_load_is_refused_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no such tokenizer directory"):
        ModelTokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"{tmp_path}: transformers cannot load its tokenizer"):
        ModelTokenizer(tmp_path)
    with pytest.raises(ValueError, match="chat_template must be a string or a list of named"):
        PromptTokenizer(demo_copy(tmp_path / "copy", chat_template=3))


def test_templates_see_every_named_special_token(tmp_path: Path) -> None:
    template = "{{ bos_token }}|{{ pad_token }}|{{ tool_token }}|{{ extra_token }}"
    copy = demo_copy(
        tmp_path,
        chat_template=template,
        pad_token={"__type": "AddedToken", "content": "<|end_of_text|>"},
        tool_token="<|assistant|>",
        extra_special_tokens={"extra_token": "<|system|>"},
    )
    text = PromptTokenizer(copy).render_chat(parse_request("chat", HI).chat)  # type: ignore[arg-type]
    assert text == "<|begin_of_text|>|<|end_of_text|>|<|assistant|>|<|system|>"
