"""The KV data plane's errors: `DataPlaneError`, the base of every error the wing raises for
a pool call or a transfer it refuses or cannot complete, and the node KV pool's own.

The other errors of the wing live beside what raises them, each a `DataPlaneError`:
`kv_transfer.TransferError` (an export or import the bookkeeping refuses),
`transfer.errors.TransferError` (bytes a backend could not move), `local_kv.TransferRefused`
(a transfer call refused, with its gRPC status) and `transfer_progress.TransferFailed` (a
transfer that failed). Standard library only: anything of the wing may import it."""

from __future__ import annotations


class DataPlaneError(Exception):
    """A KV data plane call or transfer that was refused or could not be completed."""


class PoolError(DataPlaneError):
    """The node's KV pool did not do what it was asked: no engine has attached to it yet, or
    the export or import was refused (the message says why)."""


class PoolFull(PoolError):
    """The pool cannot stage pages for an import now (every page holds a pinned block)."""


class PoolRefused(DataPlaneError):
    """An engine the pool cannot serve (another block format, no room for one block)."""
