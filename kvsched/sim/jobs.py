"""The records a simulated engine exchanges with whoever drives it: the `Job` submitted for a
request's work (with its `JobKind`), and the `StepOutcome` a step hands back.

`Job` is a hot record (slots, identity equality): the engine fills its fields as the work
runs, once per step and job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class JobKind(Enum):
    """Which part of a request's work a job does on its engine."""

    FULL = "full"  # prefill then decode here
    PREFILL_ONLY = "prefill"  # prefill here, decode elsewhere (disaggregated)
    DECODE_ONLY = "decode"  # KV handed over from a prefill instance


@dataclass(slots=True, eq=False)
class Job:
    """A request's work on one engine. The engine fills the fields below `arrival`."""

    rid: int
    kind: JobKind
    prompt: int
    output: int
    hashes: tuple[int, ...]
    arrival: float
    ready_at: float = 0.0  # admissible from here (first layer of incoming KV arrived)
    kv_done_at: float = 0.0  # last layer of incoming KV arrives
    held: int = 0  # leading prompt blocks this job holds locked in the cache
    fetched: int = 0  # blocks after `held` arriving by transfer into reserved pages
    private: int = 0  # pages reserved for this job and not holding a cached block
    cached_tokens: int = 0  # prompt tokens not computed here (local hit + fetched)
    local_hit_tokens: int = 0
    tier_hit_tokens: int = 0  # prompt tokens loaded from the node's DRAM/SSD tier
    computed: int = 0  # prompt tokens done (cached ones included)
    generated: int = 0
    admitted_at: float = -1.0
    first_token_at: float = -1.0
    finished_at: float = -1.0
    finish_tick: int = 0  # decode tick at which the last token is out
    est_prefill_s: float = 0.0  # this job's share of the engine's pending-prefill estimate

    @property
    def context(self) -> int:
        """Tokens in the job's KV now: its prompt and what it generated."""
        return self.prompt + self.generated


@dataclass(slots=True)
class StepOutcome:
    """What one step (or macro-step) produced."""

    first_tokens: list[Job] = field(default_factory=list)
    finished: list[Job] = field(default_factory=list)  # includes prefill-only jobs handed off
