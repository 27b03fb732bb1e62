"""Values that cross the policy boundary: requests in, decisions and transfer plans out, and
the two ways a policy builds its decision (`placement`, `rejection`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsched.core.adapters import NO_CHANGE, AdapterChange

RequestId = int | str


class TransferKind(Enum):
    """Why KV cache moves between instances."""

    FETCH_PREFIX = "fetch_prefix"  # pull a longer prefix to the chosen instance (on the path)
    MIGRATE_SESSION = "migrate_session"  # move a session's context to a new host
    REPLICATE_PREFIX = "replicate_prefix"  # copy a hot shared prefix to another instance
    HANDOFF = "handoff"  # prefill instance → decode instance (disaggregated serving)
    # Load a session's context from its host's node pool (DRAM) into the host's GPU before
    # its next turn (`kvsched.core.prefetch`); source and target are the host. Executed by
    # the simulator only: the Scheduler hands it out only to executors that say they run it.
    PREFETCH = "prefetch"
    # Keep a session's context in its host's GPU memory, evicted by nothing, for
    # `est_seconds` after its turn ended in a tool call (Continuum's time-to-live pin); source
    # and target are the host. Simulator only, as PREFETCH: stock vLLM cannot pin blocks.
    RETAIN = "retain"


# Plans only an engine that can be told to (the simulator's) carries out.
ENGINE_ORDERS = frozenset({TransferKind.PREFETCH, TransferKind.RETAIN})


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a router knows about a request when it asks for a placement."""

    request_id: RequestId
    prompt_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]  # our chained hashes of the prompt's full blocks
    session_id: str | None = None
    # Policy seconds the request already waited before this placement (at the router):
    # SLO admission counts them against the TTFT objective.
    waited_s: float = 0.0
    # The served model it asks for: only instances serving it are candidates, and only their
    # KV counts (two models' blocks of the same tokens hash alike). "": any instance.
    model: str = ""
    # The LoRA adapter of `model` it runs with ("": none): only instances that hold it or
    # can load it are candidates, its load is priced on the others (`adapter_bytes` of
    # weights over the host link), and its blocks hash apart from the base model's.
    adapter: str = ""
    adapter_bytes: int = 0


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """An order to move the KV of `block_hashes[skip_blocks:]` from `source` to `target`.

    `block_hashes` is the whole chain from the root so the target can place the blocks; the
    target already holds the first `skip_blocks`."""

    kind: TransferKind
    source: int
    target: int
    block_hashes: tuple[int, ...]
    skip_blocks: int
    tokens: int
    nbytes: int
    est_seconds: float
    on_critical_path: bool
    session_id: str | None = None
    request_id: RequestId | None = None
    transfer_id: str = ""  # set by the scheduler when it hands the order out
    # Start no earlier than this (policy seconds; 0: at once). Only PREFETCH plans set it.
    not_before: float = 0.0

    @property
    def n_blocks(self) -> int:
        return len(self.block_hashes) - self.skip_blocks


@dataclass(frozen=True, slots=True)
class Decision:
    """A placement (or a rejection) with the terms that produced it.

    `terms` maps a term name to one value per instance slot and `candidates` says which slots
    were eligible, so any decision can be explained after the fact without the hot path
    building per-candidate objects."""

    request_id: RequestId
    instance: int  # prefill (or only) instance; -1 when rejected
    decode_instance: int
    cached_tokens: int  # prompt tokens expected to hit locally (block-quantised, ≤ prompt − 1)
    fetched_tokens: int  # prompt tokens expected to arrive by transfer before prefill
    estimated_ttft_s: float
    rule: str
    transfers: tuple[TransferPlan, ...] = ()
    terms: Mapping[str, npt.NDArray[np.float64]] = field(default_factory=dict)
    candidates: npt.NDArray[np.bool_] | None = None
    rejected: bool = False
    retry_after_s: float = 0.0
    # The placement rebound its session and the policy follows bindings: a Conductor makes
    # the binding durable before it answers.
    rebound: bool = False
    # A parallel call of a session placed off its host: the session stays bound where it was.
    keeps_binding: bool = False
    # What the instance (and the decode instance) does before it serves an adapter request.
    adapter_change: AdapterChange = NO_CHANGE
    decode_adapter_change: AdapterChange = NO_CHANGE

    def explain(self) -> list[dict[str, Any]]:
        """All candidates with their named terms, best estimated TTFT first."""
        if not self.terms:
            return []
        n = len(next(iter(self.terms.values())))
        rows = []
        for slot in range(n):
            if self.candidates is not None and not self.candidates[slot]:
                continue
            row: dict[str, Any] = {"instance": slot}
            row.update({name: float(values[slot]) for name, values in self.terms.items()})
            row["chosen"] = slot == self.instance
            rows.append(row)
        key = "ttft_s" if "ttft_s" in self.terms else next(iter(self.terms))
        return sorted(rows, key=lambda r: (r[key] != r[key], r[key], r["instance"]))  # NaN last


@dataclass(frozen=True, slots=True)
class Completion:
    """What the router reports when a request ends."""

    request_id: RequestId
    session_id: str | None
    instance: int
    decode_instance: int
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    block_hashes: tuple[int, ...]
    arrival: float
    first_token_at: float
    finished_at: float
    ok: bool = True
    # The turn ended asking for a tool: its session comes back once the tool ran (the trace
    # says so; a Router does not report it yet).
    tool_call: bool = False
