"""Build the demo model's tokenizer files in `kvsched/data/tokenizer/`.

The simulated engine, the Routers and a real vLLM (through `tools/make_tiny_model.py`, which
copies these files into its model directory) must all tokenize alike, and nothing may be
downloaded at run time, so a small tokenizer ships with the project:

- `tokenizer.json` (HF `tokenizers`): a byte-level BPE trained on this repository's own text
  (its docs and Python sources, Apache-2.0 like the project), with a post-processor that adds
  `<|begin_of_text|>` when special tokens are asked for, as HF's Llama tokenizers do;
- `tokenizer_config.json`: what transformers (hence vLLM) reads beside it: the special tokens,
  the context length, and the chat template from `tools/demo_chat_template.jinja`.

`python tools/make_tokenizer.py` rewrites both files from the vocabulary already shipped, so
token ids never change; `--check` only says whether the shipped files are what it would
write. `--retrain` trains a new vocabulary from the current sources instead: every token id
changes, so only do that for a new demo model.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "kvsched" / "data" / "tokenizer"
CHAT_TEMPLATE = Path(__file__).resolve().parent / "demo_chat_template.jinja"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL = [BOS, EOS, "<|system|>", "<|user|>", "<|assistant|>"]
# Llama-3.1-8B's context, the model the simulated engines stand for.
MODEL_MAX_LENGTH = 131_072


def corpus() -> list[str]:
    files = sorted(
        [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "kvsched").rglob("*.py")]
    )
    return [p.read_text(encoding="utf-8") for p in files if "api" not in p.parts]


def trained(vocab_size: int) -> Tokenizer:
    """A new byte-level BPE vocabulary from this repository's text (new token ids)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok


def with_pipeline(tok: Tokenizer) -> Tokenizer:
    """`tok`'s vocabulary with the demo model's pre-tokenizer, decoder and post-processor."""
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # BOS for `add_special_tokens=True`, as HF's Llama-3 tokenizers add it: transformers takes
    # this post-processor as it is (it drops the config's add_bos_token beside a tokenizer.json,
    # which is there for readers and older loaders).
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, tok.token_to_id(BOS))],
    )
    return tok


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE.read_text(encoding="utf-8"),
    }


def files(tok: Tokenizer) -> dict[str, str]:
    """The shipped files' names and contents."""
    config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    return {"tokenizer.json": tok.to_str(pretty=False), "tokenizer_config.json": config}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=OUT, help="tokenizer directory")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    parser.add_argument("--retrain", action="store_true", help="new vocabulary: new token ids")
    parser.add_argument("--vocab-size", type=int, default=4096, help="with --retrain")
    args = parser.parse_args()
    if args.retrain and args.check:
        parser.error("--retrain and --check exclude each other")
    source = (
        trained(args.vocab_size)
        if args.retrain
        else Tokenizer.from_file(str(OUT / "tokenizer.json"))
    )
    out: Path = args.out
    stale = []
    for name, text in files(with_pipeline(source)).items():
        path = out / name
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    if stale:
        sys.exit(f"{out}: {', '.join(stale)} differ from what tools/make_tokenizer.py writes")


if __name__ == "__main__":
    main()
