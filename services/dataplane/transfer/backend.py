"""The interface between the transfer runner and the byte-moving backends.

Each Messenger has one `Backend`. On the source side it `register`s every local engine region
once (at startup), `allow`s an export's pages while a peer may read them and `revoke`s them
after, and describes an export as a `SourceExport`; on the receiving side it `open_reader`s a
`Reader` on a `SourceExport` and reads layer after layer into a local registered region.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from services.dataplane.kv_layout import KvLayout
from services.dataplane.transfer.errors import TransferError
from services.dataplane.transfer.region import KvRegion
from services.dataplane.transfer.runs import Run

__all__ = ["Backend", "Reader", "SourceExport", "TransferError"]


@dataclass(frozen=True)
class SourceExport:
    """What a reader knows of an exported source region.

    `endpoint` is "host:port" of the source Messenger's backend (Mooncake: its session name);
    `base_address` is, for Mooncake, the address of the source region's byte 0 in the source
    Messenger's process as registered there (0 for TCP, which addresses by export id);
    `layout` is the source region's geometry; `export_id` names the export at the source."""

    endpoint: str
    base_address: int
    layout: KvLayout
    export_id: str


class Reader(Protocol):
    """Reads chunks of one `SourceExport` into local regions. Any number of reads (e.g. of
    layers l and l+1) may be in flight at once; each completes on its own, and more in flight
    keep the source streaming. The per-run work of a read is done once for a `Runs`, or for
    the same list handed again (as for every layer of a transfer)."""

    async def read(self, layer: int, runs: Sequence[Run], dst: KvRegion) -> Sequence[int] | None:
        """Copy the chunks of `layer` at the runs' source pages into `dst` at (`layer`, the
        runs' destination pages); nothing else in `dst` changes. Returns once every byte is
        there, with the checksum of each chunk read (run after run) when the backend carries
        them with the bytes (computed by the source as it sent them), else None (the reader
        verifies against the export's). Raises `ValueError` when the runs do not fit the
        layouts (a caller bug) and `TransferError` when the source is gone, refuses, or the
        connection breaks (the reader is then closed; the targeted pages hold undefined
        bytes)."""
        ...

    async def close(self) -> None:
        """Release the reader's connection (idempotent); reads in flight fail."""
        ...


class Backend(Protocol):
    """One Messenger's transfer backend: serves its registered regions to peers and reads
    from theirs."""

    @property
    def name(self) -> str:
        """ "mooncake" or "tcp"."""
        ...

    @property
    def endpoint(self) -> str:
        """The "host:port" peers reach this backend at (valid after `start`)."""
        ...

    @property
    def sends_checksums(self) -> bool:
        """Whether its readers get each chunk's checksum with the bytes (then an export need
        not checksum up front)."""
        ...

    async def start(self) -> None:
        """Bind the backend's server (and start its engine)."""
        ...

    def register(self, region: KvRegion) -> None:
        """Make a local engine region readable by peers and usable as a read destination;
        once per region, after `start` (idempotent). `TransferError` when the engine refuses
        the memory (Mooncake)."""
        ...

    def unregister(self, region: KvRegion) -> None:
        """Stop serving `region` (its exports are revoked); call before closing it."""
        ...

    def allow(self, export_id: str, region: KvRegion, pages: Iterable[int]) -> None:
        """Let readers of `export_id` read `pages` of registered `region`, every layer
        (replaces an earlier grant of the same id). `ValueError` for an unregistered region
        or a page out of range."""
        ...

    def revoke(self, export_id: str) -> bool:
        """End `export_id`: later requests for it are refused (one being answered completes).
        False when it was not allowed."""
        ...

    def source_export(self, region: KvRegion, export_id: str) -> SourceExport:
        """What this Messenger tells a reader about local `region` exported as `export_id`."""
        ...

    async def open_reader(self, export: SourceExport) -> Reader:
        """A reader of `export` (raises `TransferError` when the source cannot be reached or
        refuses the export)."""
        ...

    async def stop(self) -> None:
        """Close the server, every connection and reader this backend opened, and release
        registered memory (regions stay mapped: their owner closes them)."""
        ...
