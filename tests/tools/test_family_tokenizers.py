"""The tokenizer families of tests/data/tokenizers/: what tools/make_family_tokenizers.py writes,
loaded by transformers as the class they name, tokenizing as their own tokenizer.json does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "tokenizers"
TEXTS = [
    "Hello world",
    " leading space",
    "  two leading spaces",
    "\nnewline first",
    "a\nb\n\nc\r\n",
    "trailing  ",
    "ünïcödé café e\u0301 日本語 🙂 العربية",
    "def f(x):\n    return x  # comment\n",
    "<|im_start|>user\nhi<|im_end|> <tool_call> [INST] x [/INST] <s></s>",
    "",
]


def test_committed_files_are_what_the_tool_writes() -> None:
    tool = [sys.executable, str(REPO / "tools" / "make_family_tokenizers.py"), "--check"]
    done = subprocess.run(tool, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("family", "cls", "special"),
    [
        ("qwen2", "Qwen2Tokenizer", {"<|endoftext|>": 4074, "<|im_end|>": 4076}),
        ("mistral", "LlamaTokenizer", {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x00>": 3}),
    ],
)
def test_transformers_tokenizes_as_tokenizer_json(
    family: str, cls: str, special: dict[str, int]
) -> None:
    tok = AutoTokenizer.from_pretrained(str(DATA / family), local_files_only=True)
    raw = Tokenizer.from_file(str(DATA / family / "tokenizer.json"))
    assert type(tok).__name__ == cls
    assert len(tok) == 4096
    assert {t: tok.convert_tokens_to_ids(t) for t in special} == special
    for text in TEXTS:
        assert (
            tok.encode(text, add_special_tokens=False)
            == raw.encode(text, add_special_tokens=False).ids
        )
        assert tok.encode(text) == raw.encode(text).ids


def test_chat_templates_render() -> None:
    qwen2 = AutoTokenizer.from_pretrained(str(DATA / "qwen2"), local_files_only=True)
    hi = [{"role": "user", "content": "Hi"}]
    assert qwen2.apply_chat_template(hi, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    mistral = AutoTokenizer.from_pretrained(str(DATA / "mistral"), local_files_only=True)
    chat = [{"role": "system", "content": "Be brief."}, *hi]
    assert mistral.apply_chat_template(chat, tokenize=False) == "<s>[INST] Be brief.\n\nHi[/INST]"
    with pytest.raises(Exception, match="must alternate"):
        mistral.apply_chat_template([*hi, *hi], tokenize=False)
