"""Build two more tokenizer families as test data: `tests/data/tokenizers/qwen2/` and
`tests/data/tokenizers/mistral/`.

The demo tokenizer (`kvsched/data/tokenizer/`, tools/make_tokenizer.py) is one family: a
byte-level BPE with Llama-3-style special tokens. Real deployments serve others, and no model
hub is reachable here, so two small look-alikes are made locally, each saved by the
transformers class that real models of that family name (the class decides how transformers,
hence vLLM, tokenizes: transformers 5 rebuilds the pipeline from the class and the saved
vocabulary, not from tokenizer.json alone):

- `qwen2`: a byte-level BPE as Qwen2 / Qwen2.5 have (NFC, Qwen2's split regex, byte-level),
  saved by `Qwen2Tokenizer`; the added tokens of Qwen2.5-Instruct after the trained ones
  (`<|endoftext|>` first: pad, `<|im_end|>`: EOS, no BOS; `<tool_call>` and the FIM tokens are
  added but not special, as there); the ChatML template `tests/data/chat_templates/chatml.jinja`.
- `mistral`: a SentencePiece-style BPE with byte fallback as Llama 2 / Mistral have (`<unk>`,
  `<s>`, `</s>` = 0, 1, 2, then the 256 byte pieces `<0x00>`..`<0xFF>`, then pieces with the
  `▁` metaspace; `legacy: false`; BOS added to completions), saved by `LlamaTokenizer`, with
  Mistral v0.3's control tokens (`[INST]`, `[TOOL_CALLS]`, ...) as special tokens after the
  trained pieces and the template `tests/data/chat_templates/inst.jinja`.

Both are 4,096 tokens, trained on this repository's text (README.md, docs/*.md and the
`kvsched` package's Python sources as git tracks them, in sorted order). Run it with the
project's environment, which has transformers and tokenizers:

    .venv/bin/python tools/make_family_tokenizers.py

By default it rebuilds the files from the vocabularies already committed, so token ids never
change; `--check` only says whether the committed files are what it would write (exit 1 when
not). `--retrain` trains new vocabularies from the current sources instead: every token id
changes, so only do that on purpose (and regenerate what depends on the ids).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import LlamaTokenizer, Qwen2Tokenizer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "tokenizers"
TEMPLATES = ROOT / "tests" / "data" / "chat_templates"
VOCAB_SIZE = 4096

Vocab = dict[str, int]
Merges = list[tuple[str, str]]

# Qwen2.5-Instruct's added tokens, in their order (ids 151643.. there, 4074.. here): the first
# fourteen are special, the rest are added tokens the model reads as text.
QWEN2_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]  # fmt: skip
QWEN2_PLAIN = [
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]  # fmt: skip
# Qwen2 / Qwen2.5's pre-tokenizer regex (transformers' Qwen2Tokenizer): training splits alike.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

MISTRAL_BASE = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
# Mistral v0.3's control tokens (ids 3..9 there; after the trained pieces here, so that the
# byte pieces follow </s> as in Llama 2 and Mistral v0.1).
MISTRAL_CONTROL = [
    "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]",
]  # fmt: skip


def corpus_files() -> list[Path]:
    """The training text: the files git tracks among README.md, docs/*.md and the kvsched
    package's Python sources (generated protobuf code aside), sorted. Untracked files never
    change what a retrain makes of a commit."""
    listed = subprocess.run(
        ["git", "ls-files", "--", "README.md", "docs/*.md", "kvsched/*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in sorted(listed) if not name.startswith("kvsched/api/")]


def corpus() -> list[str]:
    return [path.read_text(encoding="utf-8") for path in corpus_files()]


def vocab_and_merges(tok: Tokenizer) -> tuple[Vocab, Merges]:
    """A BPE tokenizer's model vocabulary and merges, as tokenizer.json stores them."""
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    return dict(model["vocab"]), [(a, b) for a, b in merges]


def with_added(vocab: Vocab, added: Iterable[str]) -> Vocab:
    """`vocab` with `added` appended at the next ids."""
    out = dict(vocab)
    for token in added:
        out[token] = len(out)
    return out


# -- qwen2 ----------------------------------------------------------------------------------


def train_qwen2() -> tuple[Vocab, Merges]:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(QWEN2_SPECIAL) - len(QWEN2_PLAIN),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    vocab, merges = vocab_and_merges(tok)
    return with_added(vocab, [*QWEN2_SPECIAL, *QWEN2_PLAIN]), merges


def build_qwen2(vocab: Vocab, merges: Merges) -> Any:
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=QWEN2_SPECIAL[1:],
        add_prefix_space=False,
        errors="replace",
        split_special_tokens=False,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    # Qwen2.5 marks these added but not special (skip_special_tokens keeps them).
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN2_PLAIN])
    return tok


# -- mistral --------------------------------------------------------------------------------


def train_mistral() -> tuple[Vocab, Merges]:
    tok = Tokenizer(models.BPE(byte_fallback=True))
    # Training splits words at the metaspace (a piece never holds ▁ but at its start, as in
    # SentencePiece); LlamaTokenizer then runs BPE on the whole text, which is the same.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(MISTRAL_CONTROL),
        special_tokens=MISTRAL_BASE,  # ids 0..258, in this order
        show_progress=False,
    )
    # SentencePiece trains on one sentence a line, so a newline is no piece and comes out as
    # <0x0A>, as in Llama 2 and Mistral.
    lines = [line for text in corpus() for line in text.splitlines() if line.strip()]
    tok.train_from_iterator(lines, trainer=trainer)
    vocab, merges = vocab_and_merges(tok)
    return with_added(vocab, MISTRAL_CONTROL), merges


def build_mistral(vocab: Vocab, merges: Merges) -> Any:
    return LlamaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        extra_special_tokens=MISTRAL_CONTROL,
        legacy=False,
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )


@dataclass(frozen=True)
class Family:
    """How one family's tokenizer directory is made."""

    name: str
    template: str  # in tests/data/chat_templates/
    train: Callable[[], tuple[Vocab, Merges]]
    build: Callable[[Vocab, Merges], Any]  # a transformers tokenizer
    # Written into tokenizer_config.json beside what save_pretrained writes: what
    # transformers 5 keeps in the backend only, for readers of the config alone.
    config: dict[str, Any]


FAMILIES = [
    Family("qwen2", "chatml.jinja", train_qwen2, build_qwen2, {}),
    Family(
        "mistral",
        "inst.jinja",
        train_mistral,
        build_mistral,
        {"add_bos_token": True, "add_eos_token": False, "legacy": False},
    ),
]


def committed(out: Path) -> tuple[Vocab, Merges]:
    """The vocabulary and merges of the tokenizer.json already at `out`."""
    return vocab_and_merges(Tokenizer.from_file(str(out / "tokenizer.json")))


def files(family: Family, vocab: Vocab, merges: Merges) -> dict[str, str]:
    """The family's files, as transformers' save_pretrained writes them (plus `config`)."""
    tok = family.build(vocab, merges)
    tok.chat_template = (TEMPLATES / family.template).read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        written = {p.name: p.read_text(encoding="utf-8") for p in sorted(Path(tmp).iterdir())}
    config = json.loads(written["tokenizer_config.json"]) | family.config
    # As save_pretrained formats it.
    text = json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    written["tokenizer_config.json"] = text
    return written


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=OUT, help="holds one directory a family")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    parser.add_argument("--retrain", action="store_true", help="new vocabularies: new ids")
    args = parser.parse_args()
    if args.retrain and args.check:
        parser.error("--retrain and --check exclude each other")
    stale = []
    for family in FAMILIES:
        out: Path = args.out / family.name
        # The committed vocabulary is read from the default place, as --out only says where
        # to write (a copy elsewhere is then the same).
        vocab, merges = family.train() if args.retrain else committed(OUT / family.name)
        for name, text in files(family, vocab, merges).items():
            path = out / name
            if args.check:
                if not path.exists() or path.read_text(encoding="utf-8") != text:
                    stale.append(f"{family.name}/{name}")
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    if stale:
        sys.exit(
            f"{args.out}: {', '.join(stale)} differ from what tools/make_family_tokenizers.py "
            "writes"
        )


if __name__ == "__main__":
    main()
