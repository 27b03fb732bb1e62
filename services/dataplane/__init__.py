"""The KV data plane: where KV blocks live and how they move, under the control plane's
decisions. It owns the engines' KV memory (its layout, its blocks' names and hashes, exports
and imports over it), the node's KV pool that a Messenger keeps in host memory and serves on
a local socket (`kv_pool`, `pool_store`, `pool_format`, `pool_records`, `pool_server`, its
wire format `pool_wire`), a simulated engine's end of that socket (`pool_link`), the node's
pool as the end of KV transfers (`local_kv`), both sides of a transfer between Messengers
(`exporter`; `transfers`, `transfer_mover`, `segment_reader`, `transfer_progress`), the
byte-moving backends (`transfer/`: TCP and Mooncake), and its errors (`errors`).

The front door, what the Messenger, the simulated engine and the other services import (from
`services.dataplane`, nothing deeper):

- the node's pool: `NodePool`, `PoolServer`; a simulated engine's end of it: `PoolLink`;
- transfers: `LocalKv`, `Exporter`, `Transfers`, `Transfer`, `TransferLimits`, and the
  backends: `open_backend`, `TRANSFER_BACKENDS`, `backend_missing`;
- an engine's KV memory: `KvLayout`, `KvMemory`, `DEFAULT_KV_MEMORY_DIR`, `SIM_FORMAT`,
  `EngineNames`, `KvTransfers`;
- how engines name blocks: `BlockHashes`, `add_block_hash_flags`, `block_hashes_from_args`;
- the errors callers catch: `DataPlaneError` (the base of them all), `PoolError`,
  `PoolFull`, `PoolRefused`, `TransferRefused`.

kvsched's vLLM connector runs inside vLLM's own environment and imports the pool's wire format
alone (`services.dataplane.pool_wire`). So that importing it costs nothing else, this package
imports nothing when it is imported: each name above is imported on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from services.dataplane.block_hashes import BlockHashes
    from services.dataplane.block_hashes import add_flags as add_block_hash_flags
    from services.dataplane.block_hashes import from_args as block_hashes_from_args
    from services.dataplane.errors import DataPlaneError, PoolError, PoolFull, PoolRefused
    from services.dataplane.exporter import Exporter
    from services.dataplane.kv_layout import SIM_FORMAT, KvLayout
    from services.dataplane.kv_memory import DEFAULT_DIR as DEFAULT_KV_MEMORY_DIR
    from services.dataplane.kv_memory import KvMemory
    from services.dataplane.kv_names import EngineNames
    from services.dataplane.kv_pool import NodePool
    from services.dataplane.kv_transfer import KvTransfers
    from services.dataplane.local_kv import LocalKv, TransferRefused
    from services.dataplane.pool_link import PoolLink
    from services.dataplane.pool_server import PoolServer
    from services.dataplane.transfer.factory import BACKENDS as TRANSFER_BACKENDS
    from services.dataplane.transfer.factory import backend_missing, open_backend
    from services.dataplane.transfer_progress import Transfer, TransferLimits
    from services.dataplane.transfers import Transfers

# Each front-door name: (the module under services.dataplane that owns it, its name there).
_FRONT_DOOR: dict[str, tuple[str, str]] = {
    "BlockHashes": ("block_hashes", "BlockHashes"),
    "DEFAULT_KV_MEMORY_DIR": ("kv_memory", "DEFAULT_DIR"),
    "DataPlaneError": ("errors", "DataPlaneError"),
    "EngineNames": ("kv_names", "EngineNames"),
    "Exporter": ("exporter", "Exporter"),
    "KvLayout": ("kv_layout", "KvLayout"),
    "KvMemory": ("kv_memory", "KvMemory"),
    "KvTransfers": ("kv_transfer", "KvTransfers"),
    "LocalKv": ("local_kv", "LocalKv"),
    "NodePool": ("kv_pool", "NodePool"),
    "PoolError": ("errors", "PoolError"),
    "PoolFull": ("errors", "PoolFull"),
    "PoolLink": ("pool_link", "PoolLink"),
    "PoolRefused": ("errors", "PoolRefused"),
    "PoolServer": ("pool_server", "PoolServer"),
    "SIM_FORMAT": ("kv_layout", "SIM_FORMAT"),
    "TRANSFER_BACKENDS": ("transfer.factory", "BACKENDS"),
    "Transfer": ("transfer_progress", "Transfer"),
    "TransferLimits": ("transfer_progress", "TransferLimits"),
    "TransferRefused": ("local_kv", "TransferRefused"),
    "Transfers": ("transfers", "Transfers"),
    "add_block_hash_flags": ("block_hashes", "add_flags"),
    "backend_missing": ("transfer.factory", "backend_missing"),
    "block_hashes_from_args": ("block_hashes", "from_args"),
    "open_backend": ("transfer.factory", "open_backend"),
}

__all__ = [
    "DEFAULT_KV_MEMORY_DIR",
    "SIM_FORMAT",
    "TRANSFER_BACKENDS",
    "BlockHashes",
    "DataPlaneError",
    "EngineNames",
    "Exporter",
    "KvLayout",
    "KvMemory",
    "KvTransfers",
    "LocalKv",
    "NodePool",
    "PoolError",
    "PoolFull",
    "PoolLink",
    "PoolRefused",
    "PoolServer",
    "Transfer",
    "TransferLimits",
    "TransferRefused",
    "Transfers",
    "add_block_hash_flags",
    "backend_missing",
    "block_hashes_from_args",
    "open_backend",
]


def __getattr__(name: str) -> Any:
    """A front-door name, imported from the module that owns it on first use (then kept)."""
    try:
        module, attribute = _FRONT_DOOR[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
