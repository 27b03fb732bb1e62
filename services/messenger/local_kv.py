"""This node's engines as ends of KV transfers, each with the KV memory a transfer reads or
writes, mapped into the Messenger and registered with the transfer backend once (not per
transfer):

- an engine that uses the node's KV pool (`kv_pool`; a vLLM engine through kvsched's KV
  connector, a simulated engine through its pool link): the pool, which the engine saves
  computed blocks to and loads missing blocks from; a transfer to or from it moves pool to
  pool;
- a simulated engine without a pool: its own KV memory, exported and imported through its
  HTTP API.

An engine that restarted keeps its KV in a new file: the old mapping is unregistered and
closed, and the new one mapped and registered, the first time a transfer needs it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import grpc

from kvsched.api.messenger.v1 import messenger_service_pb2 as pb
from services.common.kv_layout import SIM_FORMAT
from services.messenger.engine_api import Exported, ImportSlots, KvMemory
from services.messenger.kv_pool import KvPool
from services.messenger.transfer.backend import Backend
from services.messenger.transfer.region import KvRegion

if TYPE_CHECKING:
    from services.messenger.relay import EngineRelay

log = logging.getLogger(__name__)
_BACKENDS = {"mooncake": pb.TRANSFER_BACKEND_MOONCAKE, "tcp": pb.TRANSFER_BACKEND_TCP}


class TransferRefused(Exception):
    """A transfer call this Messenger refuses, with the gRPC status that says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class KvEnd(Protocol):
    """One end of a transfer: the store whose blocks are exported from, or imported into,
    the memory the transfer reads or writes (`EngineApi`, `KvPool`). Failures raise
    `EngineError` (`EngineNoRoom` when an import finds no room)."""

    async def export_blocks(
        self, hashes: Sequence[int], start: int, end: int, *, wait_s: float, hold_s: float
    ) -> Exported: ...

    async def release_export(self, export_id: str) -> bool: ...

    async def begin_import(
        self, hashes: Sequence[int], upto: int, *, hold_s: float
    ) -> ImportSlots: ...

    async def commit_import(
        self, import_id: str, token_ids: Sequence[int], cache_salt: str | None
    ) -> int: ...

    async def abort_import(self, import_id: str) -> bool: ...


POOL = "pool"  # the key of the node pool's region


class LocalKv:
    """The KV memory of the engines this Messenger relays."""

    def __init__(
        self,
        relays: Callable[[], Sequence[EngineRelay]],
        backend: Backend,
        pool: KvPool | None = None,
    ) -> None:
        self._relays = relays
        self.backend = backend
        self.pool = pool
        self._regions: dict[str, KvRegion] = {}  # instance id (or POOL) -> its mapped memory

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

    def engine(self, instance_id: str) -> tuple[KvEnd, KvRegion]:
        """The end that holds `instance_id`'s movable KV (its own memory, or the node's pool)
        and that memory, mapped and registered. Raises `TransferRefused`: NOT_FOUND when no
        engine of this node is that instance, FAILED_PRECONDITION when it keeps no KV bytes
        (or its file cannot be mapped)."""
        relay = next((r for r in self._relays() if r.instance_id == instance_id), None)
        if relay is not None and relay.uses_pool:
            # The pool's blocks are the node's: they outlive an engine that stopped answering.
            assert self.pool is not None
            memory, fmt = self.pool.memory, self.pool.format
            assert fmt is not None  # attached
            region = self._region(POOL, KvMemory(str(memory.path), memory.layout), fmt.kind)
            return self.pool, region
        if relay is None or relay.info is None or not relay.up:
            raise TransferRefused(
                grpc.StatusCode.NOT_FOUND,
                f"instance {instance_id!r} is not an engine of this node that answers now",
            )
        kv, own = relay.kv, relay.info.kv_memory
        if own is None or kv is None:
            raise TransferRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"instance {instance_id!r} keeps no KV memory a Messenger can move (a vLLM "
                "engine needs its node's KV pool: --kv-pool-bytes, and kvsched's KV connector)",
            )
        return kv, self._region(instance_id, own)

    def _region(self, owner: str, memory: KvMemory, block_format: str = SIM_FORMAT) -> KvRegion:
        """`owner`'s memory mapped and registered (again, if it moved to a new file)."""
        region = self._regions.get(owner)
        if region is not None and (
            str(region.path) != memory.path
            or region.layout != memory.layout
            or region.block_format != block_format
        ):
            self._drop(owner)  # the engine restarted into a new file
            region = None
        if region is None:
            try:
                region = KvRegion(memory.path, memory.layout, block_format)
            except (OSError, ValueError) as exc:
                raise TransferRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"cannot map the KV memory of {owner!r}: {exc}",
                ) from None
            self.backend.register(region)
            self._regions[owner] = region
            log.info("registered the KV memory of %s (%d bytes)", owner, region.size)
        return region

    def _drop(self, instance_id: str) -> None:
        region = self._regions.pop(instance_id)
        self.backend.unregister(region)
        try:
            region.close()
        except BufferError:  # a transfer still holds a view: the mapping goes when it ends
            log.warning("the old KV memory of %s is still in use", instance_id)

    def close(self) -> None:
        """Unregister and unmap every region (the backend is stopped first)."""
        for instance_id in list(self._regions):
            self._drop(instance_id)
