"""How gRPC failures of etcd calls become `StoreError`s: their messages name the endpoint, the
operation and what gRPC reported, never the password."""

from __future__ import annotations

import asyncio
from typing import Final

import grpc
import grpc.aio

from services.common.store.etcd.client import EtcdClient
from services.common.store.interface import (
    LeaseNotFound,
    StoreCompacted,
    StoreError,
    StoreUnavailable,
)

UNAVAILABLE_CODES: Final = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def task_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def interrupted(client: EtcdClient, what: str) -> StoreUnavailable | None:
    """What to raise for a CancelledError out of a gRPC call: gRPC raises it both when our
    task is cancelled (None: re-raise that) and when the store closed the call's channel."""
    if task_cancelled() or not client.close_reason:
        return None
    return StoreUnavailable(
        f"{client.endpoint}: {what} interrupted: the connection was closed because "
        f"{client.close_reason}; try again"
    )


def _details(e: grpc.aio.AioRpcError) -> str:
    return (e.details() or "").strip() or e.code().name


def etcd_timed_out(e: grpc.aio.AioRpcError) -> bool:
    """etcd answered, but gave up waiting for the request to apply (or was overloaded)."""
    details = e.details() or ""
    return details.startswith(("etcdserver: request timed out", "etcdserver: too many requests"))


def unavailable(
    endpoint: str, what: str, e: grpc.aio.AioRpcError, username: str | None
) -> StoreError:
    code = e.code()
    if code in (
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    ) or "authentication failed" in _details(e):
        user = f"user {username!r}" if username else "no credentials"
        return StoreUnavailable(
            f"{endpoint}: {what} rejected ({user}): {_details(e)}; check "
            "KVSCHED_ETCD_USERNAME/KVSCHED_ETCD_PASSWORD"
        )
    if etcd_timed_out(e):
        return StoreUnavailable(
            f"{endpoint}: {what} timed out inside etcd ({_details(e)}); it may still be "
            "applied. Large deletes (a prefix or a lease with very many keys) can take longer "
            "than etcd's request timeout"
        )
    if code in UNAVAILABLE_CODES:
        return StoreUnavailable(
            f"{endpoint}: {what} failed, etcd unreachable ({code.name}: {_details(e)}); is etcd "
            "running there and are KVSCHED_ETCD_ENDPOINTS and the TLS files right?"
        )
    return store_error(endpoint, what, e)


def store_error(endpoint: str, what: str, e: grpc.aio.AioRpcError) -> StoreError:
    details = _details(e)
    code = e.code()
    if code == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
        return LeaseNotFound(f"etcd at {endpoint}: {what}: {details}")
    if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
        return StoreCompacted(f"etcd at {endpoint}: {what}: {details}", 0)
    return StoreError(f"etcd at {endpoint}: {what} failed ({code.name}: {details})")
