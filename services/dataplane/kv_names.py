"""The engine's cached blocks as vLLM's KV events name them.

Blocks are keyed by vLLM's own block hashes (`kvsched.core.vllm_hashing`, the low 64 bits of
each digest), exactly as a vLLM engine with the same `--prefix-caching-hash-algo` and
`PYTHONHASHSEED` names them; events carry those hashes, each stored chain's parent and its
token ids, and each block's extra keys (a LoRA adapter's name on every block of its
requests, then the cache salt on the first), as vLLM's do.

A block's token ids and full digest (a child's hash needs its parent's whole digest) are
known from the requests that name it: `hold` when a request joins, `release` when it leaves.
They are kept while the block is cached or some request in flight names it, and dropped after
that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvsched.core.vllm_hashing import AdapterKey
from services.kv_events.vllm_wire import BlockRemoved, BlockStored


@dataclass(slots=True, eq=False)
class _Block:
    """What the engine knows of one block (by its hash)."""

    tokens: tuple[int, ...]
    digest: bytes  # vLLM's full hash of the block (its prefix's fingerprint)
    salt: str | None  # the cache salt, on the first block of a salted chain only
    session: str | None  # session of the first request that named it
    adapter: AdapterKey | None = None  # the LoRA adapter its hash was computed for
    refs: int = 0  # requests in flight naming it
    cached: bool = False
    parent: int | None = None  # its parent's hash while cached (None: the root)


class EngineNames:
    """Token ids, digests and chain links of the blocks this engine knows."""

    def __init__(self, block_size: int, medium: str = "GPU") -> None:
        self.block_size = block_size
        self.medium = medium  # where the blocks are, as vLLM's events say it
        self.blocks: dict[int, _Block] = {}

    def hold(
        self,
        hashes: Sequence[int],
        digests: Sequence[bytes],
        token_ids: Sequence[int],
        salt: str | None,
        session: str | None = None,
        *,
        adapter: AdapterKey | None = None,
    ) -> None:
        """A request naming `hashes` (blocks of its prompt with these `digests` and tokens;
        `salt` applies to the first one, `adapter` to all) joined the engine."""
        bs, blocks = self.block_size, self.blocks
        for i, h in enumerate(hashes):
            block = blocks.get(h)
            if block is None:
                tokens = tuple(token_ids[i * bs : (i + 1) * bs])
                salted = salt if i == 0 else None
                block = blocks[h] = _Block(tokens, digests[i], salted, session, adapter)
            block.refs += 1

    def release(self, hashes: Sequence[int]) -> None:
        """The request naming `hashes` left the engine."""
        blocks = self.blocks
        for h in hashes:
            block = blocks[h]
            block.refs -= 1
            if block.refs == 0 and not block.cached:
                del blocks[h]

    def stored(self, hashes: Sequence[int], parent: int | None) -> BlockStored:
        """The event for blocks `hashes` (a chain continuing `parent`, None: the root)
        entering the cache."""
        blocks = self.blocks
        first = blocks[hashes[0]]
        salt = first.salt if parent is None else None
        tokens: list[int] = []
        prev = parent
        for h in hashes:
            block = blocks[h]
            block.cached, block.parent, prev = True, prev, h
            tokens.extend(block.tokens)
        adapter = first.adapter
        extra_keys: Any = None
        if salt or adapter:
            extra_keys = [
                _extra_keys(adapter, salt if i == 0 else None) for i in range(len(hashes))
            ]
        return BlockStored(
            block_hashes=tuple(hashes),
            parent_block_hash=parent,
            token_ids=tuple(tokens),
            block_size=self.block_size,
            medium=self.medium,
            lora_name=adapter[0] if adapter else None,
            extra_keys=extra_keys,
            session_id=first.session,
        )

    def removed(self, hashes: Sequence[int]) -> BlockRemoved:
        """The event for blocks `hashes` evicted; forgets them unless a request names them."""
        blocks = self.blocks
        for h in hashes:
            block = blocks[h]
            block.cached, block.parent = False, None
            if block.refs == 0:
                del blocks[h]
        return BlockRemoved(block_hashes=tuple(hashes), medium=self.medium)

    def digest(self, h: int) -> bytes:
        """The full digest of known block `h`."""
        return self.blocks[h].digest

    def snapshot(self, cached: Iterable[int]) -> list[dict[str, Any]]:
        """The `cached` blocks (parents first) as JSON objects;
        `extra_keys` is the block's own extra keys (`_extra_keys`)."""
        blocks = self.blocks
        out: list[dict[str, Any]] = []
        for h in cached:
            block = blocks[h]
            salt = block.salt if block.parent is None else None
            out.append(
                {
                    "block_hash": h,
                    "parent_block_hash": block.parent,
                    "token_ids": list(block.tokens),
                    "extra_keys": _extra_keys(block.adapter, salt),
                    "medium": self.medium,
                }
            )
        return out


def _extra_keys(adapter: AdapterKey | None, salt: str | None) -> list[str] | None:
    """A block's extra keys as vLLM's events publish them (untagged): the adapter's name,
    then the cache salt (the first block's); None for none."""
    keys = ([adapter[0]] if adapter else []) + ([salt] if salt else [])
    return keys or None
