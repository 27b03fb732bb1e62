"""A prompt's token ids and block hashes on the Router's path, per tokenizer family, against
the raw tokenizer in the same run.

For each family (the demo Llama-3 tokenizer, and the Qwen2 and Mistral ones in
`tests/data/tokenizers/`) and each prompt length, a chat request of one long user message is
turned into its token ids as the Router does (`PromptTokenizer.prompt_ids`: vLLM's message
handling, transformers' `apply_chat_template`, the ids from transformers' tokenizer) and
hashed as vLLM hashes blocks. The baseline is the floor of any such path: the `tokenizers`
library's own `encode_batch_fast` of the already rendered text, with the `tokenizer.json`
transformers built (the ids the Router had before it used transformers, for a tokenizer it
took as it is). Each figure is the median of `--repeats` runs.

    .venv/bin/python -m bench.tokenize [--tokens 1024,32768,81920] [--repeats 9]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenizers import Tokenizer

from bench.common import median_s
from kvsched.core.vllm_hashing import VllmBlockHasher
from services.common.inference_api.openai_api import PromptTokenizer, parse_request

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = {
    "llama3 (demo)": None,
    "qwen2": ROOT / "tests" / "data" / "tokenizers" / "qwen2",
    "mistral": ROOT / "tests" / "data" / "tokenizers" / "mistral",
}
SOURCE = sorted((ROOT / "kvsched").rglob("*.py"))  # text to fill prompts with


def text_of(tok: PromptTokenizer, tokens: int) -> str:
    """Repository text of about `tokens` tokens for `tok`."""
    pieces, count = [], 0
    for path in SOURCE * 50:
        text = path.read_text(encoding="utf-8")
        pieces.append(text)
        count += len(tok.encode(text))
        if count >= tokens:
            break
    whole = "".join(pieces)
    return whole[: int(len(whole) * tokens / count)]


def row(family: str, tok: PromptTokenizer, tokens: int, hasher: VllmBlockHasher,
        repeats: int) -> str:  # fmt: skip
    """One table row: a chat prompt of about `tokens` tokens."""
    assert tok.model.backend is not None
    raw = Tokenizer.from_str(tok.model.backend.to_str())
    req = parse_request("chat", {"messages": [{"role": "user", "content": text_of(tok, tokens)}]})
    assert req.chat is not None
    rendered = tok.render_chat(req.chat)
    ids = tok.prompt_ids(req)
    assert ids == raw.encode_batch_fast([rendered], add_special_tokens=False)[0].ids
    base = median_s(lambda: raw.encode_batch_fast([rendered], add_special_tokens=False), repeats)
    ours = median_s(lambda: tok.prompt_ids(req), repeats)
    hashed = median_s(lambda: hasher.hash_prompt(tok.prompt_ids(req), None), repeats)
    return (f"| {family} | {len(ids):,} | {base * 1e3:.2f} | {ours * 1e3:.2f} | "
            f"{hashed * 1e3:.2f} | {ours / base:.2f} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="1024,32768,81920")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    hasher = VllmBlockHasher(args.block_size)
    print(f"median of {args.repeats}; block hashes of {args.block_size} tokens (sha256_cbor)")
    print("| family | prompt tokens | raw encode ms | Router ids ms | ids + hashes ms | ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    for family, path in FAMILIES.items():
        tok = PromptTokenizer(path)
        for tokens in (int(t) for t in args.tokens.split(",")):
            print(row(family, tok, tokens, hasher, args.repeats))


if __name__ == "__main__":
    main()
