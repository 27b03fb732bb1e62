"""Transfer orders handed out and not yet reported: each named once, kept until its outcome
arrives (or, bounded, until it is the oldest of too many)."""

from __future__ import annotations

import itertools
from dataclasses import replace

from kvsched.core.decision import TransferPlan
from kvsched.core.recent import Recent

OPEN_TRANSFERS = 65_536


class TransferBook:
    """Names transfer orders `<prefix>-<n>` and remembers them by name."""

    def __init__(self, prefix: str, capacity: int = OPEN_TRANSFERS) -> None:
        self.prefix = prefix  # unique across restarts where ids outlive a process
        self._ids = itertools.count(1)
        self._open: Recent[TransferPlan] = Recent(capacity)

    def open(self, plan: TransferPlan) -> TransferPlan:
        """`plan` with its id, remembered until `close`."""
        named = replace(plan, transfer_id=f"{self.prefix}-{next(self._ids)}")
        self._open.add(named.transfer_id, named)
        return named

    def close(self, transfer_id: str) -> TransferPlan | None:
        """The order named `transfer_id`, forgotten; None if unknown or already closed."""
        return self._open.pop(transfer_id)

    def forget_slot(self, slot: int) -> None:
        """Forget the orders from or to `slot` (an instance that left: they would name the
        slot's next holder)."""
        self._open.forget(lambda p: slot in (p.source, p.target))

    def __len__(self) -> int:
        return len(self._open)
