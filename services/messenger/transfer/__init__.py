"""The bytes of KV transfers: a region per engine file (`region`), the runs a read moves
(`runs`), the backend interface (`backend`) and its two implementations, `tcp` (our own
asyncio TCP: `tcp_server`, `tcp_reader`, `tcp_wire`, `sockio`) and `mooncake`
(mooncake-transfer-engine), chosen by `make_backend`."""

from services.messenger.transfer.backend import Backend, Reader, SourceExport
from services.messenger.transfer.errors import TransferError
from services.messenger.transfer.factory import BACKENDS, make_backend
from services.messenger.transfer.region import KvRegion
from services.messenger.transfer.runs import Run, Runs, coalesce

__all__ = [
    "BACKENDS",
    "Backend",
    "KvRegion",
    "Reader",
    "Run",
    "Runs",
    "SourceExport",
    "TransferError",
    "coalesce",
    "make_backend",
]
