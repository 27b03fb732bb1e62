"""The node KV pool's block format (`BlockFormat`: what one block of an engine's KV is, byte
for byte) and the file that remembers it across a Messenger's restarts (`read_format`,
`write_format`)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from services.common.security.files import write_private
from services.dataplane.kv_layout import KvLayout

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """What one block of an engine's KV is, byte for byte: the pool holds blocks of one
    format, and a transfer moves blocks only between ends of the same format.

    `kind` names the attention backend's packing of K and V, the dtype and the per-block
    shape (`vllm/cpu/packed/float32/1x32x64`); two ends agree only when all of it and the
    geometry agree."""

    kind: str
    layers: int
    chunk_bytes: int  # one block's K and V in one layer
    block_size: int

    def __post_init__(self) -> None:
        if not self.kind or min(self.layers, self.chunk_bytes, self.block_size) <= 0:
            raise ValueError(f"a block format needs a kind and positive sizes, got {self}")

    def layout(self, pages: int) -> KvLayout:
        return KvLayout(self.layers, pages, self.chunk_bytes, self.block_size)


def read_format(path: Path | None) -> BlockFormat | None:
    """The format remembered in `path`; None when there is none (or it cannot be read)."""
    if path is None or not path.exists():
        return None
    try:
        return BlockFormat(**json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as exc:
        log.warning("ignoring the KV pool format in %s: %s", path, exc)
        return None


def write_format(path: Path | None, fmt: BlockFormat) -> None:
    """Remember `fmt` in `path` (owner-only), when there is one."""
    if path is not None:
        write_private(path, json.dumps(asdict(fmt)))
