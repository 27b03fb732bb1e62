"""One request's record in the live engine: its job, how many of its tokens are out, and the
wait a handler makes for more."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kvsched.core.vllm_hashing import AdapterKey
from kvsched.sim.jobs import Job
from services.common.inference_api.openai_api import unavailable


@dataclass(slots=True, eq=False)
class Request:
    """One request in the engine. The loop raises `generated` as steps produce tokens and
    sets `done` when the last one is out (or the request was aborted or the engine stopped,
    then with `error` set for the latter)."""

    job: Job
    prompt_ids: Sequence[int]
    salt: str | None = None
    adapter: AdapterKey | None = None  # the LoRA adapter it runs with
    loaded_tokens: int = 0  # loaded from the node's pool just before it was queued
    generated: int = 0
    done: bool = False
    # Its prompt's blocks are queued for the node's pool, or being saved there. vLLM's
    # connector copies a step's blocks within the step, so a request it has ended has its KV
    # in the pool (committed, or landing: an export waits for those); here the save runs off
    # the step loop, so the last token waits for it (a session's KV moved right after its
    # turn ends is read from the pool, and would be cut at the blocks saved so far).
    saving: bool = False
    error: str | None = None
    _waiter: asyncio.Future[None] | None = None

    @property
    def visible(self) -> int:
        """The tokens a client may have: all generated, but the last while `saving`."""
        if self.saving and self.generated >= self.job.output:
            return max(self.job.output - 1, 0)
        return self.generated

    async def wait(self, seen: int) -> int:
        """Wait until more than `seen` tokens are visible or the request ended; returns how
        many are. Raises `ApiError` 503 when the engine stopped before the request finished."""
        while self.error is None and self.visible <= seen and not (self.done and not self.saving):
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            await waiter
        if self.error is not None:
            raise unavailable(self.error)
        return self.visible

    def notify(self) -> None:
        """Wake the handler in `wait`, if one waits: the loop changed what it may see."""
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
