"""Chained block hashes over token ids (the Mooncake indexer RFC form).

Only full blocks are hashed. Block i gets a local hash over its little-endian u32 token ids and
a chained hash ``h[i] = XXH3_64(h[i-1] ‖ local[i])``, so equal hashes at position i mean equal
prefixes up to block i. The chain starts from a root derived from the configured seed and the
tenant's salt: two tenants never share a hash, so one cannot probe the other's cached prefixes.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

_PAIR = struct.Struct("<QQ")
MASK64 = (1 << 64) - 1
_BIG_ENDIAN = sys.byteorder == "big"
assert array("I").itemsize == 4, "u32 token packing needs a 4-byte array type"


@dataclass(frozen=True, slots=True)
class BlockHasher:
    """Computes our block hashes; immutable, so it is shared freely."""

    block_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 0 <= self.seed <= MASK64:
            raise ValueError("seed must fit in an unsigned 64-bit integer")

    def root(self, tenant_salt: bytes = b"") -> int:
        """The chain's starting value for one tenant (the empty prefix)."""
        return int(xxhash.xxh3_64_intdigest(b"kvsched-root\x00" + tenant_salt, seed=self.seed))

    def local(self, tokens: Sequence[int]) -> int:
        """Hash of one block's tokens, as little-endian u32 values."""
        return int(xxhash.xxh3_64_intdigest(_u32_bytes(tokens), seed=self.seed))

    def chain(self, parent: int, local: int) -> int:
        """Chained hash of a block given its parent's chained hash and its own local hash."""
        return int(xxhash.xxh3_64_intdigest(_PAIR.pack(parent, local), seed=self.seed))

    def extend(self, parent: int, tokens: Sequence[int]) -> int:
        """Chained hash of the block `tokens` following the prefix whose hash is `parent`."""
        return self.chain(parent, self.local(tokens))

    def hash_tokens(self, tokens: Sequence[int], tenant_salt: bytes = b"") -> list[int]:
        """Chained hashes of every full block of `tokens` (a trailing partial block is skipped)."""
        out: list[int] = []
        h = self.root(tenant_salt)
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            h = self.extend(h, tokens[start : start + bs])
            out.append(h)
        return out


def _u32_bytes(tokens: Sequence[int]) -> bytes:
    try:
        values = array("I", tokens)
    except OverflowError as exc:
        raise ValueError("token ids must fit in an unsigned 32-bit integer") from exc
    if _BIG_ENDIAN:
        values.byteswap()
    return values.tobytes()


def pseudo_tokens(block_id: int, block_size: int) -> list[int]:
    """Deterministic stand-in tokens for a trace block id.

    Traces publish block ids, not text. Each id becomes `block_size` u32 tokens whose first two
    carry the id's low and high 32 bits, so equal ids give equal blocks and different ids give
    different blocks; the rest are filler. This lets traces drive the real hashing path.
    """
    if block_size < 2:
        raise ValueError("pseudo tokens need a block size of at least 2")
    if not 0 <= block_id <= MASK64:
        raise ValueError(f"block id {block_id} does not fit in 64 bits")
    return [block_id & 0xFFFFFFFF, block_id >> 32, *range(2, block_size)]
