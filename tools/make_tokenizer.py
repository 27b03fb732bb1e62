"""Build the demo model's tokenizer: a byte-level BPE trained on this repository's own text.

The simulated engine and the Routers need one shared `tokenizer.json` (HF `tokenizers`
format) and nothing may be downloaded at run time, so a small one ships in
`kvsched/data/tokenizer/`. Run `python tools/make_tokenizer.py` to rebuild it; the corpus is
the project's docs and Python sources (Apache-2.0, like the project), read in sorted order.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "kvsched" / "data" / "tokenizer" / "tokenizer.json"
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|system|>", "<|user|>", "<|assistant|>"]


def corpus() -> list[str]:
    files = sorted(
        [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "kvsched").rglob("*.py")]
    )
    return [p.read_text(encoding="utf-8") for p in files if "api" not in p.parts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out), pretty=False)
    print(f"wrote {args.out.relative_to(ROOT)}: {tok.get_vocab_size()} tokens")


if __name__ == "__main__":
    main()
