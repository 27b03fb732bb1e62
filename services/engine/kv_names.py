"""vLLM's names for our cached blocks, and the KV events that use them.

The engine's prefix cache is keyed by our chained hashes (what the Router computes), but vLLM
names blocks by its own hash, seeded per process, and a relay must never rely on the two
agreeing. So each stored block gets an engine hash = XXH3-64 over (its parent's engine hash,
its token ids, its extra keys) with this process's seed, and events carry those names plus
the token ids, as vLLM's do; the Messenger re-hashes the token ids into ours.

A block's token ids are known from the requests that name it: `hold` when a request joins,
`release` when it leaves. They are kept while the block is cached or some request in flight
names it, and dropped after that.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvsched.core.hashing import salt_bytes
from services.common.kv_events import BlockRemoved, BlockStored

_U64 = struct.Struct("<Q")
_UNCACHED = -1


@dataclass(slots=True, eq=False)
class _Block:
    """What the engine knows of one block (by our hash)."""

    tokens: tuple[int, ...]
    salt: str | None  # the cache salt, on the first block of a salted chain only
    session: str | None  # session of the first request that named it
    refs: int = 0  # requests in flight naming it
    name: int = _UNCACHED  # its engine hash while cached
    parent: int | None = None  # its parent's engine hash while cached (None: the root)


class EngineNames:
    """Engine hashes and token ids of the blocks this engine knows."""

    def __init__(self, block_size: int, seed: int) -> None:
        self.block_size = block_size
        self.seed = seed
        # The empty prefix's name (vLLM's NONE_HASH, random per process like the seed).
        self.root = xxhash.xxh3_64_intdigest(b"kvsched-engine-root", seed=seed)
        self.blocks: dict[int, _Block] = {}

    def hold(
        self,
        hashes: Sequence[int],
        token_ids: Sequence[int],
        salt: str | None,
        session: str | None = None,
    ) -> None:
        """A request naming `hashes` (its prompt's full blocks) joined the engine."""
        bs, blocks = self.block_size, self.blocks
        for i, h in enumerate(hashes):
            block = blocks.get(h)
            if block is None:
                tokens = tuple(token_ids[i * bs : (i + 1) * bs])
                block = blocks[h] = _Block(tokens, salt if i == 0 else None, session)
            block.refs += 1

    def release(self, hashes: Sequence[int]) -> None:
        """The request naming `hashes` left the engine."""
        blocks = self.blocks
        for h in hashes:
            block = blocks[h]
            block.refs -= 1
            if block.refs == 0 and block.name == _UNCACHED:
                del blocks[h]

    def stored(self, hashes: Sequence[int], parent: int | None) -> BlockStored:
        """The event for blocks `hashes` (a chain continuing `parent`, None: the root)
        entering the cache; names them."""
        blocks = self.blocks
        parent_name = blocks[parent].name if parent is not None else None
        prev = self.root if parent_name is None else parent_name
        first = blocks[hashes[0]]
        salt = first.salt if parent is None else None
        names: list[int] = []
        tokens: list[int] = []
        for i, h in enumerate(hashes):
            block = blocks[h]
            extra = salt_bytes(salt) if (salt and i == 0) else b""
            name = xxhash.xxh3_64_intdigest(
                _U64.pack(prev) + array("I", block.tokens).tobytes() + extra, seed=self.seed
            )
            block.parent = parent_name if i == 0 else prev
            block.name = prev = name
            names.append(name)
            tokens.extend(block.tokens)
        extra_keys: Any = None
        if salt:  # vLLM puts the cache salt among the first block's extra hash keys
            extra_keys = [[salt], *([None] * (len(hashes) - 1))]
        return BlockStored(
            block_hashes=tuple(names),
            parent_block_hash=parent_name,
            token_ids=tuple(tokens),
            block_size=self.block_size,
            medium="GPU",
            extra_keys=extra_keys,
            session_id=first.session,
        )

    def removed(self, hashes: Sequence[int]) -> BlockRemoved:
        """The event for blocks `hashes` evicted; forgets their names."""
        blocks = self.blocks
        names = []
        for h in hashes:
            block = blocks[h]
            names.append(block.name)
            block.name, block.parent = _UNCACHED, None
            if block.refs == 0:
                del blocks[h]
        return BlockRemoved(block_hashes=tuple(names), medium="GPU")

    def name(self, h: int) -> int:
        """The engine hash of cached block `h`."""
        return self.blocks[h].name

    def snapshot(self, cached: Iterable[int]) -> list[dict[str, Any]]:
        """The `cached` blocks (our hashes, parents first) in engine names, as JSON objects;
        `extra_keys` is the block's own extra keys (`[salt]` on a salted chain's first block)."""
        blocks = self.blocks
        out: list[dict[str, Any]] = []
        for h in cached:
            block = blocks[h]
            salt = block.salt if block.parent is None else None
            out.append(
                {
                    "block_hash": block.name,
                    "parent_block_hash": block.parent,
                    "token_ids": list(block.tokens),
                    "extra_keys": [salt] if salt else None,
                    "medium": "GPU",
                }
            )
        return out
