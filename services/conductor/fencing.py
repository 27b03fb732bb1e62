"""The leader's writes to etcd, each guarded by its term: a transaction applies only while the
leader key is bound to the lease this Conductor was elected with, so a leader that lost its
term (its lease lapsed, a standby took a dead-looking leader's key) writes nothing more, and
learns it from the refusal."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.common.store.interface import CommitResult, Fenced, Guard, Op, Store


class TermWriter:
    """Commits ops under the current term's guard. `guard()` is None when this Conductor
    does not lead; `on_fenced()` is told when etcd refused a guarded write."""

    def __init__(
        self, store: Store, guard: Callable[[], Guard | None], on_fenced: Callable[[], None]
    ) -> None:
        self.store = store
        self.guard = guard
        self.on_fenced = on_fenced
        self.fenced = 0  # writes refused because the term was over

    @property
    def leading(self) -> bool:
        return self.guard() is not None

    async def commit(self, ops: Sequence[Op]) -> CommitResult:
        """Apply `ops` (as `Store.commit`) only while this term leads. Raises `Fenced` when it
        does not, or no longer does (nothing of the refused transaction applied; transactions
        before it did), `StoreError` when etcd fails."""
        guard = self.guard()
        if guard is None:
            self.fenced += 1
            raise Fenced("this Conductor does not lead: it writes nothing")
        try:
            return await self.store.commit(ops, guard)
        except Fenced:
            self.fenced += 1
            self.on_fenced()
            raise
