"""Where a turn runs once the transfers of its decision have ended: one rule for the live
Router and the simulator.

A decision places the prompt on its instance and, disaggregated, the decode on another one
the prompt's KV is handed off to. What its transfers did can change that:

    the decision's transfers                      prefill on   decode on    why
    a hand-off that landed                        instance     its target   -
    a hand-off that failed                        instance     instance     hand-off failed
    a critical-path session migration that failed its source   its source   migration failed
    anything else (a failed fetch: a recompute)   instance     instance     -

A failed migration leaves the session on its source, which still holds its KV, where the
target would recompute it all; a failed hand-off leaves the prompt's KV on the prefill
instance, which then decodes too. A hand-off decides before a migration (no policy orders
both for one turn). Instances are named however the caller names them: the simulator's
slots, the Router's instance ids.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from kvsched.core.decision import TransferKind

Instance = TypeVar("Instance")

# Appended to the decision's rule when a failed transfer changed where the turn runs.
MIGRATION_FAILED: Final = " (migration failed: stays on its source)"
HANDOFF_FAILED: Final = " (hand-off failed: decoded here)"


@dataclass(frozen=True, slots=True)
class TransferOutcome(Generic[Instance]):
    """How one of a decision's transfers ended, as far as its turn is concerned."""

    kind: TransferKind
    source: Instance
    target: Instance
    on_critical_path: bool
    landed: bool  # arrived whole; False: failed, cancelled, timed out or never started


@dataclass(frozen=True, slots=True)
class TurnHost(Generic[Instance]):
    """Where a turn runs, and why when that is not where its decision put it."""

    prefill: Instance  # computes the prompt (and runs the whole turn unless handed off)
    decode: Instance  # generates the answer: `prefill` unless a hand-off landed
    why: str = ""  # for the decision's rule; "" when no failure moved the turn

    @property
    def handed_off(self) -> bool:
        return self.prefill != self.decode


def turn_host(
    instance: Instance,
    outcomes: Iterable[TransferOutcome[Instance]],
    *,
    up: Container[Instance] | None = None,
) -> TurnHost[Instance]:
    """Where a turn placed on `instance` runs given its transfers' `outcomes` (see the module
    docstring). `up` holds the instances a turn can still be sent to (None: every one); a
    failed migration whose source is not among them leaves the turn where it was placed."""
    outcomes = tuple(outcomes)
    for moved in outcomes:
        if moved.kind is TransferKind.HANDOFF:
            if moved.landed:
                return TurnHost(instance, moved.target)
            return TurnHost(instance, instance, HANDOFF_FAILED)
    for moved in outcomes:
        if (
            moved.kind is TransferKind.MIGRATE_SESSION
            and moved.on_critical_path
            and not moved.landed
            and (up is None or moved.source in up)
        ):
            return TurnHost(moved.source, moved.source, MIGRATION_FAILED)
    return TurnHost(instance, instance)
