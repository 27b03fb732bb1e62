"""Block hashes kept as the wire carries them: packed little-endian u64, 8 bytes each.

A KV event's `packed_block_hashes` reach the core as one `PackedHashes`: a read-only
sequence of ints over the bytes, so the prefix index's compiled store takes the bytes whole
(`PrefixIndex.store` / `remove`) without a Python int per hash, while every other reader
(the reference store, the etcd records, `events.split`) sees the ints it always saw, made
only when it reads them. It compares equal to any sequence of the same ints.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

HASH_BYTES = 8  # one u64 hash

if array("Q").itemsize != HASH_BYTES:  # 'Q' is at least 8 bytes; on every platform we know, 8
    raise ImportError("this platform's array('Q') is not 8 bytes: packed hashes are unsupported")

_SWAP = sys.byteorder != "little"  # the wire is little-endian; swap on a big-endian host


def pack(hashes: Iterable[int]) -> bytes:
    """`hashes` as packed little-endian u64 bytes; raises OverflowError for a value outside
    [0, 2^64)."""
    values = array("Q", hashes)
    if _SWAP:
        values.byteswap()
    return values.tobytes()


def hash_count(data: bytes) -> int:
    """How many hashes `data` packs; raises ValueError unless its length is a multiple of 8."""
    if len(data) % HASH_BYTES:
        raise ValueError(
            f"{len(data)} bytes are not a whole number of {HASH_BYTES}-byte little-endian "
            f"u64 hashes"
        )
    return len(data) // HASH_BYTES


def unpack(data: bytes) -> list[int]:
    """The hashes `data` packs, as ints (one C loop); raises ValueError as `hash_count` does."""
    hash_count(data)
    values = array("Q", data)
    if _SWAP:
        values.byteswap()
    return values.tolist()


class PackedHashes(Sequence[int]):
    """The hashes `data` packs, read lazily; changes nothing it is given."""

    __slots__ = ("_ints", "data")

    def __init__(self, data: bytes) -> None:
        """Raises ValueError unless `data` is a whole number of 8-byte hashes."""
        hash_count(data)
        self.data = data
        self._ints: list[int] | None = None  # unpacked on first read by index

    def ints(self) -> list[int]:
        """The hashes as ints (unpacked once, in one C loop, then kept)."""
        if self._ints is None:
            self._ints = unpack(self.data)
        return self._ints

    def __len__(self) -> int:
        return len(self.data) // HASH_BYTES

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> PackedHashes: ...

    def __getitem__(self, index: int | slice) -> int | PackedHashes:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1:  # what `events.split` cuts: bytes of bytes, no int made
                return PackedHashes(self.data[start * HASH_BYTES : max(stop, start) * HASH_BYTES])
            return PackedHashes(pack(self.ints()[index]))
        return self.ints()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ints())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedHashes):
            return self.data == other.data
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(other) == len(self) and list(other) == self.ints()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self.ints()))  # as the tuple it equals

    def __repr__(self) -> str:
        return f"PackedHashes({self.ints()!r})"
