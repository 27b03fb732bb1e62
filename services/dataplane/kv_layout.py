"""Where an engine keeps its KV bytes, and what they hold: the contract between a simulated
engine (which owns the memory) and its node's Messenger (which reads and writes it).

Memory is one file (on a shared-memory filesystem) per engine, laid out layer by layer, as
vLLM keeps one KV tensor per layer: each layer is an array of `pages` chunks, a chunk being one
block's K and V for that layer, so layer l of page p starts at (l × pages + p) × chunk_bytes.
The same block's chunks on consecutive pages are contiguous within a layer, which is what lets
a transfer move a run of blocks of one layer as one piece.

A simulated engine "computes" a block by filling each of its chunks with a pattern derived
from the block's hash and the layer alone, so any receiver can check that bytes it got are
the right ones without asking the sender.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from kvsched.core.models import ModelConfig

SIM_FORMAT = "kvsched-sim"  # the block format of a simulated engine: chunks of these patterns
PATTERN_WORDS = 8  # a chunk repeats a 64-byte pattern
_PATTERN_BYTES = PATTERN_WORDS * 8
_U64 = np.uint64
Bytes = npt.NDArray[np.uint8]


@dataclass(frozen=True, slots=True)
class KvLayout:
    """The geometry of one engine's KV memory."""

    layers: int
    pages: int
    chunk_bytes: int  # one block's K and V in one layer
    block_size: int

    def __post_init__(self) -> None:
        if min(self.layers, self.pages, self.chunk_bytes, self.block_size) <= 0:
            raise ValueError(f"a KV layout needs positive sizes, got {self}")
        if self.chunk_bytes % 8:
            raise ValueError(f"chunk_bytes must be a multiple of 8, got {self.chunk_bytes}")

    @classmethod
    def for_model(cls, model: ModelConfig, block_size: int, pages: int) -> KvLayout:
        """The layout of `pages` blocks of `model`'s KV (2 × kv_heads × head_dim × dtype bytes
        per token and layer)."""
        per_token_layer = 2 * model.kv_heads * model.head_dim * model.dtype_bytes
        return cls(model.layers, pages, block_size * per_token_layer, block_size)

    @property
    def size(self) -> int:
        """Bytes of the whole memory."""
        return self.layers * self.pages * self.chunk_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer."""
        return self.layers * self.chunk_bytes

    def offset(self, layer: int, page: int) -> int:
        """Byte offset of `page`'s chunk of `layer`."""
        return (layer * self.pages + page) * self.chunk_bytes


def patterns(hashes: Sequence[int], layers: int) -> npt.NDArray[np.uint64]:
    """The 64-byte pattern of every (block, layer): shape (len(hashes), layers, 8), u64 words
    from SplitMix64 over (hash, layer, word), computed for all at once."""
    h = np.asarray(hashes, dtype=_U64).reshape(-1, 1, 1)
    layer = np.arange(layers, dtype=_U64).reshape(1, -1, 1)
    word = np.arange(PATTERN_WORDS, dtype=_U64).reshape(1, 1, -1)
    with np.errstate(over="ignore"):
        x = h ^ (layer * _U64(0x9E3779B97F4A7C15)) ^ (word << _U64(56))
        x = x + _U64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
        out: npt.NDArray[np.uint64] = x ^ (x >> _U64(31))
    return out


def fill(chunks: Bytes, hashes: Sequence[int]) -> None:
    """Write the content of blocks `hashes` into `chunks`, shape (len(hashes), layers,
    chunk_bytes) (or a view of that shape into the memory)."""
    n, layers, chunk_bytes = chunks.shape
    pattern = patterns(hashes, layers).view(np.uint8)  # (n, layers, 64)
    whole, tail = divmod(chunk_bytes, _PATTERN_BYTES)
    body = chunks[:, :, : whole * _PATTERN_BYTES].reshape(n, layers, whole, _PATTERN_BYTES)
    body[...] = pattern[:, :, None, :]
    if tail:
        chunks[:, :, whole * _PATTERN_BYTES :] = pattern[:, :, :tail]


def intact_prefix(chunks: Bytes, pages: Sequence[int], hashes: Sequence[int]) -> int:
    """How many of the blocks `hashes`, held in `pages` (paired in order) of `chunks`, shape
    (layers, pages, chunk_bytes), hold their own content (`fill`) in every layer, counted
    from the first until one does not. Reads each chunk in place (runs of consecutive pages
    as one piece, as `KvMemory.store` writes them), 8 bytes a comparison."""
    n = min(len(pages), len(hashes))
    if n == 0:
        return 0
    layers, _, chunk_bytes = chunks.shape
    words = chunks.view(_U64)  # chunk_bytes is a multiple of 8 (`KvLayout`)
    whole, tail = divmod(chunk_bytes // 8, PATTERN_WORDS)
    pattern = patterns(hashes[:n], layers).transpose(1, 0, 2)  # (layers, n, 8)
    start = 0
    for end in range(1, n + 1):
        if end < n and pages[end] == pages[end - 1] + 1:
            continue
        run = words[:, pages[start] : pages[start] + end - start, :]
        want = pattern[:, start:end]
        body = run[:, :, : whole * PATTERN_WORDS]
        body = body.reshape(layers, end - start, whole, PATTERN_WORDS)
        ok = (body == want[:, :, None, :]).all(axis=(0, 2, 3))
        if tail:
            ok &= (run[:, :, whole * PATTERN_WORDS :] == want[:, :, :tail]).all(axis=(0, 2))
        if not ok.all():
            return start + int(np.argmin(ok))
        start = end
    return n


def expected_chunk(block_hash: int, layer: int, chunk_bytes: int) -> bytes:
    """What a block's chunk of `layer` holds."""
    pattern: bytes = patterns([block_hash], layer + 1)[0, layer].tobytes()
    return (pattern * -(-chunk_bytes // _PATTERN_BYTES))[:chunk_bytes]


def checksum(chunk: bytes | memoryview) -> int:
    """A chunk's checksum: XXH3-64 of its bytes (what a receiver verifies before a block
    becomes visible)."""
    return int(xxhash.xxh3_64_intdigest(chunk))


def chunk_checksums(pieces: Iterable[memoryview], chunk_bytes: int) -> list[int]:
    """`checksum` of each chunk of `pieces`, each a whole number of consecutive chunks, in
    order."""
    digest = xxhash.xxh3_64_intdigest
    return [
        digest(piece[at : at + chunk_bytes])
        for piece in pieces
        for at in range(0, len(piece), chunk_bytes)
    ]


def checksums(
    memory: memoryview, layout: KvLayout, layers: Iterable[int], pages: Sequence[int]
) -> list[int]:
    """`checksum` of the chunk of each page in `pages`, layer by layer (index layer ×
    len(pages) + i), in `memory` laid out as `layout`. The hot loop of every transfer on both
    ends: one slice and one hash a chunk, nothing else."""
    size, per_layer = layout.chunk_bytes, layout.pages
    digest = xxhash.xxh3_64_intdigest
    out: list[int] = []
    for layer in layers:
        base = layer * per_layer
        out.extend(digest(memory[(base + p) * size : (base + p + 1) * size]) for p in pages)
    return out


def block_checksums(memory: memoryview, layout: KvLayout, pages: Iterable[int]) -> Iterator[int]:
    """The checksum of each block held in `pages`, in order, in `memory` (1-D bytes) laid out
    as `layout`: XXH3-64 of the block's chunks, layer by layer, as one stream (what the
    node's KV pool keeps of a block to find its bytes changed at rest). Lazy, so a check
    reads no further than its first mismatch; xxhash lets go of the GIL while it hashes, so
    a thread computing these leaves the event loop running."""
    size, per_layer = layout.chunk_bytes, layout.pages
    state = xxhash.xxh3_64()
    for page in pages:
        state.reset()
        for layer in range(layout.layers):
            at = (layer * per_layer + page) * size
            state.update(memory[at : at + size])
        yield int(state.intdigest())
