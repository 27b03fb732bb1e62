"""What a source Messenger lets readers read: the regions registered with its backend and,
per export id, the region and pages a peer may read (granted by `allow`, withdrawn by
`revoke`). Pure bookkeeping; the TCP server enforces it on every request."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.dataplane.transfer.backend import SourceExport
from services.dataplane.transfer.region import KvRegion


@dataclass(frozen=True, slots=True)
class Grant:
    """Export `export_id` lets a reader read `pages` (every layer) of `region`; `mask` has
    byte 1 at each allowed page and 0 elsewhere (checked per request at C speed)."""

    export_id: str
    region: KvRegion
    pages: frozenset[int]
    mask: bytes

    def covers(self, page: int, count: int) -> bool:
        """Whether pages page..page+count-1 are all allowed (and in range)."""
        return (
            page >= 0
            and page + count <= len(self.mask)
            and self.mask.find(0, page, page + count) < 0
        )


class ExportTable:
    """Registered regions and live grants."""

    def __init__(self) -> None:
        self._regions: dict[int, KvRegion] = {}  # by identity: one mapping per engine file
        self._grants: dict[str, Grant] = {}

    def register(self, region: KvRegion) -> bool:
        """Add `region`; False when it already was."""
        if id(region) in self._regions:
            return False
        self._regions[id(region)] = region
        return True

    def unregister(self, region: KvRegion) -> list[str]:
        """Remove `region` and revoke every grant on it; returns the revoked export ids."""
        self._regions.pop(id(region), None)
        gone = [g.export_id for g in self._grants.values() if g.region is region]
        for export_id in gone:
            del self._grants[export_id]
        return gone

    def registered(self, region: KvRegion) -> bool:
        return self._regions.get(id(region)) is region

    @property
    def regions(self) -> list[KvRegion]:
        return list(self._regions.values())

    def allow(self, export_id: str, region: KvRegion, pages: Iterable[int]) -> Grant:
        """Let readers of `export_id` read `pages` of `region` (replacing an earlier grant of
        the same id). Raises `ValueError` for an unregistered region or a page out of range."""
        if not self.registered(region):
            raise ValueError(f"{region} is not registered with this backend; register it first")
        allowed = frozenset(pages)
        bad = sorted(p for p in allowed if not 0 <= p < region.layout.pages)
        if bad:
            raise ValueError(f"pages {bad[:8]} are outside {region} ({region.layout.pages} pages)")
        mask = bytearray(region.layout.pages)
        for p in allowed:
            mask[p] = 1
        grant = Grant(export_id, region, allowed, bytes(mask))
        self._grants[export_id] = grant
        return grant

    def revoke(self, export_id: str) -> bool:
        """End `export_id`'s grant; False when there was none."""
        return self._grants.pop(export_id, None) is not None

    def get(self, export_id: str) -> Grant | None:
        return self._grants.get(export_id)

    def describe(
        self, region: KvRegion, export_id: str, endpoint: str, base_address: int
    ) -> SourceExport:
        """What a reader is told of `region` exported as `export_id` by the backend at
        `endpoint`. Raises `ValueError` for an unregistered region."""
        if not self.registered(region):
            raise ValueError(f"{region} is not registered with this backend")
        return SourceExport(endpoint, base_address, region.layout, export_id)
