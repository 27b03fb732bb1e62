"""vLLM's own prefix-cache block hashes, computed outside vLLM.

The live services name a block by the hash vLLM gives it, so an engine's KV events need no
translation and no memory of earlier events: a Messenger that restarts, or an event that is
lost, costs nothing but that event's own blocks (llm-d's choice; the alternative, re-hashing
from each event's token ids as Dynamo does, needs every block's parent to have been seen).

vLLM (`vllm/v1/core/kv_cache_utils.py`, 0.11 and later) hashes block i of a request as
``H((parent, tuple(token_ids), extra_keys))`` where `parent` is block i-1's full digest (the
first block's is `NONE_HASH = H(seed)`), `extra_keys` is None or a tuple: a LoRA adapter's
``("lora", name, path)`` on every block of its requests (0.32: the path as the engine loaded
the adapter), then a cache salt on the first block, ``("cache_salt", salt)``; and H is one of
its `--prefix-caching-hash-algo`s:
SHA-256 or XXH3-128 over the object's pickle (protocol 5) or canonical CBOR. The seed is
`PYTHONHASHSEED` when set, else a fixed string for SHA-256 (every process agrees) and a random
one for XXH3 (none do: such engines need `PYTHONHASHSEED` set to share anything with us).
KV events carry each digest's low 64 bits (big-endian), or the digest itself when
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`; `event_hash` maps both to the same integer.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cbor2
import xxhash

MASK64 = (1 << 64) - 1
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_HASH_ALGO = "sha256"  # vLLM's default
DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed for SHA-256 without PYTHONHASHSEED
# A LoRA adapter as its blocks' hashes name it: (name, path), as the engine loaded it.
AdapterKey = tuple[str, str]


def _pickled(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def _cbor(obj: Any) -> bytes:
    return bytes(cbor2.dumps(obj, canonical=True))


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    return bytes(xxhash.xxh3_128_digest(data))


_FUNCTIONS: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], bytes]]] = {
    "sha256": (_pickled, _sha256),
    "sha256_cbor": (_cbor, _sha256),
    "xxhash": (_pickled, _xxh3_128),
    "xxhash_cbor": (_cbor, _xxh3_128),
}


def resolve_seed(algo: str, seed: str | None) -> str | None:
    """The NONE_HASH seed a vLLM engine started with `PYTHONHASHSEED=seed` (None: unset)
    uses: that seed, else the fixed one for SHA-256; None where it draws a random one."""
    if seed is not None:
        return seed
    return DEFAULT_SEED if algo.startswith("sha256") else None


def event_hash(value: int | bytes) -> int:
    """The block hash a KV event names, as the 64-bit integer the Conductor indexes."""
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & MASK64
    return value & MASK64


@dataclass(frozen=True, slots=True)
class VllmBlockHasher:
    """Computes vLLM's block hashes for one block size, algorithm and seed; immutable."""

    block_size: int
    algo: str = DEFAULT_HASH_ALGO
    seed: str = DEFAULT_SEED
    _none_hash: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.algo not in _FUNCTIONS:
            raise ValueError(f"hash algorithm must be one of {', '.join(HASH_ALGOS)}")
        object.__setattr__(self, "_none_hash", self.digest(self.seed))

    def digest(self, obj: Any) -> bytes:
        """vLLM's hash function over `obj`."""
        encode, digest = _FUNCTIONS[self.algo]
        return digest(encode(obj))

    def next_digest(
        self,
        parent: bytes | None,
        tokens: Sequence[int],
        cache_salt: str | None = None,
        adapter: AdapterKey | None = None,
    ) -> bytes:
        """The digest of the block `tokens` following the prefix whose digest is `parent`
        (None: the first block, the one that carries a request's `cache_salt`), of a request
        for LoRA `adapter` (None: the base model)."""
        lora = (("lora", *adapter),) if adapter else ()
        if parent is None:
            extra = (*lora, ("cache_salt", cache_salt)) if cache_salt else lora
            return self.digest((self._none_hash, tuple(tokens), extra or None))
        return self.digest((parent, tuple(tokens), lora or None))

    def digests(
        self,
        tokens: Sequence[int],
        cache_salt: str | None = None,
        adapter: AdapterKey | None = None,
    ) -> list[bytes]:
        """The full digests of every full block of `tokens` (a trailing partial block is
        skipped), for a request carrying `cache_salt`, for `adapter`."""
        out: list[bytes] = []
        parent: bytes | None = None
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = self.next_digest(parent, tokens[start : start + bs], cache_salt, adapter)
            out.append(parent)
        return out

    def hash_prompt(
        self,
        tokens: Sequence[int],
        cache_salt: str | None = None,
        adapter: AdapterKey | None = None,
    ) -> list[int]:
        """The 64-bit hashes (as KV events name them) of every full block of `tokens`."""
        return [event_hash(d) for d in self.digests(tokens, cache_salt, adapter)]
