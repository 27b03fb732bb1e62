"""This node's engines as ends of KV transfers (`LocalKv`), and the refusal of a transfer
call (`TransferRefused`). An engine's end is its node's KV pool (`kv_pool`), which the engine
saves computed blocks to and loads missing blocks from (kvsched's KV connector in vLLM, the
pool link of a simulated engine), so a transfer moves pool to pool. The pool's memory is
mapped into the Messenger and registered with the transfer backend once (not per transfer); a
pool that moved to a new file (replaced while empty) is unregistered and the new one mapped
and registered, the first time a transfer needs it.

The engines are the Messenger's relays, asked as `PoolUser`s: whether one is the instance, has
answered, and uses the pool (which changes as the pool attaches and the engine answers).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import grpc

from kvsched.api.messenger.v1 import messenger_service_pb2 as pb
from services.dataplane.errors import DataPlaneError
from services.dataplane.kv_memory import KvMemory
from services.dataplane.kv_pool import NodePool
from services.dataplane.transfer.backend import Backend
from services.dataplane.transfer.region import KvRegion

log = logging.getLogger(__name__)
_BACKENDS = {"mooncake": pb.TRANSFER_BACKEND_MOONCAKE, "tcp": pb.TRANSFER_BACKEND_TCP}


class PoolUser(Protocol):
    """An engine of this node as the transfers see it (the Messenger's `EngineRelay`)."""

    @property
    def instance_id(self) -> str | None:
        """The instance it is (None until it answered)."""
        ...

    @property
    def info(self) -> object | None:
        """What it said of itself (None until it answered)."""
        ...

    @property
    def uses_pool(self) -> bool:
        """Whether the node's KV pool holds blocks for it (it saves to and loads from it)."""
        ...


class TransferRefused(DataPlaneError):
    """A transfer call this Messenger refuses, with the gRPC status that says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class LocalKv:
    """The node's KV pool as the end of every transfer to or from the engines this Messenger
    relays."""

    def __init__(
        self,
        relays: Callable[[], Sequence[PoolUser]],
        backend: Backend,
        pool: NodePool | None = None,
    ) -> None:
        self._relays = relays
        self.backend = backend
        self.pool = pool
        self._region: KvRegion | None = None  # the pool's memory, mapped and registered

    @property
    def backend_value(self) -> pb.TransferBackend.ValueType:
        """The backend as the API names it."""
        return _BACKENDS[self.backend.name]

    def require_backend(self, wanted: pb.TransferBackend.ValueType) -> None:
        """Raises `TransferRefused` FAILED_PRECONDITION unless `wanted` (a `TransferBackend`;
        unspecified: any) is the one this Messenger moves KV with."""
        if wanted and wanted != self.backend_value:
            named = wanted in pb.TransferBackend.values()
            raise TransferRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this Messenger moves KV with {self.backend.name}, not "
                f"{pb.TransferBackend.Name(wanted) if named else wanted}",
            )

    def engine(self, instance_id: str) -> tuple[NodePool, KvRegion]:
        """The end that holds `instance_id`'s movable KV (the node's pool) and its memory,
        mapped and registered. Raises `TransferRefused`: NOT_FOUND when no engine of this
        node is that instance, FAILED_PRECONDITION when it uses no pool (or the pool's file
        cannot be mapped)."""
        relay = next((r for r in self._relays() if r.instance_id == instance_id), None)
        if relay is None or relay.info is None:
            raise TransferRefused(
                grpc.StatusCode.NOT_FOUND,
                f"instance {instance_id!r} is not an engine of this node that answered",
            )
        if not relay.uses_pool:
            raise TransferRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"instance {instance_id!r} keeps no KV a Messenger can move: its node needs a "
                "KV pool (--kv-pool-bytes) that the engine saves to and loads from (kvsched's "
                "KV connector in vLLM, --kv-pool-socket for a simulated engine)",
            )
        # The pool's blocks are the node's: they outlive an engine that stopped answering.
        assert self.pool is not None and self.pool.format is not None  # attached
        return self.pool, self._mapped(self.pool.memory, self.pool.format.kind)

    def _mapped(self, memory: KvMemory, block_format: str) -> KvRegion:
        """The pool's memory mapped and registered (again, if the pool moved to a new file)."""
        region = self._region
        if region is not None and (
            region.path != memory.path
            or region.layout != memory.layout
            or region.block_format != block_format
        ):
            self._drop()  # the pool was replaced (it held nothing)
            region = None
        if region is None:
            try:
                region = KvRegion(memory.path, memory.layout, block_format)
            except (OSError, ValueError) as exc:
                raise TransferRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"cannot map the node's KV pool: {exc}",
                ) from None
            self.backend.register(region)
            self._region = region
            log.info("registered the node's KV pool (%d bytes)", region.size)
        return region

    def _drop(self) -> None:
        region, self._region = self._region, None
        if region is None:
            return
        self.backend.unregister(region)
        try:
            region.close()
        except BufferError:  # a transfer still holds a view: the mapping goes when it ends
            log.warning("the old KV pool's memory is still in use")

    def close(self) -> None:
        """Unregister and unmap the pool's memory (the backend is stopped first)."""
        self._drop()
