"""What a transfer backend raises when bytes cannot be moved."""

from __future__ import annotations

from services.dataplane.errors import DataPlaneError


class TransferError(DataPlaneError):
    """Bytes could not be moved from the source: the peer is gone or unreachable, refused the
    read (e.g. the export was revoked), or the connection broke mid-read. The message names the
    peer, the layer and the reason. The destination pages a failed read targeted hold
    undefined bytes; the reader that raised it is closed and cannot be used again."""
