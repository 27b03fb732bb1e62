"""How a batch of ops becomes etcd transactions: key ranges of prefixes, the plan that cuts
the batch where etcd would refuse a transaction, and the commit loop that drops puts bound to
leases that no longer exist. Pure but for the transaction it is given to run, so the
in-memory store commits exactly as `EtcdStore` does."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

from services.common.store.interface import (
    CommitResult,
    Delete,
    DeletePrefix,
    LeaseNotFound,
    Op,
    Put,
)

log = logging.getLogger(__name__)

MAX_TXN_OPS = 128
"""etcd's default `--max-txn-ops`: more operations in one transaction are rejected."""
MAX_TXN_BYTES = 1 << 20
"""Soft cap on one transaction's payload; etcd's default `--max-request-bytes` is 1.5 MiB."""


def prefix_range_end(prefix: bytes) -> bytes:
    """The exclusive end of the key range holding every key that starts with `prefix`
    (`b"\\0"`, meaning "to the end of the keyspace", for b"" or an all-0xff prefix)."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def range_start(prefix: bytes) -> bytes:
    return prefix or b"\0"


def check_prefix(prefix: bytes) -> None:
    """Refuse the empty prefix: deleting it would wipe the whole keyspace."""
    if not prefix:
        raise ValueError("refusing to delete the empty prefix (the whole keyspace)")


def _op_size(op: Op) -> int:
    if isinstance(op, Put):
        return len(op.key) + len(op.value) + 24
    if isinstance(op, Delete):
        return len(op.key) + 8
    return 2 * len(op.prefix) + 8


def plan_transactions(
    ops: Iterable[Op], max_ops: int = MAX_TXN_OPS, max_bytes: int = MAX_TXN_BYTES
) -> list[list[Op]]:
    """Split `ops`, in order, into transactions etcd accepts: at most `max_ops` ops and about
    `max_bytes` bytes each, never putting one key twice nor putting a key the same
    transaction deletes (etcd rejects both as "duplicate key given in txn request")."""
    txns: list[list[Op]] = []
    current: list[Op] = []
    size = 0
    puts: set[bytes] = set()
    deleted_keys: set[bytes] = set()
    deleted_prefixes: list[bytes] = []

    def conflicts(op: Op) -> bool:
        if isinstance(op, Put):
            return (
                op.key in puts
                or op.key in deleted_keys
                or any(op.key.startswith(p) for p in deleted_prefixes)
            )
        if isinstance(op, Delete):
            return op.key in puts
        return any(k.startswith(op.prefix) for k in puts)

    for op in ops:
        if isinstance(op, DeletePrefix):
            check_prefix(op.prefix)
        op_size = _op_size(op)
        if current and (len(current) >= max_ops or size + op_size > max_bytes or conflicts(op)):
            txns.append(current)
            current, size = [], 0
            puts, deleted_keys, deleted_prefixes = set(), set(), []
        current.append(op)
        size += op_size
        if isinstance(op, Put):
            puts.add(op.key)
        elif isinstance(op, Delete):
            deleted_keys.add(op.key)
        else:
            deleted_prefixes.append(op.prefix)
    if current:
        txns.append(current)
    return txns


async def commit_planned(
    ops: Sequence[Op],
    txn: Callable[[Sequence[Op]], Awaitable[int]],
    lease_ttl: Callable[[int], Awaitable[int]],
) -> CommitResult:
    """Apply `ops` in order through `txn` (one transaction, returning the store revision
    after it; a guarded one raises `Fenced`, and so ends the commit, when its guard no longer
    holds) in the transactions `plan_transactions` cuts. A transaction refused with
    `LeaseNotFound` is tried again without the puts bound to leases `lease_ttl` no longer
    finds (all of the transaction's leases when it finds them all); they are counted."""
    revision = transactions = dropped = 0
    for planned in plan_transactions(ops):
        pending = planned
        while pending:
            try:
                revision = await txn(pending)
                transactions += 1
                break
            except LeaseNotFound:
                leases = {op.lease for op in pending if isinstance(op, Put) and op.lease}
                gone = {lid for lid in leases if await lease_ttl(lid) < 0} or leases
                if not gone:
                    raise
                kept = [op for op in pending if not (isinstance(op, Put) and op.lease in gone)]
                log.warning(
                    "etcd commit: dropped %d put(s) bound to missing lease(s) %s",
                    len(pending) - len(kept),
                    ", ".join(f"{lid:x}" for lid in sorted(gone)),
                )
                dropped += len(pending) - len(kept)
                pending = kept
    return CommitResult(revision, transactions, dropped)
