"""The `tcp` backend: our own TCP server and readers (no dependency beyond the kernel)."""

from __future__ import annotations

from collections.abc import Iterable

from services.dataplane.transfer.backend import SourceExport
from services.dataplane.transfer.exports import ExportTable
from services.dataplane.transfer.region import KvRegion
from services.dataplane.transfer.tcp_reader import TcpReader
from services.dataplane.transfer.tcp_server import TcpServer


class TcpBackend:
    """A `Backend` over plain TCP: its server sends chunks of the exports allowed here, its
    readers receive them straight into local regions.

    `idle_s`: a peer that makes no progress for this long mid-read is dropped (and the read
    fails); `sndbuf`/`rcvbuf`: SO_SNDBUF of served connections and SO_RCVBUF of readers
    (None: the kernel's autotuning)."""

    name = "tcp"
    sends_checksums = True

    def __init__(
        self,
        host: str,
        port: int = 0,
        *,
        connect_timeout_s: float = 5.0,
        idle_s: float = 30.0,
        sndbuf: int | None = None,
        rcvbuf: int | None = None,
    ) -> None:
        self.host = host
        self.table = ExportTable()
        self.server = TcpServer(self.table, host, port, idle_s=idle_s, sndbuf=sndbuf)
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self.rcvbuf = rcvbuf
        self._readers: set[TcpReader] = set()  # open ones, closed at `stop`

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.server.port}"

    async def start(self) -> None:
        await self.server.start()

    def register(self, region: KvRegion) -> None:
        self.table.register(region)

    def unregister(self, region: KvRegion) -> None:
        self.table.unregister(region)

    def allow(self, export_id: str, region: KvRegion, pages: Iterable[int]) -> None:
        self.table.allow(export_id, region, pages)

    def revoke(self, export_id: str) -> bool:
        return self.table.revoke(export_id)

    def source_export(self, region: KvRegion, export_id: str) -> SourceExport:
        return self.table.describe(region, export_id, self.endpoint, 0)

    async def open_reader(self, export: SourceExport) -> TcpReader:
        reader = await TcpReader.open(
            export,
            connect_timeout_s=self.connect_timeout_s,
            idle_s=self.idle_s,
            rcvbuf=self.rcvbuf,
        )
        self._readers.add(reader)
        reader.on_close = self._readers.discard
        return reader

    async def stop(self) -> None:
        for reader in list(self._readers):
            await reader.close()
        await self.server.stop()
