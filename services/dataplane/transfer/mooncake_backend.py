"""The `mooncake` backend: mooncake-transfer-engine reads the peer's registered memory
(TCP between these machines, RDMA where the NICs have it); peers find each other by the
engine's P2P handshake, so no metadata server is needed.

Findings this module is built on (mooncake-transfer-engine-non-cuda 0.3.13, TCP transport):
a batch read blocks the calling thread (so it runs in this backend's own threads, never the
loop's default executor, which other work shares); its cost is mostly per entry (64 KiB
entries move at about 60% of the rate of 256 KiB ones, 4 KiB entries at a few percent), so
each run of consecutive pages is one entry; batches of 512 entries fail ("TCP lane
queue-full"), so batches hold at most `max_batch`; a read from a killed peer fails (returns
-1) within about a second, and a stalled one is bounded by `read_timeout_s`. Destroying an
engine takes about a second with the GIL held (the library joins its threads), so `stop`
stalls the process that long.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from services.dataplane.transfer.backend import SourceExport
from services.dataplane.transfer.errors import TransferError
from services.dataplane.transfer.exports import ExportTable
from services.dataplane.transfer.region import KvRegion
from services.dataplane.transfer.runs import LastRuns, Run, Runs, check_read

log = logging.getLogger(__name__)


class _Engine(Protocol):
    """The part of `mooncake.engine.TransferEngine` used here (it ships no type hints)."""

    def initialize(self, host: str, metadata: str, protocol: str, device: str, /) -> int: ...
    def get_rpc_port(self) -> int: ...
    def register_memory(self, address: int, length: int, /) -> int: ...
    def unregister_memory(self, address: int, /) -> int: ...
    def batch_transfer_sync_read(
        self, session: str, local: list[int], remote: list[int], lengths: list[int], /
    ) -> int: ...


# The wheel is the `mooncake` extra: a Messenger started without it says so at once.
MISSING = "--transfer-backend mooncake needs the Mooncake wheel: pip install 'kvsched[mooncake]'"


def installed() -> bool:
    """Whether the Mooncake transfer engine's package can be imported here."""
    return importlib.util.find_spec("mooncake") is not None


def _new_engine() -> _Engine:
    # The library logs every connection at INFO through glog, read once at import: keep
    # errors only unless the operator chose a level.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    # Over TCP, a peer's reads share `lanes` connections (4 by default); with the most (16)
    # a read of many small runs went about twice as fast on loopback here.
    os.environ.setdefault("MC_TCP_LANES_PER_PEER", "16")
    module = importlib.import_module("mooncake.engine")
    engine: _Engine = module.TransferEngine()
    return engine


class MooncakeBackend:
    """A `Backend` on one Mooncake TransferEngine, on `host`: the address peers reach this
    Messenger at (it names the engine's session).

    `protocol`/`device`: the engine's transport ("tcp", or "rdma" with its NIC names);
    `read_timeout_s` bounds one batch; `max_batch` entries per batch; `workers` threads run
    batches (two reads in flight need two)."""

    name = "mooncake"
    sends_checksums = False  # one-sided reads: the export's checksums are the reference

    def __init__(
        self,
        host: str,
        *,
        protocol: str = "tcp",
        device: str = "",
        read_timeout_s: float = 30.0,
        max_batch: int = 128,
        workers: int = 4,
    ) -> None:
        self.host = host
        self.protocol = protocol
        self.device = device
        self.read_timeout_s = read_timeout_s
        self.max_batch = max_batch
        self.table = ExportTable()
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._engine: _Engine | None = None
        self._port = 0
        self._in_flight = 0  # batches running on backend threads
        self._count_lock = threading.Lock()
        self._readers: list[MooncakeReader] = []

    @property
    def endpoint(self) -> str:
        """The engine's session name, "host:rpc_port"."""
        if self._engine is None:
            raise RuntimeError("the Mooncake backend is not started")
        return f"{self.host}:{self._port}"

    @property
    def in_flight(self) -> int:
        """Batches running on the engine now (one that timed out still counts until it
        ends)."""
        with self._count_lock:
            return self._in_flight

    def _started(self) -> _Engine:
        if self._engine is None:
            raise RuntimeError("the Mooncake backend is not started")
        return self._engine

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="mooncake-read")
        engine = await loop.run_in_executor(self._pool, _new_engine)
        rc = await loop.run_in_executor(
            self._pool, engine.initialize, self.host, "P2PHANDSHAKE", self.protocol, self.device
        )
        if rc != 0:
            raise TransferError(
                f"the Mooncake transfer engine did not start on {self.host} over "
                f"{self.protocol!r} (device {self.device!r}): code {rc}; see its log on stderr"
            )
        self._engine = engine
        self._port = int(engine.get_rpc_port())

    def register(self, region: KvRegion) -> None:
        engine = self._started()
        if not self.table.register(region):
            return
        rc = engine.register_memory(region.address, region.size)
        if rc != 0:
            self.table.unregister(region)
            raise TransferError(f"Mooncake could not register {region} (code {rc})")

    def unregister(self, region: KvRegion) -> None:
        if self.table.registered(region):
            self.table.unregister(region)
            if self._engine is not None:
                self._engine.unregister_memory(region.address)

    def allow(self, export_id: str, region: KvRegion, pages: Iterable[int]) -> None:
        # Bookkeeping only: a Mooncake peer reads registered memory directly.
        self.table.allow(export_id, region, pages)

    def revoke(self, export_id: str) -> bool:
        return self.table.revoke(export_id)

    def source_export(self, region: KvRegion, export_id: str) -> SourceExport:
        return self.table.describe(region, export_id, self.endpoint, region.address)

    async def open_reader(self, export: SourceExport) -> MooncakeReader:
        self._started()
        reader = MooncakeReader(self, export)
        self._readers.append(reader)
        return reader

    async def read_batch(
        self,
        session: str,
        local: list[int],
        remote: list[int],
        lengths: list[int],
        pin: list[memoryview],
    ) -> int:
        """Run one batch read on a backend thread; its return code (0: done). Raises
        `TimeoutError` after `read_timeout_s`. `pin` holds views of the destination memory the
        batch writes: when this raises (timeout, cancellation) while the batch still runs,
        they are released only once it ends, so the memory cannot be unmapped under it;
        otherwise the caller releases them."""
        engine = self._started()
        assert self._pool is not None
        done: Future[int] = self._pool.submit(
            engine.batch_transfer_sync_read, session, local, remote, lengths
        )
        with self._count_lock:
            self._in_flight += 1

        def ended(_: Future[int]) -> None:  # on the backend thread
            with self._count_lock:
                self._in_flight -= 1

        done.add_done_callback(ended)
        try:
            async with asyncio.timeout(self.read_timeout_s):
                return await asyncio.shield(asyncio.wrap_future(done))
        except BaseException:
            done.add_done_callback(lambda _: _release(pin))
            raise

    async def stop(self) -> None:
        for reader in self._readers:
            await reader.close()
        self._readers.clear()
        engine, self._engine = self._engine, None
        for region in self.table.regions:
            self.table.unregister(region)
            if engine is not None:
                engine.unregister_memory(region.address)
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if engine is not None and self._in_flight:
            # A batch still runs inside it (it timed out): destroying it would crash.
            log.warning("leaving the Mooncake engine alive: %d reads still run", self._in_flight)
            _stuck.append(engine)
        del engine  # the library's destructor runs here (about a second)


def _entries(runs: Runs, chunk_bytes: int) -> tuple[list[int], list[int], list[int]]:
    """Each run's destination and source byte offsets within a layer, and its length."""
    return (
        [r.dst_page * chunk_bytes for r in runs],
        [r.src_page * chunk_bytes for r in runs],
        [r.count * chunk_bytes for r in runs],
    )


def _release(views: list[memoryview]) -> None:
    for v in views:
        v.release()


_stuck: list[_Engine] = []  # engines that must outlive their backend (see `stop`)


class MooncakeReader:
    """Reads one export through the backend's engine; reads may overlap (each runs its
    batches on a backend thread)."""

    def __init__(self, backend: MooncakeBackend, export: SourceExport) -> None:
        self.backend = backend
        self.export = export
        self._broken: str | None = None
        self._prepare = LastRuns()

    async def read(self, layer: int, runs: Sequence[Run], dst: KvRegion) -> None:
        """See `Reader.read`."""
        src = self.export.layout
        plan = self._prepare(runs)
        check_read(layer, plan, src, dst.layout)
        if not self.backend.table.registered(dst):
            raise ValueError(f"{dst} is not registered with the Mooncake backend")
        if self._broken is not None:
            raise TransferError(f"the reader is closed: {self._broken}")
        where = (
            f"layer {layer} from source {self.export.endpoint} (export {self.export.export_id!r})"
        )
        # Pins the destination: it cannot be unmapped while the engine writes into it.
        pin = dst.slices(layer, plan.spans("dst", src.chunk_bytes))
        dst_offsets, src_offsets, lengths = plan.memo(
            ("mooncake", src.chunk_bytes), lambda: _entries(plan, src.chunk_bytes)
        )
        dst_base = dst.address + dst.layout.offset(layer, 0)
        src_base = self.export.base_address + src.offset(layer, 0)
        local = [dst_base + o for o in dst_offsets]
        remote = [src_base + o for o in src_offsets]
        step = self.backend.max_batch
        handed_over = False  # a batch that did not end in time releases `pin` itself
        try:
            for i in range(0, len(runs), step):
                try:
                    rc = await self.backend.read_batch(
                        self.export.endpoint,
                        local[i : i + step],
                        remote[i : i + step],
                        lengths[i : i + step],
                        pin,
                    )
                except BaseException:
                    handed_over = True
                    raise
                if rc != 0:
                    raise self._fail(
                        f"{where}: Mooncake read failed (code {rc}): the source Messenger is "
                        "gone or unreachable, or no longer registers that memory"
                    )
        except TimeoutError as e:
            raise self._fail(f"{where}: no answer within {self.backend.read_timeout_s:g} s") from e
        except RuntimeError as e:  # the backend stopped under the read
            raise self._fail(f"{where}: {e}") from e
        finally:
            if not handed_over:
                _release(pin)

    def _fail(self, reason: str) -> TransferError:
        if self._broken is None:
            self._broken = reason
        return TransferError(reason)

    async def close(self) -> None:
        """See `Reader.close` (reads already in flight complete)."""
        self._fail("closed by its owner")
