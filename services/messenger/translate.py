"""From an engine's KV events to the Conductor's.

Engines, Routers and the Conductor name a block alike: by vLLM's own block hash
(`kvsched.core.vllm_hashing`), which the Conductor indexes as its low 64 bits. So an event is
converted on its own, with nothing remembered from earlier ones: a Messenger that restarts, or
an event that is lost, costs that event's blocks and nothing else. What the Routers hash must
match what the engines hash (same algorithm, seed and block size); a stored event of another
block size is skipped and counted, and the first block of every chain that starts at the root
is hashed again from its tokens: a hash that differs (an engine with another algorithm or
`PYTHONHASHSEED`, whose blocks no Router would ever find) is counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvsched.api.conductor.v1 import conductor_service_pb2 as pb
from kvsched.core.events import AllBlocksCleared, BlocksRemoved, BlocksStored, KvEvent, split
from kvsched.core.index import Tier
from kvsched.core.vllm_hashing import VllmBlockHasher, event_hash
from services.kv_events import vllm_wire as vllm
from services.kv_events.messages import event_message

_TIERS = {"GPU": Tier.GPU, "CPU": Tier.CPU, "DISK": Tier.DISK}
# Blocks one Conductor event may name: far below the Conductor's limit (its longest prompt in
# blocks, 8192 by default), small enough to keep every message modest.
MAX_BLOCKS = 512


@dataclass(slots=True)
class TranslateCounters:
    """What could not be translated."""

    wrong_block_size: int = 0  # stored events of another block size than the engine's
    foreign_hashes: int = 0  # chains whose first block the cluster would hash otherwise


class EventTranslator:
    """Turns one engine's vLLM events into the core's, as Conductor messages.

    An event naming more than `max_blocks` blocks is split (a stored chain into pieces that
    continue one another), so no event exceeds what the Conductor accepts in one."""

    def __init__(
        self,
        block_size: int,
        hasher: VllmBlockHasher | None = None,
        *,
        max_blocks: int = MAX_BLOCKS,
    ) -> None:
        """`hasher`: the cluster's, to check chains that start at the root against."""
        if max_blocks < 1:
            raise ValueError("max_blocks must be at least 1")
        self.block_size = block_size
        self.hasher = hasher
        self.max_blocks = max_blocks
        self.counters = TranslateCounters()

    def translate(self, events: Iterable[vllm.Event]) -> list[pb.KvEvent]:
        """Conductor events for `events`, in order."""
        ours: list[KvEvent] = []
        for event in events:
            if isinstance(event, vllm.BlockStored):
                if event.block_size != self.block_size:
                    self.counters.wrong_block_size += 1
                    continue
                if event.parent_block_hash is None and not self._named_as_ours(event):
                    self.counters.foreign_hashes += 1
                parent = event.parent_block_hash
                ours.append(
                    BlocksStored(
                        tuple(event_hash(h) for h in event.block_hashes),
                        None if parent is None else event_hash(parent),
                        _tier(event.medium),
                    )
                )
            elif isinstance(event, vllm.BlockRemoved):
                hashes = tuple(event_hash(h) for h in event.block_hashes)
                ours.append(BlocksRemoved(hashes, _tier(event.medium)))
            elif isinstance(event, vllm.AllBlocksCleared):
                ours.append(AllBlocksCleared())
        return [event_message(e) for e in split(ours, self.max_blocks)]

    def _named_as_ours(self, event: vllm.BlockStored) -> bool:
        """Whether the first block of a chain from the root has the hash we would give it."""
        if self.hasher is None or not event.block_hashes or event.lora_name:
            return True  # (an adapter's blocks hash its path too, which events do not say)
        first = event.extra_keys[0] if isinstance(event.extra_keys, list | tuple) else None
        salt = first[-1] if isinstance(first, list | tuple) and first else None
        tokens = event.token_ids[: self.block_size]
        ours = self.hasher.hash_prompt(tokens, salt if isinstance(salt, str) else None)
        return ours == [event_hash(event.block_hashes[0])]


def _tier(medium: str | None) -> Tier:
    return _TIERS.get((medium or "GPU").upper(), Tier.GPU)
