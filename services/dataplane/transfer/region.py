"""A KV region: one engine's KV file (see `services.dataplane.kv_layout`), mapped read/write
into the Messenger so transfers move its bytes in place, without copies."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType

import numpy as np
import numpy.typing as npt

from services.dataplane.kv_layout import SIM_FORMAT, KvLayout
from services.dataplane.transfer.runs import Span, merge_spans


class KvRegion:
    """The file at `path`, holding memory of geometry `layout`, mapped shared and writable:
    what a reader writes into a view lands in the engine's memory.

    Views pin the mapping: `close()` fails while any view (or array) of it is alive."""

    def __init__(
        self, path: str | os.PathLike[str], layout: KvLayout, block_format: str = SIM_FORMAT
    ) -> None:
        self.path = Path(path)
        self.layout = layout
        self.block_format = block_format  # what a chunk's bytes are (a transfer's ends agree)
        fd = os.open(self.path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != layout.size:
                raise ValueError(
                    f"{self.path} holds {size} bytes but its layout {layout} needs "
                    f"{layout.size}: the engine and the Messenger disagree on the geometry"
                )
            self._map = mmap.mmap(
                fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)  # the mapping keeps the file alive
        # Mooncake registers memory by address; the ctypes object pins the mapping only while
        # it lives, and the address stays valid as long as the mapping does.
        anchor = ctypes.c_char.from_buffer(self._map)
        self.address: int = ctypes.addressof(anchor)
        del anchor
        self._view = memoryview(self._map)

    @property
    def size(self) -> int:
        """Bytes of the region."""
        return self.layout.size

    @property
    def closed(self) -> bool:
        return self._map.closed

    def _check(self, layer: int, page: int, count: int) -> None:
        lay = self.layout
        if not (0 <= layer < lay.layers and count > 0 and page >= 0 and page + count <= lay.pages):
            raise IndexError(
                f"layer {layer}, pages {page}..{page + count - 1} are outside {self.path} "
                f"({lay.layers} layers × {lay.pages} pages)"
            )

    def view(self, layer: int, page: int, count: int = 1) -> memoryview:
        """The bytes of `count` consecutive chunks of `layer` from `page` on (writable)."""
        self._check(layer, page, count)
        start = self.layout.offset(layer, page)
        return self._view[start : start + count * self.layout.chunk_bytes]

    def gather(self, layer: int, pages: Iterable[tuple[int, int]]) -> list[memoryview]:
        """Views of `layer` at each (page, count) of `pages`, in order, a stretch adjacent to
        the previous one merged into its view."""
        pairs = list(pages)
        for page, count in pairs:
            self._check(layer, page, count)
        return self.slices(layer, merge_spans(pairs, self.layout.chunk_bytes))

    def slices(self, layer: int, spans: Sequence[Span]) -> list[memoryview]:
        """Views of `layer` at byte `spans` (start, stop) counted from the layer's start."""
        lay = self.layout
        layer_bytes = lay.pages * lay.chunk_bytes
        if not 0 <= layer < lay.layers:
            raise IndexError(f"layer {layer} is outside {self.path} ({lay.layers} layers)")
        if spans and not (
            min(a for a, _ in spans) >= 0 and max(b for _, b in spans) <= layer_bytes
        ):
            raise IndexError(f"byte spans beyond a layer ({layer_bytes}) of {self.path}")
        base = layer * layer_bytes
        whole = self._view
        return [whole[base + a : base + b] for a, b in spans]

    def whole(self) -> memoryview:
        """Every byte of the region (writable)."""
        return self._view[:]

    def blocks(self, page: int, count: int = 1) -> npt.NDArray[np.uint8]:
        """Pages `page..page+count-1` over every layer as a writable array of shape (count,
        layers, chunk_bytes) (a view into the memory, e.g. for `kv_layout.fill`)."""
        self._check(0, page, count)
        lay = self.layout
        whole = np.frombuffer(self._map, dtype=np.uint8).reshape(
            lay.layers, lay.pages, lay.chunk_bytes
        )
        return whole[:, page : page + count, :].transpose(1, 0, 2)

    def close(self) -> None:
        """Unmap the file (idempotent). Raises `BufferError` while a view is still in use (a
        transfer still reading or writing it)."""
        if self._map.closed:
            return
        self._view.release()  # slices taken from it stay valid and still pin the map
        try:
            self._map.close()
        except BufferError as e:
            self._view = memoryview(self._map)  # still open: keep the region usable
            raise BufferError(
                f"{self.path} is still in use (a view of it is alive); stop its transfers first"
            ) from e

    def __enter__(self) -> KvRegion:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KvRegion({str(self.path)!r}, {self.layout})"
