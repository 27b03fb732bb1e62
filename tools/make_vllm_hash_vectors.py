"""Write tests/data/vllm/block_hashes.json: block hashes computed by vLLM's own code, for
every `--prefix-caching-hash-algo`, with and without a cache salt and PYTHONHASHSEED, and for
a LoRA adapter's requests (extra keys from vLLM's `generate_block_hash_extra_keys`).

Run with the vLLM environment's Python (`.venv-vllm/bin/python tools/make_vllm_hash_vectors.py`);
the project's tests check `kvsched.core.vllm_hashing` against the file without vLLM.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import vllm
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "vllm" / "block_hashes.json"
BLOCK_SIZE = 16
MASK64 = (1 << 64) - 1
ADAPTER = ("tiny-lora", "/adapters/tiny-lora")  # a name and the path the engine loaded it from


def extra_keys(salt: str | None, adapter: tuple[str, str] | None, start: int) -> object:
    """The block's extra keys as vLLM makes them, from a request with only these set."""
    lora = None if adapter is None else LoRARequest(adapter[0], 1, adapter[1])
    request = SimpleNamespace(
        lora_request=lora, cache_salt=salt, mm_features=[], prompt_embeds=None
    )
    keys, _ = kv_cache_utils.generate_block_hash_extra_keys(request, start, start + BLOCK_SIZE, 0)
    return keys


def vectors() -> list[dict[str, Any]]:
    rng = random.Random(11)
    tokens = [rng.randrange(0, 1 << 17) for _ in range(5 * BLOCK_SIZE + 3)]
    out = []
    for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        for seed in (None, "0", "kvsched"):
            if seed is None and algo.startswith("xxhash"):
                continue  # a random seed: nothing to reproduce
            if seed is None:
                os.environ.pop("PYTHONHASHSEED", None)
            else:
                os.environ["PYTHONHASHSEED"] = seed
            fn = get_hash_fn_by_name(algo)
            kv_cache_utils.init_none_hash(fn)
            for salt, adapter in cases(algo, seed):
                parent = None
                hashes = []
                for i in range(len(tokens) // BLOCK_SIZE):
                    extra = extra_keys(salt, adapter, i * BLOCK_SIZE)
                    block = tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
                    parent = kv_cache_utils.hash_block_tokens(fn, parent, block, extra)
                    hashes.append(int.from_bytes(parent, "big") & MASK64)
                out.append(
                    {
                        "vllm_version": vllm.__version__,
                        "algo": algo,
                        "seed": seed,
                        "cache_salt": salt,
                        "adapter": adapter,
                        "block_size": BLOCK_SIZE,
                        "token_ids": tokens,
                        "hashes": [str(h) for h in hashes],
                    }
                )
    return out


def cases(algo: str, seed: str | None) -> list[tuple[str | None, tuple[str, str] | None]]:
    """Salt and adapter pairs: each salt without an adapter; with one, for one algorithm."""
    out: list[tuple[str | None, tuple[str, str] | None]] = [(None, None), ("tenant-salt-7", None)]
    if algo == "sha256" and seed is None:
        out += [(None, ADAPTER), ("tenant-salt-7", ADAPTER)]
    return out


def main() -> None:
    OUT.write_text(json.dumps(vectors(), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
