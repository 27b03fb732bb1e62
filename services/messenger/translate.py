"""From an engine's KV events to the Conductor's: vLLM names blocks by its own hashes; the
Conductor indexes ours (chained XXH3 over token ids, `kvsched.core.hashing`), so each stored
block is re-hashed from the token ids the event carries, continuing the chain of its parent.

The translator remembers, per engine, which of our hashes each engine hash stands for, so
removals and later children can be mapped. A stored block whose parent it never saw cannot be
placed in our chain: it is skipped and counted, and the instance needs a resync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from kvsched.api.common.v1 import common_pb2 as common
from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.hashing import BlockHasher, salt_bytes
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EngineHash, Event

_TIERS = {"GPU": common.TIER_GPU, "CPU": common.TIER_CPU, "DISK": common.TIER_DISK}

SaltOf = Callable[[BlockStored], bytes]
_Blocks = TypeVar("_Blocks", pb.BlocksStored, pb.BlocksRemoved)
# Blocks one Conductor event may name: far below the Conductor's limit (its longest prompt in
# blocks, 8192 by default), small enough to keep every message modest.
MAX_BLOCKS = 512


def no_salt(event: BlockStored) -> bytes:
    """Tenant salt of a chain started by `event`: none (a single-tenant engine)."""
    return b""


def cache_salt(event: BlockStored) -> bytes:
    """Tenant salt of a chain started by `event`, as vLLM carries a request's `cache_salt`:
    in the extra keys of the chain's first block, `extra_keys = [(lora_name?, ..., salt),
    None, ...]`, the last string of the first block's tuple. A LoRA name, when the event
    names one, comes first in that tuple and is not a salt. Anything else (no extra keys,
    another shape): no salt. The Router hashes prompts with the same bytes (UTF-8)."""
    keys = event.extra_keys
    if not isinstance(keys, list | tuple) or not keys:
        return b""
    first = keys[0]
    if not isinstance(first, list | tuple):
        return b""
    strings = [k for k in first if isinstance(k, str)]
    if strings and event.lora_name is not None and strings[0] == event.lora_name:
        strings = strings[1:]
    return salt_bytes(strings[-1]) if strings else b""


@dataclass(slots=True)
class TranslateCounters:
    """What could not be translated."""

    unknown_parents: int = 0  # stored blocks continuing a block never seen
    short_tokens: int = 0  # stored events with fewer token ids than their blocks need
    unknown_removals: int = 0  # removed blocks never seen


class EventTranslator:
    """One engine's hash map; `translate` turns its events into Conductor events.

    An event naming more than `max_blocks` blocks is split (a stored chain into pieces that
    continue one another), so no event exceeds what the Conductor accepts in one."""

    def __init__(
        self, hasher: BlockHasher, salt_of: SaltOf = no_salt, *, max_blocks: int = MAX_BLOCKS
    ) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.hasher = hasher
        self.salt_of = salt_of
        self.max_blocks = max_blocks
        self.ours: dict[EngineHash, int] = {}
        self.counters = TranslateCounters()

    def translate(self, events: Iterable[Event]) -> list[pb.KvEvent]:
        """Conductor events for `events`; remembers the stored blocks' hashes (and forgets
        removed ones) so later events can be mapped."""
        out: list[pb.KvEvent] = []
        for event in events:
            if isinstance(event, BlockStored):
                stored = self._stored(event)
                if stored is not None:
                    out.extend(pb.KvEvent(blocks_stored=part) for part in self._split(stored))
            elif isinstance(event, BlockRemoved):
                removed = self._removed(event)
                if removed is not None:
                    out.extend(pb.KvEvent(blocks_removed=part) for part in self._split(removed))
            elif isinstance(event, AllBlocksCleared):
                self.ours.clear()
                out.append(pb.KvEvent(all_blocks_cleared=pb.AllBlocksCleared()))
        return out

    def _split(self, message: _Blocks) -> list[_Blocks]:
        hashes, n = message.block_hashes, self.max_blocks
        if len(hashes) <= n:
            return [message]
        parts: list[_Blocks] = []
        for start in range(0, len(hashes), n):
            part = type(message)()
            part.CopyFrom(message)
            del part.block_hashes[:]
            part.block_hashes.extend(hashes[start : start + n])
            if isinstance(part, pb.BlocksStored) and start:
                part.parent_block_hash = hashes[start - 1]
            parts.append(part)
        return parts

    def _stored(self, event: BlockStored) -> pb.BlocksStored | None:
        bs = event.block_size
        if bs != self.hasher.block_size or len(event.token_ids) < bs * len(event.block_hashes):
            self.counters.short_tokens += 1
            return None
        if event.parent_block_hash is None:
            parent_ours = None
            h = self.hasher.root(self.salt_of(event))
        else:
            found = self.ours.get(event.parent_block_hash)
            if found is None:
                self.counters.unknown_parents += 1
                return None
            parent_ours = h = found
        hashes: list[int] = []
        tokens = event.token_ids
        for i, engine_hash in enumerate(event.block_hashes):
            h = self.hasher.extend(h, tokens[i * bs : (i + 1) * bs])
            self.ours[engine_hash] = h
            hashes.append(h)
        stored = pb.BlocksStored(
            block_hashes=hashes,
            tier=_TIERS.get((event.medium or "GPU").upper(), common.TIER_GPU),
            session_id=event.session_id or "",
        )
        if parent_ours is not None:
            stored.parent_block_hash = parent_ours
        return stored

    def _removed(self, event: BlockRemoved) -> pb.BlocksRemoved | None:
        hashes = []
        for engine_hash in event.block_hashes:
            ours = self.ours.pop(engine_hash, None)
            if ours is None:
                self.counters.unknown_removals += 1
            else:
                hashes.append(ours)
        if not hashes:
            return None
        tier = _TIERS.get((event.medium or "GPU").upper(), common.TIER_GPU)
        return pb.BlocksRemoved(block_hashes=hashes, tier=tier)
