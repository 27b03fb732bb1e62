"""vLLM's names for our cached blocks, and the KV events that use them.

The engine's prefix cache is keyed by our chained hashes (what the Router computes), but vLLM
names blocks by its own hash, seeded per process, and a relay must never rely on the two
agreeing. So each stored block gets an engine hash over (parent's engine hash, its token ids,
extra keys) with this process's seed, and events carry those names plus the token ids, as
vLLM's do; the Messenger re-hashes the token ids into ours.
"""

from __future__ import annotations

import struct
from array import array
from collections import Counter
from collections.abc import Sequence
from typing import Any

import xxhash

from kvsched.core.hashing import salt_bytes
from services.common.kv_events import BlockRemoved, BlockStored

_U64 = struct.Struct("<Q")


class EngineNames:
    """Token ids and engine hashes of the blocks this engine knows. Token ids are kept for
    blocks cached or named by a request in flight (a block is stored only once computed)."""

    def __init__(self, block_size: int, seed: int) -> None:
        self.block_size = block_size
        self.seed = seed
        self.tokens: dict[int, tuple[int, ...]] = {}
        self.salt: dict[int, str] = {}  # first block of a salted chain -> its cache salt
        self.engine_hash: dict[int, int] = {}  # cached blocks: ours -> vLLM-style
        self._refs: Counter[int] = Counter()  # requests in flight naming the block

    def hold(self, hashes: Sequence[int], token_ids: Sequence[int], salt: str | None) -> None:
        """A request naming `hashes` (its prompt's full blocks) entered the engine."""
        bs = self.block_size
        for i, h in enumerate(hashes):
            if h not in self.tokens:
                self.tokens[h] = tuple(token_ids[i * bs : (i + 1) * bs])
            self._refs[h] += 1
        if salt and hashes:
            self.salt.setdefault(hashes[0], salt)

    def release(self, hashes: Sequence[int]) -> None:
        """The request naming `hashes` left the engine."""
        for h in hashes:
            left = self._refs[h] - 1
            if left > 0:
                self._refs[h] = left
                continue
            del self._refs[h]
            if h not in self.engine_hash:
                self._forget(h)

    def stored(self, hashes: Sequence[int], parent: int | None) -> BlockStored:
        """The event for blocks `hashes` (a chain continuing `parent`) entering the cache."""
        parent_engine = self.engine_hash[parent] if parent is not None else None
        h_prev = parent_engine or 0
        names: list[int] = []
        tokens: list[int] = []
        salt = self.salt.get(hashes[0]) if parent is None else None
        for i, h in enumerate(hashes):
            block = self.tokens[h]
            extra = salt_bytes(salt) if (salt and i == 0) else b""
            h_prev = xxhash.xxh3_64_intdigest(
                _U64.pack(h_prev) + array("I", block).tobytes() + extra, seed=self.seed
            )
            self.engine_hash[h] = h_prev
            names.append(h_prev)
            tokens.extend(block)
        extra_keys: Any = None
        if salt:  # vLLM puts the cache salt among the first block's extra hash keys
            extra_keys = [[salt], *([None] * (len(hashes) - 1))]
        return BlockStored(
            block_hashes=tuple(names),
            parent_block_hash=parent_engine,
            token_ids=tuple(tokens),
            block_size=self.block_size,
            medium="GPU",
            extra_keys=extra_keys,
        )

    def removed(self, hashes: Sequence[int]) -> BlockRemoved:
        """The event for blocks `hashes` evicted."""
        names = []
        for h in hashes:
            names.append(self.engine_hash.pop(h))
            if h not in self._refs:
                self._forget(h)
        return BlockRemoved(block_hashes=tuple(names), medium="GPU")

    def _forget(self, h: int) -> None:
        self.tokens.pop(h, None)
        self.salt.pop(h, None)
