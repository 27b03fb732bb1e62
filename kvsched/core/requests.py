"""What the scheduler refuses before anything changes: requests, completions and KV events
outside the limits of the cluster (a refused call leaves every state as it was)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvsched.core.decision import RequestInfo
from kvsched.core.events import BlocksRemoved, BlocksStored, KvEvent

RefusalKind = Literal["invalid", "not_found", "out_of_range", "unavailable"]


class RequestError(Exception):
    """A call the scheduler refuses; `kind` says why (a service maps it to its status code)."""

    def __init__(self, kind: RefusalKind, message: str, next_sequence: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.next_sequence = next_sequence  # out_of_range: where a batch of events must resume


@dataclass(frozen=True, slots=True)
class Limits:
    """The longest prompt the cluster takes, and the block size its hashes are cut at."""

    max_prompt_tokens: int
    block_size: int

    @property
    def max_blocks(self) -> int:
        """Blocks of the longest prompt: the most one event or one completion may name."""
        return -(-self.max_prompt_tokens // self.block_size)

    def check_request(self, req: RequestInfo) -> None:
        """Raise RequestError unless `req` is a placement the cluster can take."""
        prompt, bs, n = req.prompt_tokens, self.block_size, len(req.block_hashes)
        if prompt <= 0:
            raise RequestError("invalid", "prompt_tokens must be positive")
        if prompt > self.max_prompt_tokens:
            raise RequestError(
                "invalid",
                f"prompt of {prompt} tokens exceeds the limit of {self.max_prompt_tokens}",
            )
        if not n and prompt >= bs:
            raise RequestError(
                "invalid",
                f"block_hashes is empty but a {prompt}-token prompt has full {bs}-token blocks",
            )
        if n > -(-prompt // bs):
            raise RequestError(
                "invalid",
                f"{n} block hashes for a {prompt}-token prompt (block size {bs}): "
                f"at most {-(-prompt // bs)}",
            )

    def check_hashes(self, hashes: Sequence[int]) -> None:
        if len(hashes) > self.max_blocks:
            raise RequestError("invalid", f"{len(hashes)} block hashes; at most {self.max_blocks}")

    def check_events(self, events: Sequence[KvEvent]) -> None:
        """Raise RequestError if any event names more blocks than the longest prompt has."""
        for event in events:
            if isinstance(event, BlocksStored | BlocksRemoved) and (
                len(event.hashes) > self.max_blocks
            ):
                raise RequestError(
                    "invalid",
                    f"an event lists {len(event.hashes)} blocks; at most {self.max_blocks}",
                )
