"""Tokenizer directories read as transformers reads them, and the shipped demo tokenizer's files
reproducible by tools/make_tokenizer.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.common.openai_api import PromptTokenizer, parse_request
from services.common.tokenizer_dir import TokenizerDir

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "kvsched" / "data" / "tokenizer"
HI = {"messages": [{"role": "user", "content": "hi"}]}


def demo_copy(tmp_path: Path, **config: Any) -> Path:
    """The demo tokenizer directory with `config` merged into its tokenizer_config.json."""
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
    files = TokenizerDir.load()
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|system|>", "<|user|>", "<|assistant|>"]
    assert [files.tokenizer.token_to_id(t) for t in special] == [0, 1, 2, 3, 4]
    assert files.tokenizer.get_vocab_size() == 4096
    assert files.tokenizer.encode("hello", add_special_tokens=False).ids == [271, 80, 272]
    assert files.special_tokens == {"bos_token": special[0], "eos_token": special[1]}
    assert list(files.chat_templates) == ["default"]


def test_a_directory_or_its_tokenizer_json(tmp_path: Path) -> None:
    copy = demo_copy(tmp_path)
    req = parse_request("chat", HI)
    ids = PromptTokenizer().prompt_ids(req)
    assert PromptTokenizer(copy).prompt_ids(req) == ids
    assert PromptTokenizer(str(copy / "tokenizer.json")).prompt_ids(req) == ids


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (
            {"tokenizer_class": "LlamaTokenizer"},
            "tokenizer_class 'LlamaTokenizer' is not supported",
        ),
        ({"tokenizer_class": None}, "tokenizer_class None is not supported"),
        ({"bos_token": "<s>"}, r"special tokens \['<s>'\] are not in tokenizer.json"),
        ({"chat_template": 3}, "chat_template must be a string or a list of named templates"),
    ],
)
def test_directories_transformers_would_read_otherwise(
    tmp_path: Path, config: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValueError, match=says):
        PromptTokenizer(demo_copy(tmp_path, **config))


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
