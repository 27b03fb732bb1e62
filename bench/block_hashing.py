"""Block hashing on the Router's path: a prompt's block hashes computed as vLLM computes them
(`kvsched.core.vllm_hashing`, each `--prefix-caching-hash-algo`), against the baseline of our
own XXH3 chain (`kvsched.core.hashing`, what the Routers used before they named blocks as
vLLM does, and what the simulator still uses), measured in the same run on the same prompts.

    .venv/bin/python -m bench.block_hashing [--tokens 32768] [--block-size 16] [--repeats 20]

Prints the median time per prompt and per block, and the ratio to the baseline.
"""

from __future__ import annotations

import argparse
import random
from functools import partial

from bench.common import median_s
from kvsched.core.hashing import BlockHasher
from kvsched.core.vllm_hashing import HASH_ALGOS, VllmBlockHasher


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = [rng.randrange(128_256) for _ in range(args.tokens)]  # Llama-3's vocabulary
    blocks = args.tokens // args.block_size
    xxh3 = BlockHasher(args.block_size)
    base = median_s(lambda: xxh3.hash_tokens(tokens, b"tenant"), args.repeats)
    print(f"{args.tokens}-token prompt, {blocks} blocks of {args.block_size}, median of "
          f"{args.repeats}")  # fmt: skip
    print("| hashing | ms per prompt | µs per block | vs XXH3 chain |")
    print("|---|---:|---:|---:|")
    print(f"| XXH3 chain (baseline) | {base * 1e3:.2f} | {base / blocks * 1e6:.2f} | 1.00 |")
    for algo in HASH_ALGOS:
        hasher = VllmBlockHasher(args.block_size, algo, "0")
        t = median_s(partial(hasher.hash_prompt, tokens, "tenant"), args.repeats)
        print(f"| vLLM {algo} | {t * 1e3:.2f} | {t / blocks * 1e6:.2f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
