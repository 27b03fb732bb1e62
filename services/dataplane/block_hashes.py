"""How the engines name KV blocks, as every service that hashes prompts is told: vLLM's
`--prefix-caching-hash-algo` and the engines' `PYTHONHASHSEED` (see
`kvsched.core.vllm_hashing`). The Routers, the Conductor and the simulated engines must agree
with the vLLM engines on both, or no prefix is ever found."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from kvsched.core.vllm_hashing import DEFAULT_HASH_ALGO, HASH_ALGOS, VllmBlockHasher, resolve_seed

Flag = Callable[[argparse.ArgumentParser, str, object, str], None]


@dataclass(frozen=True, slots=True)
class BlockHashes:
    """The engines' hash algorithm and `PYTHONHASHSEED` (None: unset)."""

    algo: str = DEFAULT_HASH_ALGO
    seed: str | None = None

    def __post_init__(self) -> None:
        if self.algo not in HASH_ALGOS:
            raise ValueError(f"--prefix-caching-hash-algo must be one of {', '.join(HASH_ALGOS)}")
        if resolve_seed(self.algo, self.seed) is None:
            raise ValueError(
                f"--prefix-caching-hash-algo {self.algo} needs --prefix-hash-seed: vLLM seeds "
                "it at random unless its engines share a PYTHONHASHSEED"
            )

    def hasher(self, block_size: int) -> VllmBlockHasher:
        seed = resolve_seed(self.algo, self.seed)
        assert seed is not None  # checked above
        return VllmBlockHasher(block_size, self.algo, seed)


def add_flags(flag: Flag, parser: argparse.ArgumentParser) -> None:
    """`--prefix-caching-hash-algo` and `--prefix-hash-seed`, through a service's `flag`."""
    flag(parser, "prefix-caching-hash-algo", DEFAULT_HASH_ALGO, "the engines' hash algorithm")
    flag(parser, "prefix-hash-seed", "", "the engines' PYTHONHASHSEED (default: unset)")


def from_args(args: argparse.Namespace) -> BlockHashes:
    """Raises ValueError for a bad combination."""
    return BlockHashes(args.prefix_caching_hash_algo, args.prefix_hash_seed or None)
