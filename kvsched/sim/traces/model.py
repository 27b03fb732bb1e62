"""What every trace reader produces: calls with block ids, sessions and dependencies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class TraceCall:
    """One LLM call of a trace, in trace order.

    `block_ids` are the trace's prefix-block ids of the prompt's *full* blocks (`Trace.block_tokens`
    tokens each): equal ids at equal positions mean equal prefixes up to that block.

    Closed loop: a call whose `after` is -1 fires `start_offset_s` after its group starts; any
    other call fires `gap_s` after call `after` finishes (its think/tool time)."""

    index: int
    session: str  # affinity key ("" when the trace has no sessions)
    group: str  # unit whose start a closed-loop replay draws (a whole agentic trace)
    timestamp_s: float  # open-loop arrival, seconds from the trace start
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    turn: int = 1
    after: int = -1
    gap_s: float = 0.0
    start_offset_s: float = 0.0
    recorded_service_s: float = 0.0  # service time the trace recorded (0 when unknown)
    tool_call: bool = False  # the call ended asking for a tool (the agent runs it, then returns)


@dataclass(frozen=True)
class Trace:
    """A whole trace after reading (and any scaling, recorded in `notes`)."""

    name: str
    format: str  # mooncake | weka | azure
    block_tokens: int
    calls: tuple[TraceCall, ...]
    closed_loop: bool  # calls carry dependencies (after / gap_s)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def span_s(self) -> float:
        """Open-loop span: last timestamp minus first."""
        if not self.calls:
            return 0.0
        return self.calls[-1].timestamp_s - self.calls[0].timestamp_s
