"""What is particular to the `mooncake` backend: what a source tells its readers, and reads
that cannot be served failing fast."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

from services.dataplane.transfer.backend import SourceExport
from services.dataplane.transfer.errors import TransferError
from services.dataplane.transfer.factory import open_backend
from services.dataplane.transfer.region import KvRegion
from services.dataplane.transfer.runs import Run
from tests.conftest import MOONCAKE
from tests.dataplane.transfer.conftest import LAYOUT

pytestmark = MOONCAKE


async def test_exports_name_the_engine_and_the_registered_address(
    backend: Callable[..., Any], region: Callable[..., KvRegion]
) -> None:
    # One engine for everything here: destroying one takes about a second.
    mc = await backend("mooncake")
    src, unregistered = region(), region()
    with pytest.raises(ValueError, match="not registered"):
        mc.allow("e1", src, [0])
    mc.register(src)
    mc.register(src)  # once per region: a second call changes nothing
    mc.allow("e1", src, [0, 1])
    export = mc.source_export(src, "e1")
    assert export == SourceExport(mc.endpoint, src.address, LAYOUT, "e1")
    host, port = export.endpoint.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    assert mc.revoke("e1") and not mc.revoke("e1")

    # A destination the engine does not know is a caller error, not a transfer failure.
    reader = await mc.open_reader(export)
    with pytest.raises(ValueError, match="not registered"):
        await reader.read(0, [Run(0, 0, 1)], unregistered)

    # Nothing listens there: the handshake fails at once.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"
    gone = await mc.open_reader(SourceExport(nowhere, 1 << 40, LAYOUT, "e9"))
    start = time.monotonic()
    with pytest.raises(TransferError, match=nowhere):
        await gone.read(0, [Run(0, 0, 1)], src)
    assert time.monotonic() - start < 5.0
    with pytest.raises(TransferError, match="closed"):
        await gone.read(0, [Run(0, 0, 1)], src)
    mc.unregister(src)
    with pytest.raises(ValueError, match="not registered"):
        mc.source_export(src, "e1")


def test_open_backend_knows_both_and_only_them() -> None:
    assert open_backend("tcp", "127.0.0.1").name == "tcp"
    assert open_backend("mooncake", "127.0.0.1").name == "mooncake"
    with pytest.raises(ValueError, match="mooncake, tcp"):
        open_backend("rdma", "127.0.0.1")
